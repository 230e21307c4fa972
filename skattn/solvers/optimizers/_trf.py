"""Trust-region least squares without bounds, matrix-free, in any array
namespace, for one problem or a batch of independent ones: the one core of every
least-squares stage.

:func:`trust_region_steps` minimises ``1/2 ||r_i(x_i)||^2`` for ``h >= 1``
problems at once (a batch of independent heads, or one problem: the joint polish,
the decoder polish, a head's logit fit), each by the steps of scipy's
``least_squares(method="trf", tr_solver="lsmr", x_scale=1.0)`` taken alone:

1. ``g = J^T f``; stop when ``||g||_inf < gtol``;
2. the Gauss-Newton step ``gn`` by CGLS (:func:`~._cgls.batched_cgls`, stopped
   where LSMR would), damped by the curvature of the loss along ``-g`` within
   the trust region (scipy's ``regularize``);
3. an orthonormal basis ``S`` of ``(g, gn)``, and the 2-D trust-region problem
   ``min 1/2 p^T S^T J^T J S p + g^T S p``, ``||p|| <= Delta``;
4. the trial point ``x + S p``; the ratio of actual to predicted decrease sets
   the radius (scipy's ``update_tr_radius``), and ``ftol``/``xtol`` stop the
   problem (``check_termination``); a rejected trial retries with a smaller
   radius in the same 2-D span, without a new solve.

Every scalar is an ``(h,)`` array on the device: the rules (:func:`radius_update`,
:func:`termination`, :func:`minimize_quadratic_1d`) and the 2-D subproblem
(:func:`_solve_trust_region_2d_batch`) are elementwise in the namespace.  The
host reads once a trial (which problems took their step, which stopped, their
costs), once at the start (the costs: a start whose residuals are not finite is
refused), and in CGLS every ``check_every`` iterations: no read an iteration
beyond the stopping test.  A problem that has stopped leaves the batch when the
problem object can shrink (``leave``), so that the products shrink with it.

:func:`trf` is the one-problem front (``h = 1``) with scipy's ``OptimizeResult``,
callbacks and resumable states.  Before the one core, :func:`trf` ran LSMR with
the scalars on the host (scipy's run to the bit on numpy) and the batched heads a
copy of the same loop with CGLS; the tests hold :func:`trf` to scipy's
documented outcome (the same status, the same minimum, the budget of
evaluations), not to its iterates.
"""

import math

import numpy as np
from scipy.optimize import OptimizeResult

from ...utils._array_api import device, to_numpy
from ._cgls import _column, _norms2, _safe, batched_cgls

__all__ = [
    "TERMINATION_MESSAGES",
    "minimize_quadratic_1d",
    "radius_update",
    "termination",
    "trf",
    "trust_region_steps",
]

# status -> message, as scipy's least_squares
TERMINATION_MESSAGES = {
    -2: "Stopped because `callback` function raised `StopIteration`.",
    0: "The maximum number of function evaluations is exceeded.",
    1: "`gtol` termination condition is satisfied.",
    2: "`ftol` termination condition is satisfied.",
    3: "`xtol` termination condition is satisfied.",
    4: "Both `ftol` and `xtol` termination conditions are satisfied.",
}


# Angles of the grid from which the boundary minimum of the 2-D subproblem is
# sought, and the (clipped) Newton steps taken from each of them.
_ANGLES = 32
_NEWTON_STEPS = 8
_TINY = float(np.finfo(float).tiny)


def minimize_quadratic_1d(xp, a, b, upper):
    """Minimum value of ``a t^2 + b t`` over ``0 <= t <= upper`` (scipy's
    ``minimize_quadratic_1d`` with ``lb = 0``, ``c = 0``), elementwise in ``xp``
    (as :func:`radius_update`): at an end or at the extremum, NaN where any
    candidate is (as ``numpy.argmin``'s first NaN), zeros as ``+0.0``.

    Examples
    --------
    >>> import numpy as np
    >>> minimize_quadratic_1d(np, np.array([1.0, 1.0, 0.0]),
    ...     np.array([-2.0, 1.0, -1.0]), np.array([3.0, 3.0, 2.0])).tolist()
    [-1.0, 0.0, -2.0]
    """
    extremum = -0.5 * b / xp.where(a == 0, 1.0, a)
    inner = (a != 0) & (extremum > 0) & (extremum < upper)
    at_zero = 0.0 * (a * 0.0 + b) + 0.0
    at_end = upper * (a * upper + b) + 0.0
    at_extremum = xp.where(inner, extremum * (a * extremum + b) + 0.0, at_zero)
    return xp.minimum(xp.minimum(at_zero, at_end), at_extremum)


