"""Phase 6 of the phased learner: an epsilon-net over the affine hull, then a polish.

Every Theta_i lies on the affine hull ``{c + sum_j C_j D_j}`` found by phases 2-5
(``c`` a point, ``D_j`` orthonormal directions).  The net tries candidate head
positions on a grid of hull coordinates; for each m-subset of grid points the W_i are
one least-squares solve away, and the subset with the smallest residual wins.  The
winner then seeds a local polish (:func:`skattn.solvers.polish`), which is not
restricted to the hull, so a slightly wrong hull is corrected there.

Speed comes from sharing work across candidates: the head features ``S(Theta_g) X``
of every grid point g are computed once, and so are the Gram blocks
``F_a^T F_b`` and ``F_a^T Y`` of every pair of grid points (they are the normal
equations of a "layer" with one head per grid point).  A candidate {a_1..a_m} then
costs one ``(m d) x (m d)`` solve, and candidates are solved in batches by
``numpy.linalg.solve`` on stacks of matrices.
"""

import math
import time
from itertools import combinations

import numpy as np
from sklearn.utils import check_random_state

from ..solvers._options import PolishOptions
from ..solvers.kernels._loss import projection_normal_equations
from ..solvers.stages._polish import staged_polish
from ._options import NetOptions

# the defaults of phase 6 (written once, in the options objects)
_NET, _POLISH = NetOptions(), PolishOptions()

# Largest Gram matrix of the grid, (n_grid d)^2 floats, and largest candidate batch.
_MAX_GRID_GRAM = 2**24
_BATCH_FLOATS = 2**21


def _default_resolution(n_heads, n_features):
    """41 points per coordinate for 2 heads, 7 for 3, 5 for 4 (1 for one head).

    Beyond, or when that grid's Gram matrix does not fit the memory budget (e.g.
    2 heads at d = 128, 4 heads at d = 64), the finest grid that fits (at least 2).
    """
    max_points = math.isqrt(_MAX_GRID_GRAM) // n_features
    if n_heads <= 4:
        preferred = {1: 1, 2: 41, 3: 7, 4: 5}[n_heads]
        if n_heads == 1 or preferred ** (n_heads - 1) <= max_points:
            return preferred
    resolution = 2
    while (resolution + 1) ** (n_heads - 1) <= max_points:
        resolution += 1
    return resolution


def minimum_norm_point(point, directions):
    """The point of the affine hull ``point + span(directions)`` closest to 0.

    Parameters
    ----------
    point : ndarray of shape (d, d)
    directions : ndarray of shape (r, d, d), orthonormal in the Frobenius product

    Returns
    -------
    center : ndarray of shape (d, d)

    Examples
    --------
    >>> import numpy as np
    >>> minimum_norm_point(np.ones((1, 1)) * 3.0, np.ones((1, 1, 1)))
    array([[0.]])
    """
    coords = np.einsum("de,rde->r", point, directions)
    return point - np.einsum("r,rde->de", coords, directions)


def hull_grid(n_coords, resolution, radius):
    """Grid of ``resolution ** n_coords`` points of ``[-radius, radius]^n_coords``.

    Parameters
    ----------
    n_coords : int
        Dimension of the box (hull coordinates per head, m - 1).
    resolution : int
        Points per coordinate (evenly spaced, ends included; 1 gives the origin).
    radius : float
        Half-width of the box.

    Returns
    -------
    grid : ndarray of shape (resolution ** n_coords, n_coords)
        One point (the origin, shape ``(1, 0)``) when ``n_coords == 0``.

    Examples
    --------
    >>> hull_grid(1, 3, 1.0)[:, 0]
    array([-1.,  0.,  1.])
    >>> hull_grid(2, 2, 1.0).shape
    (4, 2)
    """
    if n_coords == 0:
        return np.zeros((1, 0))
    axis = np.linspace(-radius, radius, resolution) if resolution > 1 else np.zeros(1)
    mesh = np.meshgrid(*([axis] * n_coords), indexing="ij")
    return np.stack([g.ravel() for g in mesh], axis=-1).reshape(-1, n_coords)


