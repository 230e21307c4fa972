"""Rotary heads' near-gauge directions, and a preconditioner that lifts them.

A rotary head's logits ``x_i^T Q R(j - i) K^T x_j`` do not change when
``Q -> Q G`` and ``K -> K G^{-T}`` for a ``G`` that commutes with every rotation
``R(t)`` (a scaled rotation in each pair: the gauge).  A pair whose angle stays
small across the window (``omega_p (k - 1)`` small: RoPE's slow pairs, base
10 000 and up) has ``R(t)`` close to the identity, and any mixing ``G = I + E``
of the slow pairs' dimensions is *nearly* a gauge: it changes the logits by
``Q [E, R(t)] K^T``, of the order of ``omega_p t |E|``.  The Gauss-Newton
systems of the polish then have singular values that small; truncated LSMR
(tens of iterations a step) does not resolve them and the polish converges
linearly, a few per cent an evaluation, even next to the truth (a planted
layer of 4 query heads sharing 2 key heads, d = 64, head dimension 16, k = 32:
40 LSMR iterations a step, cost 3e-6 after 40 evaluations from 1 % noise in
the slow pairs; 1500 iterations, 9e-9 after 5; benchmarks/HISTORY.md).

:func:`lift_near_gauge` adds the mixings as variables of their own: the
parameters become ``p(z, e) = act(M z, expm(E))``, ``M`` the parametrization's
own right preconditioner, ``E_g = (S e)_g`` and ``act`` the exact orbit
``Q_i -> Q_i G_g``, ``K_g -> K_g G_g^{-T}`` on the slow dimensions, so that a
mixing, however large, leaves the logits at equal positions as they were.
``S`` whitens the mixings' Jacobian columns at the polish's first stage (their
Gram matrix's inverse root, one block a key group, the blocks of two groups
together left out: memory linear in the groups; later stages re-base the orbit
and keep ``S``; the polish takes the Gram matrices on a share of its sequences,
:func:`~skattn.solvers.optimizers._lm_matrix_free.lift_sequences`) and
scales them to the Jacobian's typical singular value: the near-gauge
directions no longer sit at the bottom of the spectrum.
The variables are redundant, which the least-squares steps allow (LSMR's
minimum-norm solution).  A first-order lift ``p = M z + B S e`` does not do:
along ``B`` the slow block's logits change by ``-Q E^2 K^T`` at second order
and the trust region shrinks to the first order's reach.

With a constant coordinate in the tokens (``[x, 1]``, an intercept: query and
key biases), the key maps' shifts along it in the slow dimensions are
near-gauge too: the logits ``x_i^T Q R(j - i) P u`` they add hardly depend on
the key ``j``, and the softmax ignores what does not.  They are lifted with the
mixings (:meth:`SlowMixing.shift`; Qwen2's biases stalled the polish without
them).  What the lift cannot do is change the orientation of a slow block
(``expm(E)`` has a positive determinant): :func:`reflect_slow_dims` gives the
other one.
"""

import math

import numpy as np
from sklearn.utils import check_random_state

from ...layer._positions import key_head_index, rotary_frequencies, rotary_pairs
from ...utils._array_api import (
    device,
    einsum,
    expm,
    is_numpy,
    namespace,
    to_namespace,
    to_numpy,
)
from ._parametrization import _like

# A rotary pair is slow, and its dimensions take part in the near-gauge mixing,
# when its angle over the window, omega_p (k - 1), is at most this.
SLOW_ANGLE = math.pi / 2

# Mixings whose Jacobian columns' Gram eigenvalue is below this fraction of the
# largest are exact gauge (zero up to rounding): left out.
GAUGE_EIGENVALUE = 1e-13

# Random probes of the Jacobian's typical singular value.
N_PROBES = 4


