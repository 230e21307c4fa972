"""``polish``: local optimisation of an attention layer, with the solver chosen
by size.

Stages: variable projection (the W_i eliminated) by Levenberg-Marquardt, dense
(:mod:`skattn.solvers._dense`) or matrix-free (:mod:`skattn.solvers._matrix_free`),
or by L-BFGS-B (:mod:`skattn.solvers._lbfgs`); optionally then L-BFGS-B over all
parameters.
"""

import math

import numpy as np
from sklearn.utils import check_random_state
from threadpoolctl import threadpool_limits

from ._decoupled import (
    _NEAR,
    _output_factors,
    _threads,
    can_decouple,
    decoupled_refine,
    decoupled_size,
    search_head,
)
from ._dense import _varpro_levenberg_marquardt
from ._lbfgs import _full_lbfgs, _varpro_lbfgs
from ._matrix_free import _intercept_direction, varpro_least_squares
from ._minibatch import (
    _BATCH_SIZE,
    _LEARNING_RATE,
    _REPLACEMENT_BATCHES,
    _replace_head,
    minibatch_search,
)
from ._objective import (
    REALISABLE_RESIDUAL,
    _loss,
    _normalized_weights,
    solve_projections,
)
from ._parametrization import FactoredHeads, make_parametrization, random_attention

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
    max_iter=200,
    tol=1e-10,
    solver="auto",
    head_rank=None,
    verbose=0,
    damping=1e-3,
    factor_values="auto",
    intercept=False,
    stop_below=None,
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
        :func:`~skattn.solvers._matrix_free.varpro_least_squares`).

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
            )
            attention = par.attention(params)
            info["factored_values"] = bool(factor_values)
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


def relative_residual(X, Y, attention, projection, sample_weight=None):
    """``sqrt(sum w ||F(X) - Y||^2 / sum w ||Y||^2)`` (absolute when Y is 0).

    Examples
    --------
    >>> import numpy as np
    >>> X = np.ones((2, 2, 2)); th = np.zeros((1, 2, 2)); W = np.eye(2)[None]
    >>> relative_residual(X, X, th, W)
    0.0
    """
    omega = _normalized_weights(X.shape[0], sample_weight)
    y_sq = float(np.sum(omega[:, None, None] * Y**2))
    loss = _loss(X, Y, attention, projection, sample_weight, 0.0)
    return math.sqrt(2.0 * loss / y_sq) if y_sq > 0 else math.sqrt(2.0 * loss)


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
    d_out = Y.shape[2]
    p = rank + slack
    if 2 * p > d_out:
        return None
    flat = Y.reshape(-1, d_out)
    _, vectors = np.linalg.eigh(flat.T @ flat)
    return vectors[:, ::-1][:, :p].copy()


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
    rng = check_random_state(random_state)
    # a start fitted already (decoupled heads) is not polished again: on 12 MiniLM
    # heads that cost 2 iterations and 10 minutes for nothing
    options.setdefault("stop_below", REALISABLE_RESIDUAL)
    n = X.shape[0]
    if n_polish_samples is not None and n > n_polish_samples:
        rows = np.sort(rng.choice(n, size=n_polish_samples, replace=False))
        X, Y = X[rows], Y[rows]
        sample_weight = None if sample_weight is None else sample_weight[rows]
    warmup_info, final_stage = None, "none"
    m, d = attention.shape[0], attention.shape[1]
    output_rank = m * min(options.get("head_rank") or d, d)
    X_w = None
    if n_warmup_samples is not None and X.shape[0] > n_warmup_samples:
        rows = np.sort(rng.choice(X.shape[0], size=n_warmup_samples, replace=False))
        X_w, Y_w = X[rows], Y[rows]
        w_w = None if sample_weight is None else sample_weight[rows]
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


