"""Parametrizations of the attention matrices: full Theta_i or low rank Q_i K_i^T.

A parametrization maps a flat parameter vector ``p`` to the logits of every head,
``(n, m, k, k)``, and gives the logits' Jacobian-vector and vector-Jacobian
products; the rest of the model (softmax, projections) is shared.  Shapes:

* ``FullRank(m, d)``: ``p`` holds Theta ``(m, d, d)``; logits ``X Theta_i X^T``.
* ``LowRank(m, d, r)``: ``p`` holds Q ``(m, d, r)`` then K ``(m, d, r)``; logits
  ``(X Q_i)(X K_i)^T``, so Theta_i = Q_i K_i^T.  The factors are defined up to the
  gauge ``(Q_i G, K_i G^{-T})`` (``r^2`` directions per head along which the logits
  do not change); only the products are identifiable.

``LowRank`` and ``FactoredHeads`` also parametrize decoder heads (keywords
``causal``, ``rope_theta``, ``rope_layout``, ``n_kv_heads``; the model of
:mod:`skattn.layer._positions`): grouped-query heads hold ``K`` per key head,
``(m_kv, d, r)``, each query head using its group's; with rotary positions the
token maps ``X Q_i`` and ``X K_g`` are rotated by their tokens' positions (a
linear map per position, so the products rotate the directions' maps, and the
pull-backs rotate the cotangents back); a causal mask puts the logits above the
diagonal at the most negative float (their softmax is exactly 0) and zeroes the
products there.

The products cost ``O(n k d^2)`` per head for the full parametrization and
``O(n k d r + n k^2 r)`` for the low-rank one.  ``cache(X, p)`` precomputes what
the products at ``p`` reuse (the token maps ``X Q_i``, ``X K_i``).

Parameters and tokens may be arrays of any array-API namespace (numpy, torch,
CuPy, array-api-strict; :mod:`skattn.utils._array_api`): the results are in their
namespace and on their device, and numpy arrays get the numpy results of before.
Random starts are drawn on the host (numpy) and moved, so that a seed gives the
same start in every namespace.
"""

import functools

import numpy as np
from sklearn.externals.array_api_compat import is_array_api_obj
from sklearn.utils import check_random_state

from ...layer._math import _namespace, balanced_factors
from ...layer._positions import (
    LAYOUTS,
    key_head_index,
    mask_logits,
    rotary_tables,
    rotate,
)
from ...utils._array_api import (
    causal_keep,
    device,
    device_constant,
    is_numpy,
    to_namespace,
)
from ._loss import solve_projections


def _float_array(x):
    """``x`` as a float64 array of its namespace (a numpy array for array-likes)."""
    if isinstance(x, np.ndarray) or not hasattr(x, "shape"):
        return np.asarray(x, dtype=float)
    xp = _namespace(x)
    return xp.astype(x, xp.float64, copy=False)


def _flat(x):
    """``x`` flattened (a view when it can be)."""
    return _namespace(x).reshape(x, (-1,))


def _like(x, like):
    """``x`` (an array or array-like) as a float64 array of ``like``'s namespace and
    device (numpy: ``numpy.asarray(x, dtype=float)``, no copy)."""
    xp = _namespace(like)
    if is_numpy(xp):
        return np.asarray(x, dtype=float)
    return to_namespace(x, xp, device(like), dtype=xp.float64)


def _transpose(x):
    """Swap the last two axes (``numpy.swapaxes(x, -2, -1)``)."""
    return _namespace(x).matrix_transpose(x)


