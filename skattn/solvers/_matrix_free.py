"""Matrix-free second-order steps for large layers.

The variable-projection problem (the W_i eliminated by least squares) is solved by
``scipy.optimize.least_squares`` (trust-region reflective, ``tr_solver="lsmr"``) with
its Jacobian given only through products: :class:`VarproProblem` evaluates the
residual at a point and returns the Jacobian as a ``scipy.sparse.linalg.
LinearOperator`` whose ``matvec`` / ``rmatvec`` each cost about one forward or
backward pass over the examples.  No ``(m d^2)^2`` matrix is ever formed: memory
is that of a few residual vectors and the per-sample patterns.

The Jacobian is Kaufman's: with the design ``A(Theta)`` of the projections
(row ``(n, l)`` = ``sqrt(w_n) [(S_1 X_n)_l, ..., (S_m X_n)_l]``) and ``P`` the
orthogonal projector onto its columns,

    J v = (I - P) dA[v] W*,   dA[v] W* = sum_i sqrt(w) dS_i[v] X W_i,
    dS_i[v] = S_i * (dL_i - rowsum(S_i * dL_i)),  dL_i = the logits' derivative,

the Gauss-Newton matrix ``J^T J`` being the Schur complement that the dense solver
(:mod:`skattn.solvers._dense`) forms explicitly.  The logits' derivatives come from a
parametrization (:mod:`skattn.solvers._parametrization`): full Theta_i or low rank
``Q_i K_i^T``.

:func:`varpro_least_squares` runs scipy's solver in two stages: loose LSMR steps
while the residual is large (``COARSE_UNTIL``), then steps solved to LSMR's default
tolerance for the quadratic convergence at the end.  Each stage works in the
variables of the parametrization's right preconditioner at its start (for low-rank
heads the metric of scaled gradient descent; none for full Theta_i).  With
``jacobian_dtype=numpy.float32`` the final stage's Jacobian products (nearly all of
its work) run in single precision while its residuals and eliminated coefficients
stay in double: the steps are then a little less accurate, the optimum is not.
"""

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from scipy.optimize import least_squares
from scipy.sparse.linalg import LinearOperator

from ..layer._math import softmax
from . import _objective
from ._objective import _chunks, _factor, _normalized_weights, _solve_psd
from ._parametrization import _token_maps

# The states kept between Jacobian products (patterns, design, values) may take up to
# this many times the chunk budget (2**21 floats): 2**29 floats, 4 GiB (12 heads of
# MiniLM on 2464 sequences keep 2 GB; recomputing them doubles a product's cost).
_KEEP_FLOATS_PER_CHUNK_FLOAT = 256

# Far from a minimum the trust region, not the accuracy of the Gauss-Newton step,
# limits the progress: while the residual is above COARSE_UNTIL of the targets'
# norm, each step's least-squares problem is solved by LSMR only to relative
# tolerance COARSE_LSMR_TOL (its default is 1e-6); below, to the default, for the
# quadratic convergence at the end.
COARSE_UNTIL = 1e-2
COARSE_LSMR_TOL = 1e-2


def _softmax_jvp(patterns, d_logits):
    """Derivative of the row softmax: ``S * (dL - rowsum(S * dL))``."""
    return patterns * (d_logits - np.sum(patterns * d_logits, axis=-1, keepdims=True))


