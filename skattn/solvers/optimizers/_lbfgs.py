"""L-BFGS-B (scipy) on the reduced objective or on all parameters of a layer.

One L-BFGS over all parameters ``(Theta, W)`` (:func:`lbfgs_layer`) serves both
the polish's full stage and the gradient baseline
(:class:`skattn.GradientAttentionRegressor`); :func:`lbfgs_reduced` minimises the
reduced loss ``L(Theta, W*(Theta))`` over Theta or over hull coordinates.  Stop
reasons are those of :data:`skattn.solvers._stop.STOP_REASONS`.
"""

from scipy.optimize import minimize

from ..kernels._loss import _loss_gradient, reduced_loss_gradient, solve_projections
from ..kernels._parametrization import _Unknowns
from ._lm_dense import _hull_basis, _hull_coordinates

# scipy's L-BFGS-B status -> stop reason (the line search that makes no progress
# leaves the loss at its rounding floor)
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


def _lbfgs_info(result, loss_start):
    """The report of one L-BFGS-B run (a scipy OptimizeResult)."""
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


def lbfgs_reduced(X, Y, attention, sample_weight, alpha, hull, max_iter, tol):
    """L-BFGS-B on the reduced objective, over Theta or over hull coordinates.

    Returns ``(attention, projection, info)``, the projections ``W*(Theta)``.
    """
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


def lbfgs_layer(
    X,
    Y,
    attention,
    projection,
    sample_weight,
    alpha,
    max_iter,
    tol,
    *,
    head_rank=None,
    alpha_attention=0.0,
    chunk_size=None,
    maxcor=30,
    maxfun=15000,
    callback=None,
):
    """L-BFGS-B over all parameters ``(Theta, W)`` with the analytic gradient.

    Minimises ``J = sum_n w_n ||F(X_n) - Y_n||^2 / (2 sum_n w_n) + alpha ||W||^2 / 2
    + alpha_attention ||Theta||^2 / 2`` over ``Theta_i`` and ``W_i`` in full, or
    over the factors ``Q_i K_i^T`` and ``V_i O_i`` of rank ``head_rank``
    (:class:`~skattn.solvers.kernels._parametrization._Unknowns`).

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    sample_weight : ndarray of shape (n,) or None
    alpha : float
    max_iter : int
    tol : float
        Gradient tolerance (``gtol``; ``ftol`` is 0).
    head_rank : int or None
    alpha_attention : float, default=0.0
    chunk_size : int or None
        Samples per chunk of the loss (None: from the memory budget).
    maxcor, maxfun : int
        scipy's memory and function-evaluation budget.
    callback : callable or None
        scipy's ``callback(intermediate_result)``.

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    info : dict
        ``n_iter``, ``n_evaluations``, ``loss_start``, ``loss``, ``converged``,
        ``stop_reason`` (``"gradient"``, ``"no_decrease"`` or ``"max_iter"``),
        ``message``.
    """
    unknowns = _Unknowns(*projection.shape, head_rank)
    first = []  # the loss at the start: scipy's first evaluation is there

    def fun(params):
        loss, g_att, g_proj = _loss_gradient(
            X,
            Y,
            *unknowns.unpack(params),
            sample_weight,
            alpha,
            chunk_size,
            alpha_attention=alpha_attention,
        )
        if not first:
            first.append(loss)
        return loss, unknowns.gradient(params, g_att, g_proj)

    result = _lbfgs(
        fun,
        unknowns.pack(attention, projection),
        max_iter,
        tol,
        maxcor=maxcor,
        maxfun=maxfun,
        callback=callback,
    )
    attention, projection = unknowns.unpack(result.x)
    info = _lbfgs_info(result, first[0])
    return attention.copy(), projection.copy(), info
