"""Trust-region reflective least squares without bounds, matrix-free, in any array
namespace: scipy's ``least_squares(method="trf", tr_solver="lsmr", x_scale=1.0)``.

scipy's ``least_squares`` is numpy-only.  :func:`trf` is the same method, step for
step, written against the array namespace of ``x0``: the iterate, the residuals
and the Jacobian products stay in that namespace and on its device, and the
trust-region bookkeeping (the 1-D regularizing quadratic, the radius update, the
stopping tests) runs on the host in Python floats.  The 2-D subproblem in the
span of the gradient and the Gauss-Newton step is solved on the host as scipy's
on numpy, and in the namespace elsewhere (:func:`_solve_trust_region_2d_xp`, a
fixed number of operations, no host read).  The host reads two stacked sets of
scalars an iteration, besides LSMR's: the gradient's norms with the curvature
along it, then, after each trial step, its predicted and actual reductions and
norms.  Each iteration:

1. ``g = J^T f``; stop when ``||g||_inf < gtol``;
2. the Gauss-Newton step ``gn`` by :func:`~._lsmr.lsmr`, damped by the curvature
   of the loss along ``-g`` within the trust region (scipy's ``regularize``);
3. an orthonormal basis ``S`` of ``(g, gn)`` (economic QR), and the 2-D trust-region
   problem ``min 1/2 p^T S^T J^T J S p + g^T S p``, ``||p|| <= Delta``;
4. the trial point ``x + S p``; the ratio of actual to predicted decrease sets the
   radius (scipy's ``update_tr_radius``), and ``ftol``/``xtol`` stop the run
   (``check_termination``); a rejected step shrinks the radius and retries.

With numpy it makes scipy's calls: the same BLAS calls on arrays of the same
layout (the QR is scipy's ``linalg.qr``), the same scalar arithmetic, so that on
the scipy it was written against its iterates were scipy's to the bit.  The tests
hold it to scipy's documented outcome (the same status, the same minimum, the
budget of evaluations), not to one scipy version's iterates or counts.
Unlike scipy, no Jacobian product is spent on a zero vector to infer a dtype (scipy
builds a ``LinearOperator`` each iteration that does that).
"""

import math

import numpy as np
from scipy import linalg
from scipy.optimize import OptimizeResult

from ...utils._array_api import device, is_numpy, to_numpy
from ._lsmr import lsmr