class FullRank:
    """Theta_i in full: ``m d^2`` parameters.

    Examples
    --------
    >>> import numpy as np
    >>> par = FullRank(2, 3)
    >>> par.size
    18
    >>> par.logits(np.ones((1, 4, 3)), np.zeros(18)).shape
    (1, 2, 4, 4)
    """

    def __init__(self, n_heads, n_features):
        self.n_heads, self.n_features = n_heads, n_features
        self.size = n_heads * n_features * n_features

    def attention(self, params):
        """Theta ``(m, d, d)`` from the flat parameters."""
        m, d = self.n_heads, self.n_features
        return _namespace(params).reshape(params, (m, d, d))

    def from_attention(self, attention):
        """Flat parameters of the attention matrices ``(m, d, d)``."""
        attention = _float_array(attention)
        return _namespace(attention).asarray(_flat(attention), copy=True)

    def attention_vjp(self, params, grad_attention):
        """Pull a gradient in Theta ``(m, d, d)`` back to the flat parameters."""
        return _flat(_float_array(grad_attention))

    def cache(self, X, params):
        """Nothing to precompute for the full parametrization."""
        return None

    def preconditioner(self, params):
        """None: the full parametrization is solved in its own variables."""
        return None

    def logits(self, X, params, cache=None):
        """``X Theta_i X^T``: ``(n, k, d) -> (n, m, k, k)``."""
        return _bilinear(X, self.attention(params), X)

    def logits_jvp(self, X, params, direction, cache=None):
        """Directional derivative of the logits: ``X V_i X^T``."""
        return _bilinear(X, self.attention(direction), X)

    def logits_vjp(self, X, params, cotangent, cache=None):
        """Pull a cotangent ``G (n, m, k, k)`` back: ``sum_n X^T G_i X``, flat."""
        xp = _namespace(X, cotangent)
        return _flat(_pull_back(X, xp.matmul(cotangent, X[:, None, ...])))


class LowRank:
    """Theta_i = Q_i K_i^T with Q_i, K_i of shape ``(d, r)``: ``2 m d r`` parameters.

    Examples
    --------
    >>> import numpy as np
    >>> par = LowRank(2, 3, 1)
    >>> par.size
    12
    >>> theta = par.attention(np.arange(12.0))
    >>> theta.shape, int(np.linalg.matrix_rank(theta[0]))
    ((2, 3, 3), 1)
    """

    def __init__(
        self,
        n_heads,
        n_features,
        rank,
        *,
        causal=False,
        rope_theta=None,
        rope_layout="half",
        n_kv_heads=None,
    ):
        self.n_heads, self.n_features, self.rank = n_heads, n_features, rank
        _set_decoder(self, causal, rope_theta, rope_layout, n_kv_heads)
        self.size = (n_heads + self.n_kv_heads) * n_features * rank

    def factors(self, params):
        """``Q (m, d, r)``, ``K (m_kv, d, r)`` (``m_kv = m`` unless grouped)."""
        return _split(params, self, 2)

    def attention(self, params):
        """``Theta_i = Q_i K_g^T`` (``g`` query head i's key head): ``(m, d, d)``.

        With rotary positions, the logits between tokens at equal positions."""
        Q, K = self.factors(params)
        return _namespace(Q).matmul(Q, _transpose(_expand(self, K)))

    def from_attention(self, attention):
        """Balanced factors of the best rank-r approximation of each Theta_i."""
        _check_ungrouped(self)
        factors = balanced_factors(attention, self.rank)
        return _namespace(*factors).concat([_flat(f) for f in factors])

    def attention_vjp(self, params, grad_attention):
        """Pull a gradient ``G`` in Theta back to the factors: ``dQ_i = G_i K_i``,
        ``dK_i = G_i^T Q_i``, flat."""
        _check_ungrouped(self)
        Q, K = self.factors(params)
        return _namespace(Q).concat(
            [_flat(grad_attention @ K), _flat(_transpose(grad_attention) @ Q)]
        )

    def preconditioner(self, params):
        """Right preconditioner at ``params``: ``(apply, transpose, inverse)``.

        New variables ``Z`` with ``Q_i = Z^Q_i C^K_i`` and ``K_i = Z^K_i C^Q_i``,
        ``C^K_i = (K_i^T K_i)^{-1/2}`` and ``C^Q_i = (Q_i^T Q_i)^{-1/2}`` at
        ``params`` (ridged by ``1e-10`` of their mean eigenvalue): the logits'
        derivative along ``Z^Q_i`` is then ``X dZ^Q_i (X K_i C^K_i)^T``, whose
        scale no longer depends on the spread of ``Theta_i``'s singular values
        (the preconditioning of scaled gradient descent, Tong, Ma & Chi 2021).
        Near a minimum that spread is what makes the Gauss-Newton systems
        ill-conditioned and LSMR slow.  ``apply`` maps ``z`` to ``p = M z``,
        ``transpose`` a gradient in ``p`` to one in ``z`` (``M^T g``),
        ``inverse`` ``p`` to ``z``.

        Examples
        --------
        >>> import numpy as np
        >>> par = LowRank(2, 5, 2)
        >>> p = np.random.default_rng(0).normal(size=par.size)
        >>> apply, transpose, inverse = par.preconditioner(p)
        >>> bool(np.allclose(apply(inverse(p)), p))
        True
        """
        Q, K = self.factors(params)
        index = _device_group_index(self, K)
        apply, inverse = _scaled_metric(Q, K, index)
        # the C are symmetric, so M^T = M
        return apply, apply, inverse

    def cache(self, X, params):
        """The token maps ``X Q_i`` and ``X K_g`` (rotated, each query head's key
        head's), each ``(n, m, k, r)``."""
        Q, K = self.factors(params)
        both = _token_maps(X, _namespace(Q).concat([Q, K], axis=0))  # one GEMM
        return _decoder_maps(self, X, both)

    def logits(self, X, params, cache=None):
        """``(X Q_i)(X K_i)^T``: ``(n, k, d) -> (n, m, k, k)`` (masked)."""
        xq, xk = self.cache(X, params) if cache is None else cache
        return _mask(self, _namespace(xq).matmul(xq, _transpose(xk)), low=True)

    def logits_jvp(self, X, params, direction, cache=None):
        """``(X dQ_i)(X K_i)^T + (X Q_i)(X dK_i)^T`` (0 where masked)."""
        xq, xk = self.cache(X, params) if cache is None else cache
        dxq, dxk = self.cache(X, direction)
        xp = _namespace(xq)
        return _mask(
            self, xp.matmul(dxq, _transpose(xk)) + xp.matmul(xq, _transpose(dxk))
        )

    def logits_vjp(self, X, params, cotangent, cache=None):
        """``dQ_i = sum_n X^T G_i (X K_i)``, ``dK_i = sum_n X^T G_i^T (X Q_i)``
        (rotated back, summed over each key head's group)."""
        xq, xk = self.cache(X, params) if cache is None else cache
        xp = _namespace(xq, cotangent)
        cotangent = _mask(self, cotangent)
        # both pull-backs in one GEMM: (d, n k) @ (n k, 2 m r); Q's block first
        both = xp.concat(
            _pulled_maps(
                self,
                X,
                xp.matmul(cotangent, xk),
                xp.matmul(_transpose(cotangent), xq),
            ),
            axis=1,
        )
        return _flat(_pull_back(X, both))


