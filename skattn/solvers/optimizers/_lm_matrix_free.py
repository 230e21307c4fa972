"""Matrix-free Levenberg-Marquardt for large layers: trust-region least squares on
the reduced problem, its Jacobian given only through products.

The variable-projection problem (the W_i eliminated by least squares;
:class:`~skattn.solvers.kernels._varpro.VarproProblem` evaluates its residual and
Jacobian products) is solved by trust-region steps solved by conjugate gradients
(:func:`~skattn.solvers.optimizers._trf.trf`, the one core of every least-squares
stage: the steps of scipy's ``least_squares(method="trf", tr_solver="lsmr")``,
CGLS stopped where LSMR would, written against the array namespace of the data,
every scalar on the device, so that torch or CuPy arrays stay there).  No
``(m d^2)^2`` matrix is ever formed: memory is that of a few residual vectors and
the per-sample patterns.

:func:`varpro_least_squares` runs the solver in two stages: loose steps while
the residual is large (``COARSE_UNTIL``), then steps solved to LSMR's default
tolerance for the quadratic convergence at the end.  Each stage works in the
variables of the parametrization's right preconditioner at its start (for low-rank
heads the metric of scaled gradient descent; none for full Theta_i).  With
``jacobian_dtype=numpy.float32`` the final stage's Jacobian products (nearly all of
its work) run in single precision while its residuals and eliminated coefficients
stay in double: the steps are then a little less accurate, the optimum is not.
"""

import functools
import math
import time

import joblib
import numpy as np

from ...utils._array_api import (
    device,
    einsum,
    is_numpy,
    namespace,
    to_namespace,
    to_numpy,
)
from ...utils._progress import _Silent, iteration_bar
from ...utils._validation import _normalized_weights
from ..kernels._head_gram import (
    block_preconditioner,
    full_rank_head_grams,
    gram_sequences,
)
from ..kernels._near_gauge import SlowMixing, lift_near_gauge, slow_rotary_dims
from ..kernels._parametrization import FullRank, _group_index
from ..kernels._varpro import VarproProblem, _intercept_direction
from ._trf import trf


def jacobian_operator(problem, params, *, orthogonal=False):
    """The Jacobian of ``problem`` at ``params`` as a scipy ``LinearOperator`` on
    numpy vectors (``orthogonal``: see :meth:`VarproProblem.rmatvec`); the
    solvers here use the products directly.  For a problem on another namespace
    the vectors are moved to it and back."""
    from scipy.sparse.linalg import LinearOperator

    xp = namespace(problem.X)
    where = device(problem.X)
    p = xp.asarray(to_namespace(params, xp, where, dtype=xp.float64), copy=True)

    def matvec(v):
        v = to_namespace(np.ravel(v), xp, where, dtype=xp.float64)
        return to_numpy(problem.matvec(p, v))

    def rmatvec(u):
        u = to_namespace(np.ravel(u), xp, where, dtype=xp.float64)
        return to_numpy(problem.rmatvec(p, u, orthogonal=orthogonal))

    return LinearOperator(problem.shape, matvec=matvec, rmatvec=rmatvec, dtype=float)