def slow_rotary_dims(rank, rope_theta, layout, n_tokens, max_angle=SLOW_ANGLE):
    """The head dimensions of the rotary pairs that turn by at most ``max_angle``
    over a window of ``n_tokens`` tokens, sorted.

    Examples
    --------
    >>> slow_rotary_dims(8, 10000.0, "half", 32).tolist()
    [2, 3, 6, 7]
    >>> slow_rotary_dims(8, 10000.0, "interleaved", 200).tolist()
    [6, 7]
    """
    omega = rotary_frequencies(rank, rope_theta)
    slow = omega * max(int(n_tokens) - 1, 0) <= max_angle
    return np.sort(rotary_pairs(rank, layout)[slow].ravel())


class SlowMixing:
    """The orbit of the slow dimensions' mixings on flat ``[Q, K, rest]``
    parameters: ``act(p, G, H)`` maps ``Q_i`` to ``Q_i (I + P (G_g - I) P^T)``
    and ``K_g`` to ``K_g (I + P (H_g - I) P^T)`` (``P`` the ``(r, s)``
    selection of ``dims``, ``g`` query head i's key head; ``H = G^{-T}`` on the
    orbit), the rest of ``p`` as it is.

    Parameters
    ----------
    n_heads, n_kv_heads, n_features, rank : int
        ``m``, ``m_kv``, ``d``, ``r``.
    dims : array of int of shape (s,)
    index : array of int of shape (m,) or None
        Each query head's key head (None: head i's is i).
    like : array
        The parameters' namespace and device.
    constant : array of shape (d,) or None
        A token-space vector ``c`` with ``x^T c = 1`` on every token (the
        ``[x, 1]`` tokens of an intercept): then the key maps' shifts
        ``K_g + c u_g^T P^T`` (:meth:`shift`) are near-gauge too, the slow
        block's logits ``x_i^T Q_i R(t) P u_g`` nearly constant across keys,
        which the softmax does not see.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> orbit = SlowMixing(2, 1, 3, 4, np.array([1, 3]), [0, 0], np.zeros(1))
    >>> p, g = rng.normal(size=(2, 36))
    >>> dG, dH = rng.normal(size=(2, 1, 2, 2))
    >>> A_Q, A_K = orbit.derivative_transpose(p, g)
    >>> bool(np.isclose(orbit.derivative(p, dG, dH) @ g,
    ...                 np.sum(A_Q * dG) + np.sum(A_K * dH)))
    True
    """

    def __init__(
        self, n_heads, n_kv_heads, n_features, rank, dims, index, like, constant=None
    ):
        self.m, self.m_kv, self.d, self.r = n_heads, n_kv_heads, n_features, rank
        self.s = len(dims)
        xp = self.xp = namespace(like)
        on = device(like)
        index = np.arange(n_heads) if index is None else np.asarray(index)
        select = np.zeros((rank, self.s))
        select[np.asarray(dims), np.arange(self.s)] = 1.0
        members = np.zeros((n_kv_heads, n_heads))  # each key head's query heads
        members[index, np.arange(n_heads)] = 1.0
        self.select = to_namespace(select, xp, on, dtype=xp.float64)
        self.members = to_namespace(members, xp, on, dtype=xp.float64)
        self.index = index if is_numpy(xp) else xp.asarray(index, device=on)
        self.n_q, self.n_k = n_heads * n_features * rank, n_kv_heads * n_features * rank
        self.n_mixings = n_kv_heads * self.s * self.s
        self.constant = None
        if constant is not None:
            self.constant = to_namespace(constant, xp, on, dtype=xp.float64)
        self.n_shifts = 0 if constant is None else n_kv_heads * self.s

    def _split(self, p):
        xp = self.xp
        Q = xp.reshape(p[: self.n_q], (self.m, self.d, self.r))
        K = xp.reshape(p[self.n_q : self.n_q + self.n_k], (self.m_kv, self.d, self.r))
        return Q, K, p[self.n_q + self.n_k :]

    def _join(self, Q, K, rest):
        xp = self.xp
        return xp.concat([xp.reshape(Q, (-1,)), xp.reshape(K, (-1,)), rest])

    def _full(self, A):
        """``(m_kv, s, s) -> (m_kv, r, r)``: ``P A P^T``."""
        return self.select @ A @ self.select.T

    def act(self, p, G, H):
        """``p`` moved by the mixings ``G``, ``H`` ``(m_kv, s, s)``; with their
        transposes, the transpose of that linear map of ``p``."""
        xp = self.xp
        Q, K, rest = self._split(p)
        eye = xp.eye(self.s, dtype=xp.float64, device=device(p))
        G, H = self._full(G - eye), self._full(H - eye)
        return self._join(Q + Q @ xp.take(G, self.index, axis=0), K + K @ H, rest)

    def derivative(self, p, dG, dH):
        """The derivative of ``act(p, G, H)`` along ``dG``, ``dH``."""
        xp = self.xp
        Q, K, rest = self._split(p)
        dQ = Q @ xp.take(self._full(dG), self.index, axis=0)
        return self._join(dQ, K @ self._full(dH), xp.zeros_like(rest))

    def derivative_transpose(self, p, g):
        """The transpose of :meth:`derivative` at ``p``: ``(A_Q, A_K)``, each
        ``(m_kv, s, s)``."""
        xp = self.xp
        Q, K, _ = self._split(p)
        gQ, gK, _ = self._split(g)
        per_query = xp.reshape(xp.matrix_transpose(Q) @ gQ, (self.m, -1))
        A_Q = xp.reshape(self.members @ per_query, (self.m_kv, self.r, self.r))
        A_K = xp.matrix_transpose(K) @ gK
        select = self.select
        return select.T @ A_Q @ select, select.T @ A_K @ select

    def shift(self, p, U):
        """The direction of the key maps' shifts ``c u_g^T P^T`` (``U`` of
        shape ``(m_kv, s)``) in the parameters of ``p``'s size."""
        xp = self.xp
        Q, K, rest = self._split(p)
        dK = self.constant[None, :, None] * (U @ self.select.T)[:, None, :]
        return self._join(xp.zeros_like(Q), dK, xp.zeros_like(rest))

    def shift_transpose(self, g):
        """The transpose of :meth:`shift`: ``(m_kv, s)``."""
        _, gK, _ = self._split(g)
        return (self.constant @ gK) @ self.select

    def raw_index(self):
        """Each key head's positions in :meth:`directions`' ``raw``: its mixings,
        then its shifts, ``(m_kv, s^2 [+ s])``."""
        s2 = self.s * self.s
        index = [np.arange(self.m_kv)[:, None] * s2 + np.arange(s2)]
        if self.n_shifts:
            shift = self.n_mixings + np.arange(self.m_kv)[:, None] * self.s
            index.append(shift + np.arange(self.s))
        return np.concatenate(index, axis=1)

    def directions(self, p, raw):
        """``B raw``: mixings (``m_kv s^2``, first) and shifts as directions at
        ``p``; each mixing moves ``G`` by ``dE`` and ``H`` by ``-dE^T``."""
        xp = self.xp
        dE = xp.reshape(raw[: self.n_mixings], (self.m_kv, self.s, self.s))
        out = self.derivative(p, dE, -xp.matrix_transpose(dE))
        if self.n_shifts:
            out = out + self.shift(
                p, xp.reshape(raw[self.n_mixings :], (self.m_kv, self.s))
            )
        return out

    def directions_transpose(self, p, g):
        """``B^T g``: ``(m_kv s^2 + m_kv s,)``."""
        xp = self.xp
        A_G, A_H = self.derivative_transpose(p, g)
        out = [xp.reshape(A_G - xp.matrix_transpose(A_H), (-1,))]
        if self.n_shifts:
            out.append(xp.reshape(self.shift_transpose(g), (-1,)))
        return xp.concat(out)


