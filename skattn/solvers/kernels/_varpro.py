"""The reduced (variable projection) problem: its residual and Jacobian products.

The projections W_i are eliminated by least squares; :class:`VarproProblem`
evaluates the residual at a point and the products ``J v`` and ``J^T u`` of its
Jacobian (Kaufman's), each about one forward or backward pass over the examples,
never forming an ``(m d^2)^2`` matrix.  With the design ``A(Theta)`` of the
projections (row ``(n, l)`` = ``sqrt(w_n) [(S_1 X_n)_l, ..., (S_m X_n)_l]``) and
``P`` the orthogonal projector onto its columns,

    J v = (I - P) dA[v] W*,   dA[v] W* = sum_i sqrt(w) dS_i[v] X W_i,
    dS_i[v] = S_i * (dL_i - rowsum(S_i * dL_i)),  dL_i = the logits' derivative,

the Gauss-Newton matrix ``J^T J`` being the Schur complement that the dense
Levenberg-Marquardt (:mod:`skattn.solvers.optimizers._lm_dense`) forms
explicitly.  The logits' derivatives come from a parametrization
(:mod:`skattn.solvers.kernels._parametrization`).  Arrays in, arrays out: the
optimizer that wraps the products in a scipy ``LinearOperator`` is
:mod:`skattn.solvers.optimizers._lm_matrix_free`.

The examples may be arrays of any array-API namespace (numpy, torch, CuPy,
array-api-strict): the problem computes in their namespace and on their device,
and returns arrays of it (numpy arrays get the numpy results of before).  On a
device the chunks come from the memory it has free, and a product that runs out
of it is redone with the kept states dropped, then with half the chunks.
"""

import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from sklearn.externals import array_api_compat as _compat
from threadpoolctl import ThreadpoolController

from ...layer._math import _DEVICE_MEMORY_SHARE, _namespace, softmax
from ...utils._array_api import (
    device,
    free_memory,
    is_numpy,
    is_out_of_memory,
    lstsq,
    to_namespace,
)
from . import _loss
from ._loss import _chunks, _device_weights, _factor, _slices, _solve_psd, _weights
from ._parametrization import _token_maps

# The states kept between Jacobian products (patterns, design, values) may take up to
# this many times the chunk budget (2**21 floats): 2**29 floats, 4 GiB (12 heads of
# MiniLM on 2464 sequences keep 2 GB; recomputing them doubles a product's cost).
_KEEP_FLOATS_PER_CHUNK_FLOAT = 256
# On a device, the kept states may take up to this share of the memory it has free
# when the problem is made.
_DEVICE_KEEP_SHARE = 0.5


@functools.cache
def _blas_controller():
    """threadpoolctl's view of the loaded libraries, looked up once
    (``threadpool_limits`` looks them up at every call: 0.4 ms, against 0.01)."""
    return ThreadpoolController()


def _blas_limits(xp):
    """numpy's BLAS on one thread (a product's GEMMs are too thin to share its
    threads: HISTORY, fourteenth session); nothing for the other namespaces,
    whose libraries schedule their own threads.  The stages' limit too."""
    if not is_numpy(xp):
        return contextlib.nullcontext()
    return _blas_controller().limit(limits=1, user_api="blas")


def _softmax_jvp(patterns, d_logits):
    """Derivative of the row softmax: ``S * (dL - rowsum(S * dL))``."""
    xp = _namespace(patterns, d_logits)
    return patterns * (d_logits - xp.sum(patterns * d_logits, axis=-1, keepdims=True))