class FactoredHeads:
    """Low-rank heads with factored values: ``Theta_i = Q_i K_i^T``, ``W_i = V_i O_i``.

    ``p`` holds Q, K and V, each ``(m, d, r)``: ``3 m d r`` parameters.  The output
    factors ``O_i`` ``(r, d_out)`` are not parameters: the variable projection
    eliminates them (``m r`` design columns instead of the ``m d`` of the full
    ``W_i``: for 12 heads of rank 32 at d = 385, 384 columns instead of 4620).
    The values ``X V_i`` are then part of the nonlinear model, and their
    products are given here next to the logits' (:meth:`jvp`, :meth:`vjp`).
    Gauges: ``(Q_i G, K_i G^{-T})`` and ``(V_i H, H^{-1} O_i)``.

    Examples
    --------
    >>> import numpy as np
    >>> par = FactoredHeads(2, 5, 2)
    >>> par.size
    60
    >>> [f.shape for f in par.factors(np.arange(60.0))]
    [(2, 5, 2), (2, 5, 2), (2, 5, 2)]
    """

    eliminates_output_factors = True

    def __init__(
        self,
        n_heads,
        n_features,
        rank,
        *,
        causal=False,
        rope_theta=None,
        rope_layout="half",
        n_kv_heads=None,
    ):
        self.n_heads, self.n_features, self.rank = n_heads, n_features, rank
        _set_decoder(self, causal, rope_theta, rope_layout, n_kv_heads)
        self.size = (2 * n_heads + self.n_kv_heads) * n_features * rank

    def factors(self, params):
        """``Q (m, d, r)``, ``K (m_kv, d, r)``, ``V (m, d, r)``."""
        return _split(params, self, 3)

    def attention(self, params):
        """``Theta_i = Q_i K_g^T``: ``(m, d, d)`` (see :meth:`LowRank.attention`)."""
        Q, K, _ = self.factors(params)
        return _namespace(Q).matmul(Q, _transpose(_expand(self, K)))

    def from_attention(self, attention, projection):
        """Balanced Q, K of the best rank-r approximation of each Theta_i, and V
        the top r left singular vectors of each ``W_i`` (``projection``,
        ``(m, d, d_out)``): the column space is what the output factors do not
        absorb."""
        _check_ungrouped(self)
        Q, K = balanced_factors(attention, self.rank)
        projection = _float_array(projection)
        xp = _namespace(projection)
        U = xp.linalg.svd(projection, full_matrices=False)[0]
        values = U[:, :, : self.rank]
        return xp.concat([_flat(Q), _flat(K), _flat(values)])

    def preconditioner(self, params):
        """Q and K as :meth:`LowRank.preconditioner`; V in its own variables (the
        variable projection's :meth:`regauge` balances it against O instead)."""
        Q, K, V = self.factors(params)
        index = _device_group_index(self, K)
        qk_apply, qk_inverse = _scaled_metric(Q, K, index)
        half = _size(Q) + _size(K)
        xp = _namespace(Q)

        def apply(z):
            z = _flat(_like(z, Q))
            return xp.concat([qk_apply(z[:half]), z[half:]])

        def inverse(p):
            return xp.concat([qk_inverse(p[:half]), p[half:]])

        return apply, apply, inverse

    def regauge(self, params, output_factors):
        """The same model with ``O_i`` of orthonormal rows: ``V_i (O_i O_i^T)^{1/2}``.

        The derivative of the outputs along ``V_i`` is ``S_i X dV_i O_i``; with
        orthonormal rows of ``O_i`` its scale no longer depends on ``O_i``'s
        singular values (the metric of scaled gradient descent for ``V_i O_i``).
        """
        Q, K, V = self.factors(params)
        xp = _namespace(Q)
        output_factors = to_namespace(output_factors, xp, device(Q))
        grams = xp.matmul(output_factors, _transpose(output_factors))
        _, root = _inverse_root(grams)
        return xp.concat([_flat(Q), _flat(K), _flat(xp.matmul(V, root))])

    def cache(self, X, params):
        """The token maps ``X Q_i``, ``X K_i``, ``X V_i``, each ``(n, m, k, r)``."""
        Q, K, V = self.factors(params)
        maps = _token_maps(X, _namespace(Q).concat([Q, K, V], axis=0))  # one GEMM
        xq, xk = _decoder_maps(self, X, maps[:, : -self.n_heads, ...])
        return xq, xk, maps[:, -self.n_heads :, ...]

    def logits(self, X, params, cache=None):
        """``(X Q_i)(X K_i)^T``: ``(n, k, d) -> (n, m, k, k)`` (masked)."""
        xq, xk, _ = self.cache(X, params) if cache is None else cache
        return _mask(self, _namespace(xq).matmul(xq, _transpose(xk)), low=True)

    def values(self, X, params, cache=None):
        """``X V_i``: ``(n, m, k, r)``."""
        return (self.cache(X, params) if cache is None else cache)[2]

    def jvp(self, X, params, direction, cache=None):
        """Directional derivatives of the logits and of the values ``X dV_i``."""
        xq, xk, _ = self.cache(X, params) if cache is None else cache
        dxq, dxk, dxv = self.cache(X, direction)
        xp = _namespace(xq)
        d_logits = xp.matmul(dxq, _transpose(xk)) + xp.matmul(xq, _transpose(dxk))
        return _mask(self, d_logits), dxv

    def vjp(self, X, params, d_logits, d_values, cache=None):
        """Pull back cotangents of the logits ``(n, m, k, k)`` and of the values
        ``(n, m, k, r)``: flat ``(3 m d r,)``, one GEMM."""
        xq, xk, _ = self.cache(X, params) if cache is None else cache
        xp = _namespace(xq, d_logits, d_values)
        d_logits = _mask(self, d_logits)
        pulled = _pulled_maps(
            self, X, xp.matmul(d_logits, xk), xp.matmul(_transpose(d_logits), xq)
        )
        both = xp.concat([*pulled, d_values], axis=1)
        return _flat(_pull_back(X, both))