# Whiten the tokens of a random-start polish (whiten="auto") when their second
# moment's condition number on the reached subspace exceeds this, or when they
# reach a proper subspace.  Uniform Boolean and standard Gaussian tokens (moment
# about I) are left alone.
WHITEN_MIN_CONDITION = 10.0
# Sequences used to estimate the second moment.
_WHITEN_SAMPLES = 5000


def whitening_map(X, sample_weight=None, max_samples=_WHITEN_SAMPLES):
    """A linear map of the tokens to identity second moment on the reached subspace.

    With ``M = E[x x^T]`` over the tokens (weighted by sample) and its
    eigenpairs ``(lambda_j, v_j)``, ``A = [v_j / sqrt(lambda_j)]`` over the
    eigenvalues above ``d eps max(lambda)``: the tokens ``x A`` have second
    moment ``I`` in ``d' <= d`` coordinates.  A layer fitted on them maps back
    exactly: ``Theta_i = A Theta'_i A^T`` and ``W_i = A W'_i`` give the same
    logits and outputs on every token of the reached subspace (and rank
    ``Theta_i`` <= rank ``Theta'_i``, so low-rank heads stay low rank).

    This is a preconditioner: the Jacobian of the logits in ``Theta`` is
    conditioned like ``M`` squared, so anisotropic inputs (embedded text with a
    LayerNorm: eigenvalues spanning 5.4 to 0.013 for all-MiniLM-L6-v2, plus the
    hyperplane of the LayerNorm) make Gauss-Newton steps crawl.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    sample_weight : ndarray of shape (n,) or None
    max_samples : int, default=5000
        Sequences (the first ones) used to estimate ``M``.

    Returns
    -------
    A : ndarray of shape (d, d')
    condition : float
        ``max(lambda) / min(lambda)`` over the kept eigenvalues.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).normal(size=(500, 3, 2)) * [10.0, 0.1]
    >>> A, condition = whitening_map(X)
    >>> Z = (X @ A).reshape(-1, 2)
    >>> bool(np.allclose(Z.T @ Z / len(Z), np.eye(2))), bool(9e3 < condition < 1.1e4)
    (True, True)
    """
    X = X[:max_samples]
    n, k, d = X.shape
    omega = _normalized_weights(n, None if sample_weight is None else sample_weight[:n])
    tokens = X.reshape(n * k, d)
    moment = (tokens * np.repeat(omega, k)[:, None]).T @ tokens / k
    values, vectors = np.linalg.eigh(moment)
    keep = values > d * np.finfo(float).eps * max(values.max(), 0.0)
    if not np.any(keep):
        return np.eye(d), 1.0
    kept = values[keep]
    return vectors[:, keep] / np.sqrt(kept), float(kept.max() / kept.min())


def _unwhiten(attention, projection, A):
    """``A Theta'_i A^T`` and ``A W'_i``: a layer fitted on whitened tokens."""
    return (
        np.einsum("ap,mpq,bq->mab", A, attention, A, optimize=True),
        np.einsum("ap,mpo->mao", A, projection, optimize=True),
    )