__all__ = [
    "TERMINATION_MESSAGES",
    "minimize_quadratic_1d",
    "radius_update",
    "termination",
    "trf",
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


def _host_floats(xp, *scalars):
    """0-d arrays (dot products, norms) of ``xp`` as numpy ``float64`` on the
    host, in one stacked copy: one host read (so that scalar divisions by zero
    give ``inf``/``nan`` as in scipy).  The dot products are those that
    ``numpy.linalg.norm`` takes for a vector (BLAS ``ddot`` on numpy)."""
    return tuple(np.float64(value) for value in to_numpy(xp.stack(scalars)))


def _f64(*values):
    """Host floats as numpy ``float64`` scalars, for the elementwise rules
    (:func:`radius_update`, :func:`termination`, :func:`minimize_quadratic_1d`)
    on the host: the same IEEE operations as on Python floats."""
    return tuple(np.float64(v) for v in values)


def _qr_columns(xp, a, b):
    """An orthonormal basis ``S`` ``(n, 2)`` of the columns ``[a, b]`` (economic QR).

    numpy: scipy's ``linalg.qr`` (LAPACK ``geqrf``/``orgqr``, a Fortran-ordered
    ``Q``), as scipy's ``trf``, so that the products with ``S`` are its bits.
    """
    if is_numpy(xp):
        return linalg.qr(np.vstack((a, b)).T, mode="economic")[0]
    return xp.linalg.qr(xp.stack([a, b], axis=1))[0]


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


def _solve_trust_region_2d(B, g, Delta):
    """Minimise ``1/2 p^T B p + g^T p`` subject to ``||p|| <= Delta`` in 2-D, on the
    host (scipy's ``solve_trust_region_2d``): the Newton step when ``B`` is
    positive definite and the step is inside, else the minimum on the circle,
    ``p = Delta (2 t, 1 - t^2) / (1 + t^2)`` at a real root ``t`` of a quartic."""
    try:
        factor = linalg.cho_factor(B)
        p = -linalg.cho_solve(factor, g)
        if np.dot(p, p) <= Delta**2:
            return p
    except linalg.LinAlgError:
        pass
    a = B[0, 0] * Delta**2
    b = B[0, 1] * Delta**2
    c = B[1, 1] * Delta**2
    d = g[0] * Delta
    f = g[1] * Delta
    coeffs = np.array([-b + d, 2 * (a - c + f), 6 * b, 2 * (-a + c + f), -b - d])
    t = np.roots(coeffs)  # leading zeros are fine
    t = np.real(t[np.isreal(t)])
    p = Delta * np.vstack((2 * t / (1 + t**2), (1 - t**2) / (1 + t**2)))
    value = 0.5 * np.sum(p * B.dot(p), axis=0) + np.dot(g, p)
    return p[:, np.argmin(value)]


def _solve_trust_region_2d_xp(xp, B, g, Delta):
    """:func:`_solve_trust_region_2d` in ``xp``, on the device of ``B`` (2 x 2)
    and ``g`` (2,), without a host read: :func:`_solve_trust_region_2d_batch`
    of one problem.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import namespace
    >>> B, g = np.array([[2.0, 0.0], [0.0, -1.0]]), np.array([1.0, 1.0])
    >>> p = _solve_trust_region_2d_xp(namespace(B), B, g, 1.0)
    >>> bool(np.allclose(p, _solve_trust_region_2d(B, g, 1.0)))
    True
    """
    radius = xp.full((1,), float(Delta), dtype=B.dtype, device=device(B))
    return _solve_trust_region_2d_batch(xp, B[None, ...], g[None, ...], radius)[0, :]


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
    >>> expected = [_solve_trust_region_2d(B[i], g[i], Delta[i]) for i in range(2)]
    >>> bool(np.allclose(p, expected))
    True
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
    """Minimise ``1/2 ||fun(x)||^2``: trust-region reflective steps (no bounds,
    linear loss, ``x_scale=1``) with LSMR on the Jacobian's products.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``x0``, of the residuals and of the products.
    fun : callable
        ``x -> f``, the residuals ``(m,)`` in ``xp``.
    jac : callable
        ``x -> (matvec, rmatvec)``: the Jacobian at ``x`` by its products
        ``v -> J v`` and ``u -> J^T u`` (returning new arrays).  Called once at
        ``x0`` and after each accepted step.
    x0 : array of shape (n,)
    ftol, xtol, gtol : float
        scipy's tolerances: relative decrease of the cost (with a good step),
        relative step ``||dx|| < xtol (xtol + ||x||)``, and ``||g||_inf < gtol``.
    max_nfev : int or None
        Residual evaluations (``None``: ``100 n``).
    tr_options : dict or None
        Keywords of :func:`~._lsmr.lsmr` (``maxiter``, ``atol``, ``btol``,
        ``conlim``, ``damp``) and ``regularize`` (default True).
    callback : callable or None
        ``callback(intermediate_result)`` after each iteration, with attributes
        ``x``, ``fun``, ``nit``, ``nfev``, ``cost`` and ``state`` (what
        ``resume`` takes to go on from there); raising ``StopIteration`` stops
        the run with status -2.
    verbose : int, default=0
        1: the termination message; 2: also one line per iteration.
    resume : dict or None
        An intermediate result's ``state`` (a kept iterate of an interrupted
        run): the run goes on from that iteration as the uninterrupted run did
        (its residuals and Jacobian at the iterate are evaluated again, to the
        same bits); ``x0`` is then ignored.

    Returns
    -------
    OptimizeResult
        ``x`` and ``fun`` (in ``xp``), ``cost``, ``optimality`` (``||g||_inf``),
        ``grad``, ``nfev``, ``njev``, ``status`` (-2 callback, 0 ``max_nfev``,
        1 ``gtol``, 2 ``ftol``, 3 ``xtol``, 4 ``ftol`` and ``xtol``), ``message``,
        ``success`` (``status > 0``), as scipy's ``least_squares``; and
        ``n_nonfinite_trials``: the trial points whose residuals overflowed
        (rejected, the trust region cut to a quarter of the step, without a
        numpy ``RuntimeWarning``).

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
    damp = tr_options.pop("damp", 0.0)
    regularize = tr_options.pop("regularize", True)
    x = xp.asarray(x0 if resume is None else resume["x"], dtype=xp.float64, copy=True)
    n = x.shape[0]
    if max_nfev is None:
        max_nfev = 100 * n
    f = fun(x)
    # one host read: the residuals' squared norm (non-finite when any residual
    # is) and ||x||, the first radius
    ff, xx = _host_floats(xp, f @ f, x @ x)
    cost = 0.5 * ff
    if not math.isfinite(cost) and not bool(xp.all(xp.isfinite(f))):
        raise ValueError("Residuals are not finite in the initial point.")
    initial_cost = cost
    matvec, rmatvec = jac(x)
    nfev = njev = 1
    m = f.shape[0]
    g = rmatvec(f)
    # x_scale = 1: scipy's scaling by a vector of ones is exact, and left out
    Delta = np.sqrt(xx)
    if Delta == 0:
        Delta = 1.0
    reg_term = 0.0
    status = None
    iteration = n_nonfinite = 0
    step_norm = actual_reduction = None
    if resume is not None:  # where the interrupted run stood after an iteration
        Delta, nfev, njev = resume["Delta"], resume["nfev"], resume["njev"]
        iteration, initial_cost = resume["nit"], resume["initial_cost"]
        step_norm, actual_reduction = resume["step_norm"], resume["actual_reduction"]
        status = resume["status"]
    if verbose == 2:
        _print_header()

    while True:
        going = status is None and nfev != max_nfev
        scalars = [xp.max(xp.abs(g))]
        if going and regularize:
            # the loss's curvature along -g within the trust region damps LSMR
            # (a product spent in vain when the gradient stops the run: its
            # scalars are read with the gradient's norm, in one host read)
            minus_g = -g
            v = matvec(minus_g)
            scalars += [v @ v, g @ minus_g, g @ g]
        scalars = _host_floats(xp, *scalars)
        g_norm = float(scalars[0])
        if g_norm < gtol:
            status = 1
        if verbose == 2:
            _print_iteration(iteration, nfev, cost, actual_reduction, step_norm, g_norm)
        if status is not None or nfev == max_nfev:
            break

        if regularize:
            a, b, gg = scalars[1:]
            a *= 0.5
            to_tr = Delta / np.sqrt(gg)
            reg_term = -float(minimize_quadratic_1d(np, *_f64(a, b, to_tr))) / Delta**2
        damp_full = (damp**2 + reg_term) ** 0.5
        gn = lsmr(xp, matvec, rmatvec, f, damp=damp_full, shape=(m, n), **tr_options)[0]
        S = _qr_columns(xp, g, gn)
        JS = xp.stack([matvec(S[:, 0]), matvec(S[:, 1])], axis=1)
        B_S = xp.linalg.matrix_transpose(JS) @ JS
        g_S = xp.linalg.matrix_transpose(S) @ g

        actual_reduction = -1
        while actual_reduction <= 0 and nfev < max_nfev:
            if is_numpy(xp):  # scipy's, on the host
                p_S = _solve_trust_region_2d(B_S, g_S, Delta)
            else:
                p_S = _solve_trust_region_2d_xp(xp, B_S, g_S, Delta)
            step = S @ p_S
            Js = matvec(step)
            x_new = x + step
            # a trial point may overflow (logits of a step too long): it is
            # rejected below, counted, and says nothing on numpy's channel
            with trial_errors():
                f_new = fun(x_new)
                nfev += 1
                # one host read: the trial's predicted and actual reductions, norms
                JsJs, sg, ss, ff, xx = _host_floats(
                    xp, Js @ Js, step @ g, step @ step, f_new @ f_new, x @ x
                )
            predicted_reduction = -(0.5 * JsJs + sg)
            step_h_norm = np.sqrt(ss)
            cost_new = 0.5 * ff
            if not math.isfinite(cost_new) and not bool(xp.all(xp.isfinite(f_new))):
                n_nonfinite += 1
                Delta = 0.25 * step_h_norm
                continue
            actual_reduction = cost - cost_new
            # the rules of the batched heads' solver, on the host's floats
            Delta_new, ratio = (
                float(v)
                for v in radius_update(
                    np, *_f64(Delta, actual_reduction, predicted_reduction, step_h_norm)
                )
            )
            step_norm = step_h_norm
            code = int(
                termination(
                    np,
                    *_f64(actual_reduction, cost, step_norm, np.sqrt(xx), ratio),
                    ftol,
                    xtol,
                )
            )
            status = code if code > 0 else None
            if status is not None:
                break
            Delta = Delta_new

        if actual_reduction > 0:
            x, f, cost = x_new, f_new, cost_new
            matvec, rmatvec = jac(x)
            njev += 1
            g = rmatvec(f)
        else:
            step_norm = 0
            actual_reduction = 0
        iteration += 1
        if callback is not None:
            intermediate = OptimizeResult(x=x, fun=f, nit=iteration, nfev=nfev)
            intermediate["cost"] = cost
            intermediate["state"] = {
                "x": x,
                "Delta": Delta,
                "nfev": nfev,
                "njev": njev,
                "nit": iteration,
                "initial_cost": initial_cost,
                "step_norm": step_norm,
                "actual_reduction": actual_reduction,
                "status": status,
            }
            try:
                callback(intermediate)
            except StopIteration:
                status = -2
                break

    if status is None:
        status = 0
    if verbose >= 1:
        print(TERMINATION_MESSAGES[status])
        print(
            f"Function evaluations {nfev}, initial cost {initial_cost:.4e}, "
            f"final cost {cost:.4e}, "
            f"first-order optimality {g_norm:.2e}."
        )
    return OptimizeResult(
        x=x,
        cost=float(cost),
        fun=f,
        grad=g,
        optimality=float(g_norm),
        nfev=nfev,
        njev=njev,
        status=status,
        message=TERMINATION_MESSAGES[status],
        success=status > 0,
        n_nonfinite_trials=n_nonfinite,
    )
