"""One guard for skattn's optional dependencies.

Every optional import of the package (torch, safetensors, tokenizers, pandas,
matplotlib, dask, distributed, zarr, h5py) goes through :func:`require`, which
imports the module lazily and, when it is missing, raises an ``ImportError``
naming the pip extra that installs it.
"""

import importlib


def require(module, *, extra, feature, package=None):
    """Import an optional dependency, or say which skattn extra installs it.

    Parameters
    ----------
    module : str
        Dotted name of the module to import (``"safetensors.numpy"``).
    extra : str
        The pip extra of skattn that installs it (``"torch"``, ``"pretrained"``,
        ``"plot"``, ``"sweep"``, ``"dask"``, ``"ooc"``).
    feature : str
        What needs it, for the message (``"AttentionPatternDisplay"``).
    package : str, default=None
        The PyPI name to install if not the top-level module name.

    Returns
    -------
    module : module
        The imported module.

    Raises
    ------
    ImportError
        If the module cannot be imported; the message names the extra.

    Examples
    --------
    >>> from skattn.utils._optional import require
    >>> require("numpy", extra="test", feature="This example").__name__
    'numpy'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = package or module.split(".")[0]
        raise ImportError(
            f"{feature} requires {package}, an optional dependency of skattn: "
            f'pip install "skattn[{extra}]" (or pip install {package}).'
        ) from exc