def polish_from_random_starts(
    X,
    Y,
    n_heads,
    *,
    n_starts=3,
    sample_weight=None,
    n_polish_samples=None,
    n_warmup_samples=1000,
    random_state=None,
    whiten="auto",
    start_search="auto",
    decouple="auto",
    **options,
):
    """The polish from random starts, the best kept: a start needing no phases.

    Starts are tried one after another with :func:`staged_polish`; the search
    stops at the first whose fit is realisable (relative residual below
    ``REALISABLE_RESIDUAL``), else keeps the lowest residual of ``n_starts``.
    The starts are drawn, and the polish runs, on whitened tokens
    (:func:`whitening_map`) when ``whiten`` says so; the result is mapped back.
    With ``start_search``, each random start is first moved by Adam on minibatches
    (:func:`skattn.solvers._minibatch.minibatch_search`) to where the
    Levenberg-Marquardt polish converges.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    n_heads : int
    n_starts : int, default=3
    sample_weight, n_polish_samples, n_warmup_samples, random_state, **options
        As in :func:`staged_polish`.
    whiten : {"auto", True, False}, default="auto"
        Fit on the whitened tokens ``X A`` (:func:`whitening_map`) and map the
        layer back.  ``"auto"``: when the tokens' second moment has a condition
        number above ``WHITEN_MIN_CONDITION`` on the subspace they reach, or the
        subspace is proper.
    start_search : {"auto", "minibatch", "none"}, default="auto"
        ``"minibatch"``: the minibatch search before each polish (low-rank heads,
        ``head_rank``); ``"auto"``: when the polish factors the values
        (:func:`choose_factor_values`: many heads, where Levenberg-Marquardt from
        a random start stalls far from the minimum).
    decouple : {"auto", True, False}, default="auto"
        After the minibatch search, refine every head on its own one-head problem
        (:func:`skattn.solvers._decoupled.decoupled_refine`, on
        :func:`~skattn.solvers._decoupled.decoupled_size` random sequences) before
        the polish.  ``"auto"``: when the search runs and the heads' output
        factors fit in the outputs (``n_heads * head_rank <= d_out``,
        :func:`~skattn.solvers._decoupled.can_decouple`); ``True`` raises when
        they do not.

    Returns
    -------
    attention, projection, info
        As :func:`staged_polish`, for the best start; ``info`` also has
        ``n_starts_run``, ``start_residuals`` (one per start tried),
        ``whitening`` (``applied``, ``condition``, ``rank``) and
        ``start_search`` (the minibatch search's info of the best start, or
        None; with the decoupled refinement's info under ``"decoupled"``).
        When that refinement left heads unconverged, the polish returns its
        start (:func:`_unconverged_heads`): ``converged`` is False,
        ``stop_reason`` ``"heads unconverged"``, and ``unconverged_heads``
        lists them.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 4))
    >>> th_hat, W_hat, info = polish_from_random_starts(
    ...     X, forward(X, th, W), 1, random_state=0
    ... )
    >>> info["n_starts_run"], bool(np.allclose(th_hat, th, atol=1e-8))
    (1, True)
    """
    if whiten not in ("auto", True, False):
        raise ValueError(f"whiten must be 'auto', True or False, got {whiten!r}.")
    if start_search not in ("auto", "minibatch", "none"):
        raise ValueError(
            f"start_search must be 'auto', 'minibatch' or 'none', got {start_search!r}."
        )
    rng = check_random_state(random_state)
    d = X.shape[2]
    A, whitened = None, {"applied": False, "condition": None, "rank": d}
    if whiten:
        A, condition = whitening_map(X, sample_weight)
        whitened = {"applied": True, "condition": condition, "rank": A.shape[1]}
        if whiten == "auto" and condition <= WHITEN_MIN_CONDITION and A.shape[1] == d:
            A, whitened["applied"] = None, False
        else:
            X = X @ A
            d = A.shape[1]
    best, best_search, residuals = None, None, []
    head_rank = options.get("head_rank")
    factored = options.get("factor_values", "auto")
    if factored == "auto":
        factored = choose_factor_values(n_heads, d, head_rank)
    if start_search == "auto":
        start_search = "minibatch" if factored else "none"
    if start_search == "minibatch" and (head_rank is None or head_rank >= d):
        raise ValueError(
            "start_search='minibatch' needs low-rank heads (head_rank < d)."
        )
    if decouple not in ("auto", True, False):
        raise ValueError(f"decouple must be 'auto', True or False, got {decouple!r}.")
    decouplable = start_search == "minibatch" and can_decouple(
        n_heads, head_rank, Y.shape[2]
    )
    if decouple is True and not decouplable:
        raise ValueError(
            "decouple=True needs the minibatch search (start_search) and "
            f"n_heads * head_rank <= n_outputs, got {n_heads} * {head_rank} and "
            f"{Y.shape[2]} outputs."
        )
    decouple = decouplable and decouple is not False
    direction = None  # the tokens' constant coordinate, found once for all starts
    if start_search == "minibatch" and options.get("intercept"):
        direction = _intercept_direction(X)
    for _ in range(n_starts):
        start = random_attention(n_heads, d, rng)
        projection_start = None
        if factored or start_search == "minibatch":  # a random start of the V_i too
            projection_start = rng.normal(scale=1.0 / d, size=(n_heads, d, head_rank))
            projection_start = projection_start @ rng.normal(
                size=(n_heads, head_rank, Y.shape[2])
            )
        search_info = None
        if start_search == "minibatch":
            start, projection_start, search_info = _search(
                X,
                Y,
                start,
                projection_start,
                head_rank,
                direction,
                sample_weight,
                rng,
                verbose=int(options.get("verbose", 0) > 1),
                decouple=decouple,
            )
            if not factored:  # the polish eliminates whole W_i
                projection_start = None
        unconverged = _unconverged_heads(search_info)
        result = staged_polish(
            X,
            Y,
            start,
            projection_start,
            sample_weight=sample_weight,
            n_polish_samples=n_polish_samples,
            n_warmup_samples=n_warmup_samples,
            random_state=rng,
            # the joint polish does not run where the heads' own problems stopped
            # short: there it crawls (see _unconverged_heads)
            **(dict(options, stop_below=math.inf) if unconverged else options),
        )
        if unconverged and result[2]["relative_residual"] > REALISABLE_RESIDUAL:
            result[2].update(
                converged=False,
                stop_reason="heads unconverged",
                unconverged_heads=unconverged,
            )
        residuals.append(result[2]["relative_residual"])
        if best is None or residuals[-1] < best[2]["relative_residual"]:
            best, best_search = result, search_info
        if residuals[-1] <= REALISABLE_RESIDUAL:
            break
    attention, projection, info = best
    if A is not None:
        attention, projection = _unwhiten(attention, projection, A)
    info["n_starts_run"] = len(residuals)
    info["start_residuals"] = residuals
    info["whitening"] = whitened
    info["start_search"] = best_search
    return attention, projection, info