def _scaled_metric(Q, K, index=None):
    """``(apply, inverse)`` of the scaled-gradient-descent change of variables of
    :meth:`LowRank.preconditioner`, on flat ``[Q, K]`` vectors.

    ``index`` (grouped-query heads): each query head's key head (an array of
    ``K``'s namespace, on its device); ``Q_i`` is then
    scaled by its key head's ``C^K_g``, and ``K_g`` by the root of its group's
    summed ``Q_i^T Q_i``."""
    xp = _namespace(Q, K)
    c_k, c_k_inv = _inverse_root(_transpose(K) @ K)
    q_grams = _transpose(Q) @ Q
    if index is not None:
        m_kv, r = K.shape[0], K.shape[2]
        q_grams = xp.sum(xp.reshape(q_grams, (m_kv, -1, r, r)), axis=1)
        c_k, c_k_inv = (xp.take(c, index, axis=0) for c in (c_k, c_k_inv))
    c_q, c_q_inv = _inverse_root(q_grams)
    half = _size(Q)

    def apply(z):
        z = _flat(_like(z, Q))
        z_q = xp.reshape(z[:half], Q.shape)
        z_k = xp.reshape(z[half:], K.shape)
        return xp.concat([_flat(z_q @ c_k), _flat(z_k @ c_q)])

    def inverse(p):
        p_q = xp.reshape(p[:half], Q.shape)
        p_k = xp.reshape(p[half:], K.shape)
        return xp.concat([_flat(p_q @ c_k_inv), _flat(p_k @ c_q_inv)])

    return apply, inverse


