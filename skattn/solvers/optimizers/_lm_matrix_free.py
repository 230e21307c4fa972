"""Matrix-free Levenberg-Marquardt for large layers: scipy's ``least_squares`` on
the reduced problem, its Jacobian given only through products.

The variable-projection problem (the W_i eliminated by least squares;
:class:`~skattn.solvers.kernels._varpro.VarproProblem` evaluates its residual and
Jacobian products) is solved by ``scipy.optimize.least_squares`` (trust-region
reflective, ``tr_solver="lsmr"``), the Jacobian a ``scipy.sparse.linalg.
LinearOperator`` over the products (:func:`jacobian_operator`).  No ``(m d^2)^2``
matrix is ever formed: memory is that of a few residual vectors and the per-sample
patterns.

:func:`varpro_least_squares` runs scipy's solver in two stages: loose LSMR steps
while the residual is large (``COARSE_UNTIL``), then steps solved to LSMR's default
tolerance for the quadratic convergence at the end.  Each stage works in the
variables of the parametrization's right preconditioner at its start (for low-rank
heads the metric of scaled gradient descent; none for full Theta_i).  With
``jacobian_dtype=numpy.float32`` the final stage's Jacobian products (nearly all of
its work) run in single precision while its residuals and eliminated coefficients
stay in double: the steps are then a little less accurate, the optimum is not.
"""

import functools
import math

import numpy as np
from scipy.optimize import least_squares
from scipy.sparse.linalg import LinearOperator

from ...utils._validation import _normalized_weights
from ..kernels._varpro import VarproProblem


def jacobian_operator(problem, params, *, orthogonal=False):
    """The Jacobian of ``problem`` at ``params`` as a ``LinearOperator``
    (``orthogonal``: see :meth:`VarproProblem.rmatvec`)."""
    problem._evaluate(params)
    p = np.array(params, copy=True)
    return LinearOperator(
        problem.shape,
        matvec=lambda v: problem.matvec(p, np.ravel(v)),
        rmatvec=lambda u: problem.rmatvec(p, np.ravel(u), orthogonal=orthogonal),
        dtype=float,
    )


# Far from a minimum the trust region, not the accuracy of the Gauss-Newton step,
# limits the progress: while the residual is above COARSE_UNTIL of the targets'
# norm, each step's least-squares problem is solved by LSMR only to relative
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
    verbose=0,
):
    """Minimise the reduced loss matrix-free: scipy's ``least_squares``, TRF + LSMR.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    params : ndarray of shape (p,)
        Starting parameters of ``parametrization``.
    parametrization : FullRank or LowRank
    sample_weight : ndarray of shape (n,) or None
    max_iter : int, default=100
        Residual evaluations (``max_nfev``).
    tol : float, default=1e-10
        Relative step tolerance (``xtol``); ``ftol`` and ``gtol`` are set at the
        rounding floor so the solver stops on the step or at machine precision.
    max_products : int or None
        Cap on the LSMR iterations of one step (``None``: ``min(p, 200)``).
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
    fixed_columns : ndarray of shape (n, k, f) or None
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
    verbose : int, default=0
        Passed to ``least_squares``: 2 prints one line per iteration.

    Returns
    -------
    params : ndarray of shape (p,)
    projection : ndarray of shape (m, d, d_out)
    info : dict
        ``method``, ``n_iter`` (Jacobian evaluations), ``n_coarse_iter`` (those
        with loose steps), ``n_evaluations``,
        ``n_products`` (Jacobian-vector products: the linear solver's work),
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
    if coarse and np.dtype(coarse_dtype) != problem.dtype:
        loose = make(dtype=coarse_dtype)
    x = np.asarray(params, dtype=float)
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
    omega = _normalized_weights(len(X), sample_weight)
    target = math.sqrt(float(omega @ np.einsum("nkj,nkj->n", Y, Y)))
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

        x, result = _stage(
            loose,
            x,
            {"maxiter": max_products, "atol": COARSE_LSMR_TOL, "btol": COARSE_LSMR_TOL},
            max_iter,
            callback=close_enough,
            **options,
        )
        n_iter, n_evaluations = int(result.njev), int(result.nfev)
        n_coarse, status = n_iter, result.status
    n_loose_products = loose.n_products if loose is not problem else 0
    # a single-precision stage may stop on rounding: the float64 stage always follows
    finish = status in (None, -2) or loose is not problem
    loose = None  # its kept states
    products = None
    if n_evaluations < max_iter and finish:
        if np.dtype(jacobian_dtype) != problem.dtype:
            products = make(dtype=jacobian_dtype)
        x, result = _stage(
            problem,
            x,
            {"maxiter": max_products},
            max_iter - n_evaluations,
            products=products,
            **options,
        )
        n_iter += int(result.njev)
        n_evaluations += int(result.nfev)
        status = result.status
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
    return x, problem.projection, info


def _stage(
    problem, params, tr_options, max_nfev, callback=None, products=None, **options
):
    """One run of scipy's ``least_squares`` (TRF, LSMR) from ``params``.

    In the variables ``z`` of the parametrization's right preconditioner ``M``
    at ``params`` (``p = M z``; see ``LowRank.preconditioner``), or in ``p``
    itself when it has none.  The Jacobian products come from ``products`` (the
    same problem in another precision) when given, else from ``problem``, which
    gives the residuals.  Returns the final ``p`` and scipy's result.
    """
    products = problem if products is None else products
    if problem.factored:  # balance V_i against the eliminated O_i
        problem.residual(params)
        params = problem.par.regauge(params, problem.output_factors)
    precond = problem.par.preconditioner(params)
    if precond is None:
        apply = np.asarray
        z0 = params
    else:
        apply, transpose, inverse = precond
        z0 = inverse(params)
        size = problem.shape[1]
        M = LinearOperator((size, size), matvec=apply, rmatvec=transpose, dtype=float)

    def jacobian(z):
        # LSMR's left vectors stay orthogonal to the design (they are built from
        # the residual at W* and from J v): the cheaper adjoint is exact there
        J = jacobian_operator(products, apply(z), orthogonal=True)
        return J if precond is None else J @ M

    result = least_squares(
        lambda z: problem.residual(apply(z)),
        z0,
        jac=jacobian,
        method="trf",
        tr_solver="lsmr",
        tr_options=tr_options,
        x_scale=1.0,
        max_nfev=max_nfev,
        callback=callback,
        **options,
    )
    return apply(result.x), result


# least_squares' status -> stop_reason; _START: the start fitted already
_START = 5
_STATUS = {
    _START: "start",
    0: "max_iter",
    1: "gradient",
    2: "no_decrease",
    3: "step",
    4: "no_decrease",
}
