"""Dense second-order steps: Levenberg-Marquardt on the variable-projection problem
with the Gauss-Newton matrix formed explicitly.

Each iteration costs ``O(n k m^2 d^3 (d + d_out))`` to form the matrix and
``O((m d^2)^3)`` to solve it: the fastest route for small ``m d^2`` (a handful of
iterations to machine precision), hopeless past ``d ~ 32``, where
:mod:`skattn.solvers.optimizers._lm_matrix_free` takes over.
"""

import math

import numpy as np

from ...layer._math import attention_patterns
from ...utils._array_api import (
    cholesky_solve,
    device,
    einsum,
    is_numpy,
    namespace,
    to_namespace,
    to_numpy,
)
from ..kernels._loss import (
    _chunks,
    _loss,
    _normalized_weights,
    _solve_projections,
    _solve_psd,
    solve_projections,
)
from ._trf import trial_errors


def _einsum_optimized(xp, subscripts, *operands):
    """``einsum`` with numpy's contraction order search (``optimize=True``: pairwise
    BLAS contractions, the bits of before); the shim's :func:`einsum` elsewhere."""
    if is_numpy(xp):
        return np.einsum(subscripts, *operands, optimize=True)
    return einsum(xp, subscripts, *operands)


def _solve_positive(xp, matrix, rhs):
    """Solve ``matrix x = rhs`` for a symmetric positive definite ``matrix``
    (Cholesky; ``numpy.linalg.LinAlgError`` when it is not).

    On numpy the factorisation of scipy's ``linalg.solve(assume_a="pos")``, which
    this replaced (bit for bit), including its ``1 x 1`` case: a division.
    """
    if matrix.shape[0] == 1:
        if float(matrix[0, 0]) == 0.0:
            raise np.linalg.LinAlgError("A singular matrix detected.")
        return rhs / matrix[0, 0]
    return cholesky_solve(xp, matrix, rhs)


def _hull_basis(hull, m, d):
    """``(offset (m, d, d), basis (m d d, p))`` of Theta = offset + basis @ coords.

    ``hull = (point, directions)``: every Theta_i = point + sum_j C[i, j] D_j, so the
    coordinates are C (m, m - 1) flattened row-major.  In the namespace of the
    hull's arrays.
    """
    point, directions = hull
    xp = namespace(point, directions)
    r = directions.shape[0]
    flat_dirs = xp.reshape(directions, (r, d * d)).T  # (d d, r)
    basis = xp.zeros((m * d * d, m * r), dtype=flat_dirs.dtype, device=device(point))
    for i in range(m):
        basis[i * d * d : (i + 1) * d * d, i * r : (i + 1) * r] = flat_dirs
    offset = xp.asarray(xp.broadcast_to(point, (m, d, d)), copy=True)
    return offset, basis


def _hull_coordinates(attention, hull):
    """Least-squares hull coordinates C (m, r) of the Theta_i (orthonormal D_j)."""
    point, directions = hull
    xp = namespace(attention, point, directions)
    return einsum(xp, "mde,rde->mr", attention - point, directions)


def _symmetric_gather(d):
    """Indices that rebuild a symmetric ``(d, d, ...)`` array from its rows on the
    pairs ``p <= p'`` (``numpy.triu_indices(d)`` order): ``full[p, p'] =
    rows[index[p, p']]``, a gather (no fancy assignment in the array API)."""
    upper = np.triu_indices(d)
    index = np.empty((d, d), dtype=np.int64)
    index[upper[0], upper[1]] = np.arange(upper[0].size)
    index[upper[1], upper[0]] = np.arange(upper[0].size)
    return upper, index.reshape(-1)


