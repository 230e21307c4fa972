"""Each head's Gauss-Newton block, and the block-Jacobi preconditioner it gives.

The polish's Gauss-Newton systems are solved by LSMR, truncated at some tens to
hundreds of products a step.  A sharp head makes them badly conditioned: the
derivative of an attention weight is proportional to the weight, so the
directions of ``Theta_i`` that move a sharp head's small weights have singular
values thousands of times below the others, and the truncated steps leave them
out; the polish then crawls, its cost falling 10-50 % an evaluation.  (Issue
61's positional previous-token head beside a random one, d = 32, k = 16, 1000
sequences, next to the truth: the reduced Jacobian's non-null singular values
spread over 4.6e4, the residual in the smallest tenth; in the variables of the
heads' own blocks, ``z_i = L_i^T vec(Theta_i)`` with ``G_i = L_i L_i^T``, over
7.)

For full ``Theta_i`` the block is in closed form.  Row ``l`` of a sequence moves
by ``d y_l = x_l^T dTheta_i B_l`` with ``B_l = X^T (diag(s_l) - s_l s_l^T) V_i``
(``s_l`` the head's pattern row, ``V_i = X W_i``), so that, without the
projections' elimination,

    G_i = sum_l (x_l x_l^T) kron (B_l B_l^T),

``d^2 x d^2`` (one GEMM over rows of ``d^2`` columns).  Leaving out the
elimination of the ``W_i`` keeps the block a sum over rows, and it preconditions
nearly as well (measured on the layer above: 7 against 2).

Pure functions on arrays of any array-API namespace (that of the inputs, on their
device).
"""

import math

import numpy as np

from ...layer._math import softmax
from ...utils._array_api import device, einsum, namespace, solve_triangular

# Query rows the block is summed over: this many times its d^2 columns (on the
# layer above a block from 64 other sequences, 1024 rows, left the
# preconditioned singular values over 700; from 200, 3200 rows, over 16; from
# 400 over 12).
GRAM_ROWS_PER_COLUMN = 3
# Ridge of a block, relative to its largest diagonal entry: the heads' exact gauge
# directions (and those the rows do not reach) are scaled by it, not blown up by
# the inverse of a rounding error.
GRAM_RIDGE = 1e-10


def gram_sequences(n_sequences, n_tokens, n_features):
    """Indices of the sequences a head's block is summed over: evenly spaced,
    ``GRAM_ROWS_PER_COLUMN d^2`` query rows (all when there are fewer).

    Examples
    --------
    >>> gram_sequences(1000, 16, 8)
    array([  0,  83, 166, 250, 333, 416, 500, 583, 666, 750, 833, 916])
    >>> len(gram_sequences(10, 16, 32))
    10
    """
    wanted = math.ceil(GRAM_ROWS_PER_COLUMN * n_features**2 / max(n_tokens, 1))
    if wanted >= n_sequences:
        return np.arange(n_sequences)
    return np.floor(np.arange(wanted) * (n_sequences / wanted)).astype(int)


