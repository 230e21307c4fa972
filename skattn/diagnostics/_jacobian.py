"""The Jacobian of an attention layer's outputs in its parameters, for small sizes.

Pure functions on token tensors (``X`` of shape ``(n, k, d)``; ``attention``
``(m, d, d)``, ``projection`` ``(m, d, d_out)``), used by
:func:`skattn.diagnostics.certify` for local identifiability.  The parameters are
the products ``(Theta_i, W_i)``,
flattened in the order ``Theta_1, ..., Theta_m, W_1, ..., W_m`` (row-major), so
the same Jacobian serves full-rank and low-rank (``Theta_i = Q_i K_i^T``,
``W_i = V_i O_i``) parametrizations: for the latter it is restricted to the tangent
space of the rank-r matrices (:func:`low_rank_tangent_basis`), which removes the
``2 r^2`` gauge directions of the factors per head.

Derivatives (``S_il`` head i's pattern on row l, ``C_il = Cov_{S_il}(x) W_i``):
``dF[l, o] / dTheta_i[p, q] = x_l[p] C_il[q, o]`` and
``dF[l, o] / dW_i[p, o'] = delta_{o o'} (S_i X)_l[p]``.
"""

import numpy as np
from scipy import linalg

from ..layer._math import attention_patterns

# Rows of the Jacobian per chunk of the QR accumulation, relative to its columns.
_CHUNK_ROWS_PER_COLUMN = 2


def layer_jacobian(X, attention, projection):
    """The dense Jacobian of the flattened outputs in the flattened parameters.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)

    Returns
    -------
    jacobian : ndarray of shape (n * k * d_out, m * d * d + m * d * d_out)
        Rows in the order of ``F(X)`` flattened (sample, token, output);
        columns ``Theta_1, ..., Theta_m, W_1, ..., W_m`` flattened row-major.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(5, 3, 2))
    >>> th, W = rng.normal(size=(2, 2, 2)), rng.normal(size=(2, 2, 3))
    >>> J = layer_jacobian(X, th, W)
    >>> J.shape
    (45, 20)
    >>> step = 1e-6 * rng.normal(size=20)
    >>> th2 = th + step[:8].reshape(2, 2, 2); W2 = W + step[8:].reshape(2, 2, 3)
    >>> change = (forward(X, th2, W2) - forward(X, th, W)).ravel()
    >>> bool(np.allclose(J @ step, change, atol=1e-10))
    True
    """
    n, k, d = X.shape
    m, _, d_out = projection.shape
    patterns = attention_patterns(X, attention)  # (n, m, k, k)
    features = np.matmul(patterns, X[:, None])  # (n, m, k, d): (S_i X)_l
    values = np.einsum("nad,mdo->nmao", X, projection)  # (n, m, k, o)
    mean_values = np.matmul(patterns, values)  # (n, m, k, o)
    cov = np.einsum("nmla,naq,nmao->nmlqo", patterns, X, values, optimize=True)
    cov -= features[..., :, None] * mean_values[..., None, :]  # C_il (q, o)
    # d F[n, l, o] / d Theta_i[p, q] = x_l[p] C_il[q, o]
    j_theta = np.einsum("nlp,nmlqo->nlompq", X, cov, optimize=True)
    # d F[n, l, o] / d W_i[p, o'] = delta_{o o'} f_il[p]
    j_w = np.zeros((n, k, d_out, m, d, d_out))
    idx = np.arange(d_out)
    j_w[:, :, idx, :, :, idx] = features.transpose(0, 2, 1, 3)[None]
    rows = n * k * d_out
    return np.concatenate(
        [j_theta.reshape(rows, m * d * d), j_w.reshape(rows, m * d * d_out)], axis=1
    )