def _unconverged_heads(search_info):
    """The heads that the decoupled refinement of a search left unconverged.

    The joint polish is not run from such a point (it returns the start, its
    projections fitted): its Levenberg-Marquardt over all heads' parameters
    crawled where the heads' own problems had stopped, on MiniLM layer 0 of real
    text from 0.056 to 0.0485 in 56 iterations, until the run's 50-minute limit,
    with six heads unconverged (benchmarks/README.md).  The fit
    then ends with a ``ConvergenceWarning`` naming the heads.  (When the
    refinement was not kept, every refined head stayed at the search's end.)"""
    decoupled = (search_info or {}).get("decoupled")
    if not decoupled:
        return []
    return [
        i
        for i, row in enumerate(decoupled["heads"])
        if row is not None and not (row["converged"] and decoupled["kept"])
    ]


def _search(
    X,
    Y,
    attention,
    projection,
    head_rank,
    direction,
    sample_weight,
    rng,
    verbose,
    decouple=False,
):
    """The minibatch search from a start: ``(attention, value factors, info)``.

    The value factors ``V_i`` ``(m, d, r)`` stand for the projections: the polish
    starts its factored values from their column space (:meth:`FactoredHeads.
    from_attention`), an unfactored polish ignores them.  With ``decouple`` the
    searched heads are then refined each on its own problem
    (:func:`decoupled_refine`, on :func:`decoupled_size` random sequences); its
    info is ``info["decoupled"]``.
    """
    m, d = attention.shape[:2]
    par = FactoredHeads(m, d, head_rank)
    # one BLAS thread per half batch, the halves at once when BLAS has two threads
    # or more (12 MiniLM heads: 1400 steps took 5-6 min with two BLAS threads on
    # whole batches, 3.3 min on one)
    n_jobs = _threads(None, 2)
    with threadpool_limits(limits=1, user_api="blas"):
        params, info = minibatch_search(
            X,
            Y,
            par.from_attention(attention, projection),
            par,
            intercept_direction=direction,
            sample_weight=sample_weight,
            n_jobs=n_jobs,
            random_state=rng,
            verbose=verbose,
        )
    if decouple:
        params, info["decoupled"] = _decouple(
            X, Y, params, par, direction, sample_weight, rng, verbose
        )
    return par.attention(params), par.factors(params)[2], info


