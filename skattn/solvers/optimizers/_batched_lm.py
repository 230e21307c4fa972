"""Trust-region least squares for a batch of independent problems, every scalar
on the device: each head by the steps :func:`~._trf.trf` takes alone.

A :class:`~skattn.solvers.kernels._head_batch.HeadBatch` holds ``h`` problems of
the same shape (one head each): vectors have a head axis (``(h, p)``
parameters, ``(h, N)`` residuals), and its products act on every head at once.
:func:`batched_least_squares` solves them together, each head with its own trust
region, its own step acceptance and its own stopping, judged on its own
residual; :func:`batched_cgls` solves the heads' Gauss-Newton steps together,
each head with its own scalars and stopping test.

No value is read on the host inside the inner loops: the scalars are ``(h,)``
arrays of the problem's namespace, a finished head is frozen by masks (its
products still run with the others', block-diagonally), and the host looks at
the heads' flags every ``check_every`` inner iterations (first at the count the
last step took) and once per trial.  Finished heads leave the batch
(:meth:`HeadBatch.select`) so that the products shrink with it.  On a GPU the
one-head problems, each too small to fill the device, were bound by launches
and host reads one after another; together they share both.

The method is scipy's ``least_squares(method="trf", tr_solver="lsmr")`` per
head, in the variables of a right preconditioner (``LowRank``'s scaled metric at
the start): the Gauss-Newton step damped by the loss's curvature along the
gradient within the trust region, solved by conjugate gradients on the normal
equations (CGLS, stopped where LSMR would stop; LSMR, which the one-head solver
uses, needs some 200 scalar operations an iteration where CGLS needs a dozen,
and each is a kernel launch on a GPU); the 2-D trust-region problem in the span
of that step and the gradient; a rejected trial retried with a quarter of the
radius in the same span, without a new solve.  (A Levenberg-Marquardt damping
in its place solved afresh after each rejected step: on heads far from their
minimum, issue 63's, it spent five times the products and three times the
operations of the heads one at a time, and left heads unconverged that
converged alone.)  A head stops on a relative step below ``xtol``, a relative
decrease below ``ftol`` with a good step, a gradient below ``gtol``, or at
``max_nfev`` evaluations, as scipy's ``least_squares`` does.
"""

import numpy as np

from ...utils._array_api import device, to_numpy
from ..kernels._parametrization import _inverse_root
from ._trf import (
    _solve_trust_region_2d_batch,
    minimize_quadratic_1d,
    radius_update,
    termination,
    trial_errors,
)

__all__ = ["batched_cgls", "batched_least_squares"]

_EPS = float(np.finfo(float).eps)


def _norms2(xp, v):
    """Squared row norms of ``(h, n)``: ``(h,)``."""
    return xp.sum(v * v, axis=1)


def _column(xp, a):
    """``(h,)`` as ``(h, 1)``, to scale rows."""
    return xp.reshape(a, (-1, 1))


def _safe(xp, a):
    """``a`` with zeros replaced by ones (a divisor)."""
    return xp.where(a == 0, 1.0, a)