def _candidate_residuals(blocks, rhs, y_sq, candidates, ridge):
    """Twice the loss of each candidate m-subset with its least-squares W.

    ``blocks`` (G, G, d, d) = F_a^T F_b, ``rhs`` (G, d, o) = F_a^T Y (weighted and
    normalised), ``candidates`` (c, m) grid indices.  Residual
    ``y_sq - tr(W^T rhs_c)`` with ``W = K_c^{-1} rhs_c``; batched over candidates.
    Returns residuals (c,) and the W of each candidate (c, m, d, o).
    """
    c, m = candidates.shape
    d, d_out = rhs.shape[1], rhs.shape[2]
    md = m * d
    gram = blocks[candidates[:, :, None], candidates[:, None, :]]  # (c, m, m, d, d)
    gram = gram.transpose(0, 1, 3, 2, 4).reshape(c, md, md)
    right = rhs[candidates].reshape(c, md, d_out)
    # tiny relative ridge keeps nearly collinear candidates solvable
    scale = np.trace(gram, axis1=1, axis2=2) / md
    gram = gram + (ridge * scale)[:, None, None] * np.eye(md)
    solution = np.linalg.solve(gram, right)
    residuals = y_sq - np.einsum("cpo,cpo->c", solution, right)
    return residuals, solution.reshape(c, m, d, d_out)


