"""The joint polish: Levenberg-Marquardt (or L-BFGS) on all heads at once.

:func:`polish` locally optimises a layer from a start, the optimizer chosen by size:
the variable projection (the W_i eliminated) by Levenberg-Marquardt, dense
(:mod:`skattn.solvers.optimizers._lm_dense`) or matrix-free
(:mod:`skattn.solvers.optimizers._lm_matrix_free`), or by L-BFGS-B
(:mod:`skattn.solvers.optimizers._lbfgs`); optionally then L-BFGS-B over all
parameters.  :func:`staged_polish` runs it on a random subset first (the warm-up)
and then on all examples.

The arrays may be of any array-API namespace (numpy, torch, CuPy): the
Levenberg-Marquardt polish runs in the namespace and on the device of ``X``, its
subsets drawn on the host.  scipy's L-BFGS-B (``method="lbfgs"``, ``mode="full"``
or ``"both"``, never the random-start path's choice) runs on host copies, the layer
moved back (``info["host_copy"]``).
"""

import math

import numpy as np
from sklearn.utils import check_random_state

from ...utils._array_api import device, is_numpy, namespace, to_namespace, to_numpy
from ...utils._progress import stage_bar
from .._options import PolishOptions
from ..kernels._loss import REALISABLE_RESIDUAL, relative_residual, solve_projections
from ..kernels._parametrization import make_parametrization
from ..optimizers._lbfgs import lbfgs_layer, lbfgs_reduced
from ..optimizers._lm_dense import _varpro_levenberg_marquardt
from ..optimizers._lm_matrix_free import varpro_least_squares
from ._common import _copy, _on_accelerator, _on_rows, _threads

# the polish's defaults (written once, in PolishOptions)
_POLISH = PolishOptions()

# The dense Levenberg-Marquardt forms an (m d^2)^2 Gauss-Newton matrix (O(n k (m d)^2
# d^2) flops an iteration) and factors it (O((m d^2)^3)); the matrix-free one costs
# some tens of Jacobian products (O(n k m d^2) each) an iteration.  Measured from the
# same random start (n = 1000, k = 8, Boolean, one thread of a loaded machine),
# dense / matrix-free seconds: 6.7 / 13.9 at m d^2 = 256 (d = 8, m = 4), 12.6 / 9.8
# at 512 (16, 2), 102 / 38 at 1024 (16, 4), 45 / 11 at 1152 (24, 2), 138 / 22 at
# 2048 (32, 2).  So dense up to this many attention parameters, matrix-free above.
DENSE_MAX_PARAMETERS = 400


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


# Factor the values (W_i = V_i O_i, only the O_i eliminated) when the m d eliminated
# columns of full W_i are at least this many and drop at least FACTOR_VALUES_MIN_RATIO
# times (to m r + 1).  Measured on all-MiniLM-L6-v2's layer-0 heads (d = 385 with
# [x, 1]): one head (385 columns) took 4.7x the Jacobian products factored (5319
# against 1140), two heads (770) the same (1638 against 1649) at a fraction of the
# cost each, twelve heads (4620) need it.
FACTOR_VALUES_MIN_COLUMNS = 512
FACTOR_VALUES_MIN_RATIO = 4


