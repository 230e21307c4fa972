"""``polish``: local optimisation of an attention layer, with the solver chosen
by size.

Stages: variable projection (the W_i eliminated) by Levenberg-Marquardt, dense
(:mod:`skattn.solvers._dense`) or matrix-free (:mod:`skattn.solvers._matrix_free`),
or by L-BFGS-B (:mod:`skattn.solvers._lbfgs`); optionally then L-BFGS-B over all
parameters.
"""

import numpy as np

from ._dense import _varpro_levenberg_marquardt
from ._lbfgs import _full_lbfgs, _varpro_lbfgs
from ._matrix_free import varpro_least_squares
from ._objective import solve_projections
from ._parametrization import make_parametrization

# The dense Levenberg-Marquardt forms an (m d^2)^2 Gauss-Newton matrix (O(n k (m d)^2
# d^2) flops an iteration) and factors it (O((m d^2)^3)); the matrix-free one costs
# some tens of Jacobian products (O(n k m d^2) each) an iteration.  Measured on the
# same data (benchmarks/bench_scaling.py), dense is faster up to about this many
# attention parameters, matrix-free above.
DENSE_MAX_PARAMETERS = 1200


def choose_solver(n_heads, n_features, head_rank=None, hull=None):
    """``"dense"`` or ``"matrix-free"``: the faster Levenberg-Marquardt for this size.

    Dense for the full parametrization with ``m d^2 <= DENSE_MAX_PARAMETERS`` or on
    a hull (few coordinates); matrix-free otherwise and for low-rank heads.

    Examples
    --------
    >>> choose_solver(2, 8), choose_solver(2, 64), choose_solver(2, 8, head_rank=2)
    ('dense', 'matrix-free', 'matrix-free')
    """
    if hull is not None:
        return "dense"
    if head_rank is not None and head_rank < n_features:
        return "matrix-free"
    if n_heads * n_features**2 <= DENSE_MAX_PARAMETERS:
        return "dense"
    return "matrix-free"


