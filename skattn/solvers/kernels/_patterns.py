"""A head's attention patterns read off its outputs: simplex least squares.

For one head of a layer whose heads decouple
(:mod:`skattn.solvers.kernels._decoupling`), the head's share of the outputs is,
per sequence ``s`` and query token ``q``,

    u_{s,q} = sum_j P_{s,q,j} z_{s,j},     z_{s,j} = x_{s,j} W  (r numbers),

``P`` its attention patterns and ``W`` its value map.  With ``r >= k`` (head rank
32, 16 tokens) each row ``P_{s,q}`` is the unique point of the probability
simplex that best explains ``u_{s,q}``, once ``W`` is known; and ``W`` is a linear
least-squares fit once ``P`` is known.  :func:`invert_patterns` alternates the
two, with the other heads' shares as fixed columns of ``W``'s fit (as in
:func:`~skattn.solvers.decoupled_refine`), and returns the patterns that the
outputs imply, free of any ``Theta``.

Why: a nearly one-hot head (all-MiniLM-L6-v2 layer 0, head 2, a previous-token
head whose largest weight is 0.99993 at the median) is found by the search with
every row's largest weight in the right place but the small weights wrong by 4-8
nats (too sharp); Levenberg-Marquardt cannot move it, because the Jacobian of a
weight is proportional to the weight.  The patterns that :func:`invert_patterns`
reads off the outputs (3000 windows) have the small weights' logarithms right to
0.002, 0.02 and 0.08 nats (weights above 1e-3, in 1e-4 to 1e-3, in 1e-5 to 1e-4)
from a start that knows only where the largest weight is (benchmarks/HISTORY.md).

Pure functions on token tensors (no validation; callers validate).
"""

import numpy as np

from ._decoupling import _one_head_problem

# Start: the value map fitted with one-hot patterns on the rows it explains best,
# this fraction of them, refitted this many times (a quarter left too few distinct
# rows on MiniLM layer 0).
_TRIM_FRACTION = 0.5
_TRIM_ROUNDS = 4
# Rows of simplex_least_squares' systems at once (memory: about 6 kB a row at
# k = 16, about 100 MB in all).
_CHUNK_ROWS = 16384


def project_simplex(V):
    """Euclidean projection of every row (last axis) onto the probability simplex.

    The sort-based algorithm (Held, Wolfe & Crowder 1974; Duchi et al. 2008),
    vectorised over rows.

    Examples
    --------
    >>> import numpy as np
    >>> project_simplex(np.array([[0.5, 0.5, 0.5], [2.0, 0.0, -1.0]]))
    array([[0.33333333, 0.33333333, 0.33333333],
           [1.        , 0.        , 0.        ]])
    """
    V = np.asarray(V, dtype=float)
    k = V.shape[-1]
    ordered = -np.sort(-V, axis=-1)
    cumulative = np.cumsum(ordered, axis=-1) - 1.0
    support = ordered - cumulative / np.arange(1, k + 1) > 0
    # the support's size: the last index where the condition holds, plus one
    size = k - np.argmax(support[..., ::-1], axis=-1)
    shift = (
        np.take_along_axis(cumulative, (size - 1)[..., None], axis=-1) / size[..., None]
    )
    return np.maximum(V - shift, 0.0)


