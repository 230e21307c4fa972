"""Dense second-order steps: Levenberg-Marquardt on the variable-projection problem
with the Gauss-Newton matrix formed explicitly.

Each iteration costs ``O(n k m^2 d^3 (d + d_out))`` to form the matrix and
``O((m d^2)^3)`` to solve it: the fastest route for small ``m d^2`` (a handful of
iterations to machine precision), hopeless past ``d ~ 32``, where
:mod:`skattn.solvers.optimizers._lm_matrix_free` takes over.
"""

import warnings

import numpy as np
from scipy import linalg

from ...layer._math import attention_patterns
from ..kernels._loss import (
    _chunks,
    _loss,
    _normalized_weights,
    _solve_projections,
    _solve_psd,
    solve_projections,
)


def _hull_basis(hull, m, d):
    """``(offset (m, d, d), basis (m d d, p))`` of Theta = offset + basis @ coords.

    ``hull = (point, directions)``: every Theta_i = point + sum_j C[i, j] D_j, so the
    coordinates are C (m, m - 1) flattened row-major.
    """
    point, directions = hull
    r = directions.shape[0]
    flat_dirs = directions.reshape(r, d * d).T  # (d d, r)
    basis = np.zeros((m * d * d, m * r))
    for i in range(m):
        basis[i * d * d : (i + 1) * d * d, i * r : (i + 1) * r] = flat_dirs
    offset = np.broadcast_to(point, (m, d, d)).copy()
    return offset, basis


def _hull_coordinates(attention, hull):
    """Least-squares hull coordinates C (m, r) of the Theta_i (orthonormal D_j)."""
    point, directions = hull
    return np.einsum("mde,rde->mr", attention - point, directions)