def polish(
    X,
    Y,
    attention,
    projection=None,
    *,
    sample_weight=None,
    alpha=0.0,
    mode="varpro",
    method="levenberg-marquardt",
    hull=None,
    max_iter=200,
    tol=1e-10,
    damping=1e-3,
    solver="auto",
    head_rank=None,
):
    """Locally optimise an attention layer from a starting point.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
        Starting Theta_i.
    projection : ndarray of shape (m, d, d_out) or None
        Starting W_i for ``mode="full"``; ignored by the variable projection stage
        (the W_i are eliminated there), and ``None`` means ``W*(Theta)``.
    sample_weight : ndarray of shape (n,) or None
    alpha : float, default=0.0
        Ridge penalty on the projections.
    mode : {"varpro", "full", "both"}, default="varpro"
        ``"varpro"``: minimise the reduced loss ``L(Theta, W*(Theta))`` over Theta;
        ``"full"``: L-BFGS-B over all parameters (Theta, W); ``"both"``: the first
        then the second (the full stage only refines the last digits).
    method : {"levenberg-marquardt", "lbfgs"}, default="levenberg-marquardt"
        Optimiser of the variable projection stage: damped Gauss-Newton on the
        reduced problem with the W-block eliminated by its Schur complement
        (quadratic convergence on realisable data; each iteration costs
        ``O(n k m^2 d^3 (d + d_out))``), or scipy L-BFGS-B on the reduced
        loss and its envelope gradient (cheaper iterations, many more of them).
    hull : tuple (point, directions) or None
        Restrict the variable projection stage to ``Theta_i = point + sum_j C[i, j]
        directions[j]`` (directions orthonormal, shape (r, d, d)); the starting
        Theta_i are projected onto it.  The full stage is never restricted.
    max_iter : int, default=200
        Iterations (Jacobian evaluations for Levenberg-Marquardt) per stage.
    tol : float, default=1e-10
        Levenberg-Marquardt: stop after a step with ``||dTheta|| <= tol ||Theta||``
        (with quadratic convergence the error left is far smaller);
        L-BFGS-B: projected gradient tolerance (``gtol``; ``ftol`` is 0 so it does
        not stop on a small loss decrease).
    solver : {"auto", "dense", "matrix-free"}, default="auto"
        Levenberg-Marquardt only: form the Gauss-Newton matrix (``"dense"``) or
        solve each step by LSMR from Jacobian products (``"matrix-free"``,
        scipy's ``least_squares``); ``"auto"`` picks by size
        (:func:`choose_solver`).
    head_rank : int or None, default=None
        Restrict every Theta_i to rank ``head_rank`` (parametrized as
        ``Q_i K_i^T``; matrix-free solver only).  The start is truncated to that
        rank.  ``None``: full rank.
    damping : float, default=1e-3
        Dense Levenberg-Marquardt only: the first damping, relative to the largest
        diagonal entry of the reduced Gauss-Newton matrix (later adapted by
        Nielsen's rule).  Large is safe far from a minimum; from a start already
        near one (a warm start) a tiny value (e.g. 1e-10) gives plain
        Gauss-Newton steps from the first iteration, which on ill-conditioned
        problems saves the iterations spent shrinking the damping.

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    info : dict
        ``loss_start``, ``loss`` (final), ``converged``, ``n_iter`` (total) and one
        dict per stage under ``stages``.

    Notes
    -----
    On realisable (noise-free) planted layers, Levenberg-Marquardt reaches
    relative parameter errors of 1e-15-1e-16 in 5-6 Jacobian evaluations from the
    epsilon-net's winner (10-15 % relative error), about 2-4 times faster than
    L-BFGS-B, which stops near 1e-11 (``benchmarks/bench_phase6.py``).  The
    Levenberg-Marquardt iteration grows as ``d^4``: for large d prefer
    ``method="lbfgs"``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn._layer import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 4))
    >>> th_hat, W_hat, info = polish(X, forward(X, th, W), th + 0.05)
    >>> bool(np.allclose(th_hat, th, atol=1e-8)), info["converged"]
    (True, True)
    """
    if mode not in ("varpro", "full", "both"):
        raise ValueError(f"mode must be 'varpro', 'full' or 'both', got {mode!r}.")
    if method not in ("levenberg-marquardt", "lbfgs"):
        raise ValueError(
            f"method must be 'levenberg-marquardt' or 'lbfgs', got {method!r}."
        )
    if solver not in ("auto", "dense", "matrix-free"):
        raise ValueError(
            f"solver must be 'auto', 'dense' or 'matrix-free', got {solver!r}."
        )
    attention = np.asarray(attention, dtype=float)
    m, d, _ = attention.shape
    low_rank = head_rank is not None and head_rank < d
    if solver == "auto":
        solver = choose_solver(m, d, head_rank, hull)
    if low_rank and (method != "levenberg-marquardt" or solver != "matrix-free"):
        raise ValueError(
            "head_rank needs the matrix-free Levenberg-Marquardt polish "
            "(method='levenberg-marquardt', solver='matrix-free' or 'auto')."
        )
    if solver == "matrix-free" and (hull is not None or alpha):
        raise ValueError(
            "The matrix-free polish supports neither a hull restriction nor a ridge "
            "alpha; use solver='dense'."
        )
    stages = []
    if mode in ("varpro", "both"):
        if method == "lbfgs":
            attention, projection, info = _varpro_lbfgs(
                X, Y, attention, sample_weight, alpha, hull, max_iter, tol
            )
        elif solver == "dense":
            attention, projection, info = _varpro_levenberg_marquardt(
                X, Y, attention, sample_weight, alpha, hull, max_iter, tol, damping
            )
        else:
            par = make_parametrization(m, d, head_rank)
            params, projection, info = varpro_least_squares(
                X,
                Y,
                par.from_attention(attention),
                par,
                sample_weight,
                max_iter=max_iter,
                tol=tol,
            )
            attention = par.attention(params)
        info["solver"] = "lbfgs" if method == "lbfgs" else solver
        stages.append({"stage": "varpro", **info})
    if mode in ("full", "both"):
        if projection is None:
            projection = solve_projections(X, Y, attention, sample_weight, alpha)
        attention, projection, info = _full_lbfgs(
            X, Y, attention, projection, sample_weight, alpha, max_iter, tol
        )
        info["solver"] = "lbfgs"
        stages.append({"stage": "full", **info})
    info = {
        "loss_start": stages[0]["loss_start"],
        "loss": stages[-1]["loss"],
        "converged": all(stage["converged"] for stage in stages),
        "n_iter": sum(stage["n_iter"] for stage in stages),
        "n_samples": int(X.shape[0]),
        "solver": stages[0]["solver"],
        "n_products": sum(stage.get("n_products", 0) for stage in stages),
        "stages": stages,
    }
    return attention, projection, info