def _solve_trust_region_2d_batch(xp, B, g, Delta):
    """:func:`_solve_trust_region_2d` for ``h`` problems at once in ``xp``
    (``B`` ``(h, 2, 2)``, ``g`` ``(h, 2)``, ``Delta`` ``(h,)``, all on the
    device), without a host read: the Newton step when ``B`` is positive
    definite and the step is inside the radius, else the minimum on the circle
    ``p = Delta (cos t, sin t)``, found from a grid of ``_ANGLES`` angles by
    ``_NEWTON_STEPS`` Newton steps on the angle from each (each at most the grid's
    spacing, towards lower values), the best of them and of the grid taken.  It
    agrees with scipy's roots of the quartic to rounding.  Returns ``(h, 2)``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import namespace
    >>> B = np.array([[[2.0, 0.0], [0.0, -1.0]], [[3.0, 1.0], [1.0, 2.0]]])
    >>> g, Delta = np.array([[1.0, 1.0], [0.5, -0.2]]), np.array([1.0, 2.0])
    >>> p = _solve_trust_region_2d_batch(namespace(B), B, g, Delta)
    >>> np.round(p, 6).tolist()  # on the circle, then Newton's step inside
    [[-0.248001, -0.96876], [-0.24, 0.22]]
    """
    a, b, c = B[:, 0, 0], B[:, 0, 1], B[:, 1, 1]
    g0, g1 = g[:, 0], g[:, 1]
    determinant = a * c - b * b
    definite = (a > 0) & (determinant > 0)
    safe = xp.where(definite, determinant, 1.0)
    newton = xp.stack([b * g1 - c * g0, b * g0 - a * g1], axis=1) / safe[:, None]
    inside = definite & (xp.sum(newton * newton, axis=1) <= Delta**2)
    # phi(t) = 1/2 Delta^2 (a cos^2 + 2 b cos sin + c sin^2) + Delta (g0 cos + g1 sin)
    # and its first two derivatives, as [sin 2t, cos 2t, sin t, cos t] @ coefficients
    half, square = 0.5 * (a - c), Delta**2
    coefficients = xp.stack(
        [
            xp.stack([-square * half, square * b, -Delta * g0, Delta * g1], axis=1),
            xp.stack(
                [-2 * square * b, -2 * square * half, -Delta * g1, -Delta * g0], axis=1
            ),
        ],
        axis=2,
    )  # (h, 4, 2)
    spacing = 2 * math.pi / _ANGLES
    grid = xp.arange(_ANGLES, dtype=B.dtype, device=device(g)) * spacing
    start = xp.zeros((B.shape[0], 1), dtype=B.dtype, device=device(g)) + grid
    angles = start
    for _ in range(_NEWTON_STEPS):
        sine, cosine = xp.sin(angles), xp.cos(angles)
        features = xp.stack(
            [2 * sine * cosine, cosine * cosine - sine * sine, sine, cosine], axis=2
        )
        derivatives = features @ coefficients  # (h, angles, 2)
        slope, curvature = derivatives[..., 0], derivatives[..., 1]
        # a Newton step where phi is convex, a gradient step of the grid's
        # spacing elsewhere; never longer than the spacing
        move = slope / xp.clip(xp.abs(curvature), min=_TINY)
        angles = angles - xp.clip(move, min=-spacing, max=spacing)
    candidates = xp.concat([start, angles], axis=1)  # (h, 2 angles)
    points = Delta[:, None, None] * xp.stack(
        [xp.cos(candidates), xp.sin(candidates)], axis=1
    )  # (h, 2, 2 angles)
    values = 0.5 * xp.sum(points * (B @ points), axis=1) + xp.sum(
        g[:, :, None] * points, axis=1
    )
    best = xp.argmin(values, axis=1)
    count = values.shape[1]
    chosen = xp.arange(count, device=device(g))[None, :] == best[:, None]
    boundary = xp.sum(points * xp.astype(chosen, points.dtype)[:, None, :], axis=2)
    return xp.where(inside[:, None], newton, boundary)