def low_rank_tangent_basis(matrix, rank):
    """Orthonormal basis of the tangent space of the rank-``rank`` matrices.

    At ``A = U S V^T`` (rank r) the tangent space is ``{U B + C V^T}``, of
    dimension ``r (p + q - r)``: the directions in which ``A = L R^T`` moves when
    its factors move, with the ``r^2`` gauge directions ``(L G, R G^{-T})``
    removed.

    Parameters
    ----------
    matrix : ndarray of shape (p, q)
    rank : int
        Rank of the parametrization, at most ``min(p, q)``.

    Returns
    -------
    basis : ndarray of shape (p * q, dim)
        Orthonormal columns (row-major flattening), ``dim = r (p + q - r)``;
        the identity when ``rank >= min(p, q)``.

    Examples
    --------
    >>> import numpy as np
    >>> A = np.outer([1.0, 2.0, 0.0], [0.0, 1.0, 1.0])
    >>> low_rank_tangent_basis(A, 1).shape
    (9, 5)
    """
    p, q = matrix.shape
    if rank >= min(p, q):
        return np.eye(p * q)
    u, _, vt = np.linalg.svd(matrix)
    u, v = u[:, :rank], vt[:rank].T
    eye_p, eye_q = np.eye(p), np.eye(q)
    # P_T(Z) = U U^T Z + Z V V^T - U U^T Z V V^T, as a (pq, pq) operator
    pu, pv = u @ u.T, v @ v.T
    proj = np.kron(pu, eye_q) + np.kron(eye_p, pv) - np.kron(pu, pv)
    evals, evecs = np.linalg.eigh(proj)
    dim = rank * (p + q - rank)
    return evecs[:, np.argsort(evals)[::-1][:dim]]


def parameter_basis(attention, projection, head_rank=None):
    """Block-diagonal basis of the parameter directions the parametrization allows.

    Parameters
    ----------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    head_rank : int or None
        ``None``: full-rank heads (the identity basis, returned as None).

    Returns
    -------
    basis : ndarray of shape (m d^2 + m d d_out, dim) or None

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> th, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 5))
    >>> parameter_basis(th, W, 1).shape  # 2 heads x (1*(4+4-1) + 1*(4+5-1))
    (72, 30)
    """
    if head_rank is None:
        return None
    blocks = [low_rank_tangent_basis(a, head_rank) for a in attention]
    blocks += [low_rank_tangent_basis(w, head_rank) for w in projection]
    return linalg.block_diag(*blocks)


def jacobian_singular_values(X, attention, projection, basis=None):
    """Singular values of the Jacobian (optionally times ``basis``), accurately.

    The Jacobian is built in chunks of samples and reduced by a running QR
    factorisation (only its triangular factor is kept), so the singular values
    come from ``R`` rather than from the Gram matrix and small ones keep their
    relative accuracy.  Memory is ``O(cols^2)`` plus one chunk.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    basis : ndarray of shape (m d^2 + m d d_out, dim) or None
        Restrict to these parameter directions (:func:`parameter_basis`).

    Returns
    -------
    singular_values : ndarray of shape (cols,)
        Descending; ``cols`` is ``dim`` or the number of parameters.  Values past
        the number of Jacobian rows are 0.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(50, 3, 2))
    >>> th, W = rng.normal(size=(1, 2, 2)), rng.normal(size=(1, 2, 3))
    >>> s = jacobian_singular_values(X, th, W)
    >>> s.shape, bool(s[-1] > 1e-6 * s[0])
    ((10,), True)
    """
    n, k, _ = X.shape
    d_out = projection.shape[2]
    cols = basis.shape[1] if basis is not None else projection.size + attention.size
    per_sample = k * d_out
    chunk = max(1, (_CHUNK_ROWS_PER_COLUMN * cols) // per_sample)
    r = np.zeros((0, cols))
    for start in range(0, n, chunk):
        jac = layer_jacobian(X[start : start + chunk], attention, projection)
        if basis is not None:
            jac = jac @ basis
        r = linalg.qr(np.vstack([r, jac]), mode="r", check_finite=False)[0]
        r = r[: min(r.shape[0], cols)]
    s = linalg.svd(r, compute_uv=False, check_finite=False)
    return np.concatenate([s, np.zeros(cols - s.size)])