class NearGaugeLift:
    """The parameters ``p(z, e) = act(M z, expm(E), expm(-E^T))``,
    ``E_g = (S_g e_g)`` per key head, as the trust-region solver's variables
    (with the orbit's ``constant``, ``M z`` also shifted by ``S_g e_g``'s
    shifts).

    ``point(z)``, ``push(z, v)`` (the map's derivative: a direction in ``p``),
    ``pull(z, g)`` (its transpose: a gradient in ``z``) and ``start(p)`` (a
    ``z`` of ``p``).  Built by :func:`lift_near_gauge`.  The exponential's
    derivatives are taken along each direction (a block exponential), never
    formed: the lift's memory at a point is that of ``E`` and ``expm(E)``, and
    every array stays in the parameters' namespace and on their device.
    """

    def __init__(self, orbit, scale, apply, transpose, inverse, size):
        self.orbit, self.scale = orbit, scale  # numpy (m_kv, s^2 [+ s], q)
        self.apply, self.transpose, self.inverse = apply, transpose, inverse
        self.size = size
        self.n_lifted = scale.shape[0] * scale.shape[2]
        self._at = (None, None, None)  # z, its state, its point
        self._scale = None  # in the variables' namespace, once seen

    def _raw(self, e):
        """``S e`` per key head: mixings ``(m_kv, s, s)`` and shifts ``(m_kv, s)``
        (None without a constant)."""
        orbit, xp = self.orbit, self.orbit.xp
        m_kv, s = orbit.m_kv, orbit.s
        raw = einsum(xp, "gij,gj->gi", self._scale, xp.reshape(e, (m_kv, -1)))
        shifts = raw[:, s * s :] if orbit.n_shifts else None
        return xp.reshape(raw[:, : s * s], (m_kv, s, s)), shifts

    def _state(self, z):
        """At ``z``: ``M z`` (shifted), ``E``, ``G = expm(E)``, ``H =
        expm(-E^T)``."""
        if self._at[0] is z:
            return self._at[1]
        if self._scale is None:
            self._scale = _like(self.scale, z)
        E, shifts = self._raw(z[self.size :])
        G, _ = _expm_and_frechet(E, None)
        H, _ = _expm_and_frechet(-self.orbit.xp.matrix_transpose(E), None)
        base = self.apply(z[: self.size])
        if shifts is not None:
            base = base + self.orbit.shift(base, shifts)
        state = (base, E, G, H)
        # the same point array for the same z: the problem knows it again
        # without comparing values (a host read on a device)
        self._at = (z, state, self.orbit.act(base, G, H))
        return state

    def point(self, z):
        self._state(z)
        return self._at[2]

    def push(self, z, v):
        orbit, xp = self.orbit, self.orbit.xp
        base, E, G, H = self._state(z)
        dE, shifts = self._raw(v[self.size :])
        _, dG = _expm_and_frechet(E, dE)
        _, dH = _expm_and_frechet(-xp.matrix_transpose(E), -xp.matrix_transpose(dE))
        moved = self.apply(v[: self.size])
        if shifts is not None:
            moved = moved + orbit.shift(moved, shifts)
        return orbit.act(moved, G, H) + orbit.derivative(base, dG, dH)

    def pull(self, z, g):
        orbit, xp = self.orbit, self.orbit.xp
        base, E, G, H = self._state(z)
        m_kv = orbit.m_kv
        moved_back = orbit.act(g, xp.matrix_transpose(G), xp.matrix_transpose(H))
        A_G, A_H = orbit.derivative_transpose(base, g)
        # the derivative of expm at E, transposed, is its derivative at E^T
        _, from_G = _expm_and_frechet(xp.matrix_transpose(E), A_G)
        _, from_H = _expm_and_frechet(-E, A_H)
        raw = [xp.reshape(from_G - xp.matrix_transpose(from_H), (m_kv, -1))]
        if orbit.n_shifts:
            raw.append(orbit.shift_transpose(moved_back))
        raw = xp.concat(raw, axis=1)
        lifted = einsum(xp, "gij,gi->gj", self._scale, raw)
        return xp.concat([self.transpose(moved_back), xp.reshape(lifted, (-1,))])

    def start(self, p):
        xp = namespace(p)
        zeros = xp.zeros(self.n_lifted, dtype=xp.float64, device=device(p))
        return xp.concat([_like(self.inverse(p), p), zeros])