def simplex_least_squares(targets, images, start, max_iter=None, tol=1e-13):
    """``argmin ||u_{s,q} - p Z_s||`` over the probability simplex, every row.

    An active-set method (Lawson & Hanson's for nonnegative least squares, with
    the weights' sum held at one), vectorised over rows: each iteration solves,
    for every row not yet optimal, the equality-constrained problem on its free
    weights (one small KKT system per row), then either steps towards that
    solution until a weight reaches zero and fixes it there, or, when the
    solution is nonnegative, frees the fixed weight whose multiplier is most
    negative; a row stops when every multiplier is nonnegative, its solution
    exact to rounding.  Rows left after ``max_iter`` iterations are finished
    by accelerated projected gradient (FISTA, Beck & Teboulle 2009).  (On
    all-MiniLM-L6-v2 layer 0's previous-token head, 1128 sequences, FISTA's 1000
    iterations a round were most of the pattern reading; benchmarks/HISTORY.md.)

    Parameters
    ----------
    targets : ndarray of shape (n, k_q, r)
        The rows ``u_{s,q}``.
    images : ndarray of shape (n, k, r)
        The points ``z_{s,j}`` that each row of sequence ``s`` mixes.
    start : ndarray of shape (n, k_q, k)
        Rows on the simplex (e.g. the previous solution); its zeros start fixed.
    max_iter : int or None, default=None
        Active-set iterations; ``None``: ``4 k + 20``.
    tol : float, default=1e-13
        A fixed weight is freed when its multiplier is below ``-tol`` times its
        sequence's largest ``||z_{s,j}||^2``.

    Returns
    -------
    P : ndarray of shape (n, k_q, k)

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> Z = rng.normal(size=(2, 3, 5))
    >>> P = project_simplex(rng.normal(size=(2, 4, 3)))
    >>> found = simplex_least_squares(P @ Z, Z, np.full((2, 4, 3), 1 / 3))
    >>> bool(np.abs(found - P).max() < 1e-12)
    True
    """
    n, k_q, _ = targets.shape
    k = images.shape[1]
    max_iter = 4 * k + 20 if max_iter is None else int(max_iter)
    start = project_simplex(np.asarray(start, dtype=float))
    step = max(1, _CHUNK_ROWS // k_q)
    return np.concatenate(
        [
            _active_set(
                targets[i : i + step],
                images[i : i + step],
                start[i : i + step],
                max_iter,
                tol,
            )
            for i in range(0, n, step)
        ]
    )


def _active_set(targets, images, start, max_iter, tol):
    """:func:`simplex_least_squares` on one chunk of sequences."""
    n, k_q, _ = targets.shape
    k = images.shape[1]
    gram = images @ np.swapaxes(images, 1, 2)
    linear = targets @ np.swapaxes(images, 1, 2)
    diagonal = np.diagonal(gram, axis1=1, axis2=2)
    scale = np.maximum(diagonal.max(-1), np.finfo(float).tiny)
    # a ridge far below rounding keeps the KKT systems regular when a sequence
    # repeats a token (its Z_s then has equal rows)
    ridge = 1e-14 * scale
    P = np.array(start, dtype=float).reshape(n * k_q, k)
    b = linear.reshape(n * k_q, k)
    sequence = np.repeat(np.arange(n), k_q)
    free = P > 0
    active = np.arange(n * k_q)
    eye = np.eye(k, dtype=bool)
    for _ in range(max_iter):
        if active.size == 0:
            break
        s = sequence[active]
        G = gram[s]  # gathered once an iteration: the system and the multipliers
        f = free[active]
        mask = f[:, :, None] & f[:, None, :]
        system = np.zeros((active.size, k + 1, k + 1))
        system[:, :k, :k] = np.where(
            mask, G + ridge[s, None, None] * eye, eye.astype(float)
        )
        system[:, :k, k] = f
        system[:, k, :k] = f
        rhs = np.concatenate(
            [np.where(f, b[active], 0.0), np.ones((active.size, 1))], 1
        )
        solution = np.linalg.solve(system, rhs[..., None])[..., 0]
        best, multiplier = solution[:, :k], solution[:, k]
        p = P[active]
        negative = f & (best < 0)
        stepped = negative.any(1)
        # towards the solution until the first free weight reaches zero
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(negative, p / (p - best), np.inf)
        alpha = np.clip(ratio.min(1), 0.0, 1.0)[:, None]
        moved = np.where(stepped[:, None], p + alpha * (best - p), best)
        hit = stepped[:, None] & ((ratio <= alpha) | (f & (moved <= 0.0)))
        moved = np.where(hit, 0.0, moved)
        f = f & ~hit
        # optimal rows: every fixed weight's multiplier nonnegative
        dual = np.einsum("aij,aj->ai", G, moved) - b[active] + multiplier[:, None]
        dual = np.where(f | stepped[:, None], np.inf, dual)
        worst = dual.argmin(1)
        release = ~stepped & (dual.min(1) < -tol * scale[s])
        f[release, worst[release]] = True
        P[active], free[active] = moved, f
        active = active[stepped | release]
    if active.size:
        P[active] = _projected_gradient(
            b[active][:, None], gram[sequence[active]], P[active][:, None]
        )[:, 0]
    return P.reshape(n, k_q, k)


def _projected_gradient(linear, gram, start, max_iter=1000, tol=1e-13):
    """FISTA on ``1/2 p G p - b p`` over the simplex, every row: ``linear``
    ``(a, k_q, k)``, ``gram`` ``(a, k, k)``, ``start`` ``(a, k_q, k)``; each
    problem's step ``1 / ||G||``."""
    lipschitz = np.linalg.eigvalsh(gram)[:, -1][:, None, None]
    lipschitz = np.maximum(lipschitz, np.finfo(float).tiny)
    P = np.array(start, dtype=float, copy=True)
    moving, t = P.copy(), 1.0
    for _ in range(int(max_iter)):
        following = project_simplex(moving - (moving @ gram - linear) / lipschitz)
        t_next = (1.0 + np.sqrt(1.0 + 4.0 * t * t)) / 2.0
        step = following - P
        moving = following + ((t - 1.0) / t_next) * step
        P, t = following, t_next
        if np.abs(step).max() <= tol:
            break
    return P


def _value_fit(X, target, fixed, patterns, rows=None):
    """Least-squares value map (and the fixed columns' coefficients) for
    ``patterns``, on ``rows`` (a boolean ``(n, k)`` mask) or all: the coefficients
    and every row's residual norm."""
    n, k, r = target.shape
    design = patterns @ X
    if fixed is not None:
        design = np.concatenate([design, fixed], axis=2)
    design = design.reshape(n * k, -1)
    flat = target.reshape(n * k, r)
    mask = slice(None) if rows is None else rows.reshape(-1)
    coef = np.linalg.lstsq(design[mask], flat[mask], rcond=None)[0]
    residual = np.linalg.norm(design @ coef - flat, axis=1).reshape(n, k)
    return coef, residual


def invert_patterns(
    X,
    Y,
    params,
    parametrization,
    head,
    *,
    sample_weight=None,
    intercept_direction=None,
    n_rounds=10,
    max_iter=None,
    stall=0.0,
):
    """The attention patterns of head ``head`` that the outputs imply.

    On the head's one-head problem (targets ``Y D_i``, the other heads' shares
    ``Y D_{-i}`` as fixed columns, ``D`` the decoupling map at ``params``; see
    :func:`~skattn.solvers.decoupled_refine`), alternate ``n_rounds`` times: the
    value map by least squares for the patterns, then every row of the patterns
    by least squares on the probability simplex for the value map
    (:func:`simplex_least_squares`).  The start needs only the position of each
    row's largest weight, taken from ``params``: the value map is fitted with
    one-hot patterns on the half of the rows they explain best (refitted
    ``4`` times); this suits nearly one-hot heads.  Each row needs at least as
    many value features as tokens (``head_rank >= k``) to be determined.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    params : ndarray of shape (3 m d r,)
        :class:`FactoredHeads` parameters.
    parametrization : FactoredHeads
        With ``m r <= d_out`` (:func:`can_decouple`).
    head : int
    sample_weight : ndarray of shape (n,) or None
        Used for the decoupling map only.
    intercept_direction : ndarray of shape (d,) or None
        As in :func:`~skattn.solvers.decoupled_refine`.
    n_rounds : int, default=10
        Rounds at most.
    max_iter : int or None, default=None
        Active-set iterations of each simplex least-squares solve (see
        :func:`simplex_least_squares`).
    stall : float, default=0.0
        Stop early once a round lowers the relative residual by less than this
        fraction of it (0: all ``n_rounds``).

    Returns
    -------
    patterns : ndarray of shape (n, k, k)
        Rows on the probability simplex.
    info : dict
        ``residuals``: the relative residual of the head's targets after each
        value fit (the start's first), the other heads' shares eliminated.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward, softmax
    >>> from skattn.solvers import FactoredHeads
    >>> rng = np.random.default_rng(0)
    >>> par = FactoredHeads(1, 6, 6)
    >>> truth = rng.normal(size=par.size)
    >>> X = rng.normal(size=(300, 4, 6))
    >>> Y = forward(X, par.attention(truth), par.factors(truth)[2])
    >>> found, info = invert_patterns(X, Y, truth, par, 0, n_rounds=30)
    >>> real = softmax(par.logits(X, truth), axis=-1)[:, 0]
    >>> bool(np.abs(found - real).max() < 1e-6)
    True
    """
    n, k = Y.shape[:2]
    target, fixed = _one_head_problem(
        X,
        Y,
        params,
        parametrization,
        head,
        sample_weight,
        intercept_direction is not None,
    )
    norm = max(float(np.linalg.norm(target)), np.finfo(float).tiny)
    logits = parametrization.logits(X, params)[:, head]
    patterns = np.zeros_like(logits)
    np.put_along_axis(patterns, logits.argmax(-1)[..., None], 1.0, -1)
    rows = np.ones((n, k), dtype=bool)
    for _ in range(_TRIM_ROUNDS):
        coef, row_residuals = _value_fit(X, target, fixed, patterns, rows)
        rows = row_residuals <= np.quantile(row_residuals, _TRIM_FRACTION)
    d = X.shape[2]
    residuals = []
    for round_ in range(int(n_rounds) + 1):
        if round_ > 0:
            coef, row_residuals = _value_fit(X, target, fixed, patterns)
        residuals.append(float(np.linalg.norm(row_residuals) / norm))
        if round_ == n_rounds or (
            round_ > 0 and residuals[-1] > (1.0 - stall) * residuals[-2]
        ):
            break
        explained = target if fixed is None else target - fixed @ coef[d:]
        patterns = simplex_least_squares(explained, X @ coef[:d], patterns, max_iter)
    return patterns, {"residuals": residuals}
