"""The math of a multi-head attention layer, as pure functions on arrays.

    F(X) = sum_i softmax(X Theta_i X^T + 1 (X u_i)^T) X W_i + 1 c^T

(the key biases ``u_i`` and the intercept ``c`` are optional: ``None`` means 0, the
bias-free model).  Shapes used throughout (float64):

* ``X``: ``(n, k, d)`` -- n sequences of k tokens with d features;
* ``attention``: ``(m, d, d)`` -- the Theta_i;
* ``projection``: ``(m, d, d_out)`` -- the W_i;
* ``key_bias``: ``(m, d)`` or None -- the u_i (logit term ``u_i^T x_a`` of key a);
* ``intercept``: ``(d_out,)`` or None -- the constant output shift c;
* patterns: ``(n, m, k, k)`` -- row l of head i is softmax_a(x_l^T Theta_i x_a);
* head features: ``(n, m, k, d)`` -- S_i X, so that F(X) = sum_i (S_i X) W_i.

The balanced low-rank factors of each head's matrices (:func:`balanced_factors`,
for ``AttentionLayer.factors`` and the solvers' low-rank parametrizations) and the
separation of the heads' ``Theta_i`` (:func:`min_separation`, for the planted
layers of :mod:`skattn.datasets` and the conditions of :mod:`skattn.diagnostics`)
are here too.  Nothing here validates input: callers (estimators, ``AttentionLayer``)
do.
"""

import numpy as np


def softmax(logits, axis=-1):
    """Numerically stable softmax along ``axis`` (finite for logits of any size).

    Examples
    --------
    >>> import numpy as np
    >>> softmax(np.array([1000.0, -1000.0, 1000.0]))
    array([0.5, 0. , 0.5])
    """
    shifted = logits - np.max(logits, axis=axis, keepdims=True)
    expo = np.exp(shifted)
    return expo / np.sum(expo, axis=axis, keepdims=True)


# forward() computes the head features (n, m, k, d) of at most this many floats at
# once (128 MiB): 12 heads of d = 384 on 20000 sequences of 16 tokens would take 12 GB.
_FORWARD_CHUNK_FLOATS = 2**24


def attention_logits(X, attention, key_bias=None):
    """Logits ``X Theta_i X^T + 1 (X u_i)^T``: ``(n, k, d), (m, d, d) -> (n, m, k, k)``.

    ``key_bias`` (m, d), when given, adds ``u_i^T x_a`` to every row's logit of key
    token ``a`` (the query bias of a real layer, mapped through the key weights).

    Examples
    --------
    >>> import numpy as np
    >>> attention_logits(np.ones((1, 2, 3)), np.eye(3)[None]).shape
    (1, 1, 2, 2)
    """
    # (x_l^T Theta_i) for every token l, then dot with every token a.
    left = np.einsum("nkd,mde->nmke", X, attention, optimize=True)
    logits = np.matmul(left, np.swapaxes(X, 1, 2)[:, None])
    if key_bias is not None:
        # u_i^T x_a, the same for every query row l
        logits += np.einsum("nad,md->nma", X, key_bias, optimize=True)[:, :, None, :]
    return logits


def attention_patterns(X, attention, key_bias=None):
    """Row-stochastic patterns ``softmax(X Theta_i X^T + 1 (X u_i)^T)``.

    Shape ``-> (n, m, k, k)``; ``key_bias`` as in :func:`attention_logits`.

    Examples
    --------
    >>> import numpy as np
    >>> attention_patterns(np.ones((1, 2, 3)), np.zeros((1, 3, 3)))[0, 0]
    array([[0.5, 0.5],
           [0.5, 0.5]])
    """
    return softmax(attention_logits(X, attention, key_bias), axis=-1)


def head_features(X, attention, patterns=None, key_bias=None):
    """Per-head token features ``S_i X``: ``-> (n, m, k, d)``.

    F is linear in the projections given these: ``F(X) = sum_i (S_i X) W_i``.

    Examples
    --------
    >>> import numpy as np
    >>> head_features(np.ones((4, 2, 3)), np.zeros((2, 3, 3))).shape
    (4, 2, 2, 3)
    """
    if patterns is None:
        patterns = attention_patterns(X, attention, key_bias)
    return np.matmul(patterns, X[:, None])


