"""Which heads of a layer can be dropped: negligible and duplicate heads."""

import numpy as np

from ..layer._math import attention_patterns, forward
from ..solvers import solve_projections
from ..solvers.kernels._loss import relative_residual as _relative_rms


def head_redundancy(X, Y, attention, projection, tol):
    """Which heads can be dropped without raising the residual.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    tol : float
        A head is redundant when the relative RMS residual without it (the other
        heads' W re-solved by least squares) is at most ``tol``.

    Returns
    -------
    redundant : tuple of int
    notes : tuple of str
        Per head: ``""``, ``"negligible"`` (its output share is at most ``tol``)
        or ``"duplicate of head j"`` (j: the head of closest attention).
    drop_residual : ndarray of shape (m,)
    output_share : ndarray of shape (m,)

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); th = np.concatenate([th, th])
    >>> W = rng.normal(size=(2, 4, 6))
    >>> head_redundancy(X, forward(X, th, W), th, W, 1e-6)[:2]
    ((0, 1), ('duplicate of head 1', 'duplicate of head 0'))
    """
    m = attention.shape[0]
    total = forward(X, attention, projection)
    norm_total = float(np.linalg.norm(total)) or 1.0
    features = np.matmul(attention_patterns(X, attention), X[:, None])  # (n,m,k,d)
    share = (
        np.array(
            [float(np.linalg.norm(features[:, i] @ projection[i])) for i in range(m)]
        )
        / norm_total
    )
    drop = np.full(m, np.inf)
    if m > 1:
        for i in range(m):
            others = np.delete(attention, i, axis=0)
            drop[i] = _relative_rms(X, Y, others, solve_projections(X, Y, others))
    flat = attention.reshape(m, -1)
    redundant, notes = [], []
    for i in range(m):
        if drop[i] > tol:
            notes.append("")
            continue
        redundant.append(i)
        if share[i] <= tol:
            notes.append("negligible")
        else:
            dist = np.linalg.norm(flat - flat[i], axis=1)
            dist[i] = np.inf
            notes.append(f"duplicate of head {int(np.argmin(dist))}")
    return tuple(redundant), tuple(notes), drop, share