def _contiguous(xp, x):
    """``x`` laid out in C order where the library has strides (numpy, torch,
    CuPy), so that a kept state, reshaped by every product, needs no copy."""
    if is_numpy(xp):
        return np.ascontiguousarray(x)
    if _compat.is_torch_namespace(xp):
        return x.contiguous()
    if _compat.is_cupy_namespace(xp):
        import cupy

        return cupy.ascontiguousarray(x)
    return x


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
        See :mod:`skattn.solvers.kernels._parametrization`.  With ``FactoredHeads`` the
        design's columns are ``S_i X V_i`` and the eliminated coefficients the
        output factors ``O_i`` (``W_i = V_i O_i``).
    intercept : bool, default=False
        ``FactoredHeads`` only: one more eliminated column of ones, an intercept
        (the tokens need a constant coordinate, see
        :func:`~skattn.solvers.optimizers._lm_matrix_free.varpro_least_squares`).
    dtype : dtype, default=numpy.float64
        Precision of the products (``float32`` for loose steps); the eliminated
        coefficients are solved, and results returned, in float64.  A numpy
        dtype (or its name), whatever the namespace of ``X``.
    fixed_columns : ndarray of shape (n, k, f) or None
        Full ``W_i`` only: ``f`` more eliminated design columns that do not depend
        on the parameters (row ``(n, l)`` gets ``fixed_columns[n, l]``); their
        coefficients are in :attr:`fixed_coefficients`.  The decoupled one-head
        problems (:mod:`skattn.solvers.stages._rounds`) put the other heads' outputs
        there.
    n_jobs : int, default=1
        Threads over the chunks of the examples in the Jacobian products (when
        the chunks' states are kept); the chunks' sums are taken in their order,
        so the results do not depend on it.  numpy's BLAS runs one thread a
        job meanwhile (``threadpoolctl``), the evaluation's Gram on the caller's.
        Arrays on a device (GPU) use one: the device runs a chunk's products in
        parallel already.

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
    >>> from skattn.solvers.kernels._parametrization import FullRank
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(50, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 2))
    >>> problem = VarproProblem(X, forward(X, th, W), None, FullRank(1, 4))
    >>> residual = problem.residual(th.reshape(-1))
    >>> residual.shape, bool(np.abs(residual).max() < 1e-12)
    ((300,), True)
    >>> problem.matvec(th.reshape(-1), np.ones(16)).shape
    (300,)
    >>> problem.shape
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
        xp = _namespace(X, Y)
        self._xp, self._device = xp, device(X)
        # the arguments, for a twin on fewer sequences (:meth:`subset`)
        self._arguments = (X, Y, sample_weight, intercept, fixed_columns)
        free = free_memory(X)  # None on the host
        self.n_jobs = max(1, int(n_jobs)) if free is None else 1
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
        self._dtype = getattr(xp, self.dtype.name)  # the namespace's
        self.X, self.Y = (
            xp.astype(X, self._dtype, copy=False),
            xp.astype(Y, self._dtype, copy=False),
        )
        if is_numpy(xp):
            omega, _ = _weights(n, sample_weight, X)
            self.root = np.sqrt(omega).astype(self.dtype)
        else:  # made on the device: no host read or copy
            self.root = xp.astype(
                xp.sqrt(_device_weights(n, sample_weight, X)), self._dtype
            )
        self.fixed = None
        if fixed_columns is not None:
            if self.factored:
                raise ValueError("fixed_columns needs full W_i, not FactoredHeads.")
            self.fixed = xp.astype(
                to_namespace(fixed_columns, xp, self._device), self._dtype, copy=False
            )
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
        if free is None:
            self.slices = _chunks(n, 2 * per_sample)
            # keep every chunk's state between products when it fits the budget
            keep_floats = _KEEP_FLOATS_PER_CHUNK_FLOAT * _loss._CHUNK_FLOATS
        else:  # a device: its free memory sets both
            budget = int(free * _DEVICE_MEMORY_SHARE) // self.dtype.itemsize
            self.slices = _chunks(n, 2 * per_sample, budget)
            keep_floats = int(free * _DEVICE_KEEP_SHARE) // self.dtype.itemsize
        self._keep = n * per_sample <= keep_floats
        self.shape = (n * k * self.d_out, parametrization.size)
        self.n_products = 0
        self._params = None
        self._source = self._source_version = None  # see _same_point
        self._cached = None

    def subset(self, n_sequences):
        """The same problem on ``n_sequences`` of the sequences, evenly spaced
        (every ``n // n_sequences``-th from the first; their weights as they
        were), in the same precision and threads: ``self`` where that is all of
        them.  Its products cost that share of these.

        Examples
        --------
        >>> import numpy as np
        >>> from skattn.solvers.kernels._parametrization import FullRank
        >>> X = np.random.default_rng(0).normal(size=(10, 3, 2))
        >>> problem = VarproProblem(X, X, None, FullRank(1, 2))
        >>> problem.subset(4).shape, problem.subset(10) is problem
        ((24, 4), True)
        """
        X, Y, sample_weight, intercept, fixed_columns = self._arguments
        n = X.shape[0]
        if n_sequences >= n:
            return self
        step = n // max(1, int(n_sequences))
        rows = slice(0, step * max(1, int(n_sequences)), step)
        return VarproProblem(
            X[rows, ...],
            Y[rows, ...],
            None if sample_weight is None else sample_weight[rows],
            self.par,
            intercept,
            dtype=self.dtype,
            fixed_columns=None if fixed_columns is None else fixed_columns[rows, ...],
            n_jobs=self.n_jobs,
        )

    # -- evaluation at a point -------------------------------------------------
    def _chunk_state(self, rows, params):
        """Parametrization cache, patterns and the weighted design, one chunk.

        The design's rows are ``(n, l)`` and its columns ``(i, p)``: row
        ``sqrt(w_n) (S_i X_n)_l``, laid out for one GEMM per product.
        """
        xp = self._xp
        x = self.X[rows, ...]
        c, k, _ = x.shape
        cache = self.par.cache(x, params)
        patterns = softmax(self.par.logits(x, params, cache), axis=-1)
        if self.factored:  # S_i X V_i: (c, m, k, r)
            features = xp.matmul(patterns, self.par.values(x, params, cache))
        else:  # S_i X: (c, m, k, d)
            features = xp.matmul(patterns, x[:, None, ...])
        design = xp.reshape(xp.permute_dims(features, (0, 2, 1, 3)), (c * k, -1))
        if self.intercept_direction is not None:
            ones = xp.ones((c * k, 1), dtype=design.dtype, device=self._device)
            design = xp.concat([design, ones], axis=1)
        if self.fixed is not None:
            fixed = xp.reshape(self.fixed[rows, ...], (c * k, -1))
            design = xp.concat([design, fixed], axis=1)
        design *= xp.repeat(self.root[rows], k)[:, None]
        return {"cache": cache, "patterns": patterns, "design": design}

    def _states(self):
        """Per-chunk states at the current point (kept, or recomputed)."""
        if self._cached is not None:
            yield from zip(self.slices, self._cached, strict=True)
            return
        for rows in self.slices:
            yield rows, self._chunk_state(rows, self._low)

    def _retry(self, compute):
        """``compute()``, again with less memory after an out-of-memory error
        (:meth:`_shrink`) until it succeeds or nothing is left to shrink."""
        while True:
            try:
                return compute()
            except Exception as exc:
                if not is_out_of_memory(exc) or not self._shrink():
                    raise

    def _shrink(self):
        """Use less memory: drop the kept states, else halve the chunks.  False
        when the chunks are single examples already."""
        if self._keep or self._cached is not None:
            self._keep, self._cached = False, None
            return True
        size = max(rows.stop - rows.start for rows in self.slices)
        if size <= 1:
            return False
        self.slices = _slices(self.X.shape[0], size // 2)
        return True

    def _same_point(self, params):
        """Whether ``params`` is the point evaluated last.

        The very array evaluated last, unchanged since (a torch tensor's version
        counter counts its in-place changes), is that point without a look at
        its values: on a device comparing them is a read by the host, a wait for
        the device, at every residual and product.  On numpy the values are
        compared; on a device another array is taken for another point (its
        evaluation queued, not a wait: the solvers pass the array they
        evaluated)."""
        if self._params is None:
            return False
        if is_numpy(self._xp):
            return np.array_equal(params, self._params)
        if params is not self._source:
            return False
        version = getattr(params, "_version", None)
        if version is not None:
            return version == self._source_version
        # the same array, no version counter (CuPy): its values may have changed
        return bool(self._xp.all(params == self._params))

    def _evaluate(self, params):
        """Patterns, ``W*``, its Gram factor and the residual at ``params``."""
        params = to_namespace(params, self._xp, self._device)
        if self._same_point(params):
            return
        try:
            self._retry(lambda: self._evaluate_at(params))
        except BaseException:
            self._params, self._cached = None, None  # no point evaluated
            raise

    def _evaluate_at(self, params):
        """:meth:`_evaluate`, whatever the last point."""
        xp = self._xp
        md, o = self.width, self.d_out
        self._params = xp.asarray(params, dtype=xp.float64, copy=True)
        # the array given, to know it again (see _same_point)
        self._source = params
        self._source_version = getattr(params, "_version", None)
        self._low = xp.astype(self._params, self._dtype)  # the products' precision
        self._cached = None
        states = [] if self._keep else None
        gram = xp.zeros((md, md), dtype=xp.float64, device=self._device)
        rhs = xp.zeros((md, o), dtype=xp.float64, device=self._device)
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
        xp = self._xp
        m, d, o = self.m, self.X.shape[2], self.d_out
        if not self.factored:
            self.fixed_coefficients = flat[m * d :, ...]
            return xp.reshape(flat[: m * d, ...], (m, d, o))
        r = self.par.rank
        self.output_factors = xp.reshape(flat[: m * r, ...], (m, r, o))
        self._output_factors_low = xp.astype(self.output_factors, self._dtype)
        projection = xp.matmul(self.par.factors(self._params)[2], self.output_factors)
        if self.intercept_direction is not None:
            # the outer product g c^T
            projection[0, ...] += (
                self.intercept_direction[:, None] * flat[m * r, :][None, :]
            )
        return projection

    def _target(self, rows):
        """``sqrt(w) Y`` on a chunk, as rows ``(n, l)``: ``(c k, d_out)``."""
        y = self.Y[rows, ...]
        return self._xp.reshape(y * self.root[rows, None, None], (-1, self.d_out))

    def _map(self, function):
        """``function(rows, state)`` over the chunks, an iterator over the results
        in the chunks' order: in ``n_jobs`` threads of one BLAS thread each when
        the states are kept (the evaluation's Gram keeps the caller's threads)."""
        if self.n_jobs > 1 and self._cached is not None and len(self.slices) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.n_jobs)
            chunks = zip(self.slices, self._cached, strict=True)
            with _blas_limits(self._xp):
                yield from self._pool.map(lambda chunk: function(*chunk), chunks)
            return
        yield from (function(rows, state) for rows, state in self._states())

    def _residual_for(self, flat):
        """``sqrt(w) (A W - Y)`` as rows ``(n, l)``: ``(n k, d_out)``."""
        xp = self._xp
        out = xp.empty(
            (self.shape[0] // self.d_out, self.d_out),
            dtype=self._dtype,
            device=self._device,
        )
        flat = xp.astype(flat, self._dtype, copy=False)
        k = self.X.shape[1]
        for rows, state in self._states():
            block = slice(rows.start * k, rows.stop * k)
            out[block, ...] = state["design"] @ flat - self._target(rows)
        return out

    def _design_transpose(self, rows_out):
        """``A^T u`` for ``u`` as rows ``(n k, d_out)``: ``(width, d_out)``."""
        xp = self._xp
        rows_out = xp.astype(rows_out, self._dtype, copy=False)
        k = self.X.shape[1]
        out = xp.zeros((self.width, self.d_out), dtype=xp.float64, device=self._device)
        for part in self._map(
            lambda rows, state: (
                state["design"].T @ rows_out[rows.start * k : rows.stop * k, ...]
            )
        ):
            out += part
        return out

    def _project_out(self, rows_out, inplace=False):
        """``(I - P) u``: remove the part of ``u`` that the projections can fit
        (in ``rows_out`` itself with ``inplace``)."""
        xp = self._xp
        coef = _solve_psd(self._gram, self._design_transpose(rows_out), self._factor)
        coef = xp.astype(coef, self._dtype, copy=False)
        out = rows_out if inplace else xp.astype(rows_out, self._dtype)
        k = self.X.shape[1]

        def subtract(rows, state):
            out[rows.start * k : rows.stop * k, ...] -= state["design"] @ coef

        for _ in self._map(subtract):
            pass
        return out

    def _values(self, rows, state):
        """``X W*_i`` on a chunk: ``(c, m, k, d_out)`` (kept with the chunk's state)."""
        xp = self._xp
        values = state.get("values")
        if values is None:
            if self.factored:  # (X V_i) O_i, r columns at a time
                values = xp.matmul(
                    self.par.values(self.X[rows, ...], self._low, state["cache"]),
                    self._output_factors_low,
                )
            else:
                values = _contiguous(
                    xp,
                    _token_maps(
                        self.X[rows, ...], xp.astype(self.projection, self._dtype)
                    ),
                )
            if self._cached is not None:
                state["values"] = values
        return values

    # -- public ------------------------------------------------------------------
    def residual(self, params):
        """The weighted residual at ``params``, flat ``(n k d_out,)``."""
        self._evaluate(params)
        xp = self._xp
        return xp.astype(xp.reshape(self._residual, (-1,)), xp.float64, copy=False)

    def matvec(self, params, direction):
        """``J v``, flat ``(n k d_out,)``."""
        self._evaluate(params)
        self.n_products += 1
        xp = self._xp
        direction = xp.astype(
            to_namespace(direction, xp, self._device), self._dtype, copy=False
        )
        out = self._retry(lambda: self._matvec(direction))
        return xp.astype(xp.reshape(out, (-1,)), xp.float64, copy=False)

    def _matvec(self, direction):
        """``J v`` as rows ``(n k, d_out)``, in the products' precision."""
        xp = self._xp
        k, o = self.X.shape[1], self.d_out
        out = xp.empty((self.shape[0] // o, o), dtype=self._dtype, device=self._device)

        def chunk(rows, state):
            x = self.X[rows, ...]
            if self.factored:
                d_logits, d_values = self.par.jvp(
                    x, self._low, direction, state["cache"]
                )
            else:
                d_logits = self.par.logits_jvp(x, self._low, direction, state["cache"])
            d_patterns = _softmax_jvp(state["patterns"], d_logits)
            c, m = d_patterns.shape[:2]
            # sum_i dS_i (X W_i): one (k, m k) @ (m k, o) product a sample
            change = xp.matmul(
                xp.reshape(xp.permute_dims(d_patterns, (0, 2, 1, 3)), (c, k, m * k)),
                xp.reshape(self._values(rows, state), (c, m * k, o)),
            )  # (c, k, o)
            if self.factored:  # + sum_i S_i (X dV_i) O_i, one GEMM over heads
                moved = xp.matmul(state["patterns"], d_values)  # (c, m, k, r)
                c, m, k_, r = moved.shape
                moved = xp.reshape(
                    xp.permute_dims(moved, (0, 2, 1, 3)), (c * k_, m * r)
                )
                change += xp.reshape(
                    moved @ xp.reshape(self._output_factors_low, (m * r, o)),
                    (c, k_, o),
                )
            change *= self.root[rows, None, None]
            out[rows.start * k : rows.stop * k, ...] = xp.reshape(change, (-1, o))

        for _ in self._map(chunk):
            pass
        return self._project_out(out, inplace=True)

    def rmatvec(self, params, vector, *, orthogonal=False):
        """``J^T u``, flat ``(p,)``.

        ``orthogonal=True`` skips the projection ``(I - P)`` of ``u`` (half of a
        product's cost when ``d_out`` is large): exact when ``u`` is orthogonal
        to the design's columns, as the residual at ``W*`` and every vector that
        LSMR builds from it and from ``J v`` are (up to rounding).
        """
        self._evaluate(params)
        self.n_products += 1
        xp = self._xp
        vector = to_namespace(vector, xp, self._device)
        return self._retry(lambda: self._rmatvec(vector, orthogonal))

    def _rmatvec(self, vector, orthogonal):
        """:meth:`rmatvec` at the point evaluated."""
        xp = self._xp
        k, o = self.X.shape[1], self.d_out
        projected = xp.astype(xp.reshape(vector, (-1, o)), self._dtype, copy=False)
        if not orthogonal:
            projected = self._project_out(projected)

        def chunk(rows, state):
            x = self.X[rows, ...]
            scaled = (
                xp.reshape(
                    projected[rows.start * k : rows.stop * k, ...], (-1, 1, k, o)
                )
                * self.root[rows, None, None, None]
            )
            c, m = scaled.shape[0], self.m
            # u_l . (X W_i)_a for every head: one (m k, o) @ (o, k) product a
            # sample, the small u transposed into a copy (numpy's matmul of a
            # stack of transposed matrices misses BLAS: 10-100 times slower)
            values = xp.reshape(self._values(rows, state), (c, m * k, o))
            scaled_t = _contiguous(xp, xp.matrix_transpose(scaled[:, 0, ...]))
            d_patterns = xp.permute_dims(
                xp.reshape(xp.matmul(values, scaled_t), (c, m, k, k)), (0, 1, 3, 2)
            )
            d_logits = _softmax_jvp(state["patterns"], d_patterns)
            if not self.factored:
                return self.par.logits_vjp(x, self._low, d_logits, state["cache"])
            # the values' cotangent S_i^T (u O_i^T), the heads' O_i in one GEMM
            r = self.par.rank
            u_o = (
                xp.reshape(scaled, (c * k, o))
                @ xp.reshape(self._output_factors_low, (m * r, o)).T
            )
            u_o = xp.permute_dims(xp.reshape(u_o, (c, k, m, r)), (0, 2, 1, 3))
            d_values = xp.matmul(xp.matrix_transpose(state["patterns"]), u_o)
            return self.par.vjp(x, self._low, d_logits, d_values, state["cache"])

        grad = xp.zeros(self.par.size, dtype=xp.float64, device=self._device)
        for part in self._map(chunk):
            grad += part
        return grad


def _intercept_direction(X):
    """A token-space vector ``g`` with ``X g = 1`` on every token (a constant
    coordinate, possibly mixed by a whitening), by least squares on the tokens."""
    xp = _namespace(X)
    n_tokens = max(1, _loss._CHUNK_FLOATS // max(1, X.shape[1] * X.shape[2]))
    tokens = X[: min(n_tokens, X.shape[0]), ...]  # the standard: stop <= n
    tokens = xp.reshape(tokens, (-1, X.shape[2]))
    if is_numpy(xp):
        g = np.linalg.lstsq(tokens, np.ones(len(tokens)), rcond=None)[0]
    else:
        tokens = xp.astype(tokens, xp.float64)
        ones = xp.ones(tokens.shape[0], dtype=xp.float64, device=device(X))
        g = lstsq(xp, tokens, ones)
    if float(xp.max(xp.abs(tokens @ g - 1.0))) > 1e-8:
        raise ValueError(
            "intercept=True needs tokens with a constant coordinate (such as the "
            "[x, 1] tokens of fit_intercept): no linear map of these tokens is 1 "
            "on all of them."
        )
    return g