# Far from a minimum the trust region, not the accuracy of the Gauss-Newton step,
# limits the progress: while the residual is above COARSE_UNTIL of the targets'
# norm, each step's least-squares problem is solved only to relative
# tolerance COARSE_LSMR_TOL (its default is 1e-6); below, to the default, for the
# quadratic convergence at the end.
COARSE_UNTIL = 1e-2
COARSE_LSMR_TOL = 1e-2


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
    near_gauge="auto",
    head_blocks="auto",
    verbose=0,
    memory=None,
):
    """Minimise the reduced loss matrix-free: trust-region steps by CGLS.

    The arrays may be of any array-API namespace (numpy, torch, CuPy,
    array-api-strict): the solver runs in that of ``X``, on its device, every
    namespace by the same steps (scipy's ``least_squares``, which it replaced,
    ends at the same minimum).

    Parameters
    ----------
    X : array of shape (n, k, d)
    Y : array of shape (n, k, d_out)
    params : array of shape (p,)
        Starting parameters of ``parametrization`` (numpy or ``X``'s namespace).
    parametrization : FullRank or LowRank
    sample_weight : array of shape (n,) or None
    max_iter : int, default=100
        Residual evaluations (``max_nfev``).
    tol : float, default=1e-10
        Relative step tolerance (``xtol``); ``ftol`` and ``gtol`` are set at the
        rounding floor so the solver stops on the step or at machine precision.
    max_products : int or None
        Cap on the CGLS iterations of one step (``None``: ``min(p, 200)``).
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
    fixed_columns : array of shape (n, k, f) or None
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
    near_gauge : bool or "auto", default="auto"
        Solve the steps of rotary heads with their slow pairs' mixings as
        variables of their own (:func:`~skattn.solvers.kernels._near_gauge.
        lift_near_gauge`): without them the steps, truncated at
        ``max_products``, miss those nearly flat directions and the polish
        converges linearly.  ``"auto"``: when the parametrization has rotary
        heads with slow pairs over the window.  The lifted stages follow plain
        steps, taken while every ``PLAIN_WINDOW`` evaluations take the cost
        below ``PLAIN_PROGRESS`` of what it was and the relative residual is
        above ``LIFT_BELOW`` (far from a minimum the lift slows the polish).
        The lift is whitened once, on a share of the sequences
        (:func:`lift_sequences`).
    head_blocks : bool or "auto", default="auto"
        Solve the steps of the float64 stage in the variables of each head's
        Gauss-Newton block (:func:`~skattn.solvers.kernels._head_gram.
        block_preconditioner`, computed afresh every ``BLOCK_REFRESH``
        evaluations): a sharp head's small weights otherwise sit at the bottom
        of the spectrum, where truncated LSMR steps miss them, and the stage
        crawls.  ``"auto"``: for full ``Theta_i`` (:class:`FullRank`) of at
        most ``HEAD_BLOCK_MAX`` parameters a head, once the stage's first
        ``BLOCK_REFRESH`` evaluations have not converged (a stage that
        converges in them is as without); True: from the start.
    verbose : int, default=0
        Passed to :func:`~skattn.solvers.optimizers._trf.trf`: 2 prints one line
        per iteration.

    memory : StageMemory or None
        Keeps the run's result, each stage's end and its iterates at intervals
        (:mod:`skattn.solvers._checkpoints`): run again after an interruption,
        it goes on from the last kept one to the same result.  A lifted
        stage's iterate is gone on from only under the lift's scale it was
        kept in (the scale is kept too; one computed otherwise, by another
        version, runs the stage again).

    Returns
    -------
    params : array of shape (p,)
        In ``X``'s namespace and on its device, as ``projection``.
    projection : array of shape (m, d, d_out)
    info : dict
        ``method``, ``n_iter`` (Jacobian evaluations), ``n_coarse_iter`` (those
        with loose steps), ``n_evaluations``,
        ``n_products`` (Jacobian-vector products: the linear solver's work; the
        scipy solver this replaced also spent, and counted, one a step on a zero
        vector),
        ``loss_start``, ``loss``, ``converged``, ``stop_reason``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers.kernels._parametrization import FullRank
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 4))
    >>> p, W_hat, info = varpro_least_squares(
    ...     X, forward(X, th, W), (th + 0.05).reshape(-1), FullRank(1, 4)
    ... )
    >>> bool(np.allclose(p, th.reshape(-1), atol=1e-8)), info["converged"]
    (True, True)
    """
    if memory is None or not memory.enabled:
        memory, name = None, None
    else:
        name = memory.next_name("lm")
        found, kept = memory.take(name, lambda value: settled(value[2], max_iter))
        if found:
            return kept
    xp = namespace(X, Y)
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
    if coarse and not _same_dtype(coarse_dtype, problem.dtype):
        loose = make(dtype=coarse_dtype)
    x = to_namespace(params, xp, device(X), dtype=xp.float64)
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
    options["slow_dims"] = _slow_dims(parametrization, X.shape[1], near_gauge)
    omega = _normalized_weights(X.shape[0], to_numpy(sample_weight))
    omega = to_namespace(omega, xp, device(Y), dtype=xp.float64)
    target = math.sqrt(float(omega @ einsum(xp, "nkj,nkj->n", Y, Y)))
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

        def coarse_stage():
            x_end, result = _stage(
                xp,
                loose,
                x,
                {
                    "maxiter": max_products,
                    "atol": COARSE_LSMR_TOL,
                    "btol": COARSE_LSMR_TOL,
                },
                max_iter,
                callback=close_enough,
                keep=None if memory is None else (memory, f"{name}-coarse-iterate"),
                **options,
            )
            products = loose.n_products if loose is not problem else 0
            return x_end, int(result.njev), int(result.nfev), result.status, products

        # its end kept: a resumed run goes on to the next stage
        x, n_iter, n_evaluations, status, n_loose_products = _kept_stage(
            memory, f"{name}-coarse", coarse_stage, max_iter
        )
        n_coarse = n_iter
    else:
        n_loose_products = loose.n_products if loose is not problem else 0
    # a single-precision stage may stop on rounding: the float64 stage always follows
    finish = status in (None, -2) or loose is not problem
    loose = None  # its kept states
    products = None
    if n_evaluations < max_iter and finish:
        if not _same_dtype(jacobian_dtype, problem.dtype):
            products = make(dtype=jacobian_dtype)
        # lifted slow mixings are whitened at a stage's start: stages of
        # LIFT_REFRESH evaluations, each lifted afresh
        chunk = max_iter if options["slow_dims"] is None else LIFT_REFRESH
        # the heads' blocks from the start (True), or ("auto") where a stage of
        # BLOCK_REFRESH evaluations did not converge: a sharp head's crawl
        blocks = _head_blocks(problem, head_blocks)
        if blocks is not None:
            chunk = min(chunk, BLOCK_REFRESH)
        in_blocks = blocks if head_blocks is True else None
        part, whitening = 0, {}
        # the lift's scale, computed at the first lifted stage (a product pair a
        # lifted column: 25 min for heads of 64 on 2 cores), kept for a resumed run
        if memory is not None and options["slow_dims"] is not None:
            found, scale = memory.load(f"{name}-lift")
            if found:
                whitening["scale"], whitening["read"] = scale, True
            else:
                whitening["keep_scale"] = functools.partial(
                    _keep_scale, memory, f"{name}-lift"
                )
        steps = {"maxiter": max_products}
        if not is_numpy(xp) and options["slow_dims"] is not None:
            # a rotary polish's steps, truncated: CGLS's tests read at its end
            steps["check_every"] = max_products
        if options["slow_dims"] is not None and status is None:
            # far from a minimum the lift slows the polish: plain steps first,
            # while they make fast progress (see PLAIN_PROGRESS)
            def plain_stage():
                x_end, result = _stage(
                    xp,
                    problem,
                    x,
                    steps,
                    max_iter - n_evaluations,
                    callback=_slowing(target),
                    products=products,
                    keep=None if memory is None else (memory, f"{name}-plain-iterate"),
                    **{**options, "slow_dims": None},
                )
                return (
                    x_end,
                    int(result.njev),
                    int(result.nfev),
                    result.status,
                    float(result.cost),
                )

            # its end kept: a resumed run goes on to the lifted stages
            x, n_plain, n_plain_evaluations, status, cost = _kept_stage(
                memory, f"{name}-plain", plain_stage, max_iter - n_evaluations
            )
            n_iter += n_plain
            n_evaluations += n_plain_evaluations
            exact = stop_below is not None and (
                math.sqrt(2.0 * cost) <= stop_below * target
            )
            if status == -2 or (status > 0 and not exact):
                status = None  # slowed, or stopped short: the lifted stages go on
        while status in (None, 0, -2) and n_evaluations < max_iter:
            suffix = "" if part == 0 else f"-{part}"
            x, result = _stage(
                xp,
                problem,
                x,
                steps,
                min(chunk, max_iter - n_evaluations),
                products=products,
                keep=None if memory is None else (memory, f"{name}-iterate{suffix}"),
                whitening=whitening,
                preconditioner=in_blocks,
                **options,
            )
            in_blocks = blocks
            n_iter += int(result.njev)
            n_evaluations += int(result.nfev)
            status, part = result.status, part + 1
        if status is None:  # the plain steps spent the budget the lift was to have
            status = 0
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
        # scipy's other status (-1, improper input) does not arise for "trf"
        "stop_reason": _STATUS[status],
    }
    if memory is not None:
        memory.keep(name, (x, problem.projection, info))
    return x, problem.projection, info


