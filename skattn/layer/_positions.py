"""Decoder attention: rotary positions, causal and padding masks, shared key heads.

A decoder head's logit between query token ``l`` and key token ``a`` is

    x_l^T Theta_i x_a + u_i^T x_a + q_i(l)^T R((a - l) omega) k_g(a)

with the position-free part of :mod:`skattn.layer._math` and a rotary part:
``q_i(l) = P_i^T [x_l; 1]`` and ``k_g(a) = K_g^T [x_a; 1]`` (the query and key
maps of the rotated dimensions, the last row of ``P_i``, ``K_g`` being the bias
when they have ``n_features + 1`` rows), ``R`` the block rotation of RoPE (Su et
al.) by the angles ``(a - l) omega_p`` with ``omega_p = base^(-2p / r)`` for the
``r / 2`` pairs of the ``r`` rotated dimensions, and ``g = i // (m / m_kv)`` the
key head that query head ``i`` shares with its group (grouped-query attention;
``m_kv = m`` is ordinary multi-head attention, ``m_kv = 1`` multi-query).  The
pairs are dimensions ``(p, p + r/2)`` in the ``"half"`` layout (Llama, Qwen2,
Mistral, GPT-NeoX: ``rotate_half``) and ``(2p, 2p + 1)`` in the ``"interleaved"``
layout (GPT-J); the two differ by a permutation of the columns of ``P_i`` and
``K_g`` (:func:`layout_permutation`).  As in every implementation, the queries
and keys are rotated by their absolute positions ``0 .. k-1``, which gives the
relative rotation above.

A causal mask keeps key ``a <= l``; a key mask ``(n, k)`` (True: a real token)
removes padded keys.  Masked logits become the most negative float, as in
transformers, so that a row with no key left is uniform rather than NaN (its
output is meaningless; compare real tokens only).

Everything here is a pure function of arrays of any array-API namespace (numpy,
torch: :mod:`skattn.utils._array_api`), vectorised over samples; nothing
validates (``AttentionLayer`` does).
"""

from typing import NamedTuple

import numpy as np

from ..utils._array_api import causal_keep, device, namespace

LAYOUTS = ("half", "interleaved")


class Rotary(NamedTuple):
    """The rotary part of a layer's logits (see the module docstring).

    ``query`` ``(m, d or d + 1, r)``, ``key`` ``(m_kv, d or d + 1, r)`` (``m_kv``
    dividing ``m``), ``base`` the RoPE base (``rope_theta``), ``layout``
    ``"half"`` or ``"interleaved"``.
    """

    query: object
    key: object
    base: float
    layout: str = "half"


def _xp(*arrays):
    """The array namespace of ``arrays`` (``None`` ignored)."""
    return namespace(*(a for a in arrays if a is not None))


def rotary_frequencies(rotary_dim, base):
    """The angular frequencies ``omega_p = base^(-2p / r)``, ``p < r / 2``.

    Computed in float64 (transformers computes them, and the angles, in float32;
    see the module docstring of :mod:`skattn.layer._hf`).

    Examples
    --------
    >>> rotary_frequencies(4, 100.0)
    array([1. , 0.1])
    """
    return 1.0 / float(base) ** (
        np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    )


def rotary_tables(n_tokens, rotary_dim, base, like=None):
    """``cos`` and ``sin`` of the angles ``l omega_p``: two ``(k, r / 2)`` arrays.

    In the namespace and on the device of ``like`` (numpy when None).

    Examples
    --------
    >>> cos, sin = rotary_tables(3, 2, 10000.0)
    >>> cos[:, 0].round(4), sin[:, 0].round(4)
    (array([ 1.    ,  0.5403, -0.4161]), array([0.    , 0.8415, 0.9093]))
    """
    angles = np.arange(n_tokens, dtype=np.float64)[:, None] * rotary_frequencies(
        rotary_dim, base
    )
    cos, sin = np.cos(angles), np.sin(angles)
    if like is None or isinstance(like, np.ndarray):
        return cos, sin
    xp = namespace(like)
    return (
        xp.asarray(cos, dtype=xp.float64, device=device(like)),
        xp.asarray(sin, dtype=xp.float64, device=device(like)),
    )


def rotary_pairs(rotary_dim, layout):
    """The dimensions of each rotary pair in ``layout``: ``(r / 2, 2)``.

    Pair ``p`` (frequency ``omega_p``) is dimensions ``(p, p + r/2)`` in
    ``"half"`` and ``(2p, 2p + 1)`` in ``"interleaved"``.

    Examples
    --------
    >>> rotary_pairs(4, "half").tolist(), rotary_pairs(4, "interleaved").tolist()
    ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    """
    half = rotary_dim // 2
    pair = np.arange(half, dtype=np.intp)
    if layout == "half":
        return np.stack([pair, pair + half], axis=1)
    return np.stack([2 * pair, 2 * pair + 1], axis=1)


