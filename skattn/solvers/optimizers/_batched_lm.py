"""Levenberg-Marquardt for a batch of independent least-squares problems, every
scalar on the device.

A :class:`~skattn.solvers.kernels._head_batch.HeadBatch` holds ``h`` problems of
the same shape (one head each): vectors have a head axis (``(h, p)``
parameters, ``(h, N)`` residuals), and its products act on every head at once.
:func:`batched_least_squares` solves them together, each head with its own
damping, its own step acceptance and its own stopping, judged on its own
residual; :func:`batched_cgls` solves each step's damped linear problems
together, each head with its own scalars and stopping test.

No value is read on the host inside the inner loops: the scalars are ``(h,)``
arrays of the problem's namespace, a finished head is frozen by masks (its
products still run with the others', block-diagonally), and the host looks at
the heads' flags every ``check_every`` inner iterations (first at the count the
last step took) and once per Levenberg-Marquardt iteration.  Finished heads
leave the batch (:meth:`HeadBatch.select`) so that the products shrink with it.
On a GPU the one-head problems, each too small to fill the device, were bound by
launches and host reads one after another; together they share both.

The method: Levenberg-Marquardt (Moré 1978) in the variables of a right
preconditioner (``LowRank``'s scaled metric at the start), the damping updated
by Nielsen's rule (a good step scales it by ``max(1/3, 1 - (2 rho - 1)^3)``, a
rejected one by a doubling factor), the damped Gauss-Newton system solved by
conjugate gradients on the normal equations (CGLS; LSMR, which the one-head
solver uses, needs some 200 scalar operations an iteration where CGLS needs a
dozen, and each is a kernel launch on a GPU); a head stops on a relative step
below ``xtol``, a relative decrease below ``ftol`` with a good step, or at
``max_nfev`` evaluations, as scipy's ``least_squares`` does.
"""

import numpy as np