def settled(info, max_iter):
    """Whether a polish stage that ended with ``info`` (a dict; the stages
    inside it too: ``stages``, ``warmup``) ends so under ``max_iter``: none
    stopped at its iteration cap, and none took more evaluations (iterations,
    where it counts no evaluations).  A kept stage of a run under another cap
    is read back where this holds.

    Examples
    --------
    >>> from skattn.solvers.optimizers._lm_matrix_free import settled
    >>> done = {"stop_reason": "gradient", "n_evaluations": 40}
    >>> settled(done, 100), settled(done, 30)
    (True, False)
    >>> settled({"stop_reason": "max_iter", "n_evaluations": 100}, 300)
    False
    """
    if isinstance(info, dict):
        if info.get("stop_reason") == "max_iter":
            return False
        taken = info.get("n_evaluations", info.get("n_iter", 0))
        if "stop_reason" in info and taken > max_iter:
            return False
        return all(settled(value, max_iter) for value in info.values())
    if isinstance(info, (list, tuple)):
        return all(settled(value, max_iter) for value in info)
    return True


# Evaluations of a stage whose slow rotary mixings are lifted
# (:func:`~skattn.solvers.kernels._near_gauge.lift_near_gauge`) before they
# are lifted again at its end: the lift is whitened at the stage's start.
LIFT_REFRESH = 8

