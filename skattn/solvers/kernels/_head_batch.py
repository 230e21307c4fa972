"""Several heads' one-head problems as one problem with a head axis.

The decoupled refinement (:mod:`skattn.solvers.stages._rounds`) solves, for each
head ``i`` of a layer, the regression of its share ``T_i = Y D_i`` of the outputs
(``(n, k, r)``) on the design ``A_i = [S_i X, F_i]``: the head's features and
``F_i`` (``(n, k, f)``, the other heads' shares, fixed columns), with ``Q_i``,
``K_i`` the nonlinear unknowns and the design's coefficients eliminated (variable
projection; :class:`~skattn.solvers.kernels._varpro.VarproProblem` with one
``LowRank`` head).  The problems share the tokens ``X`` and have the same shape;
:class:`HeadBatch` evaluates ``h`` of them at once: every array has a head axis
(parameters ``(h, 2 d r)``, residuals ``(h, n k r)``, Grams ``(h, w, w)``), so
that one kernel serves every head.  On a GPU the heads' problems are each too
small to fill it; one after another they are bound by launches.

The residual of head ``i`` at ``p_i`` is ``sqrt(w) (A_i W_i - T_i)`` with ``W_i``
the least-squares coefficients (one step of iterative refinement from the data's
residual), and its Jacobian products

    J_i v_i = (I - P_i) sqrt(w) dS_i[v_i] X W^x_i,
    J_i^T u_i = the logits' pull-back of S_i * (G - rowsum(S_i * G)),
                G = sqrt(w) u_i (X W^x_i)^T,

with ``W^x_i`` the coefficients of ``S_i X`` and ``P_i`` the projector onto
``A_i``'s columns (the adjoint skips ``I - P_i``: the solver's vectors are
orthogonal to the design already, as the residual at ``W_i`` is).  Nothing here
reads a value on the host: the point is set by :meth:`HeadBatch.evaluate` and the
products are taken there, so that a solver decides when to look.

Arrays in, arrays out, of any array-API namespace (numpy, torch, CuPy); the
products may run in single precision (``dtype``) while residuals and coefficients
stay in double.
"""

import numpy as np
from sklearn.externals import array_api_compat as _compat

from ...layer._math import _chunk_floats, _namespace, softmax
from ...utils._array_api import (
    cholesky_unchecked,
    device,
    rank_ridge,
    solve_triangular,
    to_namespace,
)
from ._loss import _CHUNK_FLOATS, _chunks, _device_weights
from ._parametrization import LowRank, _token_maps
from ._varpro import _softmax_jvp

__all__ = ["HeadBatch", "head_layout", "lowrank_layout"]

# On torch, a head's Gram whose ridged Cholesky fails (indefinite by rounding
# beyond the rank tolerance's ridge) is factored ridged this many times more,
# chosen on the device (:func:`_psd_factor`): still about 2e-13 w of its largest
# diagonal, far below the fits' tolerances.
UNCHECKED_RIDGE = 1e3


def head_layout(xp, params, n_heads):
    """``LowRank(h)`` parameters ``[Q_1..Q_h, K_1..K_h]`` (flat) as one row per
    head, ``[Q_i, K_i]``: ``(h, 2 d r)``, each row the parameters of
    ``LowRank(1)``.

    Examples
    --------
    >>> import numpy as np
    >>> head_layout(np, np.arange(8.0), 2).tolist()
    [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]]
    """
    both = xp.reshape(params, (2, n_heads, -1))
    return xp.reshape(xp.permute_dims(both, (1, 0, 2)), (n_heads, -1))


def lowrank_layout(xp, rows):
    """The inverse of :func:`head_layout`: ``(h, 2 d r)`` rows to flat
    ``LowRank(h)`` parameters.

    Examples
    --------
    >>> import numpy as np
    >>> p = np.arange(8.0)
    >>> bool((lowrank_layout(np, head_layout(np, p, 2)) == p).all())
    True
    """
    h = rows.shape[0]
    both = xp.reshape(rows, (h, 2, -1))
    return xp.reshape(xp.permute_dims(both, (1, 0, 2)), (-1,))