def radius_update(xp, Delta, actual, predicted, step_norm):
    """scipy's ``update_tr_radius``, elementwise in ``xp`` (the one rule of
    :func:`trf`, on host floats as 0-d numpy arrays, and of the batched heads'
    solver, on ``(h,)`` arrays on a device): the ratio of actual to predicted
    reduction (1 where both are 0, 0 where the prediction is not positive);
    the new radius a quarter of the step below ratio 1/4, doubled above 3/4
    when the step reached the boundary (``> 0.95 Delta``).  Returns ``(Delta,
    ratio)``.

    Examples
    --------
    >>> import numpy as np
    >>> Delta, ratio = radius_update(np, np.array([1.0, 1.0, 1.0]),
    ...     np.array([0.1, 0.9, 0.0]), np.array([1.0, 1.0, 0.0]),
    ...     np.array([0.5, 0.99, 0.2]))
    >>> Delta.tolist(), ratio.tolist()
    ([0.125, 2.0, 1.0], [0.1, 0.9, 1.0])
    """
    ratio = xp.where(
        predicted > 0,
        actual / xp.where(predicted == 0, 1.0, predicted),
        xp.astype((predicted == 0) & (actual == 0), predicted.dtype),
    )
    bound_hit = step_norm > 0.95 * Delta
    radius = xp.where(
        ratio < 0.25,
        0.25 * step_norm,
        xp.where((ratio > 0.75) & bound_hit, 2.0 * Delta, Delta),
    )
    return radius, ratio


def termination(xp, actual, cost, step_norm, x_norm, ratio, ftol, xtol):
    """scipy's ``check_termination``, elementwise in ``xp`` (as
    :func:`radius_update`): 2 ``ftol`` (a relative decrease below ``ftol`` with
    a good step), 3 ``xtol`` (``||dx|| < xtol (xtol + ||x||)``), 4 both, -1
    neither; an ``int64`` array.

    Examples
    --------
    >>> import numpy as np
    >>> termination(np, np.array([1e-12, 1.0]), np.array([1.0, 1.0]),
    ...     np.array([1e-12, 1.0]), np.array([1.0, 1.0]),
    ...     np.array([1.0, 1.0]), 1e-8, 1e-8).tolist()
    [4, -1]
    """
    ftol_ok = (actual < ftol * cost) & (ratio > 0.25)
    xtol_ok = step_norm < xtol * (xtol + x_norm)
    code = xp.zeros_like(ftol_ok, dtype=xp.int64) - 1
    code = xp.where(ftol_ok, 2, code)
    code = xp.where(xtol_ok & ftol_ok, 4, code)
    return xp.where((code < 0) & xtol_ok, 3, code)


def _print_header():
    print(
        "{:^15}{:^15}{:^15}{:^15}{:^15}{:^15}".format(
            "Iteration",
            "Total nfev",
            "Cost",
            "Cost reduction",
            "Step norm",
            "Optimality",
        )
    )


def _print_iteration(iteration, nfev, cost, reduction, step_norm, optimality):
    reduction = " " * 15 if reduction is None else f"{reduction:^15.2e}"
    step_norm = " " * 15 if step_norm is None else f"{step_norm:^15.2e}"
    print(
        f"{iteration:^15}{nfev:^15}{cost:^15.4e}{reduction}{step_norm}"
        f"{optimality:^15.2e}"
    )