def batched_cgls(
    xp,
    matvec,
    rmatvec,
    b,
    damp,
    *,
    rtol=None,
    atol=1e-6,
    btol=1e-6,
    maxiter=None,
    first_check=None,
    check_every=8,
    counter=None,
    active=None,
):
    """CGLS (conjugate gradients on the normal equations, Hestenes & Stiefel's
    least-squares form) for ``h`` problems at once:
    ``min ||A_i x_i - b_i||^2 + damp_i^2 ||x_i||^2``.

    Each head stops where LSMR would (scipy's ``lsmr``, whose defaults
    ``atol``, ``btol`` these are, in the damped problem's terms): LSMR's
    normal-equations residual ``||A_i^T r_i - damp_i^2 x_i||`` below ``atol
    ||A_i|| ||r_i||`` (``r_i`` the damped residual), or ``||r_i||`` below
    ``btol ||b_i|| + atol ||A_i|| ||x_i||``.  LSMR is MINRES on the normal
    equations, CGLS conjugate gradients on them, and MINRES's residual at
    iteration ``k`` is ``(sum_{j <= k} ||s_j||^{-2})^{-1/2}`` of CG's ``s_j``
    (CG's own is larger and erratic: stopped on it, heads far from their
    minimum ran to the iteration cap at almost every step); ``||A_i||`` as
    LSMR estimates it, the Frobenius norm of the projected matrix (here the
    square root of the trace of the Lanczos matrix that CG's coefficients
    define).  ``rtol``, when
    given, replaces both by ``||s_i||`` below ``rtol`` of its start.  A head
    that has stopped is frozen (its step length masked).  The stopping tests
    run, and the host reads whether every head has stopped, at iteration
    ``first_check`` (default ``check_every``) and every ``check_every`` after:
    between two looks a head may iterate past its test, which only solves its
    system more exactly.  A few ``(h,)`` operations an iteration beside the two
    products (LSMR's recurrences, on ``(h,)`` arrays, took about 200).

    Parameters
    ----------
    xp : namespace
    matvec, rmatvec : callable
        ``(h, n) -> (h, N)`` and ``(h, N) -> (h, n)``.
    b : array of shape (h, N)
    damp : array of shape (h,)
    rtol, atol, btol : float
    maxiter : int or None
        Iterations at most (``None``: ``min(n, 200)``).
    counter : dict or None
        Gets ``"reads"`` (host reads) added.
    active : array of shape (h,) of bool, or None
        The heads to solve (``None``: all); the others get zero.

    Returns
    -------
    x : array of shape (h, n)
    converged : array of shape (h,)
        Whether each head met its test (at the last look).
    itn : int
        Iterations run.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> A = rng.normal(size=(2, 6, 3)); b = rng.normal(size=(2, 6))
    >>> x, converged, itn = batched_cgls(
    ...     np, lambda v: np.einsum("hij,hj->hi", A, v),
    ...     lambda u: np.einsum("hij,hi->hj", A, u), b, np.zeros(2), rtol=1e-12)
    >>> expected = [np.linalg.lstsq(A[i], b[i], rcond=None)[0] for i in range(2)]
    >>> bool(np.allclose(x, expected)), converged.tolist()
    (True, [True, True])
    """
    shift = damp * damp
    r = b
    s = rmatvec(r)
    n = s.shape[1]
    if maxiter is None:
        maxiter = min(n, 200)
    x = xp.zeros_like(s)
    p = s
    gamma = _norms2(xp, s)
    if rtol is not None:
        goal = rtol * rtol * gamma
    else:
        b_norm = xp.sqrt(_norms2(xp, b))
    running = gamma > 0
    if active is not None:
        running = running & active
    done = ~running
    weight = xp.astype(running, s.dtype)
    # the trace of the Lanczos matrix of A^T A + damp^2 I: 1 / alpha_k +
    # beta_{k-1} / alpha_{k-1} on its diagonal
    trace = xp.zeros_like(gamma)
    last = xp.zeros_like(gamma)  # beta_{k-1} / alpha_{k-1}
    # sum of 1 / ||s_j||^2: LSMR's (MINRES's) ||A^T r|| at the same iteration
    # is its inverse square root, CG's being larger and erratic
    smoothing = _inverse(xp, gamma)
    itn = 0
    check = check_every if first_check is None else max(1, int(first_check))
    while itn < maxiter:
        itn += 1
        q = matvec(p)
        delta = _norms2(xp, q) + shift * _norms2(xp, p)
        alpha = weight * gamma / _safe(xp, delta)
        x = x + _column(xp, alpha) * p
        r = r - _column(xp, alpha) * q
        s = rmatvec(r) - _column(xp, shift) * x
        gamma_new = _norms2(xp, s)
        beta = gamma_new / _safe(xp, gamma)
        inverse = delta / _safe(xp, gamma)  # 1 / alpha, whatever the mask
        trace = trace + inverse + last
        last = beta * inverse
        gamma = gamma_new
        smoothing = smoothing + _inverse(xp, gamma)
        p = s + _column(xp, beta) * p
        if itn == check or itn >= maxiter:
            if rtol is not None:
                met = gamma <= goal
            else:
                x_norm2 = _norms2(xp, x)
                r_norm = xp.sqrt(_norms2(xp, r) + shift * x_norm2)
                a_norm = xp.sqrt(trace)
                met = (1.0 / xp.sqrt(smoothing) <= atol * a_norm * r_norm) | (
                    r_norm <= btol * b_norm + atol * a_norm * xp.sqrt(x_norm2)
                )
            done = done | met
            running = running & ~met
            weight = xp.astype(running, s.dtype)
            if counter is not None:
                counter["reads"] = counter.get("reads", 0) + 1
            if not bool(xp.any(running)):
                break
            check = itn + check_every
    return x, done, itn