def _gauss_newton_system(X, Y, attention, projection, sample_weight, alpha):
    """Loss, gradient and Gauss-Newton matrix of the loss in (Theta, W), blockwise.

    The Jacobian of F(X)[l, o] is ``x_l[p] C_il[q, o]`` in Theta_i[p, q], with
    ``C_il = Cov_{S_il}(x) W_i`` (the covariance of the tokens under head i's
    pattern on row l, times W_i), and ``delta_{o o'} (S_i X)_l[p']`` in
    W_i[p', o'].  Returns ``loss``, ``g_theta (m d d,)``, ``g_w (m d, d_out)``,
    ``h_tt (m d d, m d d)``, ``h_tw (m d d, m d, d_out)`` and ``gram (m d, m d)``
    (the W-W block is ``gram kron I_{d_out}``, without the ridge); the arrays in
    the inputs' namespace, ``loss`` a float.
    """
    xp = namespace(X, Y, attention, projection)
    where = device(X)
    n, k, d = X.shape
    m = attention.shape[0]
    d_out = Y.shape[2]
    md = m * d
    omega = to_namespace(
        _normalized_weights(n, to_numpy(sample_weight)), xp, where, dtype=xp.float64
    )
    loss = 0.0  # a 0-d array after the first chunk: one host sync at the end

    def zeros(*shape):
        return xp.zeros(shape, dtype=xp.float64, device=where)

    g_theta = zeros(d, md)  # (p, (i, q))
    g_w = zeros(md, d_out)
    # x x^T is symmetric: pairs p <= p' only
    upper, gather = _symmetric_gather(d)
    first, second_index = (to_namespace(u, xp, where) for u in upper)
    h_tt = zeros(upper[0].size, md * md)  # ((p <= p'), (i, q, j, q'))
    # With d_out > d, h_tw is accumulated against the token covariances (its
    # dominant cost drops from n k m^2 d^3 d_out to n k m^2 d^4 flops).
    via_cov = d_out > d
    h_tw = zeros(d * md, md * (d if via_cov else d_out))
    gram = zeros(md, md)
    per_sample = k * max(m * k * (k + d + d_out), md * md, d * md, md * d_out)
    for part in _chunks(n, per_sample):
        x = X[part, ...]
        c = x.shape[0]
        patterns = attention_patterns(x, attention)  # (c, m, k, k)
        features = xp.matmul(patterns, x[:, None, ...])  # (c, m, k, d)
        values = einsum(xp, "nad,mdo->nmao", x, projection)  # (c, m, k, o)
        mean_values = xp.matmul(patterns, values)  # (c, m, k, o)
        residual = xp.sum(mean_values, axis=1) - Y[part, ...]  # (c, k, o)
        rows = c * k
        if via_cov:
            # token covariance under each pattern, (c, m, k, d, d), then C = Cov W
            second = _einsum_optimized(xp, "nmla,nap,naq->nmlpq", patterns, x, x)
            second -= features[..., :, None] * features[..., None, :]
            cov = xp.matmul(second, projection[None, :, None, ...])
            # (i, q, s)
            sr = xp.reshape(xp.permute_dims(second, (0, 2, 1, 3, 4)), (rows, md * d))
        else:
            # C_il = sum_a s_la x_a v_a^T - xbar_l vbar_l^T : (c, m, k, d, o)
            cov = _einsum_optimized(xp, "nmla,nap,nmao->nmlpo", patterns, x, values)
            cov -= features[..., :, None] * mean_values[..., None, :]
        wt = xp.repeat(omega[part], k)  # (rows,)
        xr = xp.reshape(x, (rows, d))
        # (i, q)
        cr = xp.reshape(xp.permute_dims(cov, (0, 2, 1, 3, 4)), (rows, md, d_out))
        # (j, p')
        fr = xp.reshape(xp.permute_dims(features, (0, 2, 1, 3)), (rows, md))
        rr = xp.reshape(residual, (rows, d_out))
        loss += 0.5 * xp.sum(wt[:, None] * rr**2)
        wr = wt[:, None] * rr
        # g_theta[p, (i, q)] = sum_rows x[p] (C r)[(i, q)]
        g_theta += (xr * wt[:, None]).T @ einsum(xp, "rqo,ro->rq", cr, rr)
        g_w += fr.T @ wr
        gram += (fr * wt[:, None]).T @ fr
        # h_tt[(p, p'), (iq, jq')] = sum_rows w x[p] x[p'] (C C^T)[iq, jq']
        ccT = xp.reshape(xp.matmul(cr, xp.permute_dims(cr, (0, 2, 1))), (rows, md * md))
        # the pairs' columns gathered from x^T: a Fortran-ordered xx on numpy, as
        # its fancy indexing gave, so that the GEMM below gives the same bits
        xt = xr.T
        xx = (
            xp.take(xt, first, axis=0).T
            * xp.take(xt, second_index, axis=0).T
            * wt[:, None]
        )
        h_tt += xx.T @ ccT
        # h_tw[(p, jp'), (iq, o)] = sum_rows w x[p] f[jp'] C[iq, o]
        xf = xp.reshape((xr * wt[:, None])[:, :, None] * fr[:, None, :], (rows, d * md))
        if via_cov:
            # C = Cov W: accumulate against Cov ((i, q, s): m d^2 columns instead
            # of m d d_out) and apply W_i once after the loop
            h_tw += xf.T @ sr
        else:
            h_tw += xf.T @ xp.reshape(cr, (rows, md * d_out))
    loss = float(loss)
    if via_cov:  # ((p, j, p'), (i, q, s)) -> ((p, j, p'), (i, q, o))
        h_tw = xp.reshape(
            einsum(
                xp, "Piqs,iso->Piqo", xp.reshape(h_tw, (d * md, m, d, d)), projection
            ),
            (d * md, md * d_out),
        )
    # reorder to parameter order (i, p, q)
    g_theta = xp.reshape(
        xp.permute_dims(xp.reshape(g_theta, (d, m, d)), (1, 0, 2)), (-1,)
    )
    full = xp.take(h_tt, to_namespace(gather, xp, where), axis=0)  # (d d, md md)
    h_tt = xp.reshape(
        xp.permute_dims(xp.reshape(full, (d, d, m, d, m, d)), (2, 0, 3, 4, 1, 5)),
        (m * d * d, m * d * d),
    )
    h_tw = xp.reshape(
        xp.permute_dims(xp.reshape(h_tw, (d, md, m, d, d_out)), (2, 0, 3, 1, 4)),
        (m * d * d, md, d_out),
    )
    loss += 0.5 * alpha * float(xp.sum(projection**2))
    g_w += alpha * xp.reshape(projection, (md, d_out))
    return loss, g_theta, g_w, h_tt, h_tw, gram


