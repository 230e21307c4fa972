"""A head's logits fitted to attention patterns, in logit space.

A nearly one-hot head's outputs pin its small attention weights weakly: the
derivative of a weight is proportional to the weight, so Gauss-Newton on the
outputs cannot see a weight of 1e-5 that is wrong by nats (all-MiniLM-L6-v2
layer 0, head 2; benchmarks/HISTORY.md).  The logarithm of a pattern is linear
in ``Theta = Q K^T`` up to a constant per row,

    log P_{s,q,j} = x_{s,q}^T Q K^T x_{s,j} - c_{s,q},

so once the patterns are known (read off the outputs by
:func:`~._patterns.invert_patterns`) ``Q, K`` solve a weighted least-squares
problem in which every weight counts by how well it is known, not by its size:

    min sum_{s,q,j} w_{s,q,j} (l_{s,q,j} - t_{s,q,j} - c_{s,q})^2,

``l = (X Q)(X K)^T`` the logits, ``t = log P`` the targets and ``c`` eliminated
(the ``w``-weighted mean over ``j`` of each row: a projection).
:func:`logit_targets` turns patterns into ``(t, w)``; :func:`logit_residual` and
:func:`logit_jacobian` are the residual and its Jacobian products in ``(Q, K)``
for a matrix-free least-squares solver.  Key biases ride on a constant token
coordinate, as everywhere in skattn.

Pure functions on token tensors in any array namespace (numpy, torch, CuPy,
array-api-strict: that of the inputs, on their device; no validation, callers
validate).
"""

import numpy as np

from ...utils._array_api import namespace

# Read-off weights at or above FULL count fully; below, in proportion down to
# FLOOR, below which a weight is not known (invert_patterns read MiniLM layer 0's
# weights in (1e-5, 1e-4] to 0.075 nats, below 1e-5 to 1.4) and is left out: its
# logit follows from Theta.  (Asking such entries to be FLOOR, with weight 0.1,
# left a planted head's fit at a cost of 6e3 on 6400 entries: true logits far
# below log FLOOR pulled the others.)
FLOOR = 1e-5
FULL = 1e-4


def logit_targets(patterns, floor=FLOOR, full=FULL):
    """Targets ``t = log max(P, floor)`` and weights ``w = min(P / full, 1)``,
    0 below ``floor``, of the logit fit for patterns ``P`` (rows on the simplex).

    Examples
    --------
    >>> import numpy as np
    >>> t, w = logit_targets(np.array([[0.9, 0.1 - 1e-6, 1e-6]]))
    >>> np.round(t, 3), w
    (array([[ -0.105,  -2.303, -11.513]]), array([[1., 1., 0.]]))
    """
    xp = namespace(patterns)
    P = xp.asarray(patterns, dtype=xp.float64)
    if floor > 0:
        targets = xp.log(xp.clip(P, min=floor))
    else:  # every weight trusted (exact patterns): their logarithms as they are
        with np.errstate(divide="ignore"):
            targets = xp.log(P)
    weights = xp.where(P >= floor, xp.clip(P / full, max=1.0), 0.0)
    return targets, weights


# A row splits its attention when its largest weight is at most this: only such
# rows pin a head's logits to useful precision (see split_rows_needed).
SPLIT_THRESHOLD = 0.99


def logit_unknowns(n_features, head_rank, key_bias=False):
    """Unknowns of one head's logits: ``r (2 d - r)`` for a rank-r ``Theta`` (the
    dimension of the rank-r ``d x d`` matrices; ``d^2`` at full rank), plus ``d``
    for a key bias.

    Examples
    --------
    >>> logit_unknowns(384, 32, key_bias=True), logit_unknowns(4, None)
    (23936, 16)
    """
    d = int(n_features)
    r = d if head_rank is None else min(int(head_rank), d)
    return r * (2 * d - r) + (d if key_bias else 0)