class VarproProblem:
    """Residual and Jacobian products of the reduced (variable projection) problem.

    The residual at parameters ``p`` is ``r(p) = sqrt(w) (A(p) W*(p) - Y)``,
    flattened from ``(n, k, d_out)``, with ``W*`` the least-squares projections
    (one step of iterative refinement on the normal equations), so that
    ``||r||^2 / 2`` is the loss of :func:`skattn.solvers.reduced_loss_gradient`.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    sample_weight : ndarray of shape (n,) or None
    parametrization : FullRank, LowRank or FactoredHeads
        See :mod:`skattn.solvers._parametrization`.  With ``FactoredHeads`` the
        design's columns are ``S_i X V_i`` and the eliminated coefficients the
        output factors ``O_i`` (``W_i = V_i O_i``).
    intercept : bool, default=False
        ``FactoredHeads`` only: one more eliminated column of ones, an intercept
        (the tokens need a constant coordinate, see :func:`varpro_least_squares`).
    dtype : dtype, default=numpy.float64
        Precision of the products (``float32`` for loose steps); the eliminated
        coefficients are solved, and results returned, in float64.
    fixed_columns : ndarray of shape (n, k, f) or None
        Full ``W_i`` only: ``f`` more eliminated design columns that do not depend
        on the parameters (row ``(n, l)`` gets ``fixed_columns[n, l]``); their
        coefficients are in :attr:`fixed_coefficients`.  The decoupled one-head
        problems (:mod:`skattn.solvers._decoupled`) put the other heads' outputs
        there.
    n_jobs : int, default=1
        Threads over the chunks of the examples in the Jacobian products (when
        the chunks' states are kept); the chunks' sums are taken in their order,
        so the results do not depend on it.  The caller limits BLAS to one
        thread each (``threadpoolctl``).

    Attributes
    ----------
    n_products : int
        Jacobian products (matvec plus rmatvec) computed so far.
    projection : ndarray of shape (m, d, d_out)
        The ``W_i`` at the last point evaluated.
    output_factors : ndarray of shape (m, r, d_out)
        ``FactoredHeads`` only: the eliminated ``O_i`` at that point.
    fixed_coefficients : ndarray of shape (f, d_out)
        With ``fixed_columns`` only: their eliminated coefficients at that point.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers._parametrization import FullRank
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(50, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 2))
    >>> problem = VarproProblem(X, forward(X, th, W), None, FullRank(1, 4))
    >>> residual = problem.residual(th.reshape(-1))
    >>> residual.shape, bool(np.abs(residual).max() < 1e-12)
    ((300,), True)
    >>> problem.jacobian(th.reshape(-1)).shape
    (300, 16)
    """

    def __init__(
        self,
        X,
        Y,
        sample_weight,
        parametrization,
        intercept=False,
        dtype=np.float64,
        fixed_columns=None,
        n_jobs=1,
    ):
        n, k, d = X.shape
        self.n_jobs = max(1, int(n_jobs))
        self._pool = None
        self.par = parametrization
        self.m = parametrization.n_heads
        self.d_out = Y.shape[2]
        r = getattr(parametrization, "rank", 0)
        # FactoredHeads: the design's columns are S_i X V_i (m r of them), the
        # eliminated projections the output factors O_i
        self.factored = getattr(parametrization, "eliminates_output_factors", False)
        self.intercept_direction = None
        if intercept and self.factored:
            self.intercept_direction = _intercept_direction(X)
        # products in ``dtype`` (float32: the loose steps far from a minimum);
        # the eliminated coefficients are solved, and everything returned, in float64
        self.dtype = np.dtype(dtype)
        self.X, self.Y = (
            X.astype(self.dtype, copy=False),
            Y.astype(self.dtype, copy=False),
        )
        self.root = np.sqrt(_normalized_weights(n, sample_weight)).astype(self.dtype)
        self.fixed = None
        if fixed_columns is not None:
            if self.factored:
                raise ValueError("fixed_columns needs full W_i, not FactoredHeads.")
            self.fixed = np.asarray(fixed_columns).astype(self.dtype, copy=False)
        self.width = (
            (self.m * r if self.factored else self.m * d)
            + (self.intercept_direction is not None)
            + (0 if self.fixed is None else self.fixed.shape[2])
        )
        # kept per sample: patterns, design row block, values, token maps
        if self.factored:
            per_sample = self.m * k * (k + self.d_out + 3 * r) + k * self.width
        else:
            per_sample = self.m * k * (k + d + self.d_out + 2 * r) + k * (
                self.width - self.m * d
            )
        self.slices = _chunks(n, 2 * per_sample)
        # keep every chunk's state between products when it fits the budget
        self._keep = n * per_sample <= _KEEP_FLOATS_PER_CHUNK_FLOAT * (
            _objective._CHUNK_FLOATS
        )
        self.shape = (n * k * self.d_out, parametrization.size)
        self.n_products = 0
        self._params = None
        self._cached = None

    # -- evaluation at a point -------------------------------------------------
    def _chunk_state(self, rows, params):
        """Parametrization cache, patterns and the weighted design, one chunk.

        The design's rows are ``(n, l)`` and its columns ``(i, p)``: row
        ``sqrt(w_n) (S_i X_n)_l``, laid out for one GEMM per product.
        """
        x = self.X[rows]
        c, k, _ = x.shape
        cache = self.par.cache(x, params)
        patterns = softmax(self.par.logits(x, params, cache), axis=-1)
        if self.factored:  # S_i X V_i: (c, m, k, r)
            features = np.matmul(patterns, self.par.values(x, params, cache))
        else:  # S_i X: (c, m, k, d)
            features = np.matmul(patterns, x[:, None])
        design = features.transpose(0, 2, 1, 3).reshape(c * k, -1)
        if self.intercept_direction is not None:
            design = np.concatenate(
                [design, np.ones((c * k, 1), dtype=design.dtype)], axis=1
            )
        if self.fixed is not None:
            design = np.concatenate(
                [design, self.fixed[rows].reshape(c * k, -1)], axis=1
            )
        design *= np.repeat(self.root[rows], k)[:, None]
        return {"cache": cache, "patterns": patterns, "design": design}

    def _states(self):
        """Per-chunk states at the current point (kept, or recomputed)."""
        if self._cached is not None:
            yield from zip(self.slices, self._cached, strict=True)
            return
        for rows in self.slices:
            yield rows, self._chunk_state(rows, self._low)

    def _evaluate(self, params):
        """Patterns, ``W*``, its Gram factor and the residual at ``params``."""
        if self._params is not None and np.array_equal(params, self._params):
            return
        md, o = self.width, self.d_out
        self._params = np.array(params, dtype=np.float64, copy=True)
        self._low = self._params.astype(self.dtype)  # the products' precision
        self._cached = None
        states = [] if self._keep else None
        gram = np.zeros((md, md))
        rhs = np.zeros((md, o))
        for rows in self.slices:
            state = self._chunk_state(rows, self._low)
            if states is not None:
                states.append(state)
            gram += state["design"].T @ state["design"]
            rhs += state["design"].T @ self._target(rows)
        self._cached = states
        self._gram, self._factor = gram, _factor(gram)
        flat = _solve_psd(gram, rhs, self._factor)
        # one step of iterative refinement from the data's residual
        flat = flat - _solve_psd(
            gram, self._design_transpose(self._residual_for(flat)), self._factor
        )
        self.projection = self._projection_of(flat)
        self._residual = self._residual_for(flat)

    def _projection_of(self, flat):
        """The ``W_i`` ``(m, d, d_out)`` of the eliminated coefficients ``flat``.

        Full ``W_i``: ``flat`` itself.  Factored values: ``W_i = V_i O_i``, and an
        intercept column's row ``c`` goes to head 0 as ``g c^T`` (``X g = 1``):
        the same outputs, since every pattern row sums to one.
        """
        m, d, o = self.m, self.X.shape[2], self.d_out
        if not self.factored:
            self.fixed_coefficients = flat[m * d :]
            return flat[: m * d].reshape(m, d, o)
        r = self.par.rank
        self.output_factors = flat[: m * r].reshape(m, r, o)
        self._output_factors_low = self.output_factors.astype(self.dtype)
        projection = np.matmul(self.par.factors(self._params)[2], self.output_factors)
        if self.intercept_direction is not None:
            projection[0] += np.outer(self.intercept_direction, flat[m * r])
        return projection

    def _target(self, rows):
        """``sqrt(w) Y`` on a chunk, as rows ``(n, l)``: ``(c k, d_out)``."""
        y = self.Y[rows]
        return (y * self.root[rows, None, None]).reshape(-1, self.d_out)

    def _map(self, function):
        """``function(rows, state)`` over the chunks, an iterator over the results
        in the chunks' order: in ``n_jobs`` threads when the states are kept."""
        if self.n_jobs > 1 and self._cached is not None and len(self.slices) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.n_jobs)
            chunks = zip(self.slices, self._cached, strict=True)
            return self._pool.map(lambda chunk: function(*chunk), chunks)
        return (function(rows, state) for rows, state in self._states())

    def _residual_for(self, flat):
        """``sqrt(w) (A W - Y)`` as rows ``(n, l)``: ``(n k, d_out)``."""
        out = np.empty((self.shape[0] // self.d_out, self.d_out), dtype=self.dtype)
        flat = flat.astype(self.dtype, copy=False)
        k = self.X.shape[1]
        for rows, state in self._states():
            block = slice(rows.start * k, rows.stop * k)
            out[block] = state["design"] @ flat - self._target(rows)
        return out

    def _design_transpose(self, rows_out):
        """``A^T u`` for ``u`` as rows ``(n k, d_out)``: ``(width, d_out)``."""
        rows_out = rows_out.astype(self.dtype, copy=False)
        k = self.X.shape[1]
        out = np.zeros((self.width, self.d_out))
        for part in self._map(
            lambda rows, state: (
                state["design"].T @ rows_out[rows.start * k : rows.stop * k]
            )
        ):
            out += part
        return out

    def _project_out(self, rows_out, inplace=False):
        """``(I - P) u``: remove the part of ``u`` that the projections can fit
        (in ``rows_out`` itself with ``inplace``)."""
        coef = _solve_psd(self._gram, self._design_transpose(rows_out), self._factor)
        coef = coef.astype(self.dtype, copy=False)
        out = rows_out if inplace else rows_out.astype(self.dtype)
        k = self.X.shape[1]

        def subtract(rows, state):
            out[rows.start * k : rows.stop * k] -= state["design"] @ coef

        for _ in self._map(subtract):
            pass
        return out

    def _values(self, rows, state):
        """``X W*_i`` on a chunk: ``(c, m, k, d_out)`` (kept with the chunk's state)."""
        values = state.get("values")
        if values is None:
            if self.factored:  # (X V_i) O_i, r columns at a time
                values = np.matmul(
                    self.par.values(self.X[rows], self._low, state["cache"]),
                    self._output_factors_low,
                )
            else:
                values = np.ascontiguousarray(
                    _token_maps(self.X[rows], self.projection.astype(self.dtype))
                )
            if self._cached is not None:
                state["values"] = values
        return values

    # -- public ------------------------------------------------------------------
    def residual(self, params):
        """The weighted residual at ``params``, flat ``(n k d_out,)``."""
        self._evaluate(params)
        return self._residual.reshape(-1).astype(np.float64, copy=False)

    def matvec(self, params, direction):
        """``J v``, flat ``(n k d_out,)``."""
        self._evaluate(params)
        self.n_products += 1
        k = self.X.shape[1]
        direction = np.asarray(direction).astype(self.dtype, copy=False)
        out = np.empty((self.shape[0] // self.d_out, self.d_out), dtype=self.dtype)

        def chunk(rows, state):
            x = self.X[rows]
            if self.factored:
                d_logits, d_values = self.par.jvp(
                    x, self._low, direction, state["cache"]
                )
            else:
                d_logits = self.par.logits_jvp(x, self._low, direction, state["cache"])
            d_patterns = _softmax_jvp(state["patterns"], d_logits)
            c, m = d_patterns.shape[:2]
            # sum_i dS_i (X W_i): one (k, m k) @ (m k, o) product a sample
            change = np.matmul(
                d_patterns.transpose(0, 2, 1, 3).reshape(c, k, m * k),
                self._values(rows, state).reshape(c, m * k, self.d_out),
            )  # (c, k, o)
            if self.factored:  # + sum_i S_i (X dV_i) O_i, one GEMM over heads
                moved = np.matmul(state["patterns"], d_values)  # (c, m, k, r)
                c, m, k_, r = moved.shape
                change += (
                    moved.transpose(0, 2, 1, 3).reshape(c * k_, m * r)
                    @ self._output_factors_low.reshape(m * r, self.d_out)
                ).reshape(c, k_, self.d_out)
            change *= self.root[rows, None, None]
            out[rows.start * k : rows.stop * k] = change.reshape(-1, self.d_out)

        for _ in self._map(chunk):
            pass
        return (
            self._project_out(out, inplace=True)
            .reshape(-1)
            .astype(np.float64, copy=False)
        )

    def rmatvec(self, params, vector, *, orthogonal=False):
        """``J^T u``, flat ``(p,)``.

        ``orthogonal=True`` skips the projection ``(I - P)`` of ``u`` (half of a
        product's cost when ``d_out`` is large): exact when ``u`` is orthogonal
        to the design's columns, as the residual at ``W*`` and every vector that
        LSMR builds from it and from ``J v`` are (up to rounding).
        """
        self._evaluate(params)
        self.n_products += 1
        k = self.X.shape[1]
        projected = vector.reshape(-1, self.d_out).astype(self.dtype, copy=False)
        if not orthogonal:
            projected = self._project_out(projected)

        def chunk(rows, state):
            x = self.X[rows]
            scaled = (
                projected[rows.start * k : rows.stop * k].reshape(-1, 1, k, self.d_out)
                * self.root[rows, None, None, None]
            )
            c, m = scaled.shape[0], self.m
            # u_l . (X W_i)_a for every head: one (k, o) @ (o, m k) product a sample
            d_patterns = (
                np.matmul(
                    scaled[:, 0],
                    np.swapaxes(
                        self._values(rows, state).reshape(c, m * k, self.d_out), 1, 2
                    ),
                )
                .reshape(c, k, m, k)
                .transpose(0, 2, 1, 3)
            )
            d_logits = _softmax_jvp(state["patterns"], d_patterns)
            if not self.factored:
                return self.par.logits_vjp(x, self._low, d_logits, state["cache"])
            # the values' cotangent S_i^T (u O_i^T), the heads' O_i in one GEMM
            r = self.par.rank
            u_o = (
                (
                    scaled.reshape(c * k, self.d_out)
                    @ self._output_factors_low.reshape(m * r, self.d_out).T
                )
                .reshape(c, k, m, r)
                .transpose(0, 2, 1, 3)
            )
            d_values = np.matmul(np.swapaxes(state["patterns"], 2, 3), u_o)
            return self.par.vjp(x, self._low, d_logits, d_values, state["cache"])

        grad = np.zeros(self.par.size)
        for part in self._map(chunk):
            grad += part
        return grad

    def jacobian(self, params, *, orthogonal=False):
        """The Jacobian at ``params`` as a ``LinearOperator`` (``orthogonal``: see
        :meth:`rmatvec`)."""
        self._evaluate(params)
        p = np.array(params, copy=True)
        return LinearOperator(
            self.shape,
            matvec=lambda v: self.matvec(p, np.ravel(v)),
            rmatvec=lambda u: self.rmatvec(p, np.ravel(u), orthogonal=orthogonal),
            dtype=float,
        )


def _intercept_direction(X):
    """A token-space vector ``g`` with ``X g = 1`` on every token (a constant
    coordinate, possibly mixed by a whitening), by least squares on the tokens."""
    tokens = X[: max(1, _objective._CHUNK_FLOATS // max(1, X.shape[1] * X.shape[2]))]
    tokens = tokens.reshape(-1, X.shape[2])
    g = np.linalg.lstsq(tokens, np.ones(len(tokens)), rcond=None)[0]
    if np.abs(tokens @ g - 1.0).max() > 1e-8:
        raise ValueError(
            "intercept=True needs tokens with a constant coordinate (such as the "
            "[x, 1] tokens of fit_intercept): no linear map of these tokens is 1 "
            "on all of them."
        )
    return g


def varpro_least_squares(
    X,
    Y,
    params,
    parametrization,
    sample_weight=None,
    *,
    max_iter=100,
    tol=1e-10,
    max_products=None,
    coarse=True,
    coarse_dtype=np.float32,
    jacobian_dtype=np.float64,
    intercept=False,
    fixed_columns=None,
    stop_below=None,
    n_jobs=1,
    verbose=0,
):
    """Minimise the reduced loss matrix-free: scipy's ``least_squares``, TRF + LSMR.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    params : ndarray of shape (p,)
        Starting parameters of ``parametrization``.
    parametrization : FullRank or LowRank
    sample_weight : ndarray of shape (n,) or None
    max_iter : int, default=100
        Residual evaluations (``max_nfev``).
    tol : float, default=1e-10
        Relative step tolerance (``xtol``); ``ftol`` and ``gtol`` are set at the
        rounding floor so the solver stops on the step or at machine precision.
    max_products : int or None
        Cap on the LSMR iterations of one step (``None``: ``min(p, 200)``).
    coarse : bool, default=True
        Solve the steps loosely (``COARSE_LSMR_TOL``) while the residual is above
        ``COARSE_UNTIL`` of the targets' norm, then to LSMR's default tolerance.
    coarse_dtype : dtype, default=numpy.float32
        Precision of the Jacobian products of the loose stage (half the cost of
        float64 BLAS); the eliminated coefficients are solved in float64 and the
        final stage runs in float64, so the result is a float64 optimum.
    jacobian_dtype : dtype, default=numpy.float64
        Precision of the final stage's Jacobian products (a twin problem in
        that precision gives the linear solver its operator); its residuals and
        eliminated coefficients, which decide the optimum, stay in float64.
        ``float32`` halves the cost of the products that are nearly all of the
        stage's work: a product's rounding error only makes each step slightly
        less exact, where a residual in single precision would stall the stage
        at single-precision rounding.
    intercept : bool, default=False
        With :class:`FactoredHeads` only: also eliminate a constant output shift
        (an intercept column in the design; the tokens must have a constant
        coordinate, as the ``[x, 1]`` tokens of ``fit_intercept``).  A rank-r
        ``V_i O_i`` cannot hold it; full ``W_i`` hold it in that coordinate.
    fixed_columns : ndarray of shape (n, k, f) or None
        Full ``W_i`` only: more eliminated design columns that do not depend on
        the parameters (see :class:`VarproProblem`).
    stop_below : float or None
        Return the start as it is when its relative residual (against the
        targets' norm, in double precision) is at most this: a start that fits
        to rounding already (``stop_reason`` ``"start"``).  Without it the
        solver spends a full step (up to ``max_products`` products) to find
        that the step is negligible.
    n_jobs : int, default=1
        Threads of the Jacobian products (see :class:`VarproProblem`).
    verbose : int, default=0
        Passed to ``least_squares``: 2 prints one line per iteration.

    Returns
    -------
    params : ndarray of shape (p,)
    projection : ndarray of shape (m, d, d_out)
    info : dict
        ``method``, ``n_iter`` (Jacobian evaluations), ``n_coarse_iter`` (those
        with loose steps), ``n_evaluations``,
        ``n_products`` (Jacobian-vector products: the linear solver's work),
        ``loss_start``, ``loss``, ``converged``, ``stop_reason``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers._parametrization import FullRank
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 4))
    >>> p, W_hat, info = varpro_least_squares(
    ...     X, forward(X, th, W), (th + 0.05).reshape(-1), FullRank(1, 4)
    ... )
    >>> bool(np.allclose(p, th.reshape(-1), atol=1e-8)), info["converged"]
    (True, True)
    """
    # the problem in double precision, and its twins in other precisions
    make = functools.partial(
        VarproProblem,
        X,
        Y,
        sample_weight,
        parametrization,
        intercept,
        fixed_columns=fixed_columns,
        n_jobs=n_jobs,
    )
    problem = make()
    loose = problem
    if coarse and np.dtype(coarse_dtype) != problem.dtype:
        loose = make(dtype=coarse_dtype)
    x = np.asarray(params, dtype=float)
    start = loose.residual(x)
    loss_start = 0.5 * float(start @ start)
    if max_products is None:
        max_products = min(parametrization.size, 200)
    eps = np.finfo(float).eps
    options = {
        "ftol": eps,
        "xtol": max(tol, eps),
        "gtol": eps,
        "verbose": verbose,
    }
    n_iter = n_evaluations = n_coarse = 0
    omega = _normalized_weights(len(X), sample_weight)
    target = math.sqrt(float(omega @ np.einsum("nkj,nkj->n", Y, Y)))
    status = None
    if stop_below is not None:
        exact = problem.residual(x) if loose is not problem else start
        if math.sqrt(float(exact @ exact)) <= stop_below * target:
            status, max_iter = _START, 0  # no stage runs
    if (
        status is None
        and coarse
        and math.sqrt(2.0 * loss_start) > COARSE_UNTIL * target
    ):
        # far from a minimum: loose steps until the residual is COARSE_UNTIL of Y
        def close_enough(intermediate_result):
            if math.sqrt(2.0 * intermediate_result.cost) <= COARSE_UNTIL * target:
                raise StopIteration

        x, result = _stage(
            loose,
            x,
            {"maxiter": max_products, "atol": COARSE_LSMR_TOL, "btol": COARSE_LSMR_TOL},
            max_iter,
            callback=close_enough,
            **options,
        )
        n_iter, n_evaluations = int(result.njev), int(result.nfev)
        n_coarse, status = n_iter, result.status
    n_loose_products = loose.n_products if loose is not problem else 0
    # a single-precision stage may stop on rounding: the float64 stage always follows
    finish = status in (None, -2) or loose is not problem
    loose = None  # its kept states
    products = None
    if n_evaluations < max_iter and finish:
        if np.dtype(jacobian_dtype) != problem.dtype:
            products = make(dtype=jacobian_dtype)
        x, result = _stage(
            problem,
            x,
            {"maxiter": max_products},
            max_iter - n_evaluations,
            products=products,
            **options,
        )
        n_iter += int(result.njev)
        n_evaluations += int(result.nfev)
        status = result.status
    final = problem.residual(x)
    info = {
        "method": "matrix-free",
        "n_iter": n_iter,
        "n_coarse_iter": n_coarse,
        "n_evaluations": n_evaluations,
        "n_products": int(
            problem.n_products
            + n_loose_products
            + (0 if products is None else products.n_products)
        ),
        "loss_start": loss_start,
        "loss": 0.5 * float(final @ final),
        "converged": status > 0,
        "stop_reason": _STATUS[status] if status in _STATUS else str(result.message),
    }
    return x, problem.projection, info


def _stage(
    problem, params, tr_options, max_nfev, callback=None, products=None, **options
):
    """One run of scipy's ``least_squares`` (TRF, LSMR) from ``params``.

    In the variables ``z`` of the parametrization's right preconditioner ``M``
    at ``params`` (``p = M z``; see ``LowRank.preconditioner``), or in ``p``
    itself when it has none.  The Jacobian products come from ``products`` (the
    same problem in another precision) when given, else from ``problem``, which
    gives the residuals.  Returns the final ``p`` and scipy's result.
    """
    products = problem if products is None else products
    if problem.factored:  # balance V_i against the eliminated O_i
        problem.residual(params)
        params = problem.par.regauge(params, problem.output_factors)
    precond = problem.par.preconditioner(params)
    if precond is None:
        apply = np.asarray
        z0 = params
    else:
        apply, transpose, inverse = precond
        z0 = inverse(params)
        size = problem.shape[1]
        M = LinearOperator((size, size), matvec=apply, rmatvec=transpose, dtype=float)

    def jacobian(z):
        # LSMR's left vectors stay orthogonal to the design (they are built from
        # the residual at W* and from J v): the cheaper adjoint is exact there
        J = products.jacobian(apply(z), orthogonal=True)
        return J if precond is None else J @ M

    result = least_squares(
        lambda z: problem.residual(apply(z)),
        z0,
        jac=jacobian,
        method="trf",
        tr_solver="lsmr",
        tr_options=tr_options,
        x_scale=1.0,
        max_nfev=max_nfev,
        callback=callback,
        **options,
    )
    return apply(result.x), result


# least_squares' status -> stop_reason; _START: the start fitted already
_START = 5
_STATUS = {
    _START: "start",
    0: "max_iter",
    1: "gradient",
    2: "no_decrease",
    3: "step",
    4: "no_decrease",
}
