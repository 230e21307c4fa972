"""First-order stages: scipy's L-BFGS-B on the reduced or on the full objective."""

import numpy as np
from scipy.optimize import minimize

from ._dense import _hull_basis, _hull_coordinates
from ._objective import _loss_gradient, reduced_loss_gradient, solve_projections

# scipy's L-BFGS-B status -> the stop reasons of the Levenberg-Marquardt stages.
_STOP = {0: "gradient", 1: "max_iter", 2: "no_decrease"}


def _lbfgs(fun, x0, max_iter, tol, *, maxcor=30, maxfun=15000, callback=None):
    """scipy L-BFGS-B with an analytic gradient; ``tol`` is the gradient tolerance.

    ``fun(x) -> (loss, gradient)``; ``ftol`` is 0, so it never stops on a small
    decrease of the loss.  Stops (``result.status``) with 0 when the largest
    projected gradient entry is below ``tol``, 1 when ``max_iter`` iterations or
    ``maxfun`` evaluations ran out, 2 when the line search makes no progress.
    """
    return minimize(
        fun,
        x0,
        jac=True,
        method="L-BFGS-B",
        callback=callback,
        options={
            "maxiter": max_iter,
            "maxfun": maxfun,
            "gtol": tol,
            "ftol": 0.0,
            "maxcor": maxcor,
        },
    )


def _varpro_lbfgs(X, Y, attention, sample_weight, alpha, hull, max_iter, tol):
    """L-BFGS-B on the reduced objective, over Theta or over hull coordinates."""
    m, d, _ = attention.shape
    if hull is not None:
        offset, basis = _hull_basis(hull, m, d)
        x0 = _hull_coordinates(attention, hull).reshape(-1)

        def to_theta(x):
            return offset + (basis @ x).reshape(m, d, d)
    else:
        basis = None
        x0 = attention.reshape(-1)

        def to_theta(x):
            return x.reshape(m, d, d)

    def fun(x):
        loss, grad, _ = reduced_loss_gradient(X, Y, to_theta(x), sample_weight, alpha)
        grad = grad.reshape(-1)
        return loss, grad if basis is None else basis.T @ grad

    loss_start = fun(x0)[0]
    result = _lbfgs(fun, x0, max_iter, tol)
    theta = to_theta(result.x)
    projection = solve_projections(X, Y, theta, sample_weight, alpha)
    info = _lbfgs_info(result, loss_start)
    return theta, projection, info


def _lbfgs_info(result, loss_start):
    """The report of one L-BFGS-B stage (a scipy OptimizeResult)."""
    return {
        "method": "lbfgs",
        "n_iter": int(result.nit),
        "n_evaluations": int(result.nfev),
        "loss_start": float(loss_start),
        "loss": float(result.fun),
        "converged": bool(result.success),
        "stop_reason": _STOP.get(int(result.status), "no_decrease"),
        "message": str(result.message),
    }


def _full_lbfgs(X, Y, attention, projection, sample_weight, alpha, max_iter, tol):
    """L-BFGS-B over all parameters (Theta, W) with the analytic gradient."""
    m, d, _ = attention.shape
    d_out = projection.shape[2]
    split = m * d * d

    def fun(x):
        theta = x[:split].reshape(m, d, d)
        proj = x[split:].reshape(m, d, d_out)
        loss, g_t, g_w = _loss_gradient(X, Y, theta, proj, sample_weight, alpha)
        return loss, np.concatenate([g_t.reshape(-1), g_w.reshape(-1)])

    x0 = np.concatenate([attention.reshape(-1), projection.reshape(-1)])
    loss_start = fun(x0)[0]
    result = _lbfgs(fun, x0, max_iter, tol)
    info = _lbfgs_info(result, loss_start)
    return (
        result.x[:split].reshape(m, d, d),
        result.x[split:].reshape(m, d, d_out),
        info,
    )