# The lift is whitened on the fewest sequences whose tokens are this many times
# the eliminated design's columns (:func:`lift_sequences`), and at least on
# LIFT_MIN_SEQUENCES of them.
LIFT_TOKENS_PER_COLUMN = 12
LIFT_MIN_SEQUENCES = 8

# A rotary polish takes plain steps (the slow mixings not lifted) while every
# PLAIN_WINDOW evaluations take the cost below PLAIN_PROGRESS of what it was,
# and the relative residual is above LIFT_BELOW; then its stages are lifted.
# Far from a minimum the lift slows the polish: the planted layer of 8 query
# heads sharing 2 key heads at base 10^6 (d = 64, head dimension 16, k = 32,
# 256 sequences), from its search's end (1.7 %), 16 evaluations took the cost
# 0.97 -> 0.35 lifted, 0.97 -> 0.029 plain (benchmarks/HISTORY.md); the lift is
# for the slow pairs' crawl near a minimum, a few per cent an evaluation.
# PLAIN_PROGRESS 0.5 (halve the cost every 4 evaluations) cut the plain steps
# short on tiny checkpoints trained at 10^6: Qwen2's layer 0 left them after
# 11 evaluations at 0.33 of the search's cost and crawled lifted (0.23 after
# 59); at 0.9 its plain steps went on to 4.1e-3 in 57, the lift and one
# reflection then to 1.2e-15 held out; layer 1 stalled lifted at 1.7e-3 where
# longer plain steps reach 1.4e-4 (eighth session of 2026-11-29).
PLAIN_WINDOW = 4
PLAIN_PROGRESS = 0.9
LIFT_BELOW = 1e-3


def _kept_stage(memory, name, compute, max_nfev):
    """``compute()``, kept in ``memory`` as ``name`` (read back where it was
    kept) when there is a memory.  ``compute()`` returns ``(x, njev, nfev,
    status, ...)`` of a run of at most ``max_nfev`` evaluations: a kept run under
    another iteration cap is read back where it stopped before either cap."""

    def ended(value):
        return value[3] != 0 and value[2] <= max_nfev

    return compute() if memory is None else memory.stage(name, compute, ended)


def _slowing(target):
    """A :func:`trf` callback that stops plain steps (``StopIteration``) where
    the slow mixings' lift should take over (see ``PLAIN_PROGRESS``)."""
    marks = {"cost": None, "nfev": 0}

    def check(intermediate_result):
        cost, nfev = float(intermediate_result.cost), int(intermediate_result.nfev)
        if math.sqrt(2.0 * cost) <= LIFT_BELOW * target:
            raise StopIteration
        if marks["cost"] is None:
            marks.update(cost=cost, nfev=nfev)
        elif nfev - marks["nfev"] >= PLAIN_WINDOW:
            if cost > PLAIN_PROGRESS * marks["cost"]:
                raise StopIteration
            marks.update(cost=cost, nfev=nfev)

    return check