def forward(X, attention, projection, features=None, key_bias=None, intercept=None):
    """The layer's output ``sum_i softmax(X Theta_i X^T) X W_i``: ``-> (n, k, d_out)``.

    With ``key_bias`` (m, d) the logits gain ``u_i^T x_a``; with ``intercept``
    (d_out,) every output token gains ``c`` (value and output biases of a real
    layer: each attention row sums to 1, so they add a constant).

    Examples
    --------
    >>> import numpy as np
    >>> X = np.ones((1, 2, 3))
    >>> forward(X, np.zeros((1, 3, 3)), np.ones((1, 3, 1)))[0, :, 0]
    array([3., 3.])
    """
    if features is None:
        n, k, d = X.shape
        step = max(1, _FORWARD_CHUNK_FLOATS // (max(len(attention), 1) * k * max(k, d)))
        if n > step:  # bounded memory: the head features of a chunk at a time
            out = np.empty(
                (n, k, projection.shape[2]), np.result_type(X, attention, projection)
            )
            for start in range(0, n, step):
                rows = slice(start, start + step)
                out[rows] = forward(
                    X[rows],
                    attention,
                    projection,
                    key_bias=key_bias,
                    intercept=intercept,
                )
            return out
        features = head_features(X, attention, key_bias=key_bias)
    out = np.einsum("nmkd,mdo->nko", features, projection, optimize=True)
    if intercept is not None:
        out += intercept
    return out


def squared_loss_gradient(X, Y, attention, projection, sample_weight=None):
    """Weighted squared loss and its analytic gradient in (Theta, W).

    ``loss = sum_n w_n ||F(X_n) - Y_n||_F^2 / (2 sum_n w_n)``.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    sample_weight : ndarray of shape (n,) or None

    Returns
    -------
    loss : float
    grad_attention : ndarray of shape (m, d, d)
    grad_projection : ndarray of shape (m, d, d_out)

    Notes
    -----
    With residual R = F(X) - Y, per head: dW_i = (S_i X)^T R,
    dS_i = R W_i^T X^T, dL_i = S_i * (dS_i - rowsum(dS_i * S_i)),
    dTheta_i = X^T dL_i X.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.ones((2, 2, 3)); th = np.zeros((1, 3, 3)); W = np.zeros((1, 3, 1))
    >>> loss, gth, gw = squared_loss_gradient(X, np.ones((2, 2, 1)), th, W)
    >>> float(loss), gth.shape, gw.shape
    (1.0, (1, 3, 3), (1, 3, 1))
    """
    n = X.shape[0]
    w = np.ones(n) if sample_weight is None else np.asarray(sample_weight, float)
    total = w.sum()
    patterns = attention_patterns(X, attention)
    features = np.matmul(patterns, X[:, None])  # (n, m, k, d)
    residual = forward(X, attention, projection, features) - Y  # (n, k, o)
    wres = residual * (w / total)[:, None, None]
    loss = 0.5 * float(np.sum(wres * residual))
    grad_projection = np.einsum("nmkd,nko->mdo", features, wres, optimize=True)
    # dS_i = R W_i^T X^T : (n, m, k, k)
    rw = np.einsum("nko,mdo->nmkd", wres, projection, optimize=True)
    d_patterns = np.matmul(rw, np.swapaxes(X, 1, 2)[:, None])
    d_logits = patterns * (
        d_patterns - np.sum(d_patterns * patterns, axis=-1, keepdims=True)
    )
    # X^T dL_i X summed over samples: a batched matmul, then one BLAS contraction.
    d_logits_x = np.matmul(d_logits, X[:, None])  # (n, m, k, d)
    grad_attention = np.einsum("nkd,nmke->mde", X, d_logits_x, optimize=True)
    return loss, grad_attention, grad_projection


def balanced_factors(matrices, rank):
    """Factors ``A (m, p, r)``, ``B (m, q, r)`` with ``A_i B_i^T`` the best rank-r
    approximation of ``matrices[i]`` (``(m, p, q)``), balanced: ``A = U sqrt(s)``,
    ``B = V sqrt(s)`` from the SVD.

    Examples
    --------
    >>> import numpy as np
    >>> M = np.outer([1.0, 2.0], [3.0, 4.0, 5.0])[None]
    >>> A, B = balanced_factors(M, 1)
    >>> bool(np.allclose(A[0] @ B[0].T, M[0]))
    True
    """
    U, s, Vt = np.linalg.svd(np.asarray(matrices, dtype=float), full_matrices=False)
    root = np.sqrt(s[:, :rank])
    return U[:, :, :rank] * root[:, None, :], np.swapaxes(Vt[:, :rank], 1, 2) * root[
        :, None, :
    ]


def min_separation(attention):
    """Smallest relative distance between two heads.

    Parameters
    ----------
    attention : ndarray of shape (n_heads, n_features, n_features)

    Returns
    -------
    separation : float
        ``min_{i<j} ||Theta_i - Theta_j||_F / max(||Theta_i||_F, ||Theta_j||_F)``;
        ``inf`` for one head, 0 when two heads are both zero.

    Examples
    --------
    >>> import numpy as np
    >>> min_separation(np.stack([np.eye(2), 2 * np.eye(2)]))
    0.5
    """
    m = len(attention)
    flat = attention.reshape(m, -1)
    norms = np.linalg.norm(flat, axis=1)
    i, j = np.triu_indices(m, k=1)
    if i.size == 0:
        return np.inf
    dist = np.linalg.norm(flat[i] - flat[j], axis=1)
    denom = np.maximum(norms[i], norms[j])
    ratios = np.divide(dist, denom, out=np.zeros_like(dist), where=denom > 0)
    return float(ratios.min())