def _evaluate(blocks, rhs, y_sq, candidates, ridge):
    """Residuals of all candidates, in batches of bounded memory."""
    m = candidates.shape[1]
    d = blocks.shape[2]
    per = (m * d) ** 2 * 3 + m * d * rhs.shape[2]
    size = max(1, _BATCH_FLOATS // per)
    out = np.empty(candidates.shape[0])
    for start in range(0, candidates.shape[0], size):
        part = candidates[start : start + size]
        out[start : start + size] = _candidate_residuals(
            blocks, rhs, y_sq, part, ridge
        )[0]
    return out


def _swap_search(blocks, rhs, y_sq, start, ridge, max_sweeps):
    """Greedy head-swap descent: replace one head by any grid point while it helps."""
    n_grid = blocks.shape[0]
    best = np.array(start)
    best_res = _evaluate(blocks, rhs, y_sq, best[None], ridge)[0]
    n_evaluated = 1
    for _ in range(max_sweeps):
        improved = False
        for slot in range(best.size):
            others = np.delete(best, slot)
            free = np.setdiff1d(np.arange(n_grid), others)
            trial = np.repeat(best[None], free.size, axis=0)
            trial[:, slot] = free
            res = _evaluate(blocks, rhs, y_sq, trial, ridge)
            n_evaluated += free.size
            j = int(np.argmin(res))
            if res[j] < best_res * (1 - 1e-12):
                best, best_res, improved = trial[j], res[j], True
        if not improved:
            break
    return np.sort(best), best_res, n_evaluated


def net_search(
    X,
    Y,
    point,
    directions,
    n_heads,
    *,
    resolution=None,
    radius=None,
    sample_weight=None,
    n_samples=1000,
    max_candidates=20_000,
    max_sweeps=10,
    ridge=1e-12,
    random_state=None,
):
    """Phase 6a: the best m-subset of a grid on the affine hull, W by least squares.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    point : ndarray of shape (d, d)
        A point of the affine hull of the Theta_i.
    directions : ndarray of shape (r, d, d)
        Orthonormal (Frobenius) directions of the hull, ``r = n_heads - 1``
        normally; shape ``(0, d, d)`` for one head.
    n_heads : int
    resolution : int or None
        Grid points per hull coordinate; ``None``: 41 for 2 heads, 7 for 3, 5 for 4,
        beyond that the finest grid whose Gram matrix fits in memory
        (``resolution ** (m - 1) * d <= 4096``).
    radius : float or None
        Half-width of the box of hull coordinates, **relative to** ``||c||_F``
        where ``c`` is the minimum-norm point of the hull (the box is centred
        there): heads of equal norm s in general position sit at
        ``||c|| ~ s / sqrt(m)`` and at coordinates up to about
        ``sqrt(m - 1) ||c||``, so a relative radius is scale-free.  ``None``:
        ``1.5 sqrt(m - 1)``.  When ``c == 0`` the unit is 1.
    sample_weight : ndarray of shape (n,) or None
    n_samples : int, default=1000
        Examples used by the net (a random subset when n is larger).
    max_candidates : int, default=20_000
        When ``comb(resolution ** r, m)`` exceeds it, the net is randomised: that
        many random m-subsets of the grid, then greedy head swaps (replace one
        head by every grid point, keep the best, repeat) from the best of them.
    max_sweeps : int, default=10
        Sweeps of the head-swap descent (randomised net only).
    ridge : float, default=1e-12
        Relative ridge of each candidate's Gram matrix.
    random_state : int, RandomState instance or None

    Returns
    -------
    attention : ndarray of shape (n_heads, d, d)
    projection : ndarray of shape (n_heads, d, d_out)
        Least-squares W_i on the net's examples.
    info : dict
        ``residual`` (the best candidate's loss relative to ``||Y||^2``),
        ``n_candidates``, ``strategy`` ("exhaustive" / "random+swap" /
        "single"), ``n_grid``, ``resolution``, ``radius`` (absolute), ``spacing``,
        ``n_samples``, ``coordinates`` (the winner's hull coordinates) and the
        spread of the candidates' relative residuals (``residual_min``,
        ``residual_median``, ``residual_max``).  A relative residual is
        ``sum_n w_n ||F(X_n) - Y_n||^2 / sum_n w_n ||Y_n||^2`` on the net's examples.

    Notes
    -----
    Heads are unordered, so the exhaustive net enumerates the
    ``comb(resolution ** r, m)`` subsets of distinct grid points, not ordered
    tuples.  The net only has to land in the basin of the polish: on planted
    Boolean and Gaussian layers (``||Theta_i||_F = 2``, d = 8-16, k = 4-8) the
    default grids (820 candidates for m = 2, 18424 for m = 3, randomised with
    head swaps for m = 4, 5) were followed by a successful polish in every
    instance tried, also with the hull's point and directions perturbed by 30 %.
    Cost: the grid's head features and Gram matrix,
    ``O(n_samples k (G d)^2)`` for G grid points, then ``O((m d)^3)`` per
    candidate.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> th = rng.normal(size=(2, 4, 4)); W = rng.normal(size=(2, 4, 4))
    >>> diff = th[1] - th[0]
    >>> directions = (diff / np.linalg.norm(diff))[None]
    >>> th_hat, W_hat, info = net_search(
    ...     X, forward(X, th, W), th[0], directions, 2, resolution=21, random_state=0
    ... )
    >>> info["n_candidates"], bool(info["residual"] < 0.1)
    (210, True)
    """
    rng = check_random_state(random_state)
    n, _, d = X.shape
    r = directions.shape[0]
    if resolution is None:
        resolution = _default_resolution(n_heads, d)
    if n_heads < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads}.")
    if resolution < 1:
        raise ValueError(f"resolution must be a positive integer, got {resolution}.")
    center = minimum_norm_point(point, directions)
    unit = float(np.linalg.norm(center)) or 1.0
    rel_radius = 1.5 * math.sqrt(max(n_heads - 1, 1)) if radius is None else radius
    abs_radius = rel_radius * unit
    grid = hull_grid(r, resolution if r else 1, abs_radius)
    n_grid = grid.shape[0]
    if n_grid < n_heads:
        raise ValueError(
            f"The net has {n_grid} grid points for {n_heads} heads; increase "
            f"resolution (got {resolution})."
        )
    if (n_grid * d) ** 2 > _MAX_GRID_GRAM:
        raise ValueError(
            f"resolution={resolution} gives {n_grid} grid points; their Gram matrix "
            f"({n_grid * d} x {n_grid * d}) is too large. Lower resolution so that "
            f"resolution ** {r} * {d} <= {int(math.sqrt(_MAX_GRID_GRAM))}."
        )
    thetas = center + np.einsum("gr,rde->gde", grid, directions)

    if n > n_samples:
        rows = np.sort(rng.choice(n, size=n_samples, replace=False))
        X, Y = X[rows], Y[rows]
        sample_weight = None if sample_weight is None else sample_weight[rows]
    gram, rhs, y_sq = projection_normal_equations(X, Y, thetas, sample_weight)
    d_out = Y.shape[2]
    blocks = gram.reshape(n_grid, d, n_grid, d).transpose(0, 2, 1, 3)
    rhs = rhs.reshape(n_grid, d, d_out)

    n_total = math.comb(n_grid, n_heads)
    if n_total <= max_candidates:
        strategy = "exhaustive" if n_total > 1 else "single"
        candidates = np.array(list(combinations(range(n_grid), n_heads)), dtype=np.intp)
        residuals = _evaluate(blocks, rhs, y_sq, candidates, ridge)
        best = candidates[int(np.argmin(residuals))]
        n_candidates = candidates.shape[0]
    else:
        strategy = "random+swap"
        keys = rng.random((max_candidates, n_grid))
        candidates = np.sort(np.argsort(keys, axis=1)[:, :n_heads], axis=1)
        residuals = _evaluate(blocks, rhs, y_sq, candidates, ridge)
        start = candidates[int(np.argmin(residuals))]
        best, _, n_swapped = _swap_search(blocks, rhs, y_sq, start, ridge, max_sweeps)
        n_candidates = candidates.shape[0] + n_swapped
    best_res, best_w = _candidate_residuals(blocks, rhs, y_sq, best[None], ridge)
    relative = residuals / y_sq if y_sq > 0 else residuals
    info = {
        "strategy": strategy,
        "n_candidates": int(n_candidates),
        "n_grid": int(n_grid),
        "resolution": int(resolution if r else 1),
        "radius": float(abs_radius),
        "spacing": float(2 * abs_radius / (resolution - 1)) if resolution > 1 else 0.0,
        "n_samples": int(X.shape[0]),
        "residual": float(best_res[0] / y_sq) if y_sq > 0 else float(best_res[0]),
        "residual_min": float(np.min(relative)),
        "residual_median": float(np.median(relative)),
        "residual_max": float(np.max(relative)),
        "coordinates": grid[best],
    }
    return thetas[best], best_w[0], info