def _stage(
    xp,
    problem,
    params,
    tr_options,
    max_nfev,
    callback=None,
    products=None,
    keep=None,
    slow_dims=None,
    whitening=None,
    preconditioner=None,
    **options,
):
    """One run of :func:`~skattn.solvers.optimizers._trf.trf` (CGLS steps) from
    ``params``.

    In the variables ``z`` of the parametrization's right preconditioner ``M``
    at ``params`` (``p = M z``; see ``LowRank.preconditioner``), or in ``p``
    itself when it has none: the Jacobian in ``z`` is ``J M``, its products
    ``J (M v)`` and ``M^T (J^T u)``.  The Jacobian products come from
    ``products`` (the same problem in another precision) when given, else from
    ``problem``, which gives the residuals.  Returns the final ``p`` and the
    solver's result.  ``keep=(memory, name)`` keeps the iterates at intervals
    (``memory.iterate_interval`` seconds) and goes on from a kept one.
    ``slow_dims``: the rotary heads' slow dimensions whose mixings are lifted
    into variables of their own (:func:`~skattn.solvers.kernels._near_gauge.
    lift_near_gauge`), or None; ``whitening``: a dict that keeps the lift's
    scale and the tokens' constant direction from one stage to the next
    (computed where it has none; then its ``keep_scale``, if any, is called
    with the scale).  ``preconditioner``: a function of ``params``
    that gives ``M`` in place of the parametrization's (see
    :func:`_head_blocks`).
    """
    products = problem if products is None else products

    def variables(params):
        """``params`` (regauged), the preconditioner and the lift there."""
        if problem.factored:  # balance V_i against the eliminated O_i
            problem.residual(params)
            params = problem.par.regauge(params, problem.output_factors)
        if preconditioner is None:
            precond = problem.par.preconditioner(params)
        else:
            precond = preconditioner(params)
        lift = None
        if slow_dims is not None:
            lift = _lifted(problem, products, params, precond, slow_dims, whitening)
        return params, precond, lift

    resume = kept = None
    start = params
    if keep is not None:
        found, kept = keep[0].load(keep[1])
        if found and kept["state"]["nfev"] <= max_nfev:
            # an interrupted run's iterate, and the stage's start; one that
            # stopped at another run's cap goes on to this one's
            start, resume = kept["start"], dict(kept["state"])
            if resume["status"] == 0 and resume["nfev"] < max_nfev:
                resume["status"] = None
    at, precond, lift = variables(start)
    lifted_with = None  # the fingerprint of the lift's scale, where kept
    if lift is not None and keep is not None:
        if "fingerprint" not in whitening:
            whitening["fingerprint"] = joblib.hash(to_numpy(lift.scale))
        lifted_with = whitening["fingerprint"]
    kept_with = None if kept is None else kept.get("lift")
    if kept_with is None and lift is not None and whitening.get("read"):
        # kept before iterates carried their scale's fingerprint: under the
        # scale kept with them (the one their run computed or read)
        kept_with = lifted_with
    if resume is not None and kept_with != lifted_with:
        # lifted variables of another scale (another version's lift, or one
        # computed again otherwise): the kept iterate is another point here,
        # and the stage runs again from where this run got to
        resume, start = None, params
        at, precond, lift = variables(start)
    params = at
    if keep is not None:
        if resume is not None:
            keep[0].reused.append(keep[1])
        callback = _keeping(keep, start, callback, lifted_with)
    callback = _ticking(iteration_bar(), callback)
    if lift is not None:
        point, push, pull, z0 = lift.point, lift.push, lift.pull, lift.start(params)
    else:
        if precond is None:
            apply = transpose = _identity
            z0 = params
        else:
            apply, transpose, inverse = precond
            z0 = inverse(params)
        last = [None, None]  # (z, p): the point of the last residual

        def point(z):
            """``p = M z``: the same array for the same ``z``, so that the problem
            knows the point of its last residual when the Jacobian there is asked
            for (trf passes the accepted ``x_new`` itself to both)."""
            if z is not last[0]:
                last[0], last[1] = z, apply(z)
            return last[1]

        def push(z, v):
            return apply(v)

        def pull(z, g):
            return transpose(g)

    def residual(z):
        return problem.residual(point(z))

    def jacobian(z):
        p = point(z)  # the problems keep their own copy of the point

        # CGLS's residuals stay orthogonal to the design (they are built from
        # the residual at W* and from J v): the cheaper adjoint is exact there
        def matvec(v):
            return products.matvec(p, push(z, v))

        def rmatvec(u):
            return pull(z, products.rmatvec(p, u, orthogonal=True))

        return matvec, rmatvec

    result = trf(
        xp,
        residual,
        jacobian,
        z0,
        tr_options=tr_options,
        max_nfev=max_nfev,
        callback=callback,
        resume=resume,
        **options,
    )
    return point(result.x), result