def full_rank_head_grams(X, attention, projection, sample_weight=None):
    """Each head's Gauss-Newton block in ``vec(Theta_i)`` (row-major), the
    ``W_i`` held fixed: ``(m, d^2, d^2)``.

    Parameters
    ----------
    X : array of shape (n, k, d)
    attention : array of shape (m, d, d)
    projection : array of shape (m, d, d_out)
    sample_weight : array of shape (n,) or None

    Examples
    --------
    The block is ``J_i^T J_i`` of the outputs' Jacobian in ``Theta_i``:

    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(5, 3, 2))
    >>> th, W = rng.normal(size=(1, 2, 2)), rng.normal(size=(1, 2, 2))
    >>> G = full_rank_head_grams(X, th, W)[0]
    >>> eps, E = 1e-6, np.eye(4).reshape(4, 1, 2, 2)
    >>> J = np.stack([(forward(X, th + eps * e, W) - forward(X, th - eps * e, W))
    ...               .ravel() / (2 * eps) for e in E], axis=1)
    >>> bool(np.allclose(G, J.T @ J, atol=1e-6))
    True
    """
    xp = namespace(X, attention, projection)
    X = xp.asarray(X, dtype=xp.float64)
    n, k, d = X.shape
    m = attention.shape[0]
    root = None
    if sample_weight is not None:
        root = xp.sqrt(xp.asarray(sample_weight, dtype=xp.float64))
    # x_l x_l^T of every row, the same for every head: (n k, d^2)
    outer = xp.reshape(X[..., :, None] * X[..., None, :], (n * k, d * d))
    grams = []
    for i in range(m):
        s = softmax(einsum(xp, "nla,ab,nmb->nlm", X, attention[i, ...], X))
        V = X @ projection[i, ...]  # (n, k, d_out)
        # B_l = X^T diag(s_l) V - (X^T s_l)(s_l^T V): (n, k, d, d_out)
        B = einsum(xp, "nlm,nma,nmj->nlaj", s, X, V)
        B = B - (s @ X)[..., :, None] * (s @ V)[..., None, :]
        if root is not None:
            B = B * root[:, None, None, None]
        C = B @ xp.matrix_transpose(B)  # (n, k, d, d)
        flat = outer.T @ xp.reshape(C, (n * k, d * d))
        # [(a, c), (b, e)] -> [(a, b), (c, e)]
        G = xp.permute_dims(xp.reshape(flat, (d, d, d, d)), (0, 2, 1, 3))
        grams.append(xp.reshape(G, (d * d, d * d)))
    return xp.stack(grams)


def block_preconditioner(grams, ridge=GRAM_RIDGE):
    """``(apply, transpose, inverse)`` of ``M = blockdiag(L_i^{-T})`` on flat
    parameters (block ``i`` the ``i``-th run of ``grams.shape[1]``), ``L_i`` the
    Cholesky factor of ``G_i + ridge * max(diag G_i) I``, so that ``M^T G M`` is
    the identity on each block but for the ridge.  Raises
    ``numpy.linalg.LinAlgError`` where a block is not finite.

    Examples
    --------
    In the variables ``z`` (``p = M z``) each block's Gram is the identity:

    >>> import numpy as np
    >>> G = np.array([[[4.0, 1.0], [1.0, 2.0]]])
    >>> apply, transpose, inverse = block_preconditioner(G, ridge=0.0)
    >>> M = np.stack([apply(e) for e in np.eye(2)], axis=1)
    >>> bool(np.allclose(M.T @ G[0] @ M, np.eye(2)))
    True
    >>> z = np.array([0.3, -1.0])
    >>> bool(np.allclose(inverse(apply(z)), z))
    True
    >>> bool(np.allclose(transpose(z), M.T @ z))
    True
    """
    xp = namespace(grams)
    m, size = grams.shape[0], grams.shape[1]
    eye = xp.eye(size, dtype=grams.dtype, device=device(grams))
    scale = xp.max(xp.linalg.diagonal(grams), axis=-1)  # (m,)
    try:
        lower = xp.linalg.cholesky(grams + (ridge * scale)[:, None, None] * eye)
    except Exception as exc:  # torch's, numpy's errors (numpy and CuPy: NaN)
        raise np.linalg.LinAlgError(str(exc)) from exc
    if not bool(xp.all(xp.isfinite(lower))):
        raise np.linalg.LinAlgError("A head's Gauss-Newton block is not finite.")
    # L^-1 once (a product a step is then one GEMV a block, as the factor's)
    inverse_factor = xp.stack(
        [solve_triangular(xp, lower[i, ...], eye, lower=True) for i in range(m)]
    )
    down = xp.matrix_transpose(inverse_factor)  # M = L^-T

    def blocks(v):
        return xp.reshape(v, (m, size, 1))

    def flat(v):
        return xp.reshape(v, (m * size,))

    def apply(z):  # M z
        return flat(down @ blocks(z))

    def transpose(g):  # M^T g = L^-1 g
        return flat(inverse_factor @ blocks(g))

    def inverse(p):  # M^-1 p = L^T p
        return flat(xp.matrix_transpose(lower) @ blocks(p))

    return apply, transpose, inverse
