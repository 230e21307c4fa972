"""Token layout of X and y: flatten, unflatten, and resolve the number of tokens.

A sequence of ``k`` tokens with ``d`` features is stored as one row of width ``k * d``:
token ``t`` occupies columns ``[t * d, (t + 1) * d)`` (token-major).  A 3-D array of
shape ``(n_samples, k, d)`` is accepted as a convenience and flattened first.

The sample weights of a loss or an error, normalised to sum to one, are here too
(:func:`_normalized_weights`, for the solvers and the metrics alike), and the checks
every ``fit`` shares: ragged lists and sparse targets (:func:`check_target`), values
too large for float64 (:func:`check_magnitude`; :func:`check_largest_magnitude` for
out-of-core values, measured in batches), and :func:`restore_on_error`, which makes
a failed ``fit`` leave the previous fit as it was.
"""

import contextlib
import functools
import math
from numbers import Integral

import numpy as np
import scipy.sparse
from sklearn.externals import array_api_compat as _compat

from ._array_api import namespace, to_numpy

# The shapes accepted for X, as said by the errors about it.
X_SHAPES = (
    "a 2-D array of shape (n_samples, n_tokens * n_features) or a 3-D array of "
    "shape (n_samples, n_tokens, n_features)"
)


def flatten_tokens(X):
    """Return ``(X2d, k)``: X flattened to 2-D and the token count a 3-D X carried.

    Parameters
    ----------
    X : array-like of shape (n_samples, width) or (n_samples, n_tokens, n_features)

    Returns
    -------
    X2d : array-like of shape (n_samples, width)
        ``X`` itself when it is not 3-D (validation happens later), otherwise the
        token-major flattening of it.
    n_tokens : int or None
        ``X.shape[1]`` for a 3-D input, ``None`` otherwise.

    Examples
    --------
    >>> import numpy as np
    >>> X2d, k = flatten_tokens(np.zeros((5, 3, 2)))
    >>> X2d.shape, k
    ((5, 6), 3)
    """
    ndim = getattr(X, "ndim", None)
    if ndim is None and isinstance(X, list | tuple):
        X = as_array(X, "X", X_SHAPES)
        ndim = X.ndim
    if ndim == 3:
        if is_foreign_array(X):  # under array_api_dispatch: stays in its namespace
            n, k, d = X.shape
            return namespace(X).reshape(X, (n, k * d)), k
        X = np.asarray(X)
        n, k, d = X.shape
        return X.reshape(n, k * d), k
    if ndim is not None and ndim not in (0, 2):  # 0-D: scikit-learn's own message
        raise ValueError(
            f"X must be 2-D (n_samples, n_tokens * n_features) or 3-D (n_samples, "
            f"n_tokens, n_features), got a {ndim}-D array of shape {np.shape(X)}. "
            f"Reshape your data: X.reshape(1, -1) for a single sequence, "
            f"X.reshape(len(X), -1) to flatten the tokens."
        )
    return X, None


def resolve_n_tokens(width, n_tokens, n_tokens_from_3d=None, *, name="X"):
    """Number of tokens for rows of ``width`` columns, with clear errors.

    Parameters
    ----------
    width : int
        Number of columns of the flattened array.
    n_tokens : int or None
        The estimator's ``n_tokens`` parameter.  ``None`` takes the token count of
        a 3-D input, else 1.
    n_tokens_from_3d : int or None
        Token count carried by a 3-D input, if any.
    name : str
        Name of the array, for error messages.

    Returns
    -------
    n_tokens : int

    Examples
    --------
    >>> resolve_n_tokens(12, 4)
    4
    >>> resolve_n_tokens(12, None)
    1
    """
    if n_tokens is None:
        n_tokens = 1 if n_tokens_from_3d is None else n_tokens_from_3d
    elif n_tokens_from_3d is not None and n_tokens != n_tokens_from_3d:
        raise ValueError(
            f"n_tokens={n_tokens} but {name} is 3-D with {n_tokens_from_3d} tokens "
            f"per sequence; pass n_tokens=None or n_tokens={n_tokens_from_3d}."
        )
    if not isinstance(n_tokens, Integral) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}.")
    if width % n_tokens != 0:
        raise ValueError(
            f"{name} has {width} columns, which is not divisible by n_tokens="
            f"{n_tokens}; expected a width of n_tokens * n_features (token-major "
            f"layout). Check n_tokens or pass a 3-D array (n_samples, n_tokens, "
            f"n_features)."
        )
    return int(n_tokens)