# Most parameters a head's Gauss-Newton block has for head_blocks="auto" (its
# factor and the factor's inverse cost O(size^3) flops, size^2 doubles each).
HEAD_BLOCK_MAX = 2048
# Evaluations of a stage in the heads' blocks before they are computed again (a
# sharp head's small weights, which set its block's smallest directions, move
# by orders of magnitude as they converge), and of the first stage before
# head_blocks="auto" turns to them (quadratic convergence from COARSE_UNTIL
# takes fewer).
BLOCK_REFRESH = 8


def _head_blocks(problem, head_blocks):
    """The function of ``params`` that gives the heads' block preconditioner
    (:func:`~skattn.solvers.kernels._head_gram.block_preconditioner` of
    :func:`~skattn.solvers.kernels._head_gram.full_rank_head_grams` on the
    sequences of :func:`~skattn.solvers.kernels._head_gram.gram_sequences`,
    the ``W_i`` eliminated at ``params``), or None where ``head_blocks`` says
    no or, with ``"auto"``, the parametrization is not full ``Theta_i`` of at
    most ``HEAD_BLOCK_MAX`` parameters a head."""
    par = problem.par
    if head_blocks is False or type(par) is not FullRank or problem.factored:
        return None
    if head_blocks == "auto" and par.n_features**2 > HEAD_BLOCK_MAX:
        return None
    xp = namespace(problem.X)
    n, k, d = problem.X.shape
    rows = to_namespace(gram_sequences(n, k, d), xp, device(problem.X))
    X = xp.take(problem.X, rows, axis=0)
    weights = xp.take(problem.root, rows, axis=0) ** 2

    def preconditioner(params):
        problem.residual(params)  # the W_i eliminated there
        grams = full_rank_head_grams(
            X, par.attention(params), problem.projection, weights
        )
        try:
            return block_preconditioner(grams)
        except np.linalg.LinAlgError:  # a block not finite: the plain variables
            return par.preconditioner(params)

    return preconditioner


def _slow_dims(parametrization, n_tokens, near_gauge):
    """The slow rotary dimensions to lift (``near_gauge``), or None."""
    theta = getattr(parametrization, "rope_theta", None)
    if near_gauge is False or theta is None:
        return None
    dims = slow_rotary_dims(
        parametrization.rank, theta, parametrization.rope_layout, n_tokens
    )
    return dims if len(dims) else None


def _lifted(problem, products, params, precond, slow_dims, whitening=None):
    """The solver's variables with the slow dimensions' mixings lifted
    (:class:`~skattn.solvers.kernels._near_gauge.NearGaugeLift`) at ``params``,
    or None when all of them are exact gauge."""
    par = problem.par
    whitening = {} if whitening is None else whitening
    if "constant" not in whitening:  # the tokens' constant coordinate, if any
        try:
            whitening["constant"] = _intercept_direction(problem.X)
        except ValueError:
            whitening["constant"] = None
    orbit = SlowMixing(
        par.n_heads,
        par.n_kv_heads,
        par.n_features,
        par.rank,
        slow_dims,
        _group_index(par),
        params,
        constant=whitening["constant"],
    )
    # the Gram matrices from a share of the sequences (unless kept already)
    lifting = products
    if whitening.get("scale") is None:
        n, k = problem.X.shape[:2]
        lifting = products.subset(lift_sequences(n, k, problem.width))
    lift = lift_near_gauge(
        lambda v: lifting.matvec(params, v),
        lambda u: lifting.rmatvec(params, u, orthogonal=True),
        params,
        precond,
        orbit,
        scale=whitening.get("scale"),
        random_state=0,
    )
    if lift is not None:
        if whitening.get("scale") is None and "keep_scale" in whitening:
            whitening.pop("keep_scale")(lift.scale)
        whitening["scale"] = lift.scale
    return lift