def _gauss_newton_system(X, Y, attention, projection, sample_weight, alpha):
    """Loss, gradient and Gauss-Newton matrix of the loss in (Theta, W), blockwise.

    The Jacobian of F(X)[l, o] is ``x_l[p] C_il[q, o]`` in Theta_i[p, q], with
    ``C_il = Cov_{S_il}(x) W_i`` (the covariance of the tokens under head i's
    pattern on row l, times W_i), and ``delta_{o o'} (S_i X)_l[p']`` in
    W_i[p', o'].  Returns ``loss``, ``g_theta (m d d,)``, ``g_w (m d, d_out)``,
    ``h_tt (m d d, m d d)``, ``h_tw (m d d, m d, d_out)`` and ``gram (m d, m d)``
    (the W-W block is ``gram kron I_{d_out}``, without the ridge).
    """
    n, k, d = X.shape
    m = attention.shape[0]
    d_out = Y.shape[2]
    md = m * d
    omega = _normalized_weights(n, sample_weight)
    loss = 0.0
    g_theta = np.zeros((d, md))  # (p, (i, q))
    g_w = np.zeros((md, d_out))
    upper = np.triu_indices(d)  # x x^T is symmetric: pairs p <= p' only
    h_tt = np.zeros((upper[0].size, md * md))  # ((p <= p'), (i, q, j, q'))
    # With d_out > d, h_tw is accumulated against the token covariances (its
    # dominant cost drops from n k m^2 d^3 d_out to n k m^2 d^4 flops).
    via_cov = d_out > d
    h_tw = np.zeros((d * md, md * (d if via_cov else d_out)))
    gram = np.zeros((md, md))
    per_sample = k * max(m * k * (k + d + d_out), md * md, d * md, md * d_out)
    for part in _chunks(n, per_sample):
        x = X[part]
        c = x.shape[0]
        patterns = attention_patterns(x, attention)  # (c, m, k, k)
        features = np.matmul(patterns, x[:, None])  # (c, m, k, d)
        values = np.einsum("nad,mdo->nmao", x, projection)  # (c, m, k, o)
        mean_values = np.matmul(patterns, values)  # (c, m, k, o)
        residual = mean_values.sum(axis=1) - Y[part]  # (c, k, o)
        rows = c * k
        if via_cov:
            # token covariance under each pattern, (c, m, k, d, d), then C = Cov W
            second = np.einsum("nmla,nap,naq->nmlpq", patterns, x, x, optimize=True)
            second -= features[..., :, None] * features[..., None, :]
            cov = np.matmul(second, projection[None, :, None])
            sr = second.transpose(0, 2, 1, 3, 4).reshape(rows, md * d)  # (i, q, s)
        else:
            # C_il = sum_a s_la x_a v_a^T - xbar_l vbar_l^T : (c, m, k, d, o)
            cov = np.einsum("nmla,nap,nmao->nmlpo", patterns, x, values, optimize=True)
            cov -= features[..., :, None] * mean_values[..., None, :]
        wt = np.repeat(omega[part], k)  # (rows,)
        xr = x.reshape(rows, d)
        cr = cov.transpose(0, 2, 1, 3, 4).reshape(rows, md, d_out)  # (i, q)
        fr = features.transpose(0, 2, 1, 3).reshape(rows, md)  # (j, p')
        rr = residual.reshape(rows, d_out)
        loss += 0.5 * float(np.sum(wt[:, None] * rr**2))
        wr = wt[:, None] * rr
        # g_theta[p, (i, q)] = sum_rows x[p] (C r)[(i, q)]
        g_theta += (xr * wt[:, None]).T @ np.einsum("rqo,ro->rq", cr, rr)
        g_w += fr.T @ wr
        gram += (fr * wt[:, None]).T @ fr
        # h_tt[(p, p'), (iq, jq')] = sum_rows w x[p] x[p'] (C C^T)[iq, jq']
        ccT = np.matmul(cr, cr.transpose(0, 2, 1)).reshape(rows, md * md)
        xx = xr[:, upper[0]] * xr[:, upper[1]] * wt[:, None]
        h_tt += xx.T @ ccT
        # h_tw[(p, jp'), (iq, o)] = sum_rows w x[p] f[jp'] C[iq, o]
        xf = ((xr * wt[:, None])[:, :, None] * fr[:, None, :]).reshape(rows, d * md)
        if via_cov:
            # C = Cov W: accumulate against Cov ((i, q, s): m d^2 columns instead
            # of m d d_out) and apply W_i once after the loop
            h_tw += xf.T @ sr
        else:
            h_tw += xf.T @ cr.reshape(rows, md * d_out)
    if via_cov:  # ((p, j, p'), (i, q, s)) -> ((p, j, p'), (i, q, o))
        h_tw = np.einsum(
            "Piqs,iso->Piqo", h_tw.reshape(d * md, m, d, d), projection
        ).reshape(d * md, md * d_out)
    # reorder to parameter order (i, p, q)
    g_theta = g_theta.reshape(d, m, d).transpose(1, 0, 2).reshape(-1)
    full = np.empty((d, d, md * md))
    full[upper[0], upper[1]] = h_tt
    full[upper[1], upper[0]] = h_tt
    h_tt = (
        full.reshape(d, d, m, d, m, d)
        .transpose(2, 0, 3, 4, 1, 5)
        .reshape(m * d * d, m * d * d)
    )
    h_tw = (
        h_tw.reshape(d, md, m, d, d_out)
        .transpose(2, 0, 3, 1, 4)
        .reshape(m * d * d, md, d_out)
    )
    loss += 0.5 * alpha * float(np.sum(projection**2))
    g_w += alpha * projection.reshape(md, d_out)
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
    """
    m, d, _ = attention.shape
    md = m * d
    if hull is not None:
        offset, basis = _hull_basis(hull, m, d)
        coords = _hull_coordinates(attention, hull).reshape(-1)
        attention = offset + (basis @ coords).reshape(m, d, d)

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
        z = _solve_psd(matrix, h_tw.transpose(1, 0, 2).reshape(md, -1), factor)
        z = z.reshape(md, -1, d_out)
        schur = h_tt - np.einsum("Pro,rQo->PQ", h_tw, z, optimize=True)
        grad = g_t - np.einsum("Pro,ro->P", h_tw, _solve_psd(matrix, g_w, factor))
        if hull is not None:
            schur = basis.T @ schur @ basis
            grad = basis.T @ grad
        return loss, grad, 0.5 * (schur + schur.T)

    theta = attention.copy()
    projection, matrix, factor, system = evaluate(theta)
    loss, grad, schur = reduced(system, matrix, factor)
    loss_start = loss
    mu = damping * max(float(np.max(np.diag(schur))), np.finfo(float).tiny)
    nu = 2.0
    n_eval, n_iter, stop = 1, 0, "max_iter"
    while n_eval < max_iter:
        n_iter += 1
        diag = np.maximum(np.diag(schur), 1e-12 * max(np.max(np.diag(schur)), 1e-300))
        try:
            with warnings.catch_warnings():
                # an ill-conditioned damped system is expected when n is too small;
                # the acceptance test below guards the step
                warnings.simplefilter("ignore", linalg.LinAlgWarning)
                step = -linalg.solve(
                    schur + mu * np.diag(diag), grad, assume_a="pos", check_finite=False
                )
        except (linalg.LinAlgError, ValueError):
            step = None
        if step is None or not np.all(np.isfinite(step)):
            mu *= nu
            nu *= 2.0
            # not (mu <= ...): a NaN system (overflowed logits) stops too, where
            # mu > ... would be False forever and the loop would never end
            if not mu <= 1e20 * max(float(np.max(np.diag(schur))), 1e-300):
                stop = "singular"
                break
            continue
        full_step = step if hull is None else basis @ step
        step_norm = float(np.linalg.norm(full_step))
        trial = theta + full_step.reshape(m, d, d)
        if step_norm <= tol * (float(np.linalg.norm(theta)) + tol):
            # last step: keep it if it does not increase the loss, then stop
            t_projection = solve_projections(X, Y, trial, sample_weight, alpha)
            t_loss = _loss(X, Y, trial, t_projection, sample_weight, alpha)
            if t_loss <= loss:
                theta = trial
            stop = "step"
            break
        t_projection, t_matrix, t_factor, t_system = evaluate(trial)
        n_eval += 1
        t_loss = t_system[0]
        predicted = -(grad @ step) - 0.5 * step @ schur @ step
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
            if not mu <= 1e20 * max(float(np.max(np.diag(schur))), 1e-300):
                stop = "no_decrease"  # at the floor of representable decrease
                break
    # final W by the refined least-squares solve, and the loss it gives
    projection = solve_projections(X, Y, theta, sample_weight, alpha)
    info = {
        "method": "levenberg-marquardt",
        "n_iter": n_iter,
        "n_evaluations": n_eval,
        "loss_start": float(loss_start),
        "loss": _loss(X, Y, theta, projection, sample_weight, alpha),
        "converged": stop in ("step", "no_decrease"),
        "stop_reason": stop,
    }
    return theta, projection, info
