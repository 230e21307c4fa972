"""write_attention_regression: a planted dataset of any size, written in chunks."""

import copy
from numbers import Integral
from pathlib import Path

import numpy as np
from sklearn.utils._param_validation import Interval, validate_params

from ..layer._math import forward
from ..utils._optional import require
from ._distributions import _as_generator, resolve_distribution
from ._generators import _REGRESSION_PARAMETERS, _draw_layer

_FORMATS = {".zarr": "zarr", ".h5": "hdf5", ".hdf5": "hdf5", ".npy": "npy"}


def _format(path):
    fmt = _FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise ValueError(
            f"path={str(path)!r} must end in .zarr (a zarr group), .h5 or .hdf5 (an "
            f"HDF5 file) or .npy (a folder holding X.npy and y.npy memmaps)."
        )
    return fmt


def _require(module, fmt):
    return require(module, extra="ooc", feature=f"Writing {fmt} files")


def _create(path, fmt, shapes, chunk_size):
    """Create the arrays X and y on disk; return them and a closer."""
    if fmt == "zarr":
        zarr = _require("zarr", fmt)
        group = zarr.open_group(str(path), mode="w")
        arrays = [
            group.create_array(
                name, shape=shape, chunks=(chunk_size, shape[1]), dtype="f8"
            )
            for name, shape in shapes.items()
        ]
        return arrays, lambda: None
    if fmt == "hdf5":
        h5py = _require("h5py", fmt)
        file = h5py.File(path, "w")
        arrays = [
            file.create_dataset(
                name, shape=shape, chunks=(chunk_size, shape[1]), dtype="f8"
            )
            for name, shape in shapes.items()
        ]
        return arrays, file.close
    Path(path).mkdir(parents=True, exist_ok=True)
    arrays = [
        np.lib.format.open_memmap(Path(path) / f"{name}.npy", "w+", "f8", shape)
        for name, shape in shapes.items()
    ]
    return arrays, lambda: [a.flush() for a in arrays]


def open_attention_regression(path):
    """Open a dataset written by :func:`write_attention_regression`, read-only.

    Nothing is loaded: the arrays are read when sliced.

    Parameters
    ----------
    path : str or path-like
        The ``.zarr`` group, ``.h5``/``.hdf5`` file or ``.npy`` folder.

    Returns
    -------
    X : zarr array, h5py Dataset or numpy.memmap of shape \
(n_samples, n_tokens * n_features)
    y : same type, of shape (n_samples, n_tokens * n_outputs)

    Raises
    ------
    ValueError
        If ``path`` does not exist, cannot be opened in its format (random
        bytes, a file where a folder is expected), or does not hold the 2-D
        arrays ``X`` and ``y`` with as many rows (an empty zarr folder, an HDF5
        file of other datasets); the message names the file and what is
        missing.

    Examples
    --------
    >>> import tempfile, os
    >>> from skattn.datasets import write_attention_regression
    >>> from skattn.datasets import open_attention_regression
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     _ = write_attention_regression(os.path.join(tmp, "d.npy"), 50, 2, 3, 1)
    ...     X, y = open_attention_regression(os.path.join(tmp, "d.npy"))
    ...     X.shape, y.shape
    ((50, 6), (50, 6))
    """
    fmt = _format(path)
    if not Path(path).exists():
        raise ValueError(f"path={str(path)!r} does not exist.")
    if fmt == "zarr":
        zarr = _require("zarr", fmt)
        if Path(path).is_dir() and not any(Path(path).iterdir()):
            raise ValueError(
                f"path={str(path)!r} is an empty folder, not a zarr group: the "
                f"arrays X and y are missing (expected them {_WRITTEN_BY})."
            )
        try:
            group = zarr.open_group(str(path), mode="r")
        except Exception as exc:  # zarr's errors vary by version and store
            raise _unreadable(path, "a zarr group", exc) from exc
        return _check_arrays(group, path, "a zarr group", lambda: None)
    if fmt == "hdf5":
        h5py = _require("h5py", fmt)
        try:
            file = h5py.File(path, "r")
        except Exception as exc:  # OSError: not an HDF5 file, or unreadable
            raise _unreadable(path, "an HDF5 file", exc) from exc
        return _check_arrays(file, path, "an HDF5 file", file.close)
    if not Path(path).is_dir():
        raise ValueError(
            f"path={str(path)!r} is a file, but a .npy dataset is a folder "
            f"holding X.npy and y.npy (as write_attention_regression writes it)."
        )
    missing = [f"{n}.npy" for n in ("X", "y") if not (Path(path) / f"{n}.npy").exists()]
    if missing:
        raise ValueError(
            f"path={str(path)!r} lacks {' and '.join(missing)}; a .npy dataset is a "
            f"folder holding the arrays X.npy and y.npy (as "
            f"write_attention_regression writes it)."
        )
    X, y = (_open_npy(Path(path) / f"{n}.npy") for n in ("X", "y"))
    return _check_shapes(X, y, path, lambda: None)