# Heads whose problems ended near but stopped improving are solved again on this
# many times the sequences, and again on this many times those while they stay
# near and unconverged and the training set has more: a sharp head's problem is
# badly conditioned on few (on MiniLM layer 1 of real text, heads 0, 2 and 3
# stopped at 5.5e-5-1.4e-4 on 376 sequences and converged on 1128; the sharpest
# head, 2.0e-4 on 376 and 2.6e-5 on 1128, converged alone on 3384 to 2.3e-12,
# held out 7.6e-12; benchmarks/README.md).
_STUCK_SEQUENCES = 3


def _stalled(heads, among):
    """The heads of ``among`` whose problems (rows of ``heads``, None when not
    refined) ended near (at most ``_NEAR``) but unconverged."""
    return [
        i
        for i in among
        if heads[i] is not None
        and not heads[i]["converged"]
        and heads[i]["relative_residual"] <= _NEAR
    ]


def _on_more_sequences(
    X, Y, params, par, direction, sample_weight, rng, verbose, info, stuck, rows
):
    """The ``stuck`` heads refined again on ``_STUCK_SEQUENCES`` times the
    sequences (``rows`` and more), those still near and unconverged there on
    ``_STUCK_SEQUENCES`` times those, and so on while the training set has
    more; each stage starts from the previous one's ends, and the heads that
    converge are taken.  ``info["stuck"]`` lists the stages (``heads``,
    ``n_sequences``, ``converged``)."""
    n = X.shape[0]
    more, start, info["stuck"] = rows, params, []
    taken = []
    while stuck and len(more) < n:
        extra = np.setdiff1d(np.arange(n), more)
        size = min(len(extra), (_STUCK_SEQUENCES - 1) * len(more))
        more = np.sort(
            np.concatenate([more, rng.choice(extra, size=size, replace=False)])
        )
        start, again = decoupled_refine(
            X[more],
            Y[more],
            start,
            par,
            sample_weight=None if sample_weight is None else sample_weight[more],
            intercept_direction=direction,
            heads=stuck,
            verbose=verbose,
        )
        info["n_products"] += again["n_products"]
        converged = [i for i in stuck if again["heads"][i]["converged"]]
        info["stuck"].append(
            {"heads": stuck, "n_sequences": len(more), "converged": converged}
        )
        if converged:
            params = params.copy()  # its factors are views: the heads go in place
            for mine, found in zip(
                par.factors(params), par.factors(start), strict=True
            ):
                mine[converged] = found[converged]
            for i in converged:
                info["heads"][i] = again["heads"][i]
            taken += converged
        stuck = _stalled(again["heads"], stuck)
    if taken:
        Xd, Yd = X[rows], Y[rows]
        weights = None if sample_weight is None else sample_weight[rows]
        info["residual"] = _output_factors(
            Xd, Yd, params, par, weights, direction is not None
        )[1]
        info["kept"] = True
    return params, info


# Heads whose one-head problem ended far (above _NEAR) are searched afresh and
# refined again in two passes over the heads still far (at most as many tries as
# heads): first on the head's own one-head problem (search_head), realisable by
# the head alone whatever the other heads' errors; then on what the other heads
# leave unexplained (_replace_head, the search's replacement), whose target is
# the head's alone once the other heads are exact.  (On MiniLM layer 0 of real
# text, five heads far after the rounds: the first gave converged heads in 3 of 7
# tries, the second in 5 of 15, the farthest head only with five other far heads
# made exact; benchmarks/README.md.)
_DECOUPLED_PASSES = ("own problem", "what the others leave")