def _set_decoder(par, causal, rope_theta, rope_layout, n_kv_heads):
    """Check and set a parametrization's decoder settings (one-line errors)."""
    m, r = par.n_heads, par.rank
    m_kv = m if n_kv_heads is None else int(n_kv_heads)
    if m_kv < 1 or m % m_kv:
        raise ValueError(
            f"n_kv_heads={n_kv_heads} must divide n_heads={m}: each group of "
            f"n_heads / n_kv_heads query heads shares one key head."
        )
    if rope_layout not in LAYOUTS:
        raise ValueError(
            f"rope_layout must be one of {list(LAYOUTS)}, got {rope_layout!r}."
        )
    if rope_theta is not None and (r % 2 or not float(rope_theta) > 0):
        raise ValueError(
            f"rotary positions rotate pairs of dimensions by a positive base: "
            f"rank={r} must be even and rope_theta={rope_theta} positive."
        )
    par.causal = bool(causal)
    par.rope_theta = None if rope_theta is None else float(rope_theta)
    par.rope_layout = rope_layout
    par.n_kv_heads = m_kv


def _split(params, par, n_blocks):
    """The factors of flat ``params``: ``Q (m, d, r)``, ``K (m_kv, d, r)``, then
    (``n_blocks`` 3) ``V (m, d, r)``."""
    d, r = par.n_features, par.rank
    xp = _namespace(params)
    heads = [par.n_heads, par.n_kv_heads, par.n_heads][:n_blocks]
    out, start = [], 0
    for h in heads:
        stop = start + h * d * r
        out.append(xp.reshape(params[start:stop], (h, d, r)))
        start = stop
    return tuple(out)


def _group_index(par):
    """Each query head's key head (``key_head_index``), or None when ungrouped."""
    if par.n_kv_heads == par.n_heads:
        return None
    return key_head_index(par.n_heads, par.n_kv_heads)


