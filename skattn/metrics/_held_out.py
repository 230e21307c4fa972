"""The held-out error of a layer, with a confidence interval."""

import math

import numpy as np

from ..layer._math import forward
from ..utils._validation import _normalized_weights


def held_out_error(X, Y, attention, projection, sample_weight=None, level=0.95):
    """Relative RMS error of a layer on examples, with a confidence interval.

    The error is ``sqrt(R)`` with the ratio ``R = sum_n w_n e_n / sum_n w_n q_n``,
    ``e_n = ||F(X_n) - Y_n||^2`` and ``q_n = ||Y_n||^2``.  The interval is the
    delta-method interval of the ratio of two means (examples i.i.d.),
    ``R +- z se(R)`` with ``se(R)^2 = sum_n w_n^2 (e_n - R q_n)^2 / (sum_n w_n
    q_n)^2``, clipped at 0 and mapped through the square root.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    sample_weight : ndarray of shape (n,) or None
    level : float, default=0.95
        Two-sided confidence level of the interval.

    Returns
    -------
    error : float
        Relative RMS error.
    interval : tuple of float
        ``(low, high)`` bounds of the relative RMS error.
    losses : ndarray of shape (n,)
        Per-example squared errors ``e_n`` (for paired comparisons).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(400, 3, 4))
    >>> th, W = rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 4, 4))
    >>> Y = forward(X, th, W) + 0.1 * rng.normal(size=(400, 3, 4))
    >>> from skattn.diagnostics import held_out_error
    >>> err, (low, high), losses = held_out_error(X, Y, th, W)
    >>> bool(low < err < high), losses.shape
    (True, (400,))
    """
    from scipy.stats import norm

    omega = _normalized_weights(X.shape[0], sample_weight)
    losses = np.sum((forward(X, attention, projection) - Y) ** 2, axis=(1, 2))
    q = np.sum(Y**2, axis=(1, 2))
    denom = float(omega @ q)
    if denom <= 0:
        err = math.sqrt(float(omega @ losses))
        return err, (err, err), losses
    ratio = float(omega @ losses) / denom
    se = math.sqrt(float(np.sum((omega * (losses - ratio * q)) ** 2))) / denom
    z = float(norm.ppf(0.5 + level / 2))
    low, high = max(ratio - z * se, 0.0), ratio + z * se
    return math.sqrt(ratio), (math.sqrt(low), math.sqrt(high)), losses