def layout_permutation(rotary_dim, source, target):
    """Column order that takes rotary dimensions from layout ``source`` to
    ``target``: ``factors[..., perm]`` in the ``target`` layout (pairs as
    :func:`rotary_pairs` places them).

    Examples
    --------
    >>> layout_permutation(4, "interleaved", "half")
    array([0, 2, 1, 3])
    >>> layout_permutation(4, "half", "interleaved")
    array([0, 2, 1, 3])
    """
    perm = np.empty(rotary_dim, dtype=np.intp)
    perm[rotary_pairs(rotary_dim, target)] = rotary_pairs(rotary_dim, source)
    return perm


def rotate(T, cos, sin, layout="half"):
    """Rotate the last axis of ``T`` ``(..., k, r)`` by the angles of each token.

    ``cos``, ``sin`` ``(k, r / 2)`` from :func:`rotary_tables`; pairs of
    dimensions as ``layout`` says.  ``"half"`` is transformers'
    ``q * cos + rotate_half(q) * sin``.

    Examples
    --------
    >>> import numpy as np
    >>> cos, sin = np.array([[0.0]]), np.array([[1.0]])  # a quarter turn
    >>> rotate(np.array([[1.0, 0.0]]), cos, sin)
    array([[0., 1.]])
    """
    xp = _xp(T)
    r = T.shape[-1]
    half = r // 2
    if layout == "half":
        first, second = T[..., :half], T[..., half:]
        return xp.concat(
            [first * cos - second * sin, second * cos + first * sin], axis=-1
        )
    even, odd = T[..., 0::2], T[..., 1::2]
    pairs = xp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return xp.reshape(pairs, T.shape)


def _maps(X, factors):
    """``[X, 1] @ factors``: ``(n, k, d), (h, d or d + 1, r) -> (n, h, k, r)``."""
    xp = _xp(X, factors)
    d = X.shape[-1]
    out = xp.matmul(X[:, None, ...], factors[None, :, :d, :])
    if factors.shape[1] == d + 1:
        out = out + factors[None, :, d : d + 1, :]
    return out


def key_head_index(n_heads, n_kv_heads):
    """The key/value head of each query head: ``i // (n_heads / n_kv_heads)``.

    As transformers' ``repeat_kv``: consecutive query heads share a key head.

    Examples
    --------
    >>> key_head_index(4, 2)
    array([0, 0, 1, 1])
    """
    return np.arange(n_heads) // (n_heads // n_kv_heads)


def rotary_logits(X, rotary):
    """The rotary part of the logits: ``(n, k, d) -> (n, m, k, k)``.

    ``q_i(l)^T R((a - l) omega) k_g(a)`` for every query token ``l`` and key
    token ``a`` (see the module docstring).

    Examples
    --------
    >>> import numpy as np
    >>> P = np.ones((2, 3, 2)); K = np.ones((1, 3, 2))  # two heads share a key
    >>> rotary_logits(np.ones((1, 4, 3)), Rotary(P, K, 10000.0)).shape
    (1, 2, 4, 4)
    """
    xp = _xp(X, rotary.query, rotary.key)
    n, k, _ = X.shape
    m, m_kv = rotary.query.shape[0], rotary.key.shape[0]
    cos, sin = rotary_tables(k, rotary.query.shape[-1], rotary.base, like=X)
    queries = rotate(_maps(X, rotary.query), cos, sin, rotary.layout)
    keys = rotate(_maps(X, rotary.key), cos, sin, rotary.layout)
    if m_kv != m:
        index = key_head_index(m, m_kv)
        if not isinstance(keys, np.ndarray):
            index = xp.asarray(index, device=device(keys))
        keys = xp.take(keys, index, axis=1)
    return xp.matmul(queries, xp.matrix_transpose(keys))


def mask_logits(logits, causal=False, key_mask=None):
    """``logits`` ``(n, m, k, k)`` with the masked keys at the most negative float.

    ``causal`` keeps key ``a <= l`` in row ``l``; ``key_mask`` ``(n, k)`` (True:
    a real token) keeps the real keys.  A new array; ``logits`` itself when
    nothing is masked.

    Examples
    --------
    >>> import numpy as np
    >>> out = mask_logits(np.zeros((1, 1, 2, 2)), causal=True)
    >>> bool(out[0, 0, 0, 1] < -1e300), float(out[0, 0, 1, 0])
    (True, 0.0)
    """
    if not causal and key_mask is None:
        return logits
    xp = _xp(logits)
    k = logits.shape[-1]
    keep = None
    if causal:
        keep = causal_keep(xp, k, device(logits))[None, None, ...]
    if key_mask is not None:
        real = key_mask[:, None, None, :]
        if not isinstance(logits, np.ndarray):
            real = xp.asarray(real, device=device(logits))
        keep = real if keep is None else xp.logical_and(keep, real)
    lowest = xp.finfo(logits.dtype).min
    # (full, not asarray: a number made a 0-d array is a copy from the host)
    return xp.where(
        keep, logits, xp.full((), lowest, dtype=logits.dtype, device=device(logits))
    )