def _device_group_index(par, like):
    """:func:`_group_index` in ``like``'s namespace, on its device (copied there
    once: :func:`device_constant`), or None when ungrouped."""
    if par.n_kv_heads == par.n_heads:
        return None
    return device_constant(
        ("key heads", par.n_heads, par.n_kv_heads),
        lambda: _group_index(par),
        _namespace(like),
        device(like),
    )


def _expand(par, K):
    """``K (m_kv, ...)`` repeated for each query head: ``(m, ...)``."""
    index = _device_group_index(par, K)
    return K if index is None else _namespace(K).take(K, index, axis=0)


def _check_ungrouped(par):
    """Raise for grouped key heads: no per-head Theta_i factors into them."""
    if par.n_kv_heads != par.n_heads:
        raise ValueError(
            f"grouped key heads (n_kv_heads={par.n_kv_heads} of n_heads="
            f"{par.n_heads}) have no factors of given Theta_i: start from factors."
        )


@functools.lru_cache(maxsize=32)
def _host_tables(n_tokens, rank, base):
    """``rotary_tables`` on the host, kept (read only)."""
    cos, sin = rotary_tables(n_tokens, rank, base)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def _tables(par, maps):
    """``cos``, ``sin`` ``(k, r / 2)`` for token maps ``(n, h, k, r)``, in their
    namespace, dtype and device."""
    k, r, base = maps.shape[-2], par.rank, par.rope_theta
    xp = _namespace(maps)
    return tuple(
        device_constant(
            ("rotary", which, k, r, base),
            lambda which=which: _host_tables(k, r, base)[which],
            xp,
            device(maps),
            maps.dtype,
        )
        for which in (0, 1)
    )


def _decoder_maps(par, X, maps):
    """``(xq, xk)`` from the token maps ``[X Q, X K]`` ``(n, m + m_kv, k, r)``:
    rotated by position (rotary) and the keys repeated for each query head."""
    m = par.n_heads
    xq, xk = maps[:, :m, ...], maps[:, m:, ...]
    if par.rope_theta is not None:
        cos, sin = _tables(par, maps)
        xq = rotate(xq, cos, sin, par.rope_layout)
        xk = rotate(xk, cos, sin, par.rope_layout)
    index = _device_group_index(par, xk)
    if index is not None:
        xk = _namespace(xk).take(xk, index, axis=1)
    return xq, xk


