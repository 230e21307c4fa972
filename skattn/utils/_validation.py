"""Token layout of X and y: flatten, unflatten, and resolve the number of tokens.

A sequence of ``k`` tokens with ``d`` features is stored as one row of width ``k * d``:
token ``t`` occupies columns ``[t * d, (t + 1) * d)`` (token-major).  A 3-D array of
shape ``(n_samples, k, d)`` is accepted as a convenience and flattened first.

The sample weights of a loss or an error, normalised to sum to one, are here too
(:func:`_normalized_weights`, for the solvers and the metrics alike).
"""

from numbers import Integral

import numpy as np


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
        X = np.asarray(X)
        ndim = X.ndim
    if ndim == 3:
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
    return X.reshape(n, n_tokens, width // n_tokens)


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
    if np.all(np.isfinite(result)):
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
