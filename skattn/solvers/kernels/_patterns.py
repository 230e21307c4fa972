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

Pure functions on token tensors in any array namespace (that of the inputs, on
their device; no validation, callers validate).  Host reads only where a loop
decides: which rows of the active-set method go on (every iteration on numpy,
every ``_READ_EVERY`` elsewhere), whether FISTA has stopped (as often), the
rows a trimmed value fit keeps, and each round's residual.
"""

import math

import numpy as np

from ...utils._array_api import (
    device,
    einsum,
    is_numpy,
    lstsq,
    namespace,
    to_numpy,
)
from ._decoupling import _one_head_problem

# Start: the value map fitted with one-hot patterns on the rows it explains best,
# this fraction of them, refitted this many times (a quarter left too few distinct
# rows on MiniLM layer 0).
_TRIM_FRACTION = 0.5
_TRIM_ROUNDS = 4
# Rows of simplex_least_squares' systems at once (memory: about 6 kB a row at
# k = 16, about 100 MB in all).
_CHUNK_ROWS = 16384
# Iterations of the active-set method and of FISTA between host reads of which
# rows go on (outside numpy, where a read waits for the device): rows that are
# done meanwhile are frozen, not computed again, so that the result is the same.
_READ_EVERY = 8
_TINY = float(np.finfo(float).tiny)


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
    xp = namespace(V)
    return _project_simplex(xp, xp.asarray(V, dtype=xp.float64))


def _project_simplex(xp, V):
    """:func:`project_simplex` of a float64 ``V`` of ``xp``."""
    k = V.shape[-1]
    ordered = -xp.sort(-V, axis=-1)
    cumulative = xp.cumulative_sum(ordered, axis=-1) - 1.0
    counts = xp.arange(1, k + 1, dtype=V.dtype, device=device(V))
    support = xp.astype(ordered - cumulative / counts > 0, xp.int8)
    # the support's size: the last index where the condition holds, plus one
    size = xp.astype(k - xp.argmax(xp.flip(support, axis=-1), axis=-1), V.dtype)
    size = size[..., None]
    # cumulative[size - 1], exactly (a sum of it and zeros)
    shift = xp.sum(xp.where(counts == size, cumulative, 0.0), axis=-1, keepdims=True)
    return _positive_part(xp, V - shift / size)


def _positive_part(xp, a):
    """``max(a, 0)`` (numpy's ufunc on numpy, without the wrapper's overhead)."""
    return np.maximum(a, 0.0) if is_numpy(xp) else xp.clip(a, min=0.0)


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
    xp = namespace(targets, images, start)
    n, k_q, _ = targets.shape
    k = images.shape[1]
    max_iter = 4 * k + 20 if max_iter is None else int(max_iter)
    start = project_simplex(xp.asarray(start, dtype=xp.float64))
    step = max(1, _CHUNK_ROWS // k_q)
    return xp.concat(
        [
            _active_set(
                xp,
                targets[i:j, ...],
                images[i:j, ...],
                start[i:j, ...],
                max_iter,
                tol,
            )
            for i, j in ((i, min(i + step, n)) for i in range(0, n, step))
        ],
        axis=0,
    )


def _active_set(xp, targets, images, start, max_iter, tol):
    """:func:`simplex_least_squares` on one chunk of sequences.

    The rows not yet optimal are gathered (``c`` of them); every ``every``
    iterations (1 on numpy) the host reads which of them go on, and those done
    are put aside; in between they are frozen (``live``)."""
    n, k_q, _ = targets.shape
    k = images.shape[1]
    where = device(targets)
    gram = images @ xp.matrix_transpose(images)
    linear = targets @ xp.matrix_transpose(images)
    diagonal = xp.linalg.diagonal(gram)
    scale = xp.clip(xp.max(diagonal, axis=-1), min=_TINY)
    # a ridge far below rounding keeps the KKT systems regular when a sequence
    # repeats a token (its Z_s then has equal rows)
    ridge = 1e-14 * scale
    rows = xp.reshape(
        xp.broadcast_to(xp.arange(n, device=where)[:, None], (n, k_q)), (-1,)
    )
    # the gathered rows: their index, weights, free set, linear term, Gram
    # matrix, ridge and tolerance
    index = xp.arange(n * k_q, device=where)
    P = xp.reshape(xp.asarray(start, dtype=xp.float64, copy=True), (n * k_q, k))
    free = P > 0
    b = xp.reshape(linear, (n * k_q, k))
    G = xp.take(gram, rows, axis=0)
    ridged = xp.take(ridge, rows, axis=0)[:, None, None]
    floor = -tol * xp.take(scale, rows, axis=0)
    eye = xp.eye(k, dtype=xp.float64, device=where)
    positions = xp.arange(k, device=where)
    every = 1 if is_numpy(xp) else _READ_EVERY
    done_index, done_P = [], []
    live = None
    for iteration in range(max_iter + 1):
        if live is not None and (iteration % every == 0 or iteration == max_iter):
            go_on = to_numpy(live)  # one host read: which rows go on
            if not go_on.all():
                gone = xp.asarray(np.flatnonzero(~go_on), device=where)
                done_index.append(xp.take(index, gone, axis=0))
                done_P.append(xp.take(P, gone, axis=0))
                keep = xp.asarray(np.flatnonzero(go_on), device=where)
                index, P, free, b, G, ridged, floor = (
                    xp.take(a, keep, axis=0)
                    for a in (index, P, free, b, G, ridged, floor)
                )
            live = None
        if index.shape[0] == 0 or iteration == max_iter:
            break
        c = index.shape[0]
        f = free
        mask = f[:, :, None] & f[:, None, :]
        weights = xp.astype(f, xp.float64)
        system = xp.zeros((c, k + 1, k + 1), dtype=xp.float64, device=where)
        system[:, :k, :k] = xp.where(mask, G + ridged * eye, eye)
        system[:, :k, k] = weights
        system[:, k, :k] = weights
        rhs = xp.ones((c, k + 1), dtype=xp.float64, device=where)
        rhs[:, :k] = xp.where(f, b, 0.0)
        solution = xp.linalg.solve(system, rhs[..., None])[..., 0]
        best, multiplier = solution[:, :k], solution[:, k]
        p = P
        negative = f & (best < 0)
        stepped = xp.any(negative, axis=1)
        # towards the solution until the first free weight reaches zero
        ratio = xp.where(negative, p / xp.where(negative, p - best, 1.0), xp.inf)
        alpha = xp.clip(xp.min(ratio, axis=1), min=0.0, max=1.0)[:, None]
        moved = xp.where(stepped[:, None], p + alpha * (best - p), best)
        hit = stepped[:, None] & ((ratio <= alpha) | (f & (moved <= 0.0)))
        moved = xp.where(hit, 0.0, moved)
        f = f & ~hit
        # optimal rows: every fixed weight's multiplier nonnegative
        dual = einsum(xp, "aij,aj->ai", G, moved) - b + multiplier[:, None]
        dual = xp.where(f | stepped[:, None], xp.inf, dual)
        worst = xp.argmin(dual, axis=1)
        release = ~stepped & (xp.min(dual, axis=1) < floor)
        f = f | (release[:, None] & (positions == worst[:, None]))
        if live is None:
            P, free = moved, f
            live = stepped | release
        else:  # rows done since the last read stay as they are
            P = xp.where(live[:, None], moved, P)
            free = xp.where(live[:, None], f, free)
            live = live & (stepped | release)
    if index.shape[0]:
        done_index.append(index)
        done_P.append(_projected_gradient(b[:, None, :], G, P[:, None, :])[:, 0, :])
    order = xp.argsort(xp.concat(done_index, axis=0))
    return xp.reshape(xp.take(xp.concat(done_P, axis=0), order, axis=0), (n, k_q, k))


def _projected_gradient(linear, gram, start, max_iter=1000, tol=1e-13):
    """FISTA on ``1/2 p G p - b p`` over the simplex, every row: ``linear``
    ``(a, k_q, k)``, ``gram`` ``(a, k, k)``, ``start`` ``(a, k_q, k)``; each
    problem's step ``1 / ||G||``.  It stops once no weight moves by more than
    ``tol`` (read every iteration on numpy, every ``_READ_EVERY`` elsewhere, the
    iterate frozen from where it stopped)."""
    xp = namespace(linear, gram, start)
    lipschitz = xp.linalg.eigvalsh(gram)[:, -1][:, None, None]
    lipschitz = xp.clip(lipschitz, min=_TINY)
    P = xp.asarray(start, dtype=xp.float64, copy=True)
    moving, t = xp.asarray(P, copy=True), 1.0
    every = 1 if is_numpy(xp) else _READ_EVERY
    stopped = None
    for iteration in range(int(max_iter)):
        following = _project_simplex(xp, moving - (moving @ gram - linear) / lipschitz)
        t_next = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0
        step = following - P
        small = xp.max(xp.abs(step)) <= tol
        if stopped is None:
            moving = following + ((t - 1.0) / t_next) * step
            P, stopped = following, small
        else:  # stopped since the last read: as it was
            ahead = following + ((t - 1.0) / t_next) * step
            moving = xp.where(stopped, moving, ahead)
            P, stopped = xp.where(stopped, P, following), stopped | small
        t = t_next
        if (iteration + 1) % every == 0:
            if bool(stopped):  # one host read
                break
            stopped = None
    return P


def _value_fit(X, target, fixed, patterns, rows=None):
    """Least-squares value map (and the fixed columns' coefficients) for
    ``patterns``, on ``rows`` (host indices of the ``n k`` rows) or all: the
    coefficients and every row's residual norm ``(n, k)``."""
    xp = namespace(X, target, fixed, patterns)
    n, k, r = target.shape
    design = patterns @ X
    if fixed is not None:
        design = xp.concat([design, fixed], axis=2)
    design = xp.reshape(design, (n * k, -1))
    flat = xp.reshape(target, (n * k, r))
    a, b = design, flat
    if rows is not None:
        keep = xp.asarray(rows, device=device(X))
        a, b = xp.take(design, keep, axis=0), xp.take(flat, keep, axis=0)
    if is_numpy(xp):
        coef = np.linalg.lstsq(a, b, rcond=None)[0]
    else:
        coef = lstsq(xp, a, b)
    residual = xp.linalg.vector_norm(design @ coef - flat, axis=1)
    return coef, xp.reshape(residual, (n, k))


def _norm(xp, a):
    """The 2-norm of all of ``a``: numpy's ``linalg.norm`` on numpy (its bits
    are not always ``vector_norm``'s)."""
    return np.linalg.norm(a) if is_numpy(xp) else xp.linalg.vector_norm(a)


def _best_rows(row_residuals, fraction):
    """Host indices of the rows (flat) whose residual is at most the
    ``fraction`` quantile of them: one host read."""
    residuals = np.reshape(to_numpy(row_residuals), -1)
    return np.flatnonzero(residuals <= np.quantile(residuals, fraction))


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
    xp = namespace(X, Y, params)
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
    norm = xp.clip(_norm(xp, target), min=_TINY)
    logits = parametrization.logits(X, params)[:, head, ...]
    largest = xp.argmax(logits, axis=-1)[..., None]
    patterns = xp.astype(xp.arange(k, device=device(logits)) == largest, logits.dtype)
    rows = None
    for trim in range(_TRIM_ROUNDS):
        coef, row_residuals = _value_fit(X, target, fixed, patterns, rows)
        if trim + 1 < _TRIM_ROUNDS:
            rows = _best_rows(row_residuals, _TRIM_FRACTION)
    d = X.shape[2]
    residuals = []
    for round_ in range(int(n_rounds) + 1):
        if round_ > 0:
            coef, row_residuals = _value_fit(X, target, fixed, patterns)
        # one host read a round: its residual, which decides whether to go on
        residuals.append(float(_norm(xp, row_residuals) / norm))
        if round_ == n_rounds or (
            round_ > 0 and residuals[-1] > (1.0 - stall) * residuals[-2]
        ):
            break
        explained = target if fixed is None else target - fixed @ coef[d:, ...]
        patterns = simplex_least_squares(
            explained, X @ coef[:d, ...], patterns, max_iter
        )
    return patterns, {"residuals": residuals}