def _decouple(X, Y, params, par, direction, sample_weight, rng, verbose):
    """:func:`decoupled_refine` on :func:`decoupled_size` random sequences; then
    each head it could not bring near (a head the search left mixed with another,
    or found only roughly) is searched afresh and refined alone again, in the
    passes of ``_DECOUPLED_PASSES`` (at most ``m`` tries).  Heads that ended near
    but unconverged are first refined again on more sequences
    (:func:`_on_more_sequences`).  Returns the parameters and the refinement's
    info, with ``stuck`` (per stage on more sequences: ``heads``,
    ``n_sequences``, ``converged``; when there were such heads) and
    ``replacements`` (per try: ``head``, ``searched_on`` and ``converged``)."""
    n, k = X.shape[:2]
    size = decoupled_size(par.n_heads, k, par.n_features, par.rank, Y.shape[2])
    rows = np.sort(rng.choice(n, size=min(n, size), replace=False))
    Xd, Yd = X[rows], Y[rows]
    weights = None if sample_weight is None else sample_weight[rows]
    params, info = decoupled_refine(
        Xd,
        Yd,
        params,
        par,
        sample_weight=weights,
        intercept_direction=direction,
        verbose=verbose,
    )
    stuck = _stalled(info["heads"], range(par.n_heads))
    if stuck and n > len(rows):
        params, info = _on_more_sequences(
            X, Y, params, par, direction, sample_weight, rng, verbose, info, stuck, rows
        )
    info["replacements"] = []
    n_jobs = _threads(None, 2)
    for searched_on in _DECOUPLED_PASSES:
        # near heads were restarted from their ends already (every replacement of
        # such a head measured on MiniLM ended worse than it began)
        pending = [
            i for i, row in enumerate(info["heads"]) if row["relative_residual"] > _NEAR
        ]
        for head in pending[: par.n_heads - len(info["replacements"])]:
            searched = np.sort(
                rng.choice(
                    n, size=min(n, _REPLACEMENT_BATCHES * _BATCH_SIZE), replace=False
                )
            )
            with threadpool_limits(limits=1, user_api="blas"):
                if searched_on == "own problem":
                    candidate = search_head(
                        X[searched],
                        Y[searched],
                        params,
                        par,
                        head,
                        sample_weight=(
                            None if sample_weight is None else sample_weight[searched]
                        ),
                        intercept_direction=direction,
                        n_jobs=n_jobs,
                        random_state=rng,
                    )[0]
                else:
                    candidate = _replace_head(
                        X,
                        Y,
                        params,
                        par,
                        head,
                        rows=searched,
                        intercept_direction=direction,
                        batch_size=min(n, _BATCH_SIZE),
                        learning_rate=_LEARNING_RATE,
                        random_state=rng,
                        dtype=np.float32,
                        n_jobs=n_jobs,
                    )
            refined, again = decoupled_refine(
                Xd,
                Yd,
                candidate,
                par,
                sample_weight=weights,
                intercept_direction=direction,
                heads=[head],
                verbose=verbose,
            )
            converged = bool(again["heads"][head]["converged"])
            info["n_products"] += again["n_products"]  # spent, taken or not
            if converged and again["residual"] < info["residual"]:
                params, info["residual"] = refined, again["residual"]
                info["heads"][head] = again["heads"][head]
                info["kept"] = True
            info["replacements"].append(
                {"head": int(head), "searched_on": searched_on, "converged": converged}
            )
            if verbose:
                print(
                    f"decoupled: head {head} searched afresh on {searched_on}, "
                    f"converged: {converged}"
                )
    return params, info