_WRITTEN_BY = "as write_attention_regression writes it"


def _unreadable(path, kind, exc):
    return ValueError(
        f"path={str(path)!r} cannot be opened as {kind} ({type(exc).__name__}: "
        f"{exc}); expected the arrays X and y {_WRITTEN_BY}."
    )


def _check_arrays(container, path, kind, close):
    """``container["X"], container["y"]``, or a ValueError naming what is missing."""
    try:
        names = sorted(container.keys())
    except Exception:  # pragma: no cover - a store that cannot list its members
        names = []
    missing = [n for n in ("X", "y") if n not in names]
    if missing:
        close()
        held = f"it holds {names}" if names else "it is empty"
        raise ValueError(
            f"path={str(path)!r} is {kind} without the array(s) {missing} ({held}); "
            f"expected the arrays X and y {_WRITTEN_BY}."
        )
    return _check_shapes(container["X"], container["y"], path, close)


def _check_shapes(X, y, path, close):
    """X and y must be 2-D arrays with as many rows."""
    for name, arr in (("X", X), ("y", y)):
        if len(getattr(arr, "shape", ())) != 2:
            close()
            raise ValueError(
                f"path={str(path)!r}: {name} must be a 2-D array (n_samples, "
                f"width), got {type(arr).__name__} of shape "
                f"{getattr(arr, 'shape', None)}; expected the arrays X and y "
                f"{_WRITTEN_BY}."
            )
    if X.shape[0] != y.shape[0]:
        close()
        raise ValueError(
            f"path={str(path)!r}: X has {X.shape[0]} rows but y has {y.shape[0]}; "
            f"expected the arrays X and y {_WRITTEN_BY}."
        )
    return X, y


def _open_npy(path):
    """A ``.npy`` file as a read-only memmap; never unpickles (``allow_pickle``
    stays False), and a file that is not a numeric array is a ValueError naming
    it."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise ValueError(
            f"{str(path)!r} is not a numeric .npy array ({exc}); skattn never "
            f"loads pickled data (unpickling can run code)."
        ) from exc
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{str(path)!r} is not a .npy array file.")
    return array


@validate_params(
    {
        "path": [str, Path],
        **_REGRESSION_PARAMETERS,
        "chunk_size": [Interval(Integral, 1, None, closed="left")],
    },
    prefer_skip_nested_validation=True,
)
def write_attention_regression(
    path,
    n_samples,
    n_tokens,
    n_features,
    n_heads,
    *,
    n_outputs=None,
    distribution="boolean",
    noise=0.0,
    attention_scale=2.0,
    structure="random",
    head_rank=None,
    chunk_size=100_000,
    random_state=None,
    return_layer=False,
):
    """Write the examples of :func:`make_attention_regression` to disk in chunks.

    Memory is bounded by ``chunk_size`` rows whatever ``n_samples``.  With the
    same arguments and an int ``random_state``, the layer and the inputs written
    are those :func:`make_attention_regression` returns, for every
    ``chunk_size``, and the targets equal its targets up to rounding (the forward
    pass runs chunk by chunk).

    Parameters
    ----------
    path : str or path-like
        Where to write: ``*.zarr`` (a zarr group with arrays ``X`` and ``y``),
        ``*.h5`` or ``*.hdf5`` (an HDF5 file with datasets ``X`` and ``y``), or
        ``*.npy`` (a folder with ``X.npy`` and ``y.npy``, opened as memmaps).
        Overwritten if it exists.
    n_samples : int
        Number of sequences.
    n_tokens : int
        Tokens per sequence k.
    n_features : int
        Features per input token d.
    n_heads : int
        Number of heads m of the planted layer.
    n_outputs : int, default=None
        Features per output token; ``None`` means ``n_features``.
    distribution : {"boolean", "gaussian"} or TokenDistribution, default="boolean"
        Input distribution.
    noise : float, default=0.0
        Standard deviation of the Gaussian label noise.
    attention_scale : float, default=2.0
        ``||Theta_i||_F`` of the planted heads.
    structure : {"random", "diagonal", "low_rank"}, default="random"
        Structure of the ``Theta_i``.
    head_rank : int, default=None
        Low-rank heads ``Theta_i = Q_i K_i^T``, ``W_i = V_i O_i`` of this rank, at
        most ``min(n_features, n_outputs)`` (see
        :func:`~skattn.datasets.make_attention_layer`).  ``None``: full rank.
    chunk_size : int, default=100000
        Rows generated and written at a time (and the chunk length on disk).
    random_state : int, RandomState instance, Generator or None, default=None
        Seed of the layer, the inputs and the noise.
    return_layer : bool, default=False
        Also return the planted layer.

    Returns
    -------
    X : zarr array, h5py Dataset or numpy.memmap of shape \
