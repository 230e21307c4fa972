"""Discovery of skattn's public estimators, feeding the common tests."""

import inspect
import pkgutil
from importlib import import_module
from operator import itemgetter

from sklearn.base import BaseEstimator, RegressorMixin, TransformerMixin

_TYPES = {"regressor": RegressorMixin, "transformer": TransformerMixin}


def all_estimators(type_filter=None):
    """Public estimator classes of skattn, sorted by name.

    Parameters
    ----------
    type_filter : {"regressor", "transformer"}, list of them, or None
        Keep only estimators of these kinds; ``None`` keeps all.

    Returns
    -------
    estimators : list of (name, class) tuples

    Examples
    --------
    >>> from skattn.utils.discovery import all_estimators
    >>> "AttentionLayer" in [name for name, _ in all_estimators("transformer")]
    True
    """
    import skattn

    found = {}
    modules = [skattn.__name__] + [
        info.name
        for info in pkgutil.walk_packages(skattn.__path__, prefix="skattn.")
        if not any(part.startswith("_") for part in info.name.split(".")[1:-1])
        and info.name not in ("skattn.__main__", "skattn.cli")
    ]
    for module_name in modules:
        module = import_module(module_name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, BaseEstimator)
                and cls.__module__.startswith("skattn")
                and not name.startswith(("_", "Base"))
                and not inspect.isabstract(cls)
            ):
                found[name] = cls
    estimators = sorted(found.items(), key=itemgetter(0))
    if type_filter is not None:
        kinds = [type_filter] if isinstance(type_filter, str) else list(type_filter)
        unknown = set(kinds) - set(_TYPES)
        if unknown:
            raise ValueError(
                f"type_filter must be among {sorted(_TYPES)} or None, got {unknown}."
            )
        estimators = [
            (name, cls)
            for name, cls in estimators
            if any(issubclass(cls, _TYPES[kind]) for kind in kinds)
        ]
    return estimators