def _varpro_levenberg_marquardt(
    X, Y, attention, sample_weight, alpha, hull, max_iter, tol, damping=1e-3
):
    """Levenberg-Marquardt on the reduced (variable projection) problem.

    Each iteration solves for ``W*(Theta)``, forms the Gauss-Newton matrix in
    (Theta, W), eliminates W by its Schur complement (Kaufman's variable projection
    Jacobian), and takes a damped step in Theta (or in hull coordinates).  Damping
    follows Nielsen's rule; a step is kept only when the reduced loss decreases.
    The first damping is ``damping`` times the largest diagonal entry of the
    reduced Gauss-Newton matrix.  Stops (``info["stop_reason"]``) after a step
    below ``tol`` relative to
    ``||Theta||`` ("step"), when no damping gives a decrease any more
    ("no_decrease": the loss is at its rounding floor), when the damped system
    stays singular ("singular"), or after ``max_iter`` Jacobian evaluations.

    The arrays may be of any array-API namespace: the matrices and steps stay in
    that of ``X`` (on its device), the damping and the acceptance test run on the
    host; numpy gives the results of before, bit for bit.  Returns ``theta``,
    ``projection`` (in ``X``'s namespace) and ``info``.
    """
    xp = namespace(X, Y)
    where = device(X)
    attention = to_namespace(attention, xp, where, dtype=xp.float64)
    m, d, _ = attention.shape
    md = m * d
    if hull is not None:
        hull = tuple(to_namespace(a, xp, where, dtype=xp.float64) for a in hull)
        offset, basis = _hull_basis(hull, m, d)
        coords = xp.reshape(_hull_coordinates(attention, hull), (-1,))
        attention = offset + xp.reshape(basis @ coords, (m, d, d))

    def evaluate(theta):
        projection, (matrix, factor) = _solve_projections(
            X, Y, theta, sample_weight, alpha, refine=False
        )
        system = _gauss_newton_system(X, Y, theta, projection, sample_weight, alpha)
        return projection, matrix, factor, system

    def reduced(system, matrix, factor):
        loss, g_t, g_w, h_tt, h_tw, _ = system
        d_out = g_w.shape[1]
        # Schur complement of the W block (matrix kron I_{d_out})
        z = _solve_psd(
            matrix,
            xp.reshape(xp.permute_dims(h_tw, (1, 0, 2)), (md, -1)),
            factor,
        )
        z = xp.reshape(z, (md, -1, d_out))
        schur = h_tt - _einsum_optimized(xp, "Pro,rQo->PQ", h_tw, z)
        grad = g_t - einsum(xp, "Pro,ro->P", h_tw, _solve_psd(matrix, g_w, factor))
        if hull is not None:
            schur = basis.T @ schur @ basis
            grad = basis.T @ grad
        return loss, grad, 0.5 * (schur + schur.T)

    def largest_diagonal(schur):
        return float(xp.max(xp.linalg.diagonal(schur)))

    def norm(a):  # numpy.linalg.norm's dot product of the flattened array
        flat = xp.reshape(a, (-1,))
        return math.sqrt(float(flat @ flat))

    theta = xp.asarray(attention, copy=True)
    projection, matrix, factor, system = evaluate(theta)
    loss, grad, schur = reduced(system, matrix, factor)
    loss_start = loss
    mu = damping * max(largest_diagonal(schur), np.finfo(float).tiny)
    nu = 2.0
    n_eval, n_iter, stop = 1, 0, "max_iter"
    eye = xp.eye(schur.shape[0], dtype=schur.dtype, device=where)
    while n_eval < max_iter:
        n_iter += 1
        floor = 1e-12 * max(largest_diagonal(schur), 1e-300)
        diag = xp.maximum(
            xp.linalg.diagonal(schur),
            xp.asarray(floor, dtype=schur.dtype, device=where),
        )
        try:
            # an ill-conditioned damped system is expected when n is too small;
            # the acceptance test below guards the step
            step = -_solve_positive(xp, schur + float(mu) * (eye * diag), grad)
        except (np.linalg.LinAlgError, ValueError):
            step = None
        if step is None or not bool(xp.all(xp.isfinite(step))):
            mu *= nu
            nu *= 2.0
            # not (mu <= ...): a NaN system (overflowed logits) stops too, where
            # mu > ... would be False forever and the loop would never end
            if not mu <= 1e20 * max(largest_diagonal(schur), 1e-300):
                stop = "singular"
                break
            continue
        full_step = step if hull is None else basis @ step
        step_norm = norm(full_step)
        trial = theta + xp.reshape(full_step, (m, d, d))
        if step_norm <= tol * (norm(theta) + tol):
            # last step: keep it if it does not increase the loss, then stop
            with trial_errors():
                t_projection = solve_projections(X, Y, trial, sample_weight, alpha)
                t_loss = _loss(X, Y, trial, t_projection, sample_weight, alpha)
            if t_loss <= loss:
                theta = trial
            stop = "step"
            break
        with trial_errors():  # an overflowing trial: a NaN loss, rejected below
            t_projection, t_matrix, t_factor, t_system = evaluate(trial)
        n_eval += 1
        t_loss = t_system[0]
        predicted = np.float64(float(-(grad @ step) - 0.5 * step @ schur @ step))
        if t_loss < loss:
            rho = (loss - t_loss) / max(predicted, np.finfo(float).tiny)
            theta, projection = trial, t_projection
            matrix, factor, system = t_matrix, t_factor, t_system
            loss, grad, schur = reduced(system, matrix, factor)
            mu *= max(0.1, 1.0 - (2.0 * rho - 1.0) ** 3)
            nu = 2.0
        else:
            mu *= nu
            nu *= 2.0
            if not mu <= 1e20 * max(largest_diagonal(schur), 1e-300):
                stop = "no_decrease"  # at the floor of representable decrease
                break
    # final W by the refined least-squares solve, and the loss it gives
    projection = solve_projections(X, Y, theta, sample_weight, alpha)
    info = {
        "method": "levenberg-marquardt",
        "n_iter": n_iter,
        "n_evaluations": n_eval,
        "loss_start": float(loss_start),
        "loss": float(_loss(X, Y, theta, projection, sample_weight, alpha)),
        "converged": stop in ("step", "no_decrease"),
        "stop_reason": stop,
    }
    return theta, projection, info