def lift_sequences(n_samples, n_tokens, n_columns):
    """How many of a polish's ``n_samples`` sequences of ``n_tokens`` tokens the
    slow mixings' lift is whitened on
    (:func:`~skattn.solvers.kernels._near_gauge.lift_near_gauge`), the
    eliminated design having ``n_columns`` columns: the fewest whose tokens are
    ``LIFT_TOKENS_PER_COLUMN`` times the columns, at least
    ``LIFT_MIN_SEQUENCES``, at most all.

    The lift costs a product pair a lifted column (19 404 of them for 2 key
    heads of 128 at base 5e5 over 32 tokens, each a pass over the sequences),
    and its scale is a preconditioner, not part of the model: the Gram
    matrices of a share of the sequences whiten the mixings nearly as well
    where the share pins the eliminated projections well.  Measured (planted
    layers, base 5e5, the slow pairs off): 4 query heads sharing 2 key heads
    of 16, d = 64, k = 32, 160 sequences: 14 evaluations to 1.3e-15 with the
    Gram of all 160, of 40 or of 10 (of 4, fewer tokens than the design's 256
    columns: crawling at 2.5e-4); heads of 64, d = 256, k = 64, 192
    sequences: the Gram of 64 (4 tokens a column) built in 9.5 minutes on 2
    cores instead of about 25, but its first two lifted stages took the cost
    from 9.0e-3 to 1.7e-3 where those of all 192 took it to 5.8e-4: hence 12
    tokens a column (all 192 there).

    Examples
    --------
    >>> lift_sequences(500, 32, 4 * 64)  # 4 heads' full W_i at d = 64
    96
    >>> lift_sequences(20, 32, 4 * 64), lift_sequences(500, 64, 16)
    (20, 8)
    >>> lift_sequences(2048, 32, 8 * 128 + 1)  # a Llama-shaped layer's polish
    385
    """
    wanted = math.ceil(LIFT_TOKENS_PER_COLUMN * n_columns / n_tokens)
    return min(int(n_samples), max(LIFT_MIN_SEQUENCES, wanted))


def _keep_scale(memory, name, scale):
    """Keep a lift's scale in ``memory`` as ``name``, for a resumed run."""
    memory.save(name, to_numpy(scale))


def _ticking(bar, callback):
    """``callback`` that also moves the joint polish's bar by an iteration
    (with the cost); ``callback`` itself where no bar is shown."""
    if isinstance(bar, _Silent):
        return callback

    def ticking(intermediate):
        bar.update(1)
        bar.set_postfix_str(f"loss {intermediate.cost:.3g}")
        if callback is not None:
            callback(intermediate)

    return ticking


def _keeping(keep, start, callback, lifted_with=None):
    """``callback`` that also keeps the iterate (with the stage's ``start`` and
    the fingerprint of the lift's scale its variables are in, ``lifted_with``)
    every ``memory.iterate_interval`` seconds; an iterate at which ``callback``
    stops the run is not kept (a resumed run reaches that stop again)."""
    memory, name = keep
    last = [time.monotonic()]

    def keeping(intermediate):
        if callback is not None:
            callback(intermediate)
        if time.monotonic() - last[0] >= memory.iterate_interval:
            kept = {"start": start, "state": intermediate["state"]}
            if lifted_with is not None:
                kept["lift"] = lifted_with
            memory.save(name, kept)
            last[0] = time.monotonic()

    return keeping


def _identity(v):
    """The right preconditioner of a parametrization that has none."""
    return v


def _same_dtype(requested, dtype):
    """Whether ``requested`` (a numpy dtype, as the public keywords take) is the
    problem's ``dtype`` (numpy's or another namespace's), compared by name."""
    return _dtype_name(requested) == _dtype_name(dtype)


def _dtype_name(dtype):
    """``"float32"`` for numpy's, torch's or array-api-strict's float32."""
    try:
        return np.dtype(dtype).name
    except TypeError:  # torch.float32, array_api_strict.float32
        return str(dtype).rsplit(".", 1)[-1]


# trf's status (scipy's least_squares') -> stop_reason; _START: the start fitted already
_START = 5
_STATUS = {
    _START: "start",
    # the loose stage reached its residual (StopIteration) on the last
    # evaluation allowed: no float64 stage was left to run
    -2: "max_iter",
    0: "max_iter",
    1: "gradient",
    2: "no_decrease",
    3: "step",
    4: "no_decrease",
}