def _inverse(xp, a):
    """``1 / a``, infinite where ``a`` is zero (without a warning)."""
    return xp.where(a > 0, 1.0 / _safe(xp, a), xp.inf)


def _preconditioner(xp, params, d, r):
    """LowRank's scaled metric (``Q_i = Z^Q_i C^K_i``, ``K_i = Z^K_i C^Q_i``)
    of every head at ``params`` ``(h, 2 d r)``: ``(apply, inverse)``, each
    ``(h, 2 d r) -> (h, 2 d r)`` (``apply`` is its own transpose)."""
    h = params.shape[0]
    Q = xp.reshape(params[:, : d * r], (h, d, r))
    K = xp.reshape(params[:, d * r :], (h, d, r))
    c_k, c_k_inv = _inverse_root(xp.matrix_transpose(K) @ K)
    c_q, c_q_inv = _inverse_root(xp.matrix_transpose(Q) @ Q)

    def mapped(z, left, right):
        zq = xp.reshape(z[:, : d * r], (-1, d, r)) @ left
        zk = xp.reshape(z[:, d * r :], (-1, d, r)) @ right
        return xp.concat(
            [xp.reshape(zq, (zq.shape[0], -1)), xp.reshape(zk, (zk.shape[0], -1))],
            axis=1,
        )

    def apply(z, keep=None):
        if keep is None:
            return mapped(z, c_k, c_q)
        return mapped(z, xp.take(c_k, keep, axis=0), xp.take(c_q, keep, axis=0))

    def inverse(p):
        return mapped(p, c_k_inv, c_q_inv)

    return apply, inverse


def _regularization(xp, matvec, g, Delta):
    """scipy's ``regularize`` damping of each head's Gauss-Newton step (as
    :func:`~._trf.trf`): ``-min_{0 <= t <= Delta / ||g||} (a t^2 + b t) /
    Delta^2`` with ``a = ||J g||^2 / 2``, ``b = -||g||^2``, the loss's decrease
    along ``-g`` within the trust region; ``(h,)``."""
    v = matvec(-g)
    a = 0.5 * _norms2(xp, v)
    gg = _norms2(xp, g)
    upper = Delta / xp.sqrt(_safe(xp, gg))
    return -minimize_quadratic_1d(xp, a, -gg, upper) / (Delta * Delta)