def layer_sequences(X, n_tokens, n_tokens_from_3d, n_features):
    """View a validated 2-D X as ``(n, k, d)`` for a layer of ``n_features`` = d.

    Unlike an estimator, a layer knows d, so ``n_tokens=None`` with a 2-D X infers
    ``k = width / d``.

    Parameters
    ----------
    X : ndarray of shape (n_samples, width)
    n_tokens : int or None
    n_tokens_from_3d : int or None
        Token count carried by a 3-D input, if any.
    n_features : int
        Features per token of the layer.

    Returns
    -------
    X3 : ndarray of shape (n_samples, n_tokens, n_features)

    Examples
    --------
    >>> import numpy as np
    >>> layer_sequences(np.zeros((2, 6)), None, None, 3).shape
    (2, 2, 3)
    """
    width = X.shape[1]
    if n_tokens is None and n_tokens_from_3d is None:
        if width % n_features:
            raise ValueError(
                f"X has {width} columns, not a multiple of the layer's n_features="
                f"{n_features}; expected n_samples rows of n_tokens * {n_features} "
                f"values (token-major)."
            )
        n_tokens = width // n_features
    k = resolve_n_tokens(width, n_tokens, n_tokens_from_3d)
    if width != k * n_features:
        raise ValueError(
            f"X has {width} columns = {k} tokens x {width // k} features, but the "
            f"layer expects {n_features} features per token."
        )
    return unflatten_tokens(X, k)


def check_fitted_tokens(n_tokens_from_3d, n_tokens_fitted):
    """Raise if a 3-D input's token count differs from the one seen in ``fit``.

    Examples
    --------
    >>> check_fitted_tokens(None, 4)  # a 2-D input: nothing to check
    >>> check_fitted_tokens(3, 4)
    Traceback (most recent call last):
    ...
    ValueError: X is 3-D with 3 tokens per sequence but the estimator was ...
    """
    if n_tokens_from_3d is not None and n_tokens_from_3d != n_tokens_fitted:
        raise ValueError(
            f"X is 3-D with {n_tokens_from_3d} tokens per sequence but the estimator "
            f"was fitted with n_tokens_={n_tokens_fitted}."
        )