def _psd_factor(xp, gram):
    """A solver of ``G_i x_i = b_i`` for a stack of symmetric PSD ``G``
    ``(h, w, w)``: a function of ``b`` ``(h, w, c)``.

    Cholesky of ``G_i`` ridged by ``w eps max(diag G_i)`` (the rank tolerance of
    ``numpy.linalg.matrix_rank``: singular Grams, from tokens in a proper
    subspace, get coefficients of least norm up to that tolerance, whose fitted
    values are those of the exact solve); where the factorization fails, the
    pseudo-inverse by ``eigh`` for the whole stack.  No value is read on the
    host where the library raises on a failed factorization (numpy).  On torch
    nothing is read at all (a checked Cholesky makes a GPU's host wait at every
    point, issue 63): where a head's ridged Gram is still not definite (by
    rounding beyond the ridge), the factor of it ridged ``UNCHECKED_RIDGE``
    times more, chosen on the device.
    """
    w = gram.shape[-1]
    eps = float(np.finfo(float).eps)
    ridge = rank_ridge(xp, gram)[:, None, None]
    ridged = gram + ridge * xp.eye(w, dtype=gram.dtype, device=device(gram))
    lower = cholesky_unchecked(xp, ridged, UNCHECKED_RIDGE * ridge)
    if lower is not None:
        return _triangular_solver(xp, lower)
    try:
        lower = xp.linalg.cholesky(ridged)
        if _compat.is_cupy_namespace(xp) and not bool(xp.all(xp.isfinite(lower))):
            raise np.linalg.LinAlgError("not positive definite")  # CuPy's NaN
    except Exception:  # numpy/torch LinAlgError: not positive definite
        values, vectors = xp.linalg.eigh(gram)
        largest = xp.max(xp.abs(values), axis=1, keepdims=True)
        keep = xp.abs(values) > w * eps * largest
        inverse = xp.where(keep, 1.0 / xp.where(keep, values, 1.0), 0.0)

        def pseudo(rhs):
            coef = xp.linalg.matrix_transpose(vectors) @ rhs
            return vectors @ (inverse[..., None] * coef)

        return pseudo
    return _triangular_solver(xp, lower)


def _packed(xp, a):
    """``a`` in C order (a copy where it is a strided view: the token maps'
    ``(c, h, k, r)`` are a permuted GEMM result, which every batched product
    would otherwise copy again; with one head the permutation is free)."""
    return xp.reshape(xp.reshape(a, (-1,)), a.shape)


def _thin_transpose(xp, a, u):
    """``a^T @ u`` for ``u`` of few columns (``(h, n, w)``, ``(h, n, r)``), as
    ``(u^T a)^T`` (about 2x faster on one CPU thread)."""
    mT = xp.linalg.matrix_transpose
    return mT(mT(u) @ a)


def _triangular_solver(xp, lower):
    """``b -> G^-1 b`` from ``G``'s lower Cholesky factors ``(h, w, w)``."""
    upper = xp.linalg.matrix_transpose(lower)

    def cholesky(rhs):
        half = solve_triangular(xp, lower, rhs, lower=True)
        return solve_triangular(xp, upper, half, lower=False)

    return cholesky