def fit_from_hull(
    X,
    Y,
    point,
    directions,
    n_heads,
    *,
    resolution=_NET.resolution,
    radius=_NET.radius,
    polish=_POLISH.enabled,
    sample_weight=None,
    n_net_samples=_NET.n_samples,
    max_candidates=_NET.max_candidates,
    polish_method="levenberg-marquardt",
    polish_mode=None,
    max_iter=_POLISH.max_iter,
    tol=_POLISH.tol,
    n_polish_samples=_POLISH.n_samples,
    n_warmup_samples=1000,
    solver=_POLISH.solver,
    head_rank=_POLISH.head_rank,
    intercept=_POLISH.intercept,
    verbose=_POLISH.verbose,
    factor_values=_POLISH.factor_values,
    random_state=None,
):
    """Phase 6: the epsilon-net on the hull, then a local polish of all parameters.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    point, directions, n_heads, resolution, radius, sample_weight, max_candidates
        As in :func:`net_search`.
    polish : bool, default=True
        Polish the net's winner with :func:`skattn.solvers.polish` (not restricted
        to the hull).
    n_net_samples : int, default=1000
        Examples used by the net.
    polish_method : {"levenberg-marquardt", "lbfgs"}, default="levenberg-marquardt"
    polish_mode : {"varpro", "full", "both"} or None
        ``None``: ``"varpro"`` for Levenberg-Marquardt (already at machine
        precision on realisable data), ``"both"`` for L-BFGS-B.
    max_iter : int, default=100
    tol : float, default=1e-10
    n_polish_samples : int or None
        Examples used by the polish (a random subset); ``None``: all.
    solver : {"auto", "dense", "matrix-free"}, default="auto"
        Levenberg-Marquardt solver of the polish (:func:`skattn.solvers.polish`).
    head_rank : int or None, default=None
        Polish low-rank heads ``Theta_i = Q_i K_i^T`` of this rank.
    intercept : bool, default=False
        The tokens' last coordinate is constant (``fit_intercept``): see
        :func:`skattn.solvers.polish`.
    verbose : int, default=0
        2 prints the matrix-free polish's iterations.
    factor_values : {"auto", True, False}, default="auto"
        With ``head_rank``: also factor the values in the polish (see
        :func:`skattn.solvers.polish`).
    n_warmup_samples : int or None, default=1000
        Two-stage polish (:func:`skattn.solvers.stages._polish.staged_polish`): when
        the polish set is larger, the polish first runs on a random subset of
        this many of its examples (the warm-up: the same
        optimum on realisable data, at a fraction of the cost, since every
        Levenberg-Marquardt iteration is linear in the examples), then on the
        whole polish set from the warm-up's result.  The second stage is skipped
        when the warm-up's fit already leaves a relative RMS residual below
        1e-10 on the whole polish set (noise-free data: nothing left to gain);
        with noise it runs from the warm-up's optimum with little damping and
        costs about 3 iterations on the polish set.  ``None``: one stage on the
        polish set.
    random_state : int, RandomState instance or None

    Returns
    -------
    attention : ndarray of shape (n_heads, d, d)
    projection : ndarray of shape (n_heads, d, d_out)
    info : dict
        ``{"net": <net_search info>, "polish": <polish info or None>}``, each
        with its wall time under ``"seconds"``.  The polish info is that of the
        last stage run, with ``n_iter`` summed over the stages, ``warmup`` (the
        warm-up stage's info, or None) and ``final_stage`` ("ran", "skipped:
        realisable" or "none").

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> th = rng.normal(size=(2, 4, 4)); W = rng.normal(size=(2, 4, 4))
    >>> diff = th[1] - th[0]
    >>> directions = (diff / np.linalg.norm(diff))[None]
    >>> th_hat, W_hat, info = fit_from_hull(
    ...     X, forward(X, th, W), th[0], directions, 2, resolution=21, random_state=0
    ... )
    >>> bool(np.allclose(np.sort(th_hat[:, 0, 0]), np.sort(th[:, 0, 0])))
    True
    """
    rng = check_random_state(random_state)
    start = time.perf_counter()
    attention, projection, net_info = net_search(
        X,
        Y,
        point,
        directions,
        n_heads,
        resolution=resolution,
        radius=radius,
        sample_weight=sample_weight,
        n_samples=n_net_samples,
        max_candidates=max_candidates,
        random_state=rng,
    )
    net_info["seconds"] = time.perf_counter() - start
    polish_info = None
    if polish:
        start = time.perf_counter()
        if polish_mode is None:
            polish_mode = "both" if polish_method == "lbfgs" else "varpro"
        attention, projection, polish_info = staged_polish(
            X,
            Y,
            attention,
            projection,
            sample_weight=sample_weight,
            n_polish_samples=n_polish_samples,
            n_warmup_samples=n_warmup_samples,
            random_state=rng,
            mode=polish_mode,
            method=polish_method,
            max_iter=max_iter,
            tol=tol,
            solver=solver,
            head_rank=head_rank,
            intercept=intercept,
            verbose=verbose,
            factor_values=factor_values,
        )
        polish_info["seconds"] = time.perf_counter() - start
    return attention, projection, {"net": net_info, "polish": polish_info}
