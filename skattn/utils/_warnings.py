"""Warnings that point at the user's line, not at a line inside skattn."""

import sys
import warnings
from pathlib import Path

_SKATTN = str(Path(__file__).resolve().parents[1])
# scikit-learn's wrappers around a fit (fit_context, available_if, set_output)
_WRAPPERS = ("base.py", "_available_if.py", "_set_output.py")


def _inside(frame):
    filename = frame.f_code.co_filename
    if filename.startswith(_SKATTN):
        return True
    parts = Path(filename).parts
    return "sklearn" in parts and parts[-1] in _WRAPPERS


def warn_at_caller(message, category=UserWarning):
    """``warnings.warn`` attributed to the first frame outside skattn (and
    outside scikit-learn's fit wrappers): the user's own call.

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_at_caller("check this", UserWarning)
    >>> caught[0].filename.endswith("_warnings.py")
    False
    """
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and _inside(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