(n_samples, n_tokens * n_features)
        The inputs, opened read-only (see :func:`open_attention_regression`).
    y : same type, of shape (n_samples, n_tokens * n_outputs)
        The targets.
    layer : AttentionLayer
        Only when ``return_layer=True``: the planted layer (``n_tokens`` and
        ``head_rank`` set).

    See Also
    --------
    make_attention_regression : the same examples, in memory.
    open_attention_regression : open a written dataset again.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> from skattn.datasets import (make_attention_regression,
    ...                              write_attention_regression)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     X, y = write_attention_regression(
    ...         os.path.join(tmp, "data.npy"), 1000, 3, 4, 2, chunk_size=300,
    ...         random_state=0)
    ...     X_mem, y_mem = make_attention_regression(1000, 3, 4, 2, random_state=0)
    ...     bool(np.array_equal(X, X_mem) and np.allclose(y, y_mem, rtol=1e-12))
    True
    """
    fmt = _format(path)
    if not Path(path).parent.is_dir():
        raise ValueError(
            f"path={str(path)!r}: the folder {str(Path(path).parent)!r} does not "
            f"exist; create it first."
        )
    rng = _as_generator(random_state)
    layer = _draw_layer(
        n_heads,
        n_features,
        n_outputs=n_outputs,
        attention_scale=attention_scale,
        structure=structure,
        rank=None,
        head_rank=head_rank,
        random_state=rng,
        n_tokens=n_tokens,
    )
    d_out = layer.projection.shape[2]
    dist = resolve_distribution(distribution, n_tokens, n_features)
    chunk_size = min(int(chunk_size), int(n_samples))
    noise_rng = None
    if noise > 0:
        # make_attention_regression draws the noise after all inputs: skip them.
        noise_rng = copy.deepcopy(rng)
        for _ in dist.iter_batches(n_samples, chunk_size, random_state=noise_rng):
            pass
    shapes = {
        "X": (n_samples, n_tokens * n_features),
        "y": (n_samples, n_tokens * d_out),
    }
    (X_out, y_out), close = _create(path, fmt, shapes, chunk_size)
    try:
        start = 0
        for X in dist.iter_batches(n_samples, chunk_size, random_state=rng):
            b = X.shape[0]
            y = forward(
                X.reshape(b, n_tokens, n_features), layer.attention, layer.projection
            ).reshape(b, -1)
            if noise_rng is not None:
                y = y + noise * noise_rng.standard_normal(y.shape)
            X_out[start : start + b] = X
            y_out[start : start + b] = y
            start += b
    finally:
        close()
    X, y = open_attention_regression(path)
    return (X, y, layer) if return_layer else (X, y)