def lift_near_gauge(
    jvp, vjp, params, preconditioner, orbit, scale=None, random_state=None
):
    """The trust-region variables with the slow dimensions' mixings lifted.

    Parameters
    ----------
    jvp, vjp : callable
        The Jacobian's products at ``params``: ``J v`` (a direction in ``p``
        to residuals) and ``J^T u``.
    params : array of shape (p,)
        The stage's start.
    preconditioner : (apply, transpose, inverse) or None
        The parametrization's own right preconditioner (``p = M z``); None: the
        identity.
    orbit : SlowMixing
    scale : array of shape (m_kv, s^2 [+ s], q) or None
        A lift's ``scale`` to use again (an earlier stage's, at a point close
        by): no products are spent on the Gram matrices and the probes.
    random_state : int, RandomState instance or None
        The probes of the typical singular value.

    Returns
    -------
    NearGaugeLift or None
        None when every mixing is exact gauge (nothing to lift).  Its scale
        ``S_g`` (``(s^2 [+ s], q)`` for each key head ``g``) makes the columns
        of ``J B_g S_g`` orthogonal, each of the root-mean-square singular
        value of ``J M``: the Gram matrix of a key head's mixings (and shifts),
        one block per key head (memory linear in the key heads; the blocks of
        two key heads' mixings together are left out), its eigenvectors below
        ``GAUGE_EIGENVALUE`` of the largest eigenvalue left out (the exact
        gauge; ``q`` the most any key head keeps, the others padded with zero
        columns).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> A = rng.normal(size=(40, 16))  # a linear "Jacobian" of Q, K (1, 2, 4)
    >>> orbit = SlowMixing(1, 1, 2, 4, np.array([1, 3]), None, np.zeros(1))
    >>> p = rng.normal(size=16)
    >>> lift = lift_near_gauge(lambda v: A @ v, lambda u: A.T @ u, p, None, orbit)
    >>> z = lift.start(p)
    >>> z.shape, bool(np.allclose(lift.point(z), p))
    ((20,), True)
    """
    if preconditioner is None:
        apply = transpose = inverse = _identity
    else:
        apply, transpose, inverse = preconditioner
    if scale is not None:
        return NearGaugeLift(orbit, scale, apply, transpose, inverse, params.shape[0])
    rng = check_random_state(random_state)
    n_raw = orbit.n_mixings + orbit.n_shifts
    if n_raw == 0:
        return None
    # each key head's Gram of J B_g, a column a product pair: B_g^T J^T J (B e_i)
    # (on the parameters' device, read by the host once a key group)
    xp = namespace(params)
    index = orbit.raw_index()  # (m_kv, s^2 [+ s]) positions in B's columns
    rows = index if is_numpy(xp) else xp.asarray(index, device=device(params))
    grams = np.empty((len(index), index.shape[1], index.shape[1]))
    positions = xp.arange(n_raw, device=device(params))
    for g, block in enumerate(index):
        columns = []
        for i in block:  # e_i made on the device (no host copy a column)
            unit = xp.astype(positions == int(i), xp.float64)
            direction = orbit.directions(params, unit)
            back = orbit.directions_transpose(params, vjp(jvp(direction)))
            columns.append(xp.take(back, rows[g, ...], axis=0))
        gram = to_numpy(xp.stack(columns, axis=1))
        del columns  # (one group's columns at a time, then its Gram alone)
        np.add(gram, gram.T, out=grams[g])
        grams[g] *= 0.5
    values, vectors = np.linalg.eigh(grams)
    keep = values > GAUGE_EIGENVALUE * max(values.max(), np.finfo(float).tiny)
    if not keep.any():
        return None
    # the typical singular value of J M: ||J M||_F^2 / size by Gaussian probes
    size = params.shape[0]
    probes = []
    draws = _like(rng.standard_normal((N_PROBES, size)), params)  # one copy
    for i in range(N_PROBES):
        probe = jvp(apply(draws[i, ...]))
        probes.append(probe @ probe)
    typical = math.sqrt(float(to_numpy(xp.stack(probes)).mean()) / size)
    q = int(keep.sum(axis=1).max())
    scale = np.zeros((len(index), index.shape[1], q))
    for g in range(len(index)):
        kept = keep[g]
        columns = vectors[g][:, kept] * (typical / np.sqrt(values[g][kept]))
        scale[g, :, : columns.shape[1]] = columns
    return NearGaugeLift(orbit, scale, apply, transpose, inverse, size)