from ...utils._array_api import device, to_numpy
from ..kernels._parametrization import _inverse_root
from ._trf import trial_errors

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
    rtol=1e-6,
    maxiter=None,
    first_check=None,
    check_every=8,
    counter=None,
):
    """CGLS (conjugate gradients on the normal equations, Hestenes & Stiefel's
    least-squares form) for ``h`` problems at once:
    ``min ||A_i x_i - b_i||^2 + damp_i^2 ||x_i||^2``.

    Each head stops when its normal equations' residual ``A_i^T (b_i - A_i x_i)
    - damp_i^2 x_i`` has fallen to ``rtol`` of its start; a head that has
    stopped is frozen (its step length masked).  The stopping test runs, and the
    host reads whether every head has stopped, at iteration ``first_check``
    (default ``check_every``) and every ``check_every`` after: between two
    looks a head may iterate past its test, which only solves its system more
    exactly.  A few ``(h,)`` operations an iteration beside the two products
    (LSMR's recurrences, on ``(h,)`` arrays, took about 200).

    Parameters
    ----------
    xp : namespace
    matvec, rmatvec : callable
        ``(h, n) -> (h, N)`` and ``(h, N) -> (h, n)``.
    b : array of shape (h, N)
    damp : array of shape (h,)
    counter : dict or None
        Gets ``"reads"`` (host reads) added.

    Returns
    -------
    x : array of shape (h, n)
    converged : array of shape (h,)
        Whether each head met ``rtol`` (at the last look).
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
    goal = rtol * rtol * gamma
    active = gamma > 0
    weight = xp.astype(active, s.dtype)
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
        gamma = gamma_new
        p = s + _column(xp, beta) * p
        if itn == check or itn >= maxiter:
            active = active & (gamma > goal)
            weight = xp.astype(active, s.dtype)
            if counter is not None:
                counter["reads"] = counter.get("reads", 0) + 1
            if not bool(xp.any(active)):
                break
            check = itn + check_every
    return x, gamma <= goal, itn


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


def batched_least_squares(
    problem,
    params,
    *,
    max_nfev=20,
    xtol=1e-10,
    ftol=_EPS,
    inner_maxiter=None,
    initial_damping=1e-3,
    check_every=8,
):
    """Minimise ``1/2 ||r_i(p_i)||^2`` for every head of ``problem`` at once.

    Parameters
    ----------
    problem : HeadBatch
    params : array of shape (h, 2 d r)
        The heads' starts (rows in ``problem``'s namespace).
    max_nfev : int, default=20
        Residual evaluations per head (the start's included, as scipy counts).
    xtol, ftol : float
        scipy's relative step and relative decrease tolerances.
    inner_maxiter : int or None
        CGLS iterations per step (``None``: ``min(2 d r, 200)``).
    initial_damping : float, default=1e-3
        ``lambda`` at the start, relative to the curvature of each head's loss
        along its gradient.
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
        (scipy's codes: 0 ``max_nfev``, 1 gradient, 2 ``ftol``, 3 ``xtol``);
        ``n_products`` (batched products), ``head_products`` (per head, the
        products it took part in: :attr:`HeadBatch.head_products`),
        ``host_reads``,
        ``inner_iterations`` (CGLS iterations, all steps).

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
    # the curvature of each head's loss along its gradient scales its damping
    Jg = matvec(g)
    g2 = xp.sum(g * g, axis=1)
    curvature = xp.sum(Jg * Jg, axis=1) / _safe(xp, g2)
    lam = initial_damping * curvature
    nu = xp.zeros_like(lam) + 2.0
    maxiter = inner_maxiter
    last_itn = None
    inner_total = 0
    while True:
        step, _, itn = batched_cgls(
            xp,
            matvec,
            rmatvec,
            -f,
            xp.sqrt(lam),
            maxiter=maxiter,
            first_check=last_itn,
            check_every=check_every,
            counter=counter,
        )
        last_itn, inner_total = itn, inner_total + itn
        Js = matvec(step)
        predicted = -(0.5 * xp.sum(Js * Js, axis=1) + xp.sum(step * g, axis=1))
        z_new = z + step
        # a trial that overflows (logits of a step too long) is not finite and
        # not accepted below; numpy's warnings of it are left unsaid
        with trial_errors():
            f_new = problem.residual(apply(z_new, index))
            cost_new = 0.5 * xp.sum(f_new * f_new, axis=1)
        actual = cost - cost_new
        finite = xp.isfinite(cost_new)
        ratio = xp.where(
            predicted > 0,
            actual / _safe(xp, predicted),
            xp.astype((predicted == 0) & (actual == 0), predicted.dtype),
        )
        accept = finite & (actual > 0)
        step_norm = xp.sqrt(_norms2(xp, step))
        z_norm = xp.sqrt(_norms2(xp, z))
        xtol_ok = step_norm < xtol * (xtol + z_norm)
        ftol_ok = (actual < ftol * cost) & (ratio > 0.25)
        code = xp.zeros(cost.shape, dtype=xp.int64, device=device(cost)) - 1
        code = xp.where(ftol_ok, 2, code)
        code = xp.where(xtol_ok & ftol_ok, 4, code)
        code = xp.where((code < 0) & xtol_ok, 3, code)
        code = xp.where((code < 0) & (cost_new == 0) & accept, 1, code)
        # the damping: Nielsen's rule
        good = 1.0 - (2.0 * ratio - 1.0) ** 3
        lam = xp.where(
            accept & (ratio > 1e-4),
            lam * xp.where(good > 1.0 / 3.0, good, 1.0 / 3.0),
            lam * nu,
        )
        nu = xp.where(accept & (ratio > 1e-4), 2.0, 2.0 * nu)
        # one read a step: which heads took it, which have stopped
        flags = xp.stack([xp.astype(accept, xp.int64), code], axis=1)
        counter["reads"] += 1
        flags = np.asarray(to_numpy(flags))
        took = flags[:, 0].astype(bool)
        codes = flags[:, 1]
        for j, i in enumerate(alive):
            n_eval[i] += 1
            n_iter[i] += int(took[j])
        taken = xp.asarray(took, device=device(z))
        z = xp.where(taken[:, None], z_new, z)
        f = xp.where(taken[:, None], f_new, f)
        cost = xp.where(taken, cost_new, cost)
        done = [j for j, i in enumerate(alive) if codes[j] > 0 or n_eval[i] >= max_nfev]
        if done or not took.all():
            x_now = apply(z, index)
        if not took.all():  # the problem's point is the accepted one again
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
            keep = [j for j in range(len(alive)) if j not in done]
            keep_array = xp.asarray(np.asarray(keep, dtype=np.int64), device=device(z))
            problem.select(keep)
            z, f, cost = (xp.take(a, keep_array, axis=0) for a in (z, f, cost))
            lam, nu = xp.take(lam, keep_array, axis=0), xp.take(nu, keep_array, axis=0)
            alive = [alive[j] for j in keep]
            index = xp.asarray(np.asarray(alive, dtype=np.int64), device=device(z))
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