def trial_errors():
    """numpy's floating-point errors left unsaid at a trial point: a step too
    long overflows the logits, and the solver rejects its non-finite loss."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


def _regularization(xp, matvec, g, Delta):
    """scipy's ``regularize`` damping of each problem's Gauss-Newton step:
    ``-min_{0 <= t <= Delta / ||g||} (a t^2 + b t) / Delta^2`` with ``a = ||J
    g||^2 / 2``, ``b = -||g||^2``, the loss's decrease along ``-g`` within the
    trust region; ``(h,)``."""
    v = matvec(-g)
    a = 0.5 * _norms2(xp, v)
    gg = _norms2(xp, g)
    upper = Delta / xp.sqrt(_safe(xp, gg))
    return -minimize_quadratic_1d(xp, a, -gg, upper) / (Delta * Delta)


def _subspace(xp, matvec, g, gn):
    """An orthonormal basis ``S`` ``(h, p, 2)`` of each problem's ``(g, gn)``
    (Gram-Schmidt; a second column of zeros where ``gn`` is along ``g``), and
    the 2-D problem there: ``B_S = (J S)^T J S`` ``(h, 2, 2)``, ``g_S = S^T g``
    ``(h, 2)``."""
    first = g / _column(xp, xp.sqrt(_safe(xp, _norms2(xp, g))))
    other = gn - _column(xp, xp.sum(first * gn, axis=1)) * first
    size = xp.sqrt(_norms2(xp, other))
    scale = xp.where(size > 1e-12 * xp.sqrt(_norms2(xp, gn)), size, xp.inf)
    second = other / _column(xp, scale)
    S = xp.stack([first, second], axis=2)
    JS = xp.stack([matvec(first), matvec(second)], axis=2)  # (h, N, 2)
    B_S = xp.matrix_transpose(JS) @ JS
    g_S = xp.stack([xp.sum(first * g, axis=1), xp.sum(second * g, axis=1)], axis=1)
    return S, B_S, g_S


def trust_region_steps(
    xp,
    problem,
    x0,
    *,
    ftol=1e-8,
    xtol=1e-8,
    gtol=1e-8,
    max_nfev=None,
    inner_maxiter=None,
    inner_atol=1e-6,
    inner_btol=1e-6,
    damp=0.0,
    regularize=True,
    check_every=8,
    callback=None,
    resume=None,
    verbose=0,
):
    """Minimise ``1/2 ||r_i(x_i)||^2`` for every problem ``i`` of ``problem``,
    each by its own trust region, steps, acceptance and stopping (the steps of
    the module's docstring).

    Parameters
    ----------
    xp : namespace
    problem : object
        ``residual(x)``: ``(h, p) -> (h, N)``, the residuals at a trial point
        (the problem may keep it as its current point); ``products(x,
        current)``: the Jacobians at ``x``, an accepted point, as ``(matvec,
        rmatvec)``, ``(h, p) -> (h, N)`` and back (``current``: ``x`` is the
        last point given to ``residual``, or the one ``finished`` left);
        ``finished(positions, x, current)``: the positions (host
        integers) that stop, at the accepted point ``x`` of every problem still
        in (to record what the problem holds at their end; the problem is at
        ``x`` afterwards), and ``leave(keep)``: only the positions ``keep`` go
        on (the problem's rows shrink with every array here).
    x0 : array of shape (h, p)
    ftol, xtol, gtol : float
        scipy's tolerances: relative decrease of the cost (with a good step),
        relative step ``||dx|| < xtol (xtol + ||x||)``, ``||g||_inf < gtol``.
    max_nfev : int or None
        Residual evaluations per problem, the start's included (``None``:
        ``100 p``).
    inner_maxiter, inner_atol, inner_btol : int or None, float, float
        CGLS's iterations a step (``None``: ``min(N, p)``, LSMR's) and LSMR's
        stopping tolerances, which it applies.
    damp : float, default=0.0
        A fixed damping of every step, besides ``regularize``'s.
    regularize : bool, default=True
        scipy's damping by the loss's curvature along the gradient.
    check_every : int, default=8
        CGLS iterations between the host's looks.
    callback : callable or None
        With ``h = 1`` only: ``callback(intermediate_result)`` after each
        accepted step, with ``x``, ``fun``, ``nit``, ``nfev``, ``cost`` and
        ``state`` (what ``resume`` takes); ``StopIteration`` stops the run
        (status -2).
    resume : dict or None
        With ``h = 1`` only: an intermediate result's ``state``; the run goes on
        from that accepted step as the uninterrupted run did (``x0`` ignored).
    verbose : int, default=0
        With ``h = 1``: 1 the termination message, 2 also a line an accepted
        step.

    Returns
    -------
    dict
        Per problem (lists): ``x`` and ``fun`` (rows in ``xp``), ``cost``,
        ``status`` (-2 callback, 0 ``max_nfev``, 1 ``gtol``, 2 ``ftol``, 3
        ``xtol``, 4 both), ``nfev``, ``njev`` (accepted steps plus one),
        ``optimality`` (``||g||_inf`` at the last Jacobian), ``n_nonfinite``
        (trials whose residuals overflowed: rejected, the radius cut to a
        quarter of the step, without a numpy ``RuntimeWarning``); and
        ``host_reads``, ``inner_iterations`` (CGLS iterations, all steps).

    Raises
    ------
    ValueError
        When the residuals at ``x0`` are not finite.
    """
    counter = {"reads": 0}
    ftol, xtol, gtol, damp = float(ftol), float(xtol), float(gtol), float(damp)
    z = xp.asarray(x0 if resume is None else resume["x"], dtype=xp.float64, copy=True)
    if resume is not None and z.ndim == 1:
        z = z[None, :]
    h0, n = z.shape
    one = callback is not None or resume is not None or verbose
    if one and h0 != 1:
        raise ValueError("callback, resume and verbose are for one problem (h = 1)")
    if max_nfev is None:
        max_nfev = 100 * n
    where = device(z)
    f = problem.residual(z)
    if inner_maxiter is None:
        inner_maxiter = min(f.shape[1], n)
    cost = 0.5 * _norms2(xp, f)
    # one read: the start's costs (non-finite where a residual is, or where
    # finite residuals overflow the sum: then read the residuals too)
    counter["reads"] += 1
    start = np.asarray(to_numpy(cost), dtype=np.float64)
    if not np.all(np.isfinite(start)) and not bool(xp.all(xp.isfinite(f))):
        raise ValueError("Residuals are not finite in the initial point.")
    host_cost = [float(c) for c in start]
    initial_cost = host_cost[0] if resume is None else resume["initial_cost"]
    alive = list(range(h0))  # the problems still in: host positions
    n_eval, n_iter, n_nonfinite = [1] * h0, [1] * h0, [0] * h0
    status = [None] * h0
    final = {key: [None] * h0 for key in ("x", "fun", "cost", "optimality")}
    nit = 0
    Delta = xp.sqrt(_norms2(xp, z))
    Delta = xp.where(Delta == 0, 1.0, Delta)
    if resume is not None:  # where the interrupted run stood after a step
        Delta = xp.full((1,), float(resume["Delta"]), dtype=xp.float64, device=where)
        n_eval, n_iter, nit = [resume["nfev"]], [resume["njev"]], resume["nit"]

    def outcome(status, inner_iterations):
        return {
            **final,
            "status": status,
            "nfev": n_eval,
            "njev": n_iter,
            "n_nonfinite": n_nonfinite,
            "host_reads": counter["reads"],
            "inner_iterations": inner_iterations,
        }

    if resume is not None and resume.get("status") is not None:
        stopped = resume["status"]  # the interrupted run stopped at that step
    elif min(n_eval) >= max_nfev:
        stopped = 0  # no evaluation left for a trial
    else:
        stopped = None
    if stopped is not None:
        final.update(
            x=[z[j, ...] for j in range(h0)],
            fun=[f[j, ...] for j in range(h0)],
            cost=host_cost,
            optimality=[math.nan] * h0,
        )
        problem.finished(list(range(h0)), z, True)
        return outcome([stopped] * h0, 0)
    matvec, rmatvec = problem.products(z, True)
    g = rmatvec(f)
    g_max = xp.max(xp.abs(g), axis=1)
    fresh = xp.ones(Delta.shape, dtype=xp.bool, device=where)  # a new Jacobian
    S = B_S = g_S = None
    # the inner solve's first check where the last one stopped (a resumed run
    # too: its steps are the uninterrupted run's)
    last_itn = None if resume is None else resume.get("last_itn")
    inner_total = 0
    any_fresh = True  # (on the host) some problem has a new Jacobian
    if verbose == 2:
        _print_header()
    while True:
        # the problems with a new Jacobian: their gradient test and 2-D problem
        g_ok = fresh & (g_max < gtol)
        if any_fresh:
            reg = _regularization(xp, matvec, g, Delta) if regularize else 0.0 * Delta
            gn, _, itn = batched_cgls(
                xp,
                matvec,
                rmatvec,
                f,
                xp.sqrt(xp.clip(reg + damp * damp, min=0.0)),
                atol=inner_atol,
                btol=inner_btol,
                maxiter=inner_maxiter,
                first_check=last_itn,
                check_every=check_every,
                counter=counter,
                active=fresh & ~g_ok,
            )
            last_itn, inner_total = itn, inner_total + itn
            S_new, B_new, g_new = _subspace(xp, matvec, g, gn)
            if S is None:
                S, B_S, g_S = S_new, B_new, g_new
            else:
                S = xp.where(fresh[:, None, None], S_new, S)
                B_S = xp.where(fresh[:, None, None], B_new, B_S)
                g_S = xp.where(fresh[:, None], g_new, g_S)
        # a trial for every problem: a retry with a smaller radius where the
        # last was rejected
        p_S = _solve_trust_region_2d_batch(xp, B_S, g_S, Delta)
        step = xp.sum(S * p_S[:, None, :], axis=2)
        predicted = -(
            0.5 * xp.sum(p_S * xp.sum(B_S * p_S[:, None, :], axis=2), axis=1)
            + xp.sum(p_S * g_S, axis=1)
        )
        z_new = z + step
        # a trial that overflows (logits of a step too long) is not finite and
        # not accepted; numpy's warnings of it are left unsaid
        with trial_errors():
            f_new = problem.residual(z_new)
            cost_new = 0.5 * _norms2(xp, f_new)
        finite = xp.isfinite(cost_new)
        actual = xp.where(finite, cost - cost_new, -1.0)
        step_norm_now = xp.sqrt(_norms2(xp, step))
        # scipy's update_tr_radius and check_termination, per problem
        radius, ratio = radius_update(xp, Delta, actual, predicted, step_norm_now)
        code = termination(
            xp, actual, cost, step_norm_now, xp.sqrt(_norms2(xp, z)), ratio, ftol, xtol
        )
        code = xp.where(finite, code, -1)
        code = xp.where(g_ok, 1, code)
        accept = finite & (actual > 0) & ~g_ok
        Delta = xp.where(finite, radius, 0.25 * step_norm_now)
        # one read a trial: which problems took their step, which stopped,
        # whether the trial was finite, the cost, the step's norm, the
        # gradient's, the new radius
        flags = xp.stack(
            [
                xp.astype(accept, xp.float64),
                xp.astype(code, xp.float64),
                xp.astype(finite, xp.float64),
                xp.where(accept, cost_new, cost),
                step_norm_now,
                g_max,
                Delta,
            ],
            axis=1,
        )
        counter["reads"] += 1
        flags = np.asarray(to_numpy(flags), dtype=np.float64)
        took = flags[:, 0] > 0
        codes = flags[:, 1].astype(np.int64)
        for j, i in enumerate(alive):
            n_eval[i] += 0 if codes[j] == 1 else 1
            n_iter[i] += int(took[j])
            n_nonfinite[i] += int(flags[j, 2] == 0 and codes[j] != 1)
        current = bool(took.all())  # the problem is at z
        if current:  # the same arrays, so that a problem knows its point
            z, f, cost = z_new, f_new, cost_new
        elif took.any():
            z = xp.where(accept[:, None], z_new, z)
            f = xp.where(accept[:, None], f_new, f)
            cost = xp.where(accept, cost_new, cost)
        fresh = accept
        done = [j for j, i in enumerate(alive) if codes[j] > 0 or n_eval[i] >= max_nfev]
        stop = False
        if one and took[0]:
            nit += 1
            step_norm = float(flags[0, 4])
            reduction = host_cost[0] - float(flags[0, 3])
            host_cost[0] = float(flags[0, 3])
            if verbose == 2:
                _print_iteration(
                    nit, n_eval[0], host_cost[0], reduction, step_norm, flags[0, 5]
                )
            if callback is not None:
                intermediate = OptimizeResult(
                    x=z[0, ...], fun=f[0, ...], nit=nit, nfev=n_eval[0]
                )
                intermediate["cost"] = host_cost[0]
                intermediate["state"] = {
                    "x": z[0, ...],
                    "Delta": float(flags[0, 6]),
                    "nfev": n_eval[0],
                    "njev": n_iter[0],
                    "nit": nit,
                    "initial_cost": initial_cost,
                    "last_itn": last_itn,
                    "status": (
                        int(codes[0])
                        if codes[0] > 0
                        else (0 if n_eval[0] >= max_nfev else None)
                    ),
                }
                try:
                    callback(intermediate)
                except StopIteration:
                    stop = True
                    done = [0]
        if done:
            problem.finished(done, z, current)
            current = True
            for j in done:
                i = alive[j]
                code = int(codes[j])
                status[i] = -2 if stop else (code if code > 0 else 0)
                final["x"][i], final["fun"][i] = z[j, ...], f[j, ...]
                final["cost"][i] = float(flags[j, 3])
                final["optimality"][i] = float(flags[j, 5])
        if len(done) == len(alive):
            break
        going = [j for j in range(len(alive)) if j not in done]
        any_fresh = bool(took[going].any())
        if done:
            problem.leave(going)
            rows = xp.asarray(np.asarray(going, dtype=np.int64), device=where)
            z, f, g, cost, Delta, fresh, g_max, S, B_S, g_S = (
                xp.take(a, rows, axis=0)
                for a in (z, f, g, cost, Delta, fresh, g_max, S, B_S, g_S)
            )
            alive = [alive[j] for j in going]
        if any_fresh:
            matvec, rmatvec = problem.products(z, current)
            g = rmatvec(f)
            g_max = xp.max(xp.abs(g), axis=1)
    if verbose >= 1:
        print(TERMINATION_MESSAGES[status[0]])
        print(
            f"Function evaluations {n_eval[0]}, initial cost {initial_cost:.4e}, "
            f"final cost {final['cost'][0]:.4e}, "
            f"first-order optimality {final['optimality'][0]:.2e}."
        )
    return outcome(status, inner_total)


class _OneProblem:
    """:func:`trf`'s ``fun`` and ``jac`` as a batch of one problem; the row
    of a point is the same array each time it is asked for, so that ``fun``
    and ``jac`` see the same object at an accepted point (the joint polish's
    problem knows its point by it)."""

    def __init__(self, fun, jac):
        self._fun, self._jac = fun, jac
        self._last = (None, None)

    def _row(self, x):
        if x is not self._last[0]:
            self._last = (x, x[0, ...])
        return self._last[1]

    def residual(self, x):
        return self._fun(self._row(x))[None, ...]

    def products(self, x, current):
        matvec, rmatvec = self._jac(self._row(x))
        return (
            lambda v: matvec(v[0, ...])[None, ...],
            lambda u: rmatvec(u[0, ...])[None, ...],
        )

    def finished(self, positions, x, current):
        pass

    def leave(self, keep):  # pragma: no cover - one problem stops the run
        pass


# tr_options that trf takes (LSMR's names, applied by CGLS)
_TR_OPTIONS = {"maxiter", "atol", "btol", "damp", "regularize", "check_every"}


def trf(
    xp,
    fun,
    jac,
    x0,
    *,
    ftol=1e-8,
    xtol=1e-8,
    gtol=1e-8,
    max_nfev=None,
    tr_options=None,
    callback=None,
    verbose=0,
    resume=None,
):
    """Minimise ``1/2 ||fun(x)||^2``: :func:`trust_region_steps` for one problem
    (no bounds, linear loss, ``x_scale=1``), scipy's ``least_squares`` interface.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``x0``, of the residuals and of the products.
    fun : callable
        ``x -> f``, the residuals ``(m,)`` in ``xp``.
    jac : callable
        ``x -> (matvec, rmatvec)``: the Jacobian at ``x`` by its products
        ``v -> J v`` and ``u -> J^T u`` (returning new arrays).  Called at
        ``x0`` and after each accepted step, with the array ``fun`` was given.
    x0 : array of shape (n,)
    ftol, xtol, gtol : float
        scipy's tolerances: relative decrease of the cost (with a good step),
        relative step ``||dx|| < xtol (xtol + ||x||)``, and ``||g||_inf < gtol``.
    max_nfev : int or None
        Residual evaluations (``None``: ``100 n``).
    tr_options : dict or None
        The steps' solver (LSMR's keywords, which CGLS applies): ``maxiter``,
        ``atol``, ``btol``, ``damp``, ``regularize`` (default True) and
        ``check_every`` (iterations between the host's looks, default 8).
    callback : callable or None
        ``callback(intermediate_result)`` after each accepted step, with
        attributes ``x``, ``fun``, ``nit``, ``nfev``, ``cost`` and ``state``
        (what ``resume`` takes to go on from there); raising ``StopIteration``
        stops the run with status -2.
    verbose : int, default=0
        1: the termination message; 2: also one line per accepted step.
    resume : dict or None
        An intermediate result's ``state`` (a kept iterate of an interrupted
        run): the run goes on from that step as the uninterrupted run did (its
        residuals and Jacobian there are evaluated again, to the same bits);
        ``x0`` is then ignored.

    Returns
    -------
    OptimizeResult
        ``x`` and ``fun`` (in ``xp``), ``cost``, ``optimality`` (``||g||_inf``
        at the last Jacobian), ``nfev``, ``njev``, ``status`` (-2 callback, 0
        ``max_nfev``, 1 ``gtol``, 2 ``ftol``, 3 ``xtol``, 4 ``ftol`` and
        ``xtol``), ``message``, ``success`` (``status > 0``), as scipy's
        ``least_squares``; and ``n_nonfinite_trials``: the trial points whose
        residuals overflowed (rejected, the trust region cut to a quarter of
        the step, without a numpy ``RuntimeWarning``).

    Raises
    ------
    ValueError
        When the residuals at ``x0`` are not finite.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import namespace
    >>> t = np.linspace(0.0, 1.0, 20); y = 2.0 * np.exp(-1.5 * t)
    >>> def fun(x):
    ...     return x[0] * np.exp(x[1] * t) - y
    >>> def jac(x):
    ...     e = np.exp(x[1] * t); J = np.stack([e, x[0] * t * e], axis=1)
    ...     return (lambda v: J @ v), (lambda u: J.T @ u)
    >>> x0 = np.array([1.0, 0.0])
    >>> result = trf(namespace(x0), fun, jac, x0, tr_options={"maxiter": 2})
    >>> np.round(result.x, 8).tolist(), result.status > 0
    ([2.0, -1.5], True)
    """
    tr_options = dict(tr_options or {})
    unknown = set(tr_options) - _TR_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown tr_options {sorted(unknown)}; known: {sorted(_TR_OPTIONS)}"
        )
    start = None if resume is not None else xp.reshape(xp.asarray(x0), (1, -1))
    out = trust_region_steps(
        xp,
        _OneProblem(fun, jac),
        start,
        ftol=ftol,
        xtol=xtol,
        gtol=gtol,
        max_nfev=max_nfev,
        inner_maxiter=tr_options.get("maxiter"),
        inner_atol=tr_options.get("atol", 1e-6),
        inner_btol=tr_options.get("btol", 1e-6),
        damp=tr_options.get("damp", 0.0),
        regularize=tr_options.get("regularize", True),
        check_every=tr_options.get("check_every", 8),
        callback=callback,
        resume=resume,
        verbose=verbose,
    )
    status = out["status"][0]
    return OptimizeResult(
        x=out["x"][0],
        cost=out["cost"][0],
        fun=out["fun"][0],
        optimality=out["optimality"][0],
        nfev=out["nfev"][0],
        njev=out["njev"][0],
        status=status,
        message=TERMINATION_MESSAGES[status],
        success=status > 0,
        n_nonfinite_trials=out["n_nonfinite"][0],
        host_reads=out["host_reads"],
    )