def split_rows_needed(n_features, head_rank, n_tokens, key_bias=False):
    """Rows that split a head's attention that a counting bound asks for to pin
    its logits: ``ceil(u / (k - 1))``, ``u = r (2 d - r)`` unknowns of a rank-r
    ``Theta`` (``d^2`` at full rank) plus ``d`` for a key bias, each split row
    giving at most ``k - 1`` logit differences.  A necessary condition, a
    heuristic (see :func:`skattn.metrics.sharp_head_pinning`).

    Examples
    --------
    >>> split_rows_needed(384, 32, 16, key_bias=True)  # MiniLM layer 0, a head
    1596
    """
    unknowns = logit_unknowns(n_features, head_rank, key_bias)
    return -(-unknowns // (int(n_tokens) - 1))


def split_rows(X, Q, K, threshold=SPLIT_THRESHOLD):
    """Rows of ``X`` ``(n, k, d)`` whose largest weight under the head ``Q K^T``
    is at most ``threshold``.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.eye(3)[None]  # one sequence of three tokens
    >>> sharp, flat = 10 * np.eye(3), np.zeros((3, 3))
    >>> split_rows(X, sharp, np.eye(3)), split_rows(X, flat, np.eye(3))
    (0, 3)
    """
    xp = namespace(X, Q, K)
    logits = (X @ Q) @ xp.matrix_transpose(X @ K)
    shifted = logits - xp.max(logits, axis=-1, keepdims=True)
    largest = 1.0 / xp.sum(xp.exp(shifted), axis=-1)
    return int(xp.count_nonzero(largest <= threshold))  # one host read


def _split(xp, params, d, r):
    return xp.reshape(params[: d * r], (d, r)), xp.reshape(params[d * r :], (d, r))


def _centre(xp, values, weights):
    """``values`` minus each row's ``weights``-weighted mean (last axis)."""
    total = xp.sum(weights, axis=-1, keepdims=True)
    return values - xp.sum(weights * values, axis=-1, keepdims=True) / total


def logit_residual(X, targets, weights, params, rank):
    """``sqrt(w) * centre_w(l - t)``, flat: the residual of the logit fit at
    ``params = [vec Q, vec K]`` (each ``(d, rank)``).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import softmax
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(5, 4, 3)); Q, K = rng.normal(size=(2, 3, 2))
    >>> P = softmax((X @ Q) @ np.swapaxes(X @ K, 1, 2), axis=-1)
    >>> t, w = logit_targets(P, floor=0.0)
    >>> params = np.concatenate([Q.ravel(), K.ravel()])
    >>> float(np.abs(logit_residual(X, t, w, params, 2)).max()) < 1e-12
    True
    """
    xp = namespace(X, targets, weights, params)
    d = X.shape[2]
    Q, K = _split(xp, params, d, rank)
    logits = (X @ Q) @ xp.matrix_transpose(X @ K)
    return xp.reshape(xp.sqrt(weights) * _centre(xp, logits - targets, weights), (-1,))


def logit_jacobian(X, weights, params, rank):
    """The Jacobian of :func:`logit_residual` at ``params`` by its products:
    ``(matvec, rmatvec)``.

    ``d l = (X dQ)(X K)^T + (X Q)(X dK)^T``; the transpose maps a residual-shaped
    ``u`` to ``G = centre_w^T(sqrt(w) u)`` and then ``dQ = sum X^T G (X K)``,
    ``dK = sum X^T G^T (X Q)``.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(5, 4, 3)); w = rng.uniform(0.1, 1, size=(5, 4, 4))
    >>> p, v, u = rng.normal(size=12), rng.normal(size=12), rng.normal(size=80)
    >>> matvec, rmatvec = logit_jacobian(X, w, p, 2)
    >>> bool(np.isclose(u @ matvec(v), rmatvec(u) @ v))
    True
    """
    xp = namespace(X, weights, params)
    d = X.shape[2]
    Q, K = _split(xp, params, d, rank)
    XQ, XK = X @ Q, X @ K
    XKt = xp.matrix_transpose(XK)
    flat_t = xp.matrix_transpose(xp.reshape(X, (-1, d)))
    root = xp.sqrt(weights)
    total = xp.sum(weights, axis=-1, keepdims=True)
    shape = weights.shape

    def matvec(v):
        dQ, dK = _split(xp, v, d, rank)
        dl = (X @ dQ) @ XKt + XQ @ xp.matrix_transpose(X @ dK)
        return xp.reshape(root * _centre(xp, dl, weights), (-1,))

    def rmatvec(u):
        u = root * xp.reshape(u, shape)
        G = u - weights * (xp.sum(u, axis=-1, keepdims=True) / total)
        # sums over sequences and tokens as one GEMM each (einsum would not use BLAS)
        dQ = flat_t @ xp.reshape(G @ XK, (-1, rank))
        dK = flat_t @ xp.reshape(xp.matrix_transpose(G) @ XQ, (-1, rank))
        return xp.concat([xp.reshape(dQ, (-1,)), xp.reshape(dK, (-1,))])

    return matvec, rmatvec