def _expm_and_frechet(E, B):
    """``expm(E_g)`` and, with ``B`` (else None), its Frechet derivative along
    ``B_g``, for stacks ``(m_kv, s, s)`` in their namespace: the upper right
    block of ``expm([[E, B], [0, E]])`` (Higham, *Functions of Matrices*,
    3.2)."""
    if B is None:
        return expm(namespace(E), E), None
    xp = namespace(E, B)
    s = E.shape[-1]
    top = xp.concat([E, B], axis=-1)
    bottom = xp.concat([xp.zeros_like(E), E], axis=-1)
    exp = expm(xp, xp.concat([top, bottom], axis=-2))
    return exp[..., :s, :s], exp[..., :s, s:]


def _identity(v):
    return v


def reflect_slow_dims(params, parametrization, key_heads, dims):
    """``params`` with the last of the slow dimensions ``dims`` negated in the
    key heads ``key_heads`` (an int or a sequence) and in the query heads of
    their groups.

    The logits at equal positions do not change (``Q D D K^T``, ``D`` the
    reflection), but the orientation of the slow block does: the lifted mixings
    ``expm(E)`` (determinant positive) cannot reach a start whose slow block is
    mixed by a matrix of negative determinant, and the polish stops at a
    stationary point there (a planted layer of 4 query heads sharing 2 key
    heads, d = 64, head dimension 16, k = 32: stalled at 7.0e-5; reflected in
    the wrong group's block, 8.4e-17 after 6 evaluations).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.solvers.kernels._parametrization import LowRank
    >>> par = LowRank(2, 3, 4, n_kv_heads=1, rope_theta=100.0)
    >>> p = np.random.default_rng(0).normal(size=par.size)
    >>> q = reflect_slow_dims(p, par, 0, np.array([1, 3]))
    >>> bool(np.allclose(par.attention(p), par.attention(q))), bool(np.allclose(p, q))
    (True, False)
    """
    xp = namespace(params)
    m, m_kv, d, r = (
        parametrization.n_heads,
        parametrization.n_kv_heads,
        parametrization.n_features,
        parametrization.rank,
    )
    sign = np.ones((m + m_kv, 1, r))
    members = key_head_index(m, m_kv)
    key_heads = np.atleast_1d(np.asarray(key_heads))
    flipped = np.concatenate(
        [np.isin(members, key_heads), np.isin(np.arange(m_kv), key_heads)]
    )
    sign[flipped, :, int(np.asarray(dims)[-1])] = -1.0
    n_qk = (m + m_kv) * d * r
    head = xp.reshape(params[:n_qk], (m + m_kv, d, r)) * _like(sign, params)
    return xp.concat([xp.reshape(head, (-1,)), params[n_qk:]])