def unflatten_tokens(X, n_tokens):
    """View a 2-D array ``(n_samples, k * d)`` as ``(n_samples, k, d)``.

    Examples
    --------
    >>> import numpy as np
    >>> unflatten_tokens(np.arange(12.0).reshape(2, 6), 3)[1, 2]
    array([10., 11.])
    """
    n, width = X.shape
    if is_foreign_array(X):  # the array API has no reshape method
        return namespace(X).reshape(X, (n, n_tokens, width // n_tokens))
    return X.reshape(n, n_tokens, width // n_tokens)


def is_foreign_array(x):
    """Whether ``x`` is an array of a namespace other than numpy (torch, CuPy,
    array-api-strict, ...), as validation keeps it under ``array_api_dispatch``.

    Examples
    --------
    >>> import numpy as np
    >>> is_foreign_array(np.ones(2)), is_foreign_array([1.0])
    (False, False)
    """
    return not isinstance(x, np.ndarray) and _compat.is_array_api_obj(x)


def check_no_overflow(result, what, **inputs):
    """Return ``result``, or raise a ValueError if it is not finite although its
    inputs are: values too large for float64 arithmetic (logits of ``1e300``).

    Parameters
    ----------
    result : ndarray
    what : str
        What ``result`` is, for the message.
    **inputs : ndarray
        The finite arrays it was computed from, by name.

    Examples
    --------
    >>> import numpy as np
    >>> check_no_overflow(np.ones(2), "y_pred", X=np.ones(2))
    array([1., 1.])
    """
    if is_foreign_array(result):
        xp = namespace(result)
        if bool(xp.all(xp.isfinite(result))):
            return result
        inputs = {name: to_numpy(value) for name, value in inputs.items()}
    elif np.all(np.isfinite(result)):
        return result
    sizes = ", ".join(
        f"{name} up to {float(np.max(np.abs(value))) if np.size(value) else 0.0:.3g}"
        for name, value in inputs.items()
        if value is not None
    )
    raise ValueError(
        f"{what} overflowed float64 (NaN or infinite values) from finite inputs "
        f"({sizes} in absolute value): the values are too large for the "
        f"attention logits. Rescale X (e.g. with sklearn.preprocessing."
        f"StandardScaler) or the parameters first."
    )


def check_finite(X, name):
    """Raise a ValueError naming ``name`` if X holds NaN or infinity."""
    if not np.all(np.isfinite(X)):
        n_bad = int(np.size(X) - np.count_nonzero(np.isfinite(X)))
        raise ValueError(
            f"{name} contains {n_bad} NaN or infinite value(s); attention layers need "
            f"finite inputs. Remove or impute them first."
        )


def _normalized_weights(n, sample_weight):
    """Weights ``w_n / sum w``, shape (n,); uniform when ``sample_weight`` is None.

    Examples
    --------
    >>> _normalized_weights(4, None)
    array([0.25, 0.25, 0.25, 0.25])
    >>> _normalized_weights(2, [1, 3])
    array([0.25, 0.75])
    """
    if sample_weight is None:
        return np.full(n, 1.0 / n)
    w = np.asarray(sample_weight, dtype=float)
    return w / w.sum()


def _is_sequence(value):
    return isinstance(value, list | tuple) or (
        isinstance(value, np.ndarray) and value.ndim > 0
    )


def _index(name, path):
    return name + "".join(f"[{i}]" for i in path)


def ragged_description(values, name="X"):
    """Where nested sequences stop having one shape, in words; ``None`` if nowhere.

    Examples
    --------
    >>> ragged_description([[1.0, 2.0, 3.0], [1.0, 2.0]])
    'its rows have lengths 3 (X[0]) and 2 (X[1])'
    >>> ragged_description([[[1.0, 2.0]], [[1.0]]])
    'its tokens have lengths 2 (X[0][0]) and 1 (X[1][0])'
    >>> ragged_description([[1.0], [2.0]]) is None
    True
    """
    what = ["rows", "tokens"]
    items = [((i,), value) for i, value in enumerate(values)]
    for level in range(32):  # deeper nesting than any X or y: not ours to describe
        nested = [_is_sequence(value) for _, value in items]
        if not any(nested):
            return None
        if not all(nested):
            inner = next(p for (p, _), s in zip(items, nested, strict=True) if s)
            outer = next(p for (p, _), s in zip(items, nested, strict=True) if not s)
            return (
                f"{_index(name, inner)} is a sequence but {_index(name, outer)} is "
                f"a number"
            )
        first = {}
        for path, value in items:
            first.setdefault(len(value), path)
        if len(first) > 1:
            shown = [f"{n} ({_index(name, p)})" for n, p in list(first.items())[:4]]
            if len(first) > 4:
                listed = ", ".join(shown) + ", ..."
            else:
                listed = ", ".join(shown[:-1]) + f" and {shown[-1]}"
            level_name = what[level] if level < len(what) else "entries"
            return f"its {level_name} have lengths {listed}"
        items = [
            (path + (j,), inner)
            for path, value in items
            for j, inner in enumerate(value)
        ]
    return None


def as_array(values, name, expected):
    """``np.asarray(values)``, with a clear error for a ragged (nested) list.

    Parameters
    ----------
    values : list or tuple
    name : str
        ``"X"`` or ``"y"``, for the message.
    expected : str
        The shapes accepted, for the message (``"a 2-D array of shape ..."``).

    Returns
    -------
    array : ndarray

    Raises
    ------
    ValueError
        When the rows (or the tokens of the rows) have different lengths, naming
        the lengths and where they differ.

    Examples
    --------
    >>> as_array([[1.0, 2.0], [3.0]], "X", "a 2-D array")
    Traceback (most recent call last):
    ...
    ValueError: X is a ragged list: its rows have lengths 2 (X[0]) and 1 (X[1]); ...
    """
    try:
        return np.asarray(values)
    except ValueError as exc:
        where = ragged_description(values, name)
        if where is None:
            raise
        raise ValueError(
            f"{name} is a ragged list: {where}; pass {expected}, every row of the "
            f"same length (pad or truncate the sequences to a common number of "
            f"tokens first)."
        ) from exc


def check_target(y, owner, expected):
    """Reject a sparse y and a ragged list y with clear messages; return y.

    Parameters
    ----------
    y : array-like
    owner : str
        The estimator's class name, for the message.
    expected : str
        The shapes of y accepted, for the message.

    Returns
    -------
    y : array-like
        ``y`` itself, or a list or tuple as an ndarray.

    Raises
    ------
    TypeError
        For a scipy.sparse y.
    ValueError
        For a ragged list.

    Examples
    --------
    >>> import scipy.sparse
    >>> check_target(scipy.sparse.eye(2, format="csr"), "Est", "a 2-D array")
    Traceback (most recent call last):
    ...
    TypeError: y is a sparse csr_matrix, but Est needs a dense y: ...
    """
    if scipy.sparse.issparse(y):
        raise TypeError(
            f"y is a sparse {type(y).__name__}, but {owner} needs a dense y: pass "
            f"y.toarray(), {expected}."
        )
    if isinstance(y, list | tuple):
        return as_array(y, "y", expected)
    return y


def check_magnitude(values, name, degree, owner, *, what="", fix=None):
    """Raise a ValueError when ``values`` is too large for float64 arithmetic.

    ``owner`` sums products of ``degree`` entries of ``values`` (logits, moments,
    squared errors) over all of them: with ``size`` entries that sum overflows
    float64 once the largest ``|value|`` exceeds ``(float64 max / size) **
    (1 / degree)``, so larger values are rejected up front, before the fit turns
    them into NaN, a ``LinAlgError`` or a meaningless score.

    Parameters
    ----------
    values : ndarray
        Finite values (validated already).
    name : str
        ``"X"`` or ``"y"``.
    degree : int
        Highest number of entries the estimator multiplies together.
    owner : str
        The estimator's class name.
    what : str, default=""
        What those products are, for the message (``"the attention logits"``).
    fix : str, default=None
        How to rescale; ``None``: ``sklearn.preprocessing.StandardScaler``.

    Returns
    -------
    values : ndarray

    See Also
    --------
    check_largest_magnitude : the same check of a largest ``|value|`` measured
        elsewhere (out-of-core X and y, scanned in batches).

    Examples
    --------
    >>> import numpy as np
    >>> _ = check_magnitude(np.ones(3), "X", 2, "Est")
    >>> check_magnitude(np.full(3, 1e200), "X", 2, "Est")
    Traceback (most recent call last):
    ...
    ValueError: X has entries up to 1e+200 in absolute value, too large for ...
    """
    if is_foreign_array(values):  # under array_api_dispatch: on its device
        xp = namespace(values)
        size = math.prod(values.shape)
        if size == 0:
            return values
        largest = float(xp.max(xp.abs(values)))
    else:
        values = np.asarray(values)
        size = values.size
        if size == 0:
            return values
        largest = float(np.max(np.abs(values)))
    check_largest_magnitude(largest, size, name, degree, owner, what=what, fix=fix)
    return values


def check_largest_magnitude(largest, size, name, degree, owner, *, what="", fix=None):
    """:func:`check_magnitude` given the largest ``|value|`` and the entry count.

    For values that are not in memory (out-of-core X and y, whose largest
    ``|value|`` is measured in the one pass that validates them): the same
    limit, the same message.

    Parameters
    ----------
    largest : float
        Largest absolute value of the (finite) entries.
    size : int
        Number of entries.
    name, degree, owner, what, fix
        As for :func:`check_magnitude`.

    Examples
    --------
    >>> check_largest_magnitude(1.0, 3, "X", 2, "Est")
    >>> check_largest_magnitude(1e200, 3, "X", 2, "Est")
    Traceback (most recent call last):
    ...
    ValueError: X has entries up to 1e+200 in absolute value, too large for ...
    """
    if size == 0:
        return
    limit = (np.finfo(np.float64).max / size) ** (1.0 / degree)
    if largest > limit:
        fix = "e.g. with sklearn.preprocessing.StandardScaler" if fix is None else fix
        what = f" ({what})" if what else ""
        raise ValueError(
            f"{name} has entries up to {largest:.3g} in absolute value, too large "
            f"for float64 arithmetic: {owner} sums products of {degree} of them"
            f"{what}, which overflow above about {limit:.1g} for {size} "
            f"entries. Rescale {name} ({fix}) first."
        )


@contextlib.contextmanager
def restore_on_error(estimator):
    """Leave ``vars(estimator)`` as it was if the block raises (any exception,
    KeyboardInterrupt included): a failed ``fit`` keeps the previous fit.

    The attributes are restored as the same objects, so the block must assign
    new values rather than modify the old ones in place.

    Examples
    --------
    >>> class Est:
    ...     coef_ = None
    >>> est = Est()
    >>> est.coef_ = 1.0
    >>> try:
    ...     with restore_on_error(est):
    ...         est.coef_, est.n_features_in_ = 2.0, 5
    ...         raise ValueError("bad sample_weight")
    ... except ValueError:
    ...     pass
    >>> est.coef_, hasattr(est, "n_features_in_")
    (1.0, False)
    """
    saved = dict(vars(estimator))
    try:
        yield estimator
    except BaseException:
        state = vars(estimator)
        state.clear()
        state.update(saved)
        raise


def all_or_nothing(method):
    """Decorate ``fit`` or ``partial_fit``: on any exception the estimator's
    attributes are restored (:func:`restore_on_error`)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with restore_on_error(self):
            return method(self, *args, **kwargs)

    return wrapped