class HeadBatch:
    """The one-head problems of ``h`` heads on the same tokens, evaluated at once.

    Parameters
    ----------
    X : array of shape (n, k, d)
    targets : array of shape (n, k, h, o)
        Head ``i``'s targets ``T_i`` in ``targets[:, :, i, :]``.
    fixed : array of shape (n, k, h, f) or None
        Head ``i``'s fixed columns ``F_i`` in ``fixed[:, :, i, :]``.
    sample_weight : array of shape (n,) or None
    dtype : dtype, default=numpy.float64
        Precision of the Jacobian products (a numpy dtype); residuals and
        coefficients are computed in float64.
    head_rank : int or None
        The rank ``r`` of ``Q_i``, ``K_i`` (``None``: ``o``, as in the
        decoupled problems, where a head's share has ``r`` columns).

    Attributes
    ----------
    n_heads, n_features, rank, n_outputs : int
        ``h``, ``d``, ``r``, ``o``.
    size : int
        Parameters per head, ``2 d r``.
    n_products : int
        Batched products taken (each one product of every head).
    head_products : list of int
        Per head of the batch as built, the products it took part in (a batched
        product counts once for each head still in the batch): what that head
        alone would have counted.
    coefficients : array of shape (h, w, o)
        The eliminated coefficients at the point evaluated (``w = d + f``); the
        first ``d`` rows of head ``i`` are its ``W^x_i``.
    target_norms : array of shape (h,)
        ``||sqrt(w) T_i||``, the norms the relative residuals are taken against.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(40, 4, 3))
    >>> theta = rng.normal(size=(2, 3, 3)); W = rng.normal(size=(2, 3, 2))
    >>> targets = np.stack([forward(X, theta[i:i + 1], W[i:i + 1]) for i in
    ...                     range(2)], axis=2)  # (n, k, h, r): one head each
    >>> batch = HeadBatch(X, targets, None, None, head_rank=3)
    >>> batch.residual(rng.normal(size=(2, batch.size))).shape
    (2, 320)
    """

    def __init__(
        self, X, targets, fixed, sample_weight, dtype=np.float64, head_rank=None
    ):
        xp = _namespace(X, targets)
        self._xp, self._device = xp, device(X)
        n, k, d = X.shape
        h, o = targets.shape[2], targets.shape[3]
        r = o if head_rank is None else int(head_rank)
        f = 0 if fixed is None else fixed.shape[3]
        self.n_heads, self.n_features, self.rank, self.n_outputs = h, d, r, o
        self.size = 2 * d * r
        self.width = d + f
        self.n_samples, self.n_tokens = n, k
        self.dtype = np.dtype(dtype)
        self._low = getattr(xp, self.dtype.name)
        self.X = xp.astype(X, xp.float64, copy=False)
        self._X_low = xp.astype(X, self._low, copy=False)
        omega = _device_weights(n, sample_weight, X)
        root = xp.sqrt(omega)
        self._root = root
        # weighted targets and fixed columns, head-major rows: (h, n k, .)
        self._targets = self._head_major(targets * root[:, None, None, None])
        self._fixed = None
        if fixed is not None:
            self._fixed = self._head_major(
                xp.astype(fixed, xp.float64, copy=False) * root[:, None, None, None]
            )
        self.target_norms = xp.sqrt(xp.sum(self._targets**2, axis=(1, 2)))
        self._fixed_gram = self._fixed_low = None
        if self._fixed is not None:
            self._fixed_gram = xp.matrix_transpose(self._fixed) @ self._fixed
            self._fixed_low = xp.astype(self._fixed, self._low)
        self._point = None
        # chunks of samples for the per-sample work (patterns, features): on the
        # host each head's part as large as one head's alone (the one-head
        # problems' budget each), so that a batched product launches no more
        # operations than one head's; on a device a share of its free memory
        per_sample = h * k * (2 * k + 2 * d + 4 * r)
        self.slices = _chunks(n, per_sample, _chunk_floats(X, h * _CHUNK_FLOATS))
        self.n_products = 0
        self.head_products = [0] * h
        self._heads = list(range(h))  # the heads left, as indices of the first
        self.n_evaluations = 0

    def _head_major(self, a):
        """``(n, k, h, c)`` to ``(h, n k, c)`` (a copy in C order)."""
        xp = self._xp
        n, k, h, c = a.shape
        out = xp.reshape(xp.permute_dims(a, (2, 0, 1, 3)), (h, n * k, c))
        return xp.asarray(out, copy=True)

    def select(self, heads):
        """Keep only ``heads`` (host indices into the batch): the problem of
        those heads, at their part of the point evaluated last."""
        xp = self._xp
        index = to_namespace(np.asarray(heads, dtype=np.int64), xp, self._device)

        def take(a, axis=0):
            return None if a is None else xp.take(a, index, axis=axis)

        self.n_heads = len(heads)
        self._heads = [self._heads[j] for j in heads]
        self._targets, self._fixed = take(self._targets), take(self._fixed)
        self._fixed_low = take(self._fixed_low)
        self._fixed_gram = take(self._fixed_gram)
        self.target_norms = take(self.target_norms)
        if self._point is None:
            return
        self._point = take(self._point)
        self._point_low = take(self._point_low)
        self._par = LowRank(self.n_heads, self.n_features, self.rank)
        self.coefficients = take(self.coefficients)
        self._gram = take(self._gram)
        self._solve = _psd_factor(xp, self._gram)
        self._residual = take(self._residual)
        self._states = [
            {
                key: take(value, 0 if key.startswith("features") else 1)
                for key, value in state.items()
            }
            for state in self._states
        ]

    # -- the point -------------------------------------------------------------
    def evaluate(self, params):
        """Set the point ``params`` ``(h, 2 d r)``: the patterns, the
        coefficients and the residual there."""
        xp = self._xp
        h, d, r = self.n_heads, self.n_features, self.rank
        self.n_evaluations += 1
        self._point = xp.asarray(params, dtype=xp.float64, copy=True)
        self._par = LowRank(h, d, r)
        flat = lowrank_layout(xp, self._point)
        self._point_low = xp.astype(flat, self._low)
        k = self.n_tokens
        gram = xp.zeros((h, d, d), dtype=xp.float64, device=self._device)
        cross = None
        if self._fixed is not None:
            f = self._fixed.shape[2]
            cross = xp.zeros((h, d, f), dtype=xp.float64, device=self._device)
        rhs = xp.zeros((h, d, self.n_outputs), dtype=xp.float64, device=self._device)
        states = []
        for rows in self.slices:
            x = self.X[rows, ...]
            cache = tuple(_packed(xp, a) for a in self._par.cache(x, flat))
            patterns = softmax(self._par.logits(x, flat, cache), axis=-1)
            c = patterns.shape[0]
            # sqrt(w) S_i X, head-major rows (h, c k, d): a GEMM a head (a
            # matmul broadcast over the heads copies x h times, and permuting
            # its result to head-major rows costs more than the GEMMs)
            weighted = patterns * self._root[rows, None, None, None]
            features = xp.reshape(
                xp.stack([weighted[:, i, ...] @ x for i in range(h)]), (h, c * k, d)
            )
            band = slice(rows.start * k, rows.stop * k)
            transposed = xp.matrix_transpose(features)
            gram += transposed @ features
            rhs += _thin_transpose(xp, features, self._targets[:, band, :])
            if cross is not None:
                cross += transposed @ self._fixed[:, band, :]
            low = self._low != xp.float64
            states.append(
                {
                    "q": xp.astype(cache[0], self._low),
                    "k": xp.astype(cache[1], self._low),
                    "patterns": patterns,
                    "patterns_low": xp.astype(patterns, self._low) if low else patterns,
                    "features": features,
                    "features_low": xp.astype(features, self._low) if low else features,
                }
            )
        self._states = states
        if cross is not None:  # [S X, F]^T [S X, F], with F^T F kept
            top = xp.concat([gram, cross], axis=2)
            bottom = xp.concat([xp.matrix_transpose(cross), self._fixed_gram], axis=2)
            gram = xp.concat([top, bottom], axis=1)
            rhs = xp.concat(
                [rhs, _thin_transpose(xp, self._fixed, self._targets)], axis=1
            )
        self._gram = gram
        self._solve = solve = _psd_factor(xp, gram)
        coef = solve(rhs)
        # one step of iterative refinement from the data's residual
        coef = coef - solve(self._design_transpose(self._fitted(coef) - self._targets))
        self.coefficients = coef
        self._residual = self._fitted(coef) - self._targets
        # X W^x_i per chunk, (c, h, k, r), in the products' precision
        w_x = xp.astype(coef[:, :d, :], self._low)
        for rows, state in zip(self.slices, states, strict=True):
            state["values"] = _packed(xp, _token_maps(self._X_low[rows, ...], w_x))

    def _fitted(self, coef, low=False):
        """``A_i W_i`` for every head: ``(h, n k, r)``."""
        xp = self._xp
        d = self.n_features
        key = "features_low" if low else "features"
        coef = xp.astype(coef, self._low) if low else coef
        # transposed, (h, r, n k): the long axis as the GEMMs' columns (about 4x
        # faster on one CPU thread than (h, n k, d) @ (h, d, r)), the chunks
        # joined along it
        mT = xp.linalg.matrix_transpose
        values = mT(coef[:, :d, :])
        out = [values @ mT(state[key]) for state in self._states]
        fitted = xp.concat(out, axis=2) if len(out) > 1 else out[0]
        if self._fixed is not None:
            fixed = self._fixed_low if low else self._fixed
            fitted = fitted + mT(coef[:, d:, :]) @ mT(fixed)
        return mT(fitted)

    def _design_transpose(self, u, low=False):
        """``A_i^T u_i`` for ``u`` ``(h, n k, r)``: ``(h, w, r)`` (float64)."""
        xp = self._xp
        k = self.n_tokens
        key = "features_low" if low else "features"
        total = None
        for rows, state in zip(self.slices, self._states, strict=True):
            band = slice(rows.start * k, rows.stop * k)
            part = _thin_transpose(xp, state[key], u[:, band, :])
            total = part if total is None else total + part
        total = xp.astype(total, xp.float64)
        if self._fixed is None:
            return total
        fixed = self._fixed_low if low else self._fixed
        return xp.concat(
            [total, xp.astype(_thin_transpose(xp, fixed, u), xp.float64)], axis=1
        )

    # -- public ------------------------------------------------------------------
    def residual(self, params=None):
        """The weighted residuals ``(h, n k r)`` at ``params`` (evaluated there
        first), or at the point evaluated last."""
        if params is not None:
            self.evaluate(params)
        xp = self._xp
        return xp.reshape(self._residual, (self.n_heads, -1))

    def _count_product(self):
        """One batched product: one more for each head still in the batch."""
        self.n_products += 1
        for i in self._heads:
            self.head_products[i] += 1

    def matvec(self, direction):
        """``J_i v_i`` for ``direction`` ``(h, 2 d r)``: ``(h, n k r)`` (float64)."""
        xp = self._xp
        self._count_product()
        h, r, k = self.n_heads, self.n_outputs, self.n_tokens
        v = xp.astype(lowrank_layout(xp, direction), self._low)
        parts = []
        for rows, state in zip(self.slices, self._states, strict=True):
            x = self._X_low[rows, ...]
            d_logits = self._par.logits_jvp(
                x, self._point_low, v, (state["q"], state["k"])
            )
            d_patterns = _softmax_jvp(state["patterns_low"], d_logits)
            change = xp.matmul(d_patterns, state["values"])  # (c, h, k, r)
            change = (
                change * xp.astype(self._root[rows], self._low)[:, None, None, None]
            )
            c = change.shape[0]
            parts.append(
                xp.reshape(xp.permute_dims(change, (1, 0, 2, 3)), (h, c * k, r))
            )
        out = xp.concat(parts, axis=1) if len(parts) > 1 else parts[0]
        # (I - P_i): remove what the head's design can fit
        coef = self._solve(self._design_transpose(out, low=True))
        out = out - self._fitted(coef, low=True)
        return xp.astype(xp.reshape(out, (h, -1)), xp.float64)

    def rmatvec(self, vector):
        """``J_i^T u_i`` for ``vector`` ``(h, n k r)`` orthogonal to the designs
        (see the module's docstring): ``(h, 2 d r)`` (float64)."""
        xp = self._xp
        self._count_product()
        h, r, k = self.n_heads, self.n_outputs, self.n_tokens
        u = xp.astype(xp.reshape(vector, (h, -1, r)), self._low)
        total = None
        for rows, state in zip(self.slices, self._states, strict=True):
            c = rows.stop - rows.start
            band = u[:, rows.start * k : rows.stop * k, :]
            scaled = xp.permute_dims(xp.reshape(band, (h, c, k, r)), (1, 0, 2, 3))
            scaled = (
                scaled * xp.astype(self._root[rows], self._low)[:, None, None, None]
            )
            # (c, h, k, k)
            d_patterns = xp.matmul(scaled, xp.matrix_transpose(state["values"]))
            d_logits = _softmax_jvp(state["patterns_low"], d_patterns)
            part = self._par.logits_vjp(
                self._X_low[rows, ...],
                self._point_low,
                d_logits,
                (state["q"], state["k"]),
            )
            total = part if total is None else total + part
        return head_layout(xp, xp.astype(total, xp.float64), h)