def _pulled_maps(par, X, g_q, g_k):
    """Cotangents of the rotated, repeated maps ``(n, m, k, r)`` pulled back to
    those of ``[X Q, X K]``: rotated back, the keys' summed over each group."""
    if par.rope_theta is not None:
        cos, sin = _tables(par, g_q)
        g_q = rotate(g_q, cos, -sin, par.rope_layout)
        g_k = rotate(g_k, cos, -sin, par.rope_layout)
    if par.n_kv_heads != par.n_heads:
        xp = _namespace(g_k)
        n, m, k, r = g_k.shape
        g_k = xp.sum(
            xp.reshape(g_k, (n, par.n_kv_heads, m // par.n_kv_heads, k, r)), axis=2
        )
    return g_q, g_k


def _mask(par, logits, low=False):
    """``logits (n, m, k, k)`` with the keys after each query masked (causal):
    at the most negative float (``low``: logits) or 0 (their derivatives)."""
    if not par.causal:
        return logits
    if low:
        return mask_logits(logits, causal=True)
    xp = _namespace(logits)
    keep = causal_keep(xp, logits.shape[-1], device(logits))
    return xp.where(
        keep, logits, xp.zeros((), dtype=logits.dtype, device=device(logits))
    )


def _size(x):
    """Number of elements of ``x``."""
    return int(np.prod(x.shape))


def _at_least(x, value):
    """``maximum(x, value)`` for a Python scalar ``value`` (torch's takes arrays)."""
    # (clip with a Python bound: no 0-d array copied from the host)
    return _namespace(x).clip(x, min=float(value))


def _inverse_root(grams, ridge=1e-10):
    """``(G + eps I)^{-1/2}`` and its inverse for a stack of PSD ``(m, r, r)``,
    ``eps`` = ``ridge`` times the mean eigenvalue (at least the smallest normal)."""
    xp = _namespace(grams)
    values, vectors = xp.linalg.eigh(grams)
    # float64's smallest normal, rounded to the values' dtype (numpy's rule)
    floor = ridge * _at_least(
        xp.mean(values, axis=1, keepdims=True), np.finfo(float).tiny
    )
    root = xp.sqrt(_at_least(values, 0.0) + floor)
    inv_root = vectors / root[:, None, :] @ _transpose(vectors)
    root_mat = vectors * root[:, None, :] @ _transpose(vectors)
    return inv_root, root_mat


def make_parametrization(n_heads, n_features, head_rank=None, factor_values=False):
    """``FullRank`` when ``head_rank`` is None or ``>= n_features``, else ``LowRank``
    (``FactoredHeads`` with ``factor_values``).

    Examples
    --------
    >>> type(make_parametrization(2, 8, 4)).__name__
    'LowRank'
    >>> type(make_parametrization(2, 8, 4, factor_values=True)).__name__
    'FactoredHeads'
    >>> type(make_parametrization(2, 8)).__name__
    'FullRank'
    """
    if head_rank is None or head_rank >= n_features:
        return FullRank(n_heads, n_features)
    if factor_values:
        return FactoredHeads(n_heads, n_features, head_rank)
    return LowRank(n_heads, n_features, head_rank)


def random_attention(n_heads, n_features, random_state=None, scale=1.0, *, like=None):
    """Random starting ``Theta_i``: i.i.d. ``N(0, (scale / d)^2)`` entries.

    So ``E ||Theta_i||_F^2 = scale^2``: for tokens with i.i.d. mean-0 variance-1
    entries the start's logits between distinct tokens have standard deviation
    about ``scale`` (at the default 1, soft, informative patterns: the softmax is
    neither uniform nor saturated).  Drawn on the host (numpy); ``like`` (an
    array) moves the draw to its namespace and device, so that a seed gives the
    same start in every namespace.

    Examples
    --------
    >>> random_attention(2, 4, random_state=0).shape
    (2, 4, 4)
    """
    rng = check_random_state(random_state)
    d = n_features
    draw = rng.normal(scale=scale / d, size=(n_heads, d, d))
    if like is None or isinstance(like, np.ndarray) or not is_array_api_obj(like):
        return draw  # numpy tokens, or tokens read in batches from disk
    return to_namespace(draw, _namespace(like), device(like))


def _token_maps(X, maps):
    """``X M_i`` for ``X (n, k, d)``, ``maps (m, d, r)``: ``(n, m, k, r)``, one GEMM."""
    xp = _namespace(X, maps)
    n, k, d = X.shape
    m, _, r = maps.shape
    flat = xp.reshape(X, (n * k, d)) @ xp.reshape(
        xp.permute_dims(maps, (1, 0, 2)), (d, m * r)
    )
    return xp.permute_dims(xp.reshape(flat, (n, k, m, r)), (0, 2, 1, 3))


def _pull_back(X, tensor):
    """``sum_n X_n^T T_ni`` for ``T (n, m, k, r)``: ``(m, d, r)``, one GEMM."""
    xp = _namespace(X, tensor)
    n, k, d = X.shape
    m, r = tensor.shape[1], tensor.shape[3]
    flat = xp.reshape(xp.permute_dims(tensor, (0, 2, 1, 3)), (n * k, m * r))
    product = xp.reshape(X, (n * k, d)).T @ flat
    return xp.permute_dims(xp.reshape(product, (d, m, r)), (1, 0, 2))


def _bilinear(left, middle, right):
    """``left Theta_i right^T``: ``(n, k, d), (m, d, d), (n, k, d) -> (n, m, k, k)``."""
    xp = _namespace(left, middle, right)
    return xp.matmul(
        _token_maps(left, middle), xp.permute_dims(right, (0, 2, 1))[:, None, ...]
    )


class _Projections:
    """The projections ``W_i`` in full (``rank=None``: ``m d d_out`` parameters) or
    as ``V_i O_i`` (``V (m, d, r)`` then ``O (m, r, d_out)``: ``m r (d + d_out)``).

    The projection counterpart of :class:`~skattn.solvers.FullRank` and
    :class:`~skattn.solvers.LowRank`, for solvers that train ``W`` by gradient
    rather than eliminating it.
    """

    def __init__(self, n_heads, n_features, n_outputs, rank=None):
        self.shape = (n_heads, n_features, n_outputs)
        self.rank = rank
        if rank is None:
            self.size = n_heads * n_features * n_outputs
        else:
            self.size = n_heads * rank * (n_features + n_outputs)

    def factors(self, params):
        """``V (m, d, r)``, ``O (m, r, d_out)``."""
        m, d, d_out = self.shape
        split = m * d * self.rank
        xp = _namespace(params)
        return (
            xp.reshape(params[:split], (m, d, self.rank)),
            xp.reshape(params[split:], (m, self.rank, d_out)),
        )

    def projection(self, params):
        """``W (m, d, d_out)`` from the flat parameters."""
        if self.rank is None:
            return _namespace(params).reshape(params, self.shape)
        value, output = self.factors(params)
        return value @ output

    def from_projection(self, projection):
        """Flat parameters of ``W``: balanced factors of its best rank-r
        approximation for low rank."""
        if self.rank is None:
            projection = _float_array(projection)
            return _namespace(projection).asarray(_flat(projection), copy=True)
        value, output = balanced_factors(projection, self.rank)
        return _namespace(value).concat([_flat(value), _flat(_transpose(output))])

    def projection_vjp(self, params, grad_projection):
        """Pull a gradient ``G`` in ``W`` back: ``dV_i = G_i O_i^T``,
        ``dO_i = V_i^T G_i``, flat."""
        if self.rank is None:
            return _flat(_float_array(grad_projection))
        value, output = self.factors(params)
        return _namespace(value).concat(
            [
                _flat(grad_projection @ _transpose(output)),
                _flat(_transpose(value) @ grad_projection),
            ]
        )


class _Unknowns:
    """The flat unknowns of a layer: the attention part, then the projections.

    ``head_rank=None``: ``Theta`` and ``W`` in full; else (a rank below
    ``min(d, d_out)``) the factors ``Q, K`` (:class:`~skattn.solvers.LowRank`)
    then ``V, O`` (:class:`_Projections`).
    """

    def __init__(self, n_heads, n_features, n_outputs, head_rank=None):
        self.attention_part = make_parametrization(n_heads, n_features, head_rank)
        self.projection_part = _Projections(n_heads, n_features, n_outputs, head_rank)
        self.size = self.attention_part.size + self.projection_part.size

    def pack(self, attention, projection):
        """Flat parameters of the layer ``(Theta, W)``."""
        parts = [
            self.attention_part.from_attention(attention),
            self.projection_part.from_projection(projection),
        ]
        return _namespace(*parts).concat(parts)

    def unpack(self, params):
        """``Theta (m, d, d)``, ``W (m, d, d_out)`` from the flat parameters."""
        split = self.attention_part.size
        return (
            self.attention_part.attention(params[:split]),
            self.projection_part.projection(params[split:]),
        )

    def gradient(self, params, grad_attention, grad_projection):
        """The gradient in the flat parameters from those in ``Theta`` and ``W``."""
        split = self.attention_part.size
        parts = [
            self.attention_part.attention_vjp(params[:split], grad_attention),
            self.projection_part.projection_vjp(params[split:], grad_projection),
        ]
        return _namespace(*parts).concat(parts)


def _initial_parameters(X, Y, sample_weight, n_heads, init_scale, alpha, random_state):
    """A random start: small random Theta, then the best W for that Theta.

    Theta by :func:`skattn.solvers.kernels._parametrization.random_attention` at scale
    ``init_scale``: the typical attention logit ``x^T Theta_i x'`` of
    unit-variance tokens has standard deviation ``init_scale``.  W then solves
    the (ridge) least squares problem given Theta.

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
        Both in the namespace and on the device of ``X`` (drawn on the host).
    """
    attention = random_attention(
        n_heads, X.shape[2], random_state, scale=init_scale, like=X
    )
    # J's ridge on Theta does not change the minimising W given Theta
    projection = solve_projections(X, Y, attention, sample_weight, alpha)
    return attention, projection