def choose_factor_values(n_heads, n_features, head_rank):
    """Whether the polish of rank-``head_rank`` heads also factors the values.

    True when the ``m d`` eliminated columns of full ``W_i`` are at least
    ``FACTOR_VALUES_MIN_COLUMNS`` and ``d >= FACTOR_VALUES_MIN_RATIO (r + 1)``:
    then eliminating only the output factors (``m r + 1`` columns) cuts a
    Jacobian product's cost more than the extra nonlinear parameters ``V_i``
    cost in products.

    Examples
    --------
    >>> choose_factor_values(12, 385, 32), choose_factor_values(1, 385, 32)
    (True, False)
    >>> choose_factor_values(2, 8, 4)
    False
    """
    if head_rank is None or head_rank >= n_features:
        return False
    return (
        n_heads * n_features >= FACTOR_VALUES_MIN_COLUMNS
        and n_features >= FACTOR_VALUES_MIN_RATIO * (head_rank + 1)
    )


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
    max_iter=_POLISH.max_iter,
    tol=_POLISH.tol,
    solver=_POLISH.solver,
    head_rank=_POLISH.head_rank,
    verbose=_POLISH.verbose,
    damping=1e-3,
    factor_values=_POLISH.factor_values,
    intercept=_POLISH.intercept,
    stop_below=None,
    memory=None,
):
    """Locally optimise an attention layer from a starting point.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
        Starting Theta_i.
    projection : ndarray of shape (m, d, d_out) or None
        Starting W_i for ``mode="full"``, and the start of the value factors
        ``V_i`` (its top ``head_rank`` left singular vectors) when the values are
        factored; otherwise ignored by the variable projection stage (the W_i are
        eliminated there).  ``None`` means ``W*(Theta)``.
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
    max_iter : int, default=100
        Iterations (Jacobian evaluations for Levenberg-Marquardt) per stage.
    tol : float, default=1e-10
        Levenberg-Marquardt: stop after a step with ``||dTheta|| <= tol ||Theta||``
        (with quadratic convergence the error left is far smaller);
        L-BFGS-B: projected gradient tolerance (``gtol``; ``ftol`` is 0 so it does
        not stop on a small loss decrease).
    solver : {"auto", "dense", "matrix-free"}, default="auto"
        Levenberg-Marquardt only: form the Gauss-Newton matrix (``"dense"``) or
        solve each step by conjugate gradients from Jacobian products
        (``"matrix-free"``, the steps of scipy's ``least_squares``); ``"auto"``
        picks by size (:func:`choose_solver`).
    head_rank : int or None, default=None
        Restrict every Theta_i to rank ``head_rank`` (parametrized as
        ``Q_i K_i^T``; matrix-free solver only).  The start is truncated to that
        rank.  ``None``: full rank.
    verbose : int, default=0
        Matrix-free solver only: 2 prints one line per iteration.
    damping : float, default=1e-3
        Dense Levenberg-Marquardt only: the first damping, relative to the largest
        diagonal entry of the reduced Gauss-Newton matrix (later adapted by
        Nielsen's rule).  Large is safe far from a minimum; from a start already
        near one (a warm start) a tiny value (e.g. 1e-10) gives plain
        Gauss-Newton steps from the first iteration, which on ill-conditioned
        problems saves the iterations spent shrinking the damping.
    factor_values : {"auto", True, False}, default="auto"
        With ``head_rank``: also factor ``W_i = V_i O_i`` (rank ``head_rank``),
        optimise ``V_i`` with ``Q_i, K_i`` and eliminate only the output factors
        ``O_i`` (:class:`~skattn.solvers.FactoredHeads`): ``m r`` eliminated
        columns instead of ``m d``.  ``"auto"``: for many heads of a large ``d``
        (:func:`choose_factor_values`).
    intercept : bool, default=False
        The tokens carry a constant coordinate whose projection row is an
        intercept (the ``[x, 1]`` tokens of ``fit_intercept``): with factored
        values it is eliminated as a column of its own, since a rank-r
        ``V_i O_i`` cannot hold it.
    stop_below : float or None
        Matrix-free solver only: return the start when it fits to this relative
        residual already (``stop_reason`` ``"start"``; see
        :func:`~skattn.solvers.optimizers._lm_matrix_free.varpro_least_squares`).
    memory : StageMemory or None
        Matrix-free solver only: keeps its result and its iterates at intervals
        (:mod:`skattn.solvers._checkpoints`).

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    info : dict
        ``loss_start``, ``loss`` (final), ``converged``, ``stop_reason`` (of the
        last stage: ``"step"`` or ``"gradient"``, its tolerance met;
        ``"no_decrease"``, the loss at its rounding floor; ``"max_iter"``;
        ``"singular"``), ``n_iter`` (total) and one dict per stage under
        ``stages``.

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
    >>> from skattn.layer._math import forward
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
    xp = namespace(X, Y)
    attention = to_namespace(attention, xp, device(X), dtype=xp.float64)
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
    if not is_numpy(xp) and (method == "lbfgs" or mode != "varpro"):
        # scipy's L-BFGS-B runs on the host: the polish on host copies, its
        # results moved back (the random-start path never asks for it)
        attention, projection, info = polish(
            *(to_numpy(a) for a in (X, Y, attention, projection)),
            sample_weight=to_numpy(sample_weight),
            alpha=alpha,
            mode=mode,
            method=method,
            hull=None if hull is None else tuple(to_numpy(h) for h in hull),
            max_iter=max_iter,
            tol=tol,
            solver=solver,
            head_rank=head_rank,
            verbose=verbose,
            damping=damping,
            factor_values=factor_values,
            intercept=intercept,
            stop_below=stop_below,
        )
        info["host_copy"] = True  # scipy's L-BFGS-B needs numpy arrays
        return (
            to_namespace(attention, xp, device(X)),
            to_namespace(projection, xp, device(X)),
            info,
        )
    stages = []
    if mode in ("varpro", "both"):
        if method == "lbfgs":
            attention, projection, info = lbfgs_reduced(
                X, Y, attention, sample_weight, alpha, hull, max_iter, tol
            )
        elif solver == "dense":
            attention, projection, info = _varpro_levenberg_marquardt(
                X, Y, attention, sample_weight, alpha, hull, max_iter, tol, damping
            )
        else:
            if factor_values == "auto":
                factor_values = choose_factor_values(m, d, head_rank)
            par = make_parametrization(m, d, head_rank, factor_values=factor_values)
            if getattr(par, "eliminates_output_factors", False):
                if projection is None:
                    projection = solve_projections(X, Y, attention, sample_weight)
                start = par.from_attention(attention, projection)
            else:
                start = par.from_attention(attention)
            params, projection, info = varpro_least_squares(
                X,
                Y,
                start,
                par,
                sample_weight,
                max_iter=max_iter,
                tol=tol,
                intercept=intercept,
                stop_below=stop_below,
                verbose=verbose,
                memory=memory,
                # the products' chunks in as many jobs as BLAS has threads (at
                # most 2), one BLAS thread each (HISTORY, fourteenth session)
                n_jobs=1 if _on_accelerator(X) else _threads(None, 2),
            )
            attention = par.attention(params)
            info["factored_values"] = bool(factor_values)
        info["solver"] = "lbfgs" if method == "lbfgs" else solver
        stages.append({"stage": "varpro", **info})
    if mode in ("full", "both"):
        if projection is None:
            projection = solve_projections(X, Y, attention, sample_weight, alpha)
        attention, projection, info = lbfgs_layer(
            X, Y, attention, projection, sample_weight, alpha, max_iter, tol
        )
        info["solver"] = "lbfgs"
        stages.append({"stage": "full", **info})
    info = {
        "loss_start": stages[0]["loss_start"],
        "loss": stages[-1]["loss"],
        "converged": all(stage["converged"] for stage in stages),
        "stop_reason": stages[-1]["stop_reason"],
        "n_iter": sum(stage["n_iter"] for stage in stages),
        "n_samples": int(X.shape[0]),
        "solver": stages[0]["solver"],
        "n_products": sum(stage.get("n_products", 0) for stage in stages),
        "stages": stages,
    }
    return attention, projection, info


# First damping of a warm-started dense Levenberg-Marquardt stage.
_WARM_DAMPING = 1e-6


def warmup_size(n_heads, n_tokens, n_features, head_rank=None, minimum=1000):
    """Examples for the warm-up stage of :func:`staged_polish`.

    Each sequence gives about ``k (k - 1)`` logit differences per head, and the
    attention parameters are ``m d^2`` (or ``2 m d r`` for low-rank heads): the
    warm-up takes twice the examples that count, and at least ``minimum``.  (Four
    times made d = 128, k = 8, m = 2 take 2341 examples and 584 s on a loaded
    machine, where 1000 sufficed at d = 64: the warm-up, not the product, drove
    the growth with d.)

    Examples
    --------
    >>> warmup_size(2, 8, 16), warmup_size(2, 8, 128), warmup_size(8, 8, 128)
    (1000, 1171, 4682)
    """
    d, m, k = n_features, n_heads, max(n_tokens, 2)
    per_head = d * d if head_rank is None or head_rank >= d else 2 * d * head_rank
    return int(max(minimum, math.ceil(2 * m * per_head / (k * (k - 1)))))


def output_basis(Y, rank, slack=9):
    """Orthonormal basis of the top principal output directions, or None.

    The outputs of m heads whose ``W_i`` have rank at most ``r`` span at most
    ``m r`` directions of the ``d_out`` output coordinates (plus one for an
    intercept).  When ``rank + slack`` is at most half of ``d_out``, the warm-up
    stage of :func:`staged_polish` fits ``Y B`` for the top ``rank + slack``
    right singular vectors ``B`` of ``Y``: on realisable data the same
    ``Theta_i`` (nothing of ``Y`` lies outside), at a fraction of the cost of the
    projections' elimination, which is linear in ``d_out``.  Otherwise None.

    Parameters
    ----------
    Y : ndarray of shape (n, k, d_out)
    rank : int
        Upper bound on the rank of the outputs, ``m min(r, d)``.
    slack : int, default=9
        Directions kept beyond ``rank``.

    Returns
    -------
    basis : ndarray of shape (d_out, p) or None

    Examples
    --------
    >>> import numpy as np
    >>> Y = np.random.default_rng(0).normal(size=(50, 3, 2)) @ np.ones((2, 40))
    >>> output_basis(Y, 2).shape
    (40, 11)
    >>> output_basis(Y, 20) is None
    True
    """
    xp = namespace(Y)
    d_out = Y.shape[2]
    p = rank + slack
    if 2 * p > d_out:
        return None
    flat = xp.reshape(Y, (-1, d_out))
    _, vectors = xp.linalg.eigh(flat.T @ flat)
    # the top p, largest first (numpy: the reversed view's copy, as before)
    return _copy(xp, xp.flip(vectors, axis=1)[:, :p])


def polish_rows(rng, n, n_polish_samples, n_warmup_samples):
    """The polish set and its warm-up subset, drawn by ``rng``: ``(rows,
    warm)``, sorted host indices, ``rows`` of the ``n`` examples (None: all of
    them, when ``n_polish_samples`` is None or not below ``n``), ``warm`` of the
    polish set (None: no warm-up stage, when ``n_warmup_samples`` is None or
    not below the polish set's size).  The subsets of every kind of head's
    staged polish (:func:`staged_polish`,
    :func:`~skattn.solvers._decoder.decoder_stages`).

    Examples
    --------
    >>> import numpy as np
    >>> rows, warm = polish_rows(np.random.default_rng(0), 10, 6, 4)
    >>> len(rows), len(warm), bool(warm.max() < 6)
    (6, 4, True)
    >>> polish_rows(np.random.default_rng(0), 10, None, None)
    (None, None)
    """
    rows = warm = None
    if n_polish_samples is not None and n > n_polish_samples:
        rows = np.sort(rng.choice(n, size=n_polish_samples, replace=False))
        n = n_polish_samples
    if n_warmup_samples is not None and n > n_warmup_samples:
        warm = np.sort(rng.choice(n, size=n_warmup_samples, replace=False))
    return rows, warm


def staged_polish(
    X,
    Y,
    attention,
    projection=None,
    *,
    sample_weight=None,
    n_polish_samples=None,
    n_warmup_samples=1000,
    random_state=None,
    **options,
):
    """:func:`polish` in two stages: a random subset first, then all examples.

    The warm-up stage polishes on ``n_warmup_samples`` random examples of the
    polish set (on realisable data the same optimum, at a fraction of the cost:
    every iteration is linear in the examples); the final stage polishes on the
    whole polish set from there, and is skipped when the warm-up's fit already
    leaves a relative RMS residual below ``REALISABLE_RESIDUAL`` on it (then only
    one forward pass touches all the examples).  When the heads' outputs span
    few of the output coordinates (low-rank heads, large ``d_out``), the warm-up
    fits only their top principal directions (:func:`output_basis`).  A start
    that already fits a stage's examples to ``REALISABLE_RESIDUAL`` is not
    polished (``stop_below``; the matrix-free solver).

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
        Start.
    projection : ndarray of shape (m, d, d_out) or None
        Start of the projections where :func:`polish` uses one (factored
        values); the final stage starts from the warm-up's.
    sample_weight : ndarray of shape (n,) or None
    n_polish_samples : int or None
        Examples of the polish set (a random subset); ``None``: all.
    n_warmup_samples : int or None, default=1000
        Examples of the warm-up stage; ``None``: one stage on the polish set.
    random_state : int, RandomState instance or None
    **options
        Passed to :func:`polish` (``mode``, ``method``, ``solver``, ``head_rank``,
        ``max_iter``, ``tol``).

    Returns
    -------
    attention, projection, info
        As :func:`polish`; ``info`` also has ``warmup`` (the warm-up stage's info
        or None), ``final_stage`` ("ran", "skipped: realisable" or "none"),
        ``n_polish_samples`` and ``relative_residual`` (on the polish set).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(400, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 4))
    >>> th_hat, W_hat, info = staged_polish(
    ...     X, forward(X, th, W), th + 0.05, n_warmup_samples=100, random_state=0
    ... )
    >>> info["final_stage"], bool(info["relative_residual"] < 1e-10)
    ('skipped: realisable', True)
    """
    # one bar for the polish's iterations, warm-up and final stage (at most
    # max_iter each, and most stop well before): open-ended, the bound said
    bound = options.get("max_iter", _POLISH.max_iter) * (2 if n_warmup_samples else 1)
    with stage_bar("polish", None, "iter", iterations=True, at_most=bound):
        xp = namespace(X, Y)
        rng = check_random_state(random_state)
        # a start fitted already (decoupled heads) is not polished again: on 12 MiniLM
        # heads that cost 2 iterations and 10 minutes for nothing
        options.setdefault("stop_below", REALISABLE_RESIDUAL)
        rows, warm = polish_rows(rng, X.shape[0], n_polish_samples, n_warmup_samples)
        if rows is not None:
            X, Y, sample_weight = _on_rows(xp, rows, X, Y, sample_weight)
        warmup_info, final_stage = None, "none"
        m, d = attention.shape[0], attention.shape[1]
        output_rank = m * min(options.get("head_rank") or d, d)
        X_w = None
        if warm is not None:
            X_w, Y_w, w_w = _on_rows(xp, warm, X, Y, sample_weight)
            basis = output_basis(Y_w, output_rank)
        elif n_warmup_samples is not None:
            # no more examples than a warm-up: warm up on all of them when the heads'
            # outputs span few of the output coordinates (the cheaper products of
            # the principal outputs; without this, fewer examples fitted slower)
            basis = output_basis(Y, output_rank)
            if basis is not None:
                X_w, Y_w, w_w = X, Y, sample_weight
        if X_w is not None:
            attention, projection, warmup_info = polish(
                X_w,
                Y_w if basis is None else Y_w @ basis,
                attention,
                None if projection is None or basis is not None else projection,
                sample_weight=w_w,
                **options,
            )
            warmup_info["output_rank"] = Y.shape[2] if basis is None else basis.shape[1]
            if basis is not None:  # the projections onto all outputs
                projection = solve_projections(X_w, Y_w, attention, w_w)
            final_stage = "ran"
            residual = relative_residual(X, Y, attention, projection, sample_weight)
            if residual <= REALISABLE_RESIDUAL:
                final_stage = "skipped: realisable"
        if final_stage == "skipped: realisable":
            info = dict(warmup_info)
        else:
            if warmup_info is not None:
                # a warm start: begin with (nearly) undamped Gauss-Newton steps
                options.setdefault("damping", _WARM_DAMPING)
            attention, projection, info = polish(
                X, Y, attention, projection, sample_weight=sample_weight, **options
            )
            if warmup_info is not None:
                info["n_iter"] += warmup_info["n_iter"]
                info["n_products"] += warmup_info["n_products"]
                info["loss_start"] = warmup_info["loss_start"]
        info["warmup"] = warmup_info
        info["final_stage"] = final_stage
        info["n_polish_samples"] = int(X.shape[0])
        if final_stage != "skipped: realisable":
            residual = relative_residual(X, Y, attention, projection, sample_weight)
        info["relative_residual"] = residual
        return attention, projection, info
