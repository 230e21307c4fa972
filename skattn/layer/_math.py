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

The functions up to :func:`balanced_factors` take arrays of any array-API namespace
(numpy, torch, CuPy, array-api-strict; :mod:`skattn.utils._array_api`) and return
arrays of that namespace, on the inputs' device; numpy arrays get the numpy results
of before, bit for bit.
"""

import numpy as np

from ..utils._array_api import (
    device,
    einsum,
    free_memory,
    is_numpy,
    is_out_of_memory,
    namespace,
)
from ._positions import mask_logits, rotary_logits


def softmax(logits, axis=-1):
    """Numerically stable softmax along ``axis`` (finite for logits of any size).

    Examples
    --------
    >>> import numpy as np
    >>> softmax(np.array([1000.0, -1000.0, 1000.0]))
    array([0.5, 0. , 0.5])
    """
    xp = _namespace(logits)
    shifted = logits - xp.max(logits, axis=axis, keepdims=True)
    expo = xp.exp(shifted)
    return expo / xp.sum(expo, axis=axis, keepdims=True)


class _Numpy:
    """The array-API numpy namespace, its hot aliases bound to numpy's functions.

    ``array_api_compat``'s numpy aliases (``reshape``, ``permute_dims``,
    ``matmul``, ``astype``, ...) wrap numpy's in a Python call each, and finding
    the namespace of numpy arrays takes microseconds: per chunk of a Jacobian
    product that adds up on small problems.  The same functions, the same
    results; anything else is the compat namespace's (``is_numpy`` holds: it
    has that namespace's name).
    """

    def __init__(self, compat):
        self._compat = compat
        self.__name__ = compat.__name__

    def __getattr__(self, name):
        if name == "_compat":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self._compat, name)

    def __reduce__(self):  # copies and pickles are the one instance
        return _namespace, ()

    matmul = staticmethod(np.matmul)

    # the methods: numpy's function forms dispatch first (half a microsecond)
    @staticmethod
    def reshape(x, /, shape):
        return x.reshape(shape)

    @staticmethod
    def permute_dims(x, /, axes):
        return x.transpose(axes)

    @staticmethod
    def matrix_transpose(x):
        return x.swapaxes(-1, -2)

    @staticmethod
    def astype(x, dtype, /, *, copy=True, device=None):
        return x.astype(dtype, copy=copy)


_NUMPY = _Numpy(namespace())


def _namespace(*arrays):
    """:func:`~skattn.utils._array_api.namespace`, at once for numpy arrays (and
    ``None``): the kernels ask for it in every call."""
    for array in arrays:
        if array is not None and not isinstance(array, np.ndarray):
            xp = namespace(*arrays)  # which ignores what is no array (TokenBatches)
            return _NUMPY if is_numpy(xp) else xp
    return _NUMPY


# forward() computes the head features (n, m, k, d) of at most this many floats at
# once (128 MiB): 12 heads of d = 384 on 20000 sequences of 16 tokens would take 12 GB.
_FORWARD_CHUNK_FLOATS = 2**24
# On a device (GPU), one chunk's largest intermediate may take this share of the
# memory free when the chunking is chosen: a handful of intermediates of that size
# live at once, and larger chunks keep the device busy.
_DEVICE_MEMORY_SHARE = 1 / 16


def _einsum(xp, subscripts, *operands):
    """``einsum`` in ``xp``; numpy's with ``optimize=True`` (BLAS contractions, and
    the bits of before)."""
    if is_numpy(xp):
        return np.einsum(subscripts, *operands, optimize=True)
    return einsum(xp, subscripts, *operands)


def _chunk_floats(x, floats):
    """Floats that one chunk's largest intermediate may hold for arrays like ``x``.

    ``floats`` (a fixed budget) for host arrays (numpy, torch on the CPU), so
    that their chunking and results do not change; on a device, a share of the
    memory it has free (:data:`_DEVICE_MEMORY_SHARE`).

    Examples
    --------
    >>> import numpy as np
    >>> _chunk_floats(np.ones(2), 2**21)
    2097152
    """
    free = free_memory(x)
    if free is None:
        return floats
    xp = _namespace(x)
    itemsize = (
        xp.finfo(x.dtype).bits // 8 if xp.isdtype(x.dtype, "real floating") else 8
    )
    return max(1, int(free * _DEVICE_MEMORY_SHARE) // itemsize)


def _halving(size, attempt):
    """``attempt(size)``, with ``size`` halved after an out-of-memory error.

    ``attempt`` runs a whole chunked computation with chunks of ``size``
    samples; a device that runs out of memory (or the host: ``MemoryError``)
    retries it with half the chunk, down to one sample, rather than failing.

    Examples
    --------
    >>> _halving(8, lambda size: size)
    8
    """
    while True:
        try:
            return attempt(size)
        except Exception as exc:
            if size <= 1 or not is_out_of_memory(exc):
                raise
            size = max(1, size // 2)


def attention_logits(
    X, attention, key_bias=None, *, causal=False, rotary=None, key_mask=None
):
    """Logits ``X Theta_i X^T + 1 (X u_i)^T``: ``(n, k, d), (m, d, d) -> (n, m, k, k)``.

    ``key_bias`` (m, d), when given, adds ``u_i^T x_a`` to every row's logit of key
    token ``a`` (the query bias of a real layer, mapped through the key weights).
    The decoder terms of :mod:`skattn.layer._positions`: ``rotary`` (a
    :class:`~skattn.layer._positions.Rotary`) adds the rotary logits, ``causal``
    and ``key_mask`` (n, k) mask keys (the most negative float).

    Examples
    --------
    >>> import numpy as np
    >>> attention_logits(np.ones((1, 2, 3)), np.eye(3)[None]).shape
    (1, 1, 2, 2)
    """
    xp = _namespace(X, attention)
    # (x_l^T Theta_i) for every token l, then dot with every token a.
    left = _einsum(xp, "nkd,mde->nmke", X, attention)
    logits = xp.matmul(left, xp.permute_dims(X, (0, 2, 1))[:, None, ...])
    if key_bias is not None:
        # u_i^T x_a, the same for every query row l
        logits += _einsum(xp, "nad,md->nma", X, key_bias)[:, :, None, :]
    if rotary is not None:
        logits = logits + rotary_logits(X, rotary)
    return mask_logits(logits, causal, key_mask)


def attention_patterns(X, attention, key_bias=None, **decoder):
    """Row-stochastic patterns ``softmax(X Theta_i X^T + 1 (X u_i)^T)``.

    Shape ``-> (n, m, k, k)``; ``key_bias`` and the ``decoder`` keywords
    (``causal``, ``rotary``, ``key_mask``) as in :func:`attention_logits`.

    Examples
    --------
    >>> import numpy as np
    >>> attention_patterns(np.ones((1, 2, 3)), np.zeros((1, 3, 3)))[0, 0]
    array([[0.5, 0.5],
           [0.5, 0.5]])
    """
    return softmax(attention_logits(X, attention, key_bias, **decoder), axis=-1)


def head_features(X, attention, patterns=None, key_bias=None, **decoder):
    """Per-head token features ``S_i X``: ``-> (n, m, k, d)``.

    ``decoder``: the keywords of :func:`attention_logits` (``causal``,
    ``rotary``, ``key_mask``).

    F is linear in the projections given these: ``F(X) = sum_i (S_i X) W_i``.

    Examples
    --------
    >>> import numpy as np
    >>> head_features(np.ones((4, 2, 3)), np.zeros((2, 3, 3))).shape
    (4, 2, 2, 3)
    """
    if patterns is None:
        patterns = attention_patterns(X, attention, key_bias, **decoder)
    return _namespace(X).matmul(patterns, X[:, None, ...])


def forward(
    X, attention, projection, features=None, key_bias=None, intercept=None, **decoder
):
    """The layer's output ``sum_i softmax(X Theta_i X^T) X W_i``: ``-> (n, k, d_out)``.

    With ``key_bias`` (m, d) the logits gain ``u_i^T x_a``; with ``intercept``
    (d_out,) every output token gains ``c`` (value and output biases of a real
    layer: each attention row sums to 1, so they add a constant).  ``decoder``:
    the keywords ``causal``, ``rotary`` and ``key_mask`` of
    :func:`attention_logits` (a ``key_mask`` is cut into the same chunks as X).

    Examples
    --------
    >>> import numpy as np
    >>> X = np.ones((1, 2, 3))
    >>> forward(X, np.zeros((1, 3, 3)), np.ones((1, 3, 1)))[0, :, 0]
    array([3., 3.])
    """
    xp = _namespace(X, attention, projection)
    if features is None:
        n, k, d = X.shape
        per_sample = max(attention.shape[0], 1) * k * max(k, d)
        step = max(1, _chunk_floats(X, _FORWARD_CHUNK_FLOATS) // per_sample)
        if n > step:  # bounded memory: the head features of a chunk at a time
            return _halving(
                step,
                lambda size: _forward_chunks(
                    X, attention, projection, key_bias, intercept, size, decoder
                ),
            )
        try:
            features = head_features(X, attention, key_bias=key_bias, **decoder)
        except Exception as exc:  # a device out of memory: in chunks after all
            if n <= 1 or not is_out_of_memory(exc):
                raise
            return _halving(
                n // 2,
                lambda size: _forward_chunks(
                    X, attention, projection, key_bias, intercept, size, decoder
                ),
            )
    out = _einsum(xp, "nmkd,mdo->nko", features, projection)
    if intercept is not None:
        out += intercept
    return out


def _forward_chunks(X, attention, projection, key_bias, intercept, step, decoder):
    """:func:`forward` on chunks of ``step`` samples (the head features of one
    chunk at a time)."""
    xp = _namespace(X, attention, projection)
    n, k, _ = X.shape
    out = xp.empty(
        (n, k, projection.shape[2]),
        dtype=xp.result_type(X, attention, projection),
        device=device(X),
    )
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))  # the standard: stop <= n
        features = head_features(
            X[rows, ...], attention, key_bias=key_bias, **_rows(decoder, rows)
        )
        out[rows, ...] = forward(
            X[rows, ...], attention, projection, features, intercept=intercept
        )
    return out


def _rows(decoder, rows):
    """The ``decoder`` keywords of a chunk of samples (its rows of ``key_mask``)."""
    if decoder.get("key_mask") is None:
        return decoder
    return {**decoder, "key_mask": decoder["key_mask"][rows, ...]}


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
    loss, grad_attention, grad_projection = _squared_loss_gradient(
        X, Y, attention, projection, sample_weight
    )
    return float(loss), grad_attention, grad_projection


def _squared_loss_gradient(X, Y, attention, projection, sample_weight=None):
    """:func:`squared_loss_gradient` with the loss a 0-d array (no host sync)."""
    xp = _namespace(X, Y, attention, projection)
    n = X.shape[0]
    if sample_weight is None:
        w = xp.ones(n, dtype=xp.float64, device=device(X))
    else:
        w = xp.astype(xp.asarray(sample_weight, device=device(X)), xp.float64)
    total = xp.sum(w)
    patterns = attention_patterns(X, attention)
    features = xp.matmul(patterns, X[:, None, ...])  # (n, m, k, d)
    residual = forward(X, attention, projection, features) - Y  # (n, k, o)
    wres = residual * (w / total)[:, None, None]
    loss = 0.5 * xp.sum(wres * residual)
    grad_projection = _einsum(xp, "nmkd,nko->mdo", features, wres)
    # dS_i = R W_i^T X^T : (n, m, k, k)
    rw = _einsum(xp, "nko,mdo->nmkd", wres, projection)
    d_patterns = xp.matmul(rw, xp.permute_dims(X, (0, 2, 1))[:, None, ...])
    d_logits = patterns * (
        d_patterns - xp.sum(d_patterns * patterns, axis=-1, keepdims=True)
    )
    # X^T dL_i X summed over samples: a batched matmul, then one BLAS contraction.
    d_logits_x = xp.matmul(d_logits, X[:, None, ...])  # (n, m, k, d)
    grad_attention = _einsum(xp, "nkd,nmke->mde", X, d_logits_x)
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
    if isinstance(matrices, np.ndarray) or not hasattr(matrices, "shape"):
        matrices = np.asarray(matrices, dtype=float)
    xp = _namespace(matrices)
    matrices = xp.astype(matrices, xp.float64, copy=False)
    U, s, Vt = xp.linalg.svd(matrices, full_matrices=False)
    root = xp.sqrt(s[:, :rank])
    return U[:, :, :rank] * root[:, None, :], xp.permute_dims(
        Vt[:, :rank, :], (0, 2, 1)
    ) * root[:, None, :]


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