def _subspace(xp, matvec, g, gn):
    """An orthonormal basis ``S`` ``(h, p, 2)`` of each head's ``(g, gn)``
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


def batched_least_squares(
    problem,
    params,
    *,
    max_nfev=20,
    xtol=1e-10,
    ftol=_EPS,
    gtol=_EPS,
    inner_maxiter=None,
    check_every=8,
):
    """Minimise ``1/2 ||r_i(p_i)||^2`` for every head of ``problem`` at once,
    each head by the steps :func:`~._trf.trf` takes alone.

    Per head, in the variables of its right preconditioner (``LowRank``'s
    scaled metric at the start): the Gauss-Newton step by CGLS (LSMR's tests)
    damped by scipy's ``regularize`` term, the 2-D trust-region problem in the
    span of it and the gradient, the radius updated by the ratio of actual to
    predicted decrease, scipy's stopping tests.  A rejected trial retries with
    a smaller radius in the same 2-D span, without a new CGLS solve (a head
    far from its minimum costs two products a retry, not a solve: issue 63's
    heads that do not converge).  Heads with a new Jacobian solve their steps
    together; the others are masked in the solve.  The host reads the heads'
    flags once a trial, and CGLS's tests every ``check_every`` iterations.

    Parameters
    ----------
    problem : HeadBatch
    params : array of shape (h, 2 d r)
        The heads' starts (rows in ``problem``'s namespace).
    max_nfev : int, default=20
        Residual evaluations per head (the start's included, as scipy counts).
    xtol, ftol, gtol : float
        scipy's relative step, relative decrease and gradient tolerances.
    inner_maxiter : int or None
        CGLS iterations per step (``None``: ``min(2 d r, 200)``).
    check_every : int, default=8
        CGLS iterations between the host's looks (:func:`batched_cgls`).

    Returns
    -------
    params : array of shape (h, 2 d r)
    coefficients : array of shape (h, w, r)
        The eliminated coefficients at ``params``.
    info : dict
        Per head (lists of Python numbers): ``n_iter`` (accepted steps plus
        one, scipy's ``njev``), ``n_evaluations``, ``loss``, ``status``
        (scipy's codes: 0 ``max_nfev``, 1 gradient, 2 ``ftol``, 3 ``xtol``,
        4 both); ``n_products`` (batched products), ``head_products`` (per
        head, the products it took part in: :attr:`HeadBatch.head_products`),
        ``host_reads``, ``inner_iterations`` (CGLS iterations, all steps).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers.kernels._head_batch import HeadBatch
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 4, 3))
    >>> Q, K = rng.normal(size=(2, 2, 3, 1)); W = rng.normal(size=(2, 3, 2))
    >>> targets = np.stack([forward(X, Q[i:i + 1] @ K[i:i + 1].transpose(0, 2, 1),
    ...                             W[i:i + 1]) for i in range(2)], axis=2)
    >>> truth = np.concatenate([Q.reshape(2, -1), K.reshape(2, -1)], axis=1)
    >>> start = truth + 0.05 * rng.normal(size=truth.shape)
    >>> batch = HeadBatch(X, targets, None, None, head_rank=1)
    >>> p, coef, info = batched_least_squares(batch, start)
    >>> [loss < 1e-20 for loss in info["loss"]]
    [True, True]
    """
    xp = problem._xp
    h0 = problem.n_heads
    d, r = problem.n_features, problem.rank
    counter = {"reads": 0}
    x_all = xp.asarray(params, dtype=xp.float64, copy=True)
    apply, inverse = _preconditioner(xp, x_all, d, r)
    z = inverse(x_all)
    where = device(z)
    # the heads still in the batch: host indices into the original heads
    alive = list(range(h0))
    index = None  # their indices as an array (None: all)
    f = problem.residual(x_all)
    cost = 0.5 * xp.sum(f * f, axis=1)
    n_eval = [1] * h0
    n_iter = [1] * h0
    status = [None] * h0
    final_x = [None] * h0
    final_cost = [None] * h0
    final_coef = [None] * h0

    def jac():
        return (
            lambda v: problem.matvec(apply(v, index)),
            lambda u: apply(problem.rmatvec(u), index),
        )

    matvec, rmatvec = jac()
    g = rmatvec(f)
    Delta = xp.sqrt(_norms2(xp, z))
    Delta = xp.where(Delta == 0, 1.0, Delta)
    fresh = xp.ones(Delta.shape, dtype=xp.bool, device=where)  # a new Jacobian
    S = B_S = g_S = None
    last_itn = None
    inner_total = 0
    any_fresh = True  # (on the host) some head has a new Jacobian
    while True:
        # the heads with a new Jacobian: their gradient test and 2-D problem
        g_ok = fresh & (xp.max(xp.abs(g), axis=1) < gtol)
        if any_fresh:
            reg = _regularization(xp, matvec, g, Delta)
            gn, _, itn = batched_cgls(
                xp,
                matvec,
                rmatvec,
                f,
                xp.sqrt(xp.clip(reg, min=0.0)),
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
        # a trial for every head: a retry with a smaller radius where the last
        # was rejected
        p_S = _solve_trust_region_2d_batch(xp, B_S, g_S, Delta)
        step = xp.sum(S * p_S[:, None, :], axis=2)
        predicted = -(
            0.5 * xp.sum(p_S * xp.sum(B_S * p_S[:, None, :], axis=2), axis=1)
            + xp.sum(p_S * g_S, axis=1)
        )
        z_new = z + step
        # a trial that overflows (logits of a step too long) is not finite and
        # not accepted below; numpy's warnings of it are left unsaid
        with trial_errors():
            f_new = problem.residual(apply(z_new, index))
            cost_new = 0.5 * xp.sum(f_new * f_new, axis=1)
        finite = xp.isfinite(cost_new)
        actual = xp.where(finite, cost - cost_new, -1.0)
        step_norm = xp.sqrt(_norms2(xp, step))
        # scipy's update_tr_radius and check_termination, per head: trf's rules
        radius, ratio = radius_update(xp, Delta, actual, predicted, step_norm)
        code = termination(
            xp, actual, cost, step_norm, xp.sqrt(_norms2(xp, z)), ratio, ftol, xtol
        )
        code = xp.where(finite, code, -1)
        code = xp.where(g_ok, 1, code)
        accept = (actual > 0) & ~g_ok
        Delta = xp.where(finite, radius, 0.25 * step_norm)
        # one read a trial: which heads took their step, which have stopped
        flags = xp.stack([xp.astype(accept, xp.int64), code], axis=1)
        counter["reads"] += 1
        flags = np.asarray(to_numpy(flags))
        took = flags[:, 0].astype(bool)
        codes = flags[:, 1]
        for j, i in enumerate(alive):
            n_eval[i] += 0 if codes[j] == 1 else 1
            n_iter[i] += int(took[j])
        z = xp.where(accept[:, None], z_new, z)
        f = xp.where(accept[:, None], f_new, f)
        cost = xp.where(accept, cost_new, cost)
        fresh = accept
        done = [j for j, i in enumerate(alive) if codes[j] > 0 or n_eval[i] >= max_nfev]
        going = [j for j in range(len(alive)) if j not in done]
        any_fresh = bool(took[going].any())
        if done or not took.all():
            x_now = apply(z, index)
        if not took.all() and (done or any_fresh):
            # the problem's point is the accepted one again (for the done heads'
            # coefficients, and the new Jacobians' products)
            problem.evaluate(x_now)
        for j in done:
            i = alive[j]
            status[i] = int(codes[j]) if codes[j] > 0 else 0
            final_x[i] = x_now[j, ...]
            final_cost[i] = cost[j]
            final_coef[i] = problem.coefficients[j, ...]
        if len(done) == len(alive):
            break
        if done:
            keep = going
            keep_array = xp.asarray(np.asarray(keep, dtype=np.int64), device=where)
            problem.select(keep)
            z, f, g, cost, Delta, fresh = (
                xp.take(a, keep_array, axis=0) for a in (z, f, g, cost, Delta, fresh)
            )
            S, B_S, g_S = (xp.take(a, keep_array, axis=0) for a in (S, B_S, g_S))
            alive = [alive[j] for j in keep]
            index = xp.asarray(np.asarray(alive, dtype=np.int64), device=where)
        if any_fresh:
            matvec, rmatvec = jac()
            g = rmatvec(f)
    x = xp.stack(final_x)
    coefficients = xp.stack(final_coef)
    losses = to_numpy(xp.stack(final_cost))
    counter["reads"] += 1
    info = {
        "n_iter": n_iter,
        "n_evaluations": n_eval,
        "loss": [float(c) for c in np.asarray(losses)],
        "status": status,
        "n_products": problem.n_products,
        "head_products": list(problem.head_products),
        "host_reads": counter["reads"],
        "inner_iterations": inner_total,
    }
    return x, coefficients, info
