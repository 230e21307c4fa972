"""Phases 2 and 4 of the phased learner: sculpt the affine hull of the Theta_i.

A certified row ``l`` (all heads put the same pattern ``p`` on it, see
:func:`~skattn.phased._projection_sum.certify_rows`) gives, for every pair of tokens,
``x_l^T Theta (x_a - x_b) = ln(p_a / p_b)``: affine equations in ``vec(Theta)``
(``d^2`` unknowns) that every ``Theta_i``, hence every point of their affine hull,
satisfies.  Many certified rows carve a slab-shaped convex body around the hull.  The
hull's ``m - 1`` directions are the near-null directions of the equations' normal
matrix and a point is their minimum-norm solution orthogonal to those directions.

The equations of one row are stored in centred form: with weights
``omega_a = p_a**weight_power`` on the tokens with ``p_a >= p_min``,
``sqrt(omega_a) x_l^T Theta (x_a - xbar) = sqrt(omega_a) (ln p_a - lbar)`` where
``xbar`` and ``lbar`` are the ``omega``-weighted means (the least-squares elimination
of the unknown softmax normaliser).  Their normal matrix is accumulated as
``sum_l kron(x_l x_l^T, V_l)`` with ``V_l = sum_a v_a v_a^T``, a factor ``k`` cheaper
than forming the equations; memory is bounded by ``max_rows``, not by ``n``.

Phase 4 (:func:`sculpt_hull`) alternates the refinement of ``W_sum`` (phase 3) and
the hull fit while the certification tolerance tightens.

The certification scan over all samples is one
:func:`~skattn.utils._batches.map_reduce_batches` pass: each batch keeps its best
certified rows (:func:`_hull_scan_batch`) and the merge keeps the best of those,
so on dask arrays it runs as one task per chunk on the workers; only the kept
rows' samples are read in this process.
"""

import inspect
import time
import warnings
from functools import partial

import numpy as np
from sklearn.utils import check_random_state

from ..utils._batches import map_reduce_batches
from ._errors import CertificationError, CertificationWarning
from ._hull_operator import _normal_diag, constraint_matvec, iterative_hull
from ._options import HullOptions
from ._projection_sum import (
    _certify_batch,
    _check_certifiable,
    _check_projection_sum,
    _check_token_arrays,
    _refine_projection_sum,
    _refine_scan,
    crude_projection_sum,
    refine_projection_sum,
)

# the defaults of phases 2-4 (written once, in HullOptions)
_HULL = HullOptions()

# hull_constraints(solver="auto") keeps the dense normal matrix up to this many
# features per token and the factored (matrix-free) system beyond.  Measured
# (benchmarks/studies/bench_hull_solvers.py, k = 8, m = 2, n = 5e4, one round of
# phase 2, constraints + fit): d = 8, 16, 24: dense 0.001-0.2 s to fit against 2-3 s for
# LOBPCG; d = 32: 2.7 vs 3.6 s at tol 0.3, 1.3 vs 0.9 s at tol 0.08; the dense
# normal matrix costs O(rows d^4), so beyond d = 32 the factored system wins.
_DENSE_HULL_MAX_FEATURES = 32


def hull_constraints(
    X,
    Y,
    W_sum,
    *,
    tol,
    sample_weight=None,
    p_min=0.05,
    weight_power=2.0,
    max_rows=20000,
    n_keep_equations=2000,
    batch_size=4096,
    rcond=1e-8,
    random_state=None,
    confidence_floor=None,
    keep_rows=False,
    gauge_features=(),
    solver="auto",
):
    """Phase 2, step 2: affine constraints on ``vec(Theta)`` from certified rows.

    Parameters
    ----------
    X : ndarray of shape (n_samples, n_tokens, n_features)
    Y : ndarray of shape (n_samples, n_tokens, n_outputs)
        Needs ``n_outputs >= n_tokens``.
    W_sum : ndarray of shape (n_features, n_outputs)
        Current estimate of ``sum_i W_i``.
    tol : float
        Certification tolerance (relative residual of a row).
    sample_weight : ndarray of shape (n_samples,), default=None
        Multiplies the weight of every equation of the sample.
    p_min : float, default=0.05
        Tokens with ``p_a < p_min`` give no equation (``ln p_a`` is too noisy).
    weight_power : float, default=2.0
        Equation ``a`` of a row has weight ``p_a ** weight_power``.  The residual
        certifies ``p`` to an absolute accuracy, so the error of ``ln p_a`` scales as
        ``1 / p_a`` and ``p_a ** 2`` is its inverse variance (measured: power 2
        cuts the hull error by 10-40 % against power 1).
    max_rows : int, default=20000
        At most this many certified rows, those with the smallest residuals, are
        turned into equations (the normal matrix is ``d^2 x d^2``; a few times
        ``d^2 / (k - 1)`` rows determine it).  Residuals are compared in single
        precision, ties going to the first sample and row, so that the rows kept
        do not depend on the batches or chunks.
    n_keep_equations : int, default=2000
        A random subsample of this many weighted equations is kept in ``stats`` for
        a robust fit of the point (:func:`fit_affine_hull` with ``method="huber"``).
    batch_size : int, default=4096
        Samples certified at a time.  ``X`` and ``Y`` may be
        :class:`~skattn.utils._batches.TokenBatches` of out-of-core arrays, scanned by
        :func:`~skattn.utils._batches.map_reduce_batches` (dask arrays: one task per
        chunk, named ``skattn-certify``, on a cluster's workers).
    rcond : float, default=1e-8
        See :func:`~skattn.phased._projection_sum.certify_rows`.
    random_state : int, RandomState instance or None, default=None
        Chooses the kept equations.
    confidence_floor : float, default=None
        ``None``: every certified row has the same weight.  A float ``c``: the
        weight of a row with relative residual ``r`` is divided by
        ``r**2 + (c * tol)**2``, an inverse-variance weight (the residual measures
        how much the heads disagree on the row, hence the bias of its log-ratios).
        Measured with the exact ``W_sum`` (``benchmarks/studies/study_three_heads.py``,
        m=2, k=2-4, scales 2-4): ``c=0.03`` cuts the hull error by 1.5-10x
        (0.08-0.42 to 0.01-0.24) and raises the gap ratio 1.5-10x; it does not
        rescue m=3 at k=4, where almost no certified row has agreeing heads.
        Within :func:`sculpt_hull` (estimated ``W_sum``): hull error 0.011-0.074
        to 0.005-0.055 for m=2, 0.13-0.16 to 0.10-0.12 for m=3 at k=2, unchanged
        (+-0.03, all failed) for m=3 at k=4.
    keep_rows : bool, default=False
        Also keep the rows used (tokens, patterns and weights, in
        ``stats["rows"]``; ``max_rows * n_tokens * n_features`` floats), which
        ``fit_affine_hull(..., reweight_iter > 0)`` needs.
    gauge_features : tuple of int, default=()
        Token features that are constant (the coordinate 1 appended by
        ``fit_intercept=True``).  Column ``j`` of Theta for such a feature only adds
        a term constant in the key token, which cancels in the softmax: it is a
        gauge, null in every equation.  Its entries are pinned to 0 (a diagonal
        term equal to the normal matrix's largest diagonal entry, at most its top
        eigenvalue), so they neither count as hull directions nor disturb the
        spectral gap; the Huber fit constrains them to 0.
    solver : {"auto", "dense", "matrix-free"}, default="auto"
        ``"dense"`` accumulates the normal matrix ``A^T Omega A`` (d^2, d^2),
        ``O(rows d^4)``.  ``"matrix-free"`` keeps the rows' equations in factored
        form (``x_row`` and ``v``, ``O(rows k d)`` floats) for
        :func:`fit_affine_hull`'s iterative solver
        (:mod:`~skattn.phased._hull_operator`: products with ``A`` and ``A^T`` in
        ``O(rows d^2)``); ``stats["normal"]`` is then ``None``.  ``"auto"``:
        matrix-free when ``n_features > _DENSE_HULL_MAX_FEATURES`` (the measured
        crossover).

    Returns
    -------
    stats : dict
        Sufficient statistics: ``normal`` (d^2, d^2) = ``A^T Omega A``, ``rhs`` (d^2,)
        = ``A^T Omega b``, ``rhs_norm2`` = ``b^T Omega b``, ``n_rows``,
        ``n_equations``, ``n_features``, ``tol``, and the kept equations
        ``equations`` (e, d^2) and ``targets`` (e,) (already weighted); with
        ``keep_rows=True`` also ``rows``: a dict of ``tokens`` (L, k, d),
        ``x_row`` (L, d), ``p`` (L, k), ``omega`` (L, k) (the pattern and sample
        weights of the equations) and ``row_weight`` (L,) (the confidence
        factor; 1 without ``confidence_floor``) of the rows that give equations.
    info : dict
        ``n_rows``, ``n_certified``, ``certified_fraction``, ``n_rows_used``,
        ``n_equations``, ``n_degenerate_samples``, ``median_residual`` (of the
        rows used).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 3, 4))
    >>> theta, W = rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 4, 5))
    >>> stats, info = hull_constraints(X, forward(X, theta, W), W[0], tol=1e-6)
    >>> stats["normal"].shape, info["certified_fraction"]
    ((16, 16), 1.0)
    """
    stats, info, _ = _hull_constraints(
        X,
        Y,
        W_sum,
        tol=tol,
        sample_weight=sample_weight,
        p_min=p_min,
        weight_power=weight_power,
        max_rows=max_rows,
        n_keep_equations=n_keep_equations,
        batch_size=batch_size,
        rcond=rcond,
        random_state=random_state,
        confidence_floor=confidence_floor,
        keep_rows=keep_rows,
        gauge_features=gauge_features,
        solver=solver,
    )
    return stats, info


def _hull_constraints(
    X,
    Y,
    W_sum,
    *,
    tol,
    sample_weight,
    p_min,
    weight_power,
    max_rows,
    n_keep_equations,
    batch_size,
    rcond,
    random_state,
    confidence_floor,
    keep_rows,
    gauge_features,
    solver,
    next_refine=None,
):
    """:func:`hull_constraints`, and with ``next_refine`` the next round's first
    phase-3 pass from the same certification.

    ``next_refine`` is ``None`` or a dict of ``tol``, ``screen``, ``solver`` and
    ``hessian_rows`` (the next round's phase 3, whose ``rcond`` is this scan's):
    its first pass certifies every row under the same ``W_sum``, so one
    certification of each batch serves both scans
    (:func:`_hull_refine_scan_batch`).  Returns ``(stats, info, next_scan)``,
    ``next_scan`` the merged phase-3 partial (``None`` without ``next_refine``).
    """
    X, Y, w = _check_token_arrays(X, Y, sample_weight)
    n, k, d = X.shape
    _check_certifiable(k, Y.shape[2])
    W_sum = _check_projection_sum(W_sum, d, Y.shape[2])
    rng = check_random_state(random_state)
    if confidence_floor is not None and not confidence_floor > 0:
        raise ValueError(
            f"confidence_floor must be None or a positive float, got "
            f"{confidence_floor!r}."
        )
    matrix_free = _use_matrix_free(solver, d)
    # One scan: the max_rows certified rows of smallest residual (ties: smallest
    # global row index), then in global (sample, row) order.
    hull_scan = (
        partial(_hull_scan_batch, W_sum=W_sum, tol=tol, rcond=rcond, max_rows=max_rows),
        partial(_merge_hull_scans, max_rows=max_rows),
    )
    if next_refine is None:
        scan = map_reduce_batches(
            X, Y, *hull_scan, batch_size=batch_size, name="skattn-certify"
        )
        next_scan = None
    else:
        refine_scan = _refine_scan(
            W_sum,
            next_refine["tol"],
            rcond,
            next_refine["screen"],
            next_refine["optimizer"],
            next_refine["hessian_rows"],
        )
        scan, next_scan = map_reduce_batches(
            X,
            Y,
            partial(
                _hull_refine_scan_batch,
                W_sum=W_sum,
                rcond=rcond,
                scans=(hull_scan[0], refine_scan[0]),
            ),
            partial(_merge_scan_pairs, merges=(hull_scan[1], refine_scan[1])),
            batch_size=batch_size,
            per_sample=(w,),
            name="skattn-certify",
        )
    order = np.argsort(scan["row"])
    buf_res, buf_p = scan["residual"][order], scan["p"][order]
    buf_sample, buf_row = np.divmod(scan["row"][order], k)
    n_cert, n_degenerate = scan["n_certified"], scan["n_degenerate"]

    d2 = d * d
    h = d * (d + 1) // 2
    half = None if matrix_free else np.zeros((h, h))  # see _normal_half
    factors = []  # matrix-free: the rows' (x_row, v, beta)
    rhs = np.zeros(d2)
    rhs_norm2 = 0.0
    n_equations = 0
    kept_eq, kept_b = [], []
    rows_kept = []
    # Each equation is kept with the same probability (at most k per row).
    keep_prob = min(1.0, 2.0 * n_keep_equations / max(1, buf_res.size * k))
    for start in range(0, buf_res.size, batch_size):
        sl = slice(start, start + batch_size)
        tokens = X[buf_sample[sl]]  # (L, k, d)
        x_row = tokens[np.arange(tokens.shape[0]), buf_row[sl]]  # (L, d)
        p = buf_p[sl]
        kept = p >= p_min
        usable_row = kept.sum(axis=1) >= 2
        omega = np.where(kept, np.clip(p, p_min, None) ** weight_power, 0.0)
        omega *= (w[buf_sample[sl]] * usable_row)[:, None]
        if confidence_floor is None:
            row_weight = np.ones(p.shape[0])
        else:
            row_weight = 1.0 / (buf_res[sl] ** 2 + (confidence_floor * tol) ** 2)
        if keep_rows:  # only rows that give equations
            u = (omega > 0).sum(axis=1) >= 2
            rows_kept.append((tokens[u], x_row[u], p[u], omega[u], row_weight[u]))
        omega *= row_weight[:, None]
        v, beta = _row_equations(tokens, p, omega)
        if matrix_free:
            u = (omega > 0).sum(axis=1) >= 2  # rows that give equations
            factors.append((x_row[u], v[u], beta[u]))
            part = _rhs_terms(x_row, v, beta)
        else:
            part = _normal_equations(x_row, v, beta, full=False)
            half += part[0]
        rhs += part[1]
        rhs_norm2 += part[2]
        n_eq_rows = np.maximum(kept.sum(axis=1) - 1, 0) * usable_row
        n_equations += int(n_eq_rows.sum())
        # Kept equations for a robust fit: a_la = x_l kron v_la, b_la = beta_la.
        li, ai = np.nonzero(omega > 0)
        if li.size:
            pick = rng.random_sample(li.size) < keep_prob
            li, ai = li[pick], ai[pick]
            kept_eq.append((x_row[li], v[li, ai]))
            kept_b.append(beta[li, ai])
    eq_x = np.concatenate([e[0] for e in kept_eq]) if kept_eq else np.empty((0, d))
    eq_v = np.concatenate([e[1] for e in kept_eq]) if kept_eq else np.empty((0, d))
    targets = np.concatenate(kept_b) if kept_b else np.empty(0)
    if targets.size > n_keep_equations:
        pick = rng.choice(targets.size, n_keep_equations, replace=False)
        eq_x, eq_v, targets = eq_x[pick], eq_v[pick], targets[pick]
    stats = {
        "gauge_features": tuple(int(j) for j in gauge_features),
        "normal": None,
        "rhs": rhs,
        "rhs_norm2": rhs_norm2,
        "n_rows": int(buf_res.size),
        "n_equations": n_equations,
        "n_features": d,
        "tol": float(tol),
        "n_samples": n,
        "equation_factors": (eq_x, eq_v),
        "targets": targets,
    }
    if matrix_free:
        x_all = np.concatenate([f[0] for f in factors]) if factors else np.empty((0, d))
        v_all = (
            np.concatenate([f[1] for f in factors]) if factors else np.empty((0, k, d))
        )
        stats["constraints"] = _constraint_factors(
            x_all, v_all, stats["gauge_features"], d
        )
    else:
        normal = _normal_from_half(half, d)
        stats["normal"] = _pin_gauge(normal, stats["gauge_features"], d)
        stats["equations"] = np.einsum("ei,ej->eij", eq_x, eq_v).reshape(-1, d2)
    stats["rhs"][_gauge_indices(stats["gauge_features"], d)] = 0.0
    if keep_rows:
        names = ("tokens", "x_row", "p", "omega", "row_weight")
        shapes = ((0, k, d), (0, d), (0, k), (0, k), (0,))
        stats["rows"] = {
            name: np.concatenate([part[i] for part in rows_kept])
            if rows_kept
            else np.empty(shape)
            for i, (name, shape) in enumerate(zip(names, shapes, strict=True))
        }
    info = {
        "n_rows": int(n * k),
        "n_certified": int(n_cert),
        "certified_fraction": n_cert / (n * k),
        "n_rows_used": int(buf_res.size),
        "n_equations": n_equations,
        "n_degenerate_samples": n_degenerate,
        "median_residual": float(np.median(buf_res)) if buf_res.size else np.nan,
    }
    return stats, info, next_scan


def _hull_scan_batch(X, Y, idx, *, W_sum, tol, rcond, max_rows, certified=None):
    """Certified rows of one batch of samples ``idx`` (the phase-2 scan's partial).

    A dict: ``residual`` (r,), ``row`` (r,) global row index ``n * k + l``, ``p``
    (r, k) of the at most ``max_rows`` certified rows of smallest residual, and
    the counts ``n_certified`` and ``n_degenerate`` (unusable samples).
    ``certified`` is :func:`_certify_batch`'s output on the batch, if known.
    """
    k = X.shape[1]
    if certified is None:
        certified = _certify_batch(X, Y, W_sum, rcond)
    P, residual, usable = certified
    s_idx, r_idx = np.nonzero(residual < tol)
    part = {
        "residual": residual[s_idx, r_idx],
        "row": idx[s_idx].astype(np.int64) * k + r_idx,
        "p": P[s_idx, r_idx],
        "n_certified": int(s_idx.size),
        "n_degenerate": int((~usable).sum()),
    }
    return _best_rows(part, max_rows)


def _hull_refine_scan_batch(X, Y, idx, w, *, W_sum, rcond, scans):
    """The partials of a phase-2 scan and a phase-3 pass under the same ``W_sum``.

    ``scans`` are the two batch functions (:func:`_hull_scan_batch` and
    :func:`~skattn.phased._projection_sum._refine_scan_batch`, partials with
    this ``W_sum`` and ``rcond``); each batch is certified once for both.
    """
    hull, refine = scans
    certified = _certify_batch(X, Y, W_sum, rcond)
    return (
        hull(X, Y, idx, certified=certified),
        refine(X, Y, idx, w, certified=certified),
    )


def _merge_scan_pairs(parts, merges):
    """Merge of :func:`_hull_refine_scan_batch` pairs: each scan by its merge."""
    return tuple(merge([part[j] for part in parts]) for j, merge in enumerate(merges))


def _best_rows(part, max_rows):
    """``part`` cut to its ``max_rows`` rows of smallest ``(residual, row)``.

    Residuals are compared in single precision (relative 6e-8) and ties go to
    the smaller global row index.  The order is total, so the rows kept from any
    grouping of the samples into batches or chunks are the same; and rows whose
    residuals are equal up to the rounding of their batch (the rows of repeated
    samples: Boolean tokens repeat at small ``k * d``) tie exactly, instead of
    being ordered by that rounding.
    """
    res = part["residual"].astype(np.float32)
    if res.size <= max_rows:
        return part
    cut = np.partition(res, max_rows - 1)[max_rows - 1]
    below = np.flatnonzero(res < cut)
    tied = np.flatnonzero(res == cut)
    tied = tied[np.argsort(part["row"][tied])[: max_rows - below.size]]
    keep = np.sort(np.concatenate([below, tied]))
    return {**part, **{name: part[name][keep] for name in ("residual", "row", "p")}}


def _merge_hull_scans(parts, max_rows):
    """Merge of :func:`_hull_scan_batch` partials of consecutive samples."""
    merged = {
        name: np.concatenate([part[name] for part in parts])
        for name in ("residual", "row", "p")
    }
    merged["n_certified"] = sum(part["n_certified"] for part in parts)
    merged["n_degenerate"] = sum(part["n_degenerate"] for part in parts)
    return _best_rows(merged, max_rows)


def _row_equations(tokens, p, omega):
    """Centred weighted equations of rows: ``v`` (L, k, d) and ``beta`` (L, k).

    Equation ``a`` of row ``l`` is ``x_l^T Theta v_la = beta_la``; tokens with
    ``omega_la = 0`` give none (their ``v`` and ``beta`` are 0).
    """
    total = np.maximum(omega.sum(axis=1, keepdims=True), 1e-300)
    logp = np.where(omega > 0, np.log(np.clip(p, 1e-300, None)), 0.0)
    xbar = np.einsum("la,lad->ld", omega / total, tokens)
    lbar = np.sum(omega / total * logp, axis=1, keepdims=True)
    root = np.sqrt(omega)
    v = root[:, :, None] * (tokens - xbar[:, None])  # (L, k, d)
    beta = root * (logp - lbar)  # (L, k)
    return v, beta


def _rhs_terms(x_row, v, beta):
    """``A^T b`` (d^2,) and ``b^T b`` of rows' equations (``None`` for ``A^T A``)."""
    h = np.einsum("lad,la->ld", v, beta)  # (L, d)
    return None, (x_row.T @ h).reshape(-1), float(np.sum(beta**2))


def _signature_defaults(func):
    """The default values of ``func``'s parameters, by name."""
    return {
        name: parameter.default
        for name, parameter in inspect.signature(func).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


def _use_matrix_free(solver, d):
    """Whether the hull's system stays in factored form (see ``hull_constraints``)."""
    if solver not in ("auto", "dense", "matrix-free"):
        raise ValueError(
            f"solver must be 'auto', 'dense' or 'matrix-free', got {solver!r}."
        )
    if solver == "auto":
        return d > _DENSE_HULL_MAX_FEATURES
    return solver == "matrix-free"


def _constraint_factors(x_row, v, gauge_features, d):
    """The factored system: rows, gauge mask and pin (as ``_pin_gauge`` sets it)."""
    mask = np.ones(d * d)
    mask[_gauge_indices(gauge_features, d)] = 0.0
    diag = _normal_diag(x_row, v) * mask
    pin = max(float(np.max(diag, initial=0.0)), np.finfo(float).tiny)
    return {"x_row": x_row, "v": v, "mask": mask, "pin": pin if mask.min() < 1 else 0.0}


def _normal_equations(x_row, v, beta, full=True):
    """``A^T A`` (d^2, d^2), ``A^T b`` (d^2,) and ``b^T b`` of rows' equations.

    ``full=False`` returns :func:`_normal_half`'s distinct entries of ``A^T A``
    in its place (sums of batches are summed in that form).
    """
    d = x_row.shape[1]
    h = np.einsum("lad,la->ld", v, beta)  # (L, d)
    rhs = np.einsum("li,lj->ij", x_row, h).reshape(d * d)
    half = _normal_half(x_row, v)
    normal = _normal_from_half(half, d) if full else half
    return normal, rhs, float(np.sum(beta**2))


def _normal_half(x_row, v):
    """The distinct entries of ``A^T A``: ``sum_l (x_l x_l^T)_ii' (V_l)_jj'``.

    ``normal[(i, j), (i', j')] = sum_l x_li x_li' (V_l)_jj'`` with
    ``V_l = sum_a v_la v_la^T``; both factors are symmetric, so only the pairs
    ``i <= i'`` and ``j <= j'`` are summed: an (h, h) matrix, ``h = d (d + 1) / 2``,
    one GEMM with a quarter of the flops of the full one (measured, d = 32,
    4096 rows, one thread: 70 instead of 155 ms, the same bits as the full GEMM).
    :func:`_normal_from_half` spreads each entry over the four places it occupies.
    """
    L, d = x_row.shape
    flat = _upper_pairs(d)
    V = np.swapaxes(v, 1, 2) @ v  # (L, d, d)
    XX = np.einsum("li,lj->lij", x_row, x_row)
    Xs = np.take(XX.reshape(L, d * d), flat, axis=1)  # (L, h)
    Vs = np.take(V.reshape(L, d * d), flat, axis=1)
    return Xs.T @ Vs


def _upper_pairs(d):
    """Flat indices ``i * d + j`` of the pairs ``i <= j`` (row-major order)."""
    iu, ju = np.triu_indices(d)
    return iu * d + ju


def _normal_from_half(half, d):
    """The normal matrix (d^2, d^2) from :func:`_normal_half`'s distinct entries."""
    iu, ju = np.triu_indices(d)
    T = np.empty((d, d, d, d))  # T[i, i', j, j'] = normal[(i, j), (i', j')]
    a, b = iu[:, None], ju[:, None]
    c, e = iu[None, :], ju[None, :]
    T[a, b, c, e] = half
    T[b, a, c, e] = half
    T[a, b, e, c] = half
    T[b, a, e, c] = half
    return T.transpose(0, 2, 1, 3).reshape(d * d, d * d)


def _hull_row_residual(rows, point, directions):
    """RMS residual of each kept row's equations over the hull.

    Every point of the hull satisfies the equations of a row on which all heads
    agree, so the residual at the point and the equations' change along the
    directions (times ``||point||``, the hull's scale) both measure the row's
    disagreement.
    """
    v, beta = _row_equations(rows["tokens"], rows["p"], rows["omega"])
    x_row = rows["x_row"]
    r = np.einsum("ld,de,lae->la", x_row, point, v) - beta
    out = np.sum(r**2, axis=1)
    scale2 = float(np.sum(point**2))
    for D in directions:
        out += scale2 * np.sum(np.einsum("ld,de,lae->la", x_row, D, v) ** 2, axis=1)
    n_tok = np.maximum((rows["omega"] > 0).sum(axis=1), 1)
    return np.sqrt(out / n_tok)


def _reweighted_stats(stats, row_factor):
    """``stats`` rebuilt from its kept rows with extra row weights ``row_factor``."""
    rows = stats["rows"]
    omega = rows["omega"] * (rows["row_weight"] * row_factor)[:, None]
    v, beta = _row_equations(rows["tokens"], rows["p"], omega)
    gauge, d = stats.get("gauge_features", ()), stats["n_features"]
    if stats.get("normal") is None:
        _, rhs, rhs_norm2 = _rhs_terms(rows["x_row"], v, beta)
        rhs[_gauge_indices(gauge, d)] = 0.0
        constraints = _constraint_factors(rows["x_row"], v, gauge, d)
        return {**stats, "constraints": constraints, "rhs": rhs, "rhs_norm2": rhs_norm2}
    normal, rhs, rhs_norm2 = _normal_equations(rows["x_row"], v, beta)
    normal = _pin_gauge(normal, gauge, d)
    return {**stats, "normal": normal, "rhs": rhs, "rhs_norm2": rhs_norm2}


def _gauge_indices(gauge_features, d):
    """Flat indices in ``vec(Theta)`` (row-major) of the gauge columns."""
    return np.array([i * d + j for j in gauge_features for i in range(d)], dtype=int)


def _pin_gauge(normal, gauge_features, d):
    """``normal`` with the gauge entries of ``vec(Theta)`` pinned to 0.

    Their rows and columns are (up to rounding) zero; they become exact zeros and
    the diagonal gets the largest diagonal entry of ``normal``.
    """
    idx = _gauge_indices(gauge_features, d)
    if idx.size == 0:
        return normal
    normal = normal.copy()
    pin = max(float(np.max(np.diag(normal))), np.finfo(float).tiny)
    normal[idx, :] = 0.0
    normal[:, idx] = 0.0
    normal[idx, idx] = pin
    return normal


def _too_few(stats, needed):
    tol = stats.get("tol", np.nan)
    have = stats["n_equations"]
    n = stats.get("n_samples", 0)
    more = int(np.ceil(n * needed / max(have, 1))) if n else None
    hint = f" or pass about {more} samples" if more else ""
    return (
        f"Too few certified constraints to fit the affine hull: {have} equations "
        f"for {stats['n_features'] ** 2} unknowns (need at least {needed}). "
        f"Relax the certification tolerance (tol={tol:g}, try {2 * tol:g}){hint}."
    )


def fit_affine_hull(
    stats,
    n_heads,
    *,
    method="lstsq",
    huber_delta=None,
    reweight_iter=0,
    n_eigenvalues=None,
    start=None,
):
    """Phase 2, step 3: the affine hull of the ``Theta_i`` from the constraints.

    The ``n_heads - 1`` eigenvectors of the normal matrix ``A^T Omega A`` with the
    smallest eigenvalues are the hull's directions; the point is the minimum-norm
    least-squares solution orthogonal to them.  The spectrum is the evidence: the
    ratio of the ``m``-th to the ``(m-1)``-th smallest eigenvalue of the normal
    matrix, and of the ``(m+1)``-th to the ``m``-th smallest eigenvalue of the
    *augmented* matrix ``[A, -b]^T Omega [A, -b]`` (whose near-null space is spanned
    by the homogeneous points ``(vec Theta_i, 1)``, so it shows a gap for every
    ``m >= 1``; see :func:`~skattn.phased._span.estimate_n_heads`).

    Parameters
    ----------
    stats : dict
        From :func:`hull_constraints`.
    n_heads : int
        Number of heads ``m`` (the hull has dimension ``m - 1``).
    method : {"lstsq", "huber"}, default="lstsq"
        How the point is fitted.  ``"huber"`` solves a convex program (cvxpy):
        the Huber loss of the kept equations' residuals, with the point orthogonal
        to the directions, which down-weights mis-certified rows.
    huber_delta : float, default=None
        Huber threshold; default 1.5 times the median absolute residual of the
        least-squares point.
    reweight_iter : int, default=0
        Iteratively reweighted least squares over rows: after each fit, a row's
        weight is multiplied by ``1 / (1 + (r / c)**2)`` (Cauchy), with ``r`` the
        RMS residual of its equations over the hull (at the point and along the
        directions, which every agreeing row leaves unchanged) and ``c`` 1.5 times
        the median ``r``; then the hull is fitted again.  Needs
        ``hull_constraints(..., keep_rows=True)``.  Measured with the exact
        ``W_sum`` and ``confidence_floor=0.03`` (m=2, k=2-4): 3 iterations cut the
        hull error a further 1.5-2x and raise the gap ratio 2-60x.  Caveats: the
        reweighting confirms the hull it starts from, so the gap ratio it reports
        is inflated and no longer comparable with an unweighted fit; within
        :func:`sculpt_hull` (estimated ``W_sum``) it helped on some planted
        layers and hurt on others (m=3, k=2: hull error 0.16 -> 0.30 with a gap
        ratio of 84), and breaks down when most certified rows have disagreeing
        heads (m=3, k=4).
    n_eigenvalues : int, default=None
        Matrix-free statistics only (``hull_constraints(..., solver=
        "matrix-free")``): how many of the smallest eigenvalues of each spectrum
        to compute (default ``n_heads + 1``, and one more of the augmented
        spectrum; :func:`sculpt_hull` asks for ``max_heads + 2`` when it counts
        the heads).  The dense path returns them all.
    start : ndarray of shape (r, d, d), default=None
        Matrix-free only: matrices that seed the iterative eigensolver (e.g. the
        previous round's point and directions).

    Returns
    -------
    hull : tuple (point, directions)
        ``point`` of shape (d, d), ``directions`` of shape (n_heads - 1, d, d),
        orthonormal in the Frobenius inner product.
    info : dict
        ``spectrum`` (ascending eigenvalues of the normal matrix, divided by the
        largest), ``augmented_spectrum`` (same for the augmented matrix),
        ``gap_ratio`` (m-th / (m-1)-th smallest eigenvalue; ``nan`` for m = 1),
        ``augmented_gap_ratio`` ((m+1)-th / m-th), ``rms_residual`` (weighted RMS
        residual of the equations at the point), ``n_equations``, ``method``,
        ``solver`` (``"dense"`` or ``"matrix-free"``; the latter also reports
        ``iterative``: operator products and iterations, and its spectra hold
        only the smallest ``n_eigenvalues`` eigenvalues).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(300, 3, 3))
    >>> theta, W = rng.normal(size=(1, 3, 3)), rng.normal(size=(1, 3, 4))
    >>> stats, _ = hull_constraints(X, forward(X, theta, W), W[0], tol=1e-6)
    >>> (point, directions), info = fit_affine_hull(stats, 1)
    >>> bool(np.allclose(point, theta[0])), directions.shape
    (True, (0, 3, 3))
    """
    d = stats["n_features"]
    d2 = d * d
    m = int(n_heads)
    if m < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}.")
    if m > d2:
        raise ValueError(f"n_heads={m} exceeds the number of unknowns d^2={d2}.")
    needed = d2 + m
    if stats["n_equations"] < needed:
        raise CertificationError(_too_few(stats, needed))
    reweight_iter = int(reweight_iter)
    if reweight_iter < 0:
        raise ValueError(
            f"reweight_iter must be a non-negative integer, got {reweight_iter!r}."
        )
    if reweight_iter and "rows" not in stats:
        raise ValueError(
            "reweight_iter > 0 needs the certified rows: build stats with "
            "hull_constraints(..., keep_rows=True)."
        )
    if reweight_iter and not stats["rows"]["p"].shape[0]:
        reweight_iter = 0  # no row gives equations: nothing to reweight
    for _ in range(reweight_iter):
        point, directions = _lstsq_hull(stats, m)
        r = _hull_row_residual(stats["rows"], point, directions.T.reshape(m - 1, d, d))
        c = 1.5 * float(np.median(r)) + np.finfo(float).tiny
        stats = _reweighted_stats(stats, 1.0 / (1.0 + (r / c) ** 2))
    if method not in ("lstsq", "huber"):
        raise ValueError(f"method must be 'lstsq' or 'huber', got {method!r}.")
    if stats.get("normal") is None:
        return _fit_matrix_free(
            stats, m, method, huber_delta, reweight_iter, n_eigenvalues, start
        )
    normal, rhs = stats["normal"], stats["rhs"]
    evals, evecs = np.linalg.eigh(normal)
    top = max(evals[-1], np.finfo(float).tiny)
    directions = evecs[:, : m - 1]
    rest_vals, rest_vecs = evals[m - 1 :], evecs[:, m - 1 :]
    if rest_vals[0] <= 1e-12 * top:
        raise CertificationError(
            "The certified constraints do not determine the affine hull: the normal "
            f"matrix has {int(np.sum(evals <= 1e-12 * top))} null directions, more "
            f"than n_heads - 1 = {m - 1}. Certify more diverse rows: relax the "
            f"tolerance (tol={stats.get('tol', np.nan):g}) or pass more samples."
        )
    point = rest_vecs @ (rest_vecs.T @ rhs / rest_vals)
    if method == "huber":
        point = _huber_point(stats, point, directions, huber_delta)
    augmented = np.empty((d2 + 1, d2 + 1))
    augmented[:d2, :d2] = normal
    augmented[:d2, d2] = augmented[d2, :d2] = -rhs
    augmented[d2, d2] = stats["rhs_norm2"]
    aug = np.linalg.eigvalsh(augmented)
    aug = np.clip(aug, 0.0, None) / max(aug[-1], np.finfo(float).tiny)
    sq = float(point @ normal @ point - 2 * point @ rhs + stats["rhs_norm2"])
    spectrum = np.clip(evals, 0.0, None) / top
    info = _hull_info(stats, m, method, reweight_iter, spectrum, aug, sq, "dense")
    return (point.reshape(d, d), directions.T.reshape(m - 1, d, d)), info


def _hull_info(stats, m, method, reweight_iter, spectrum, aug, sq, solver):
    """The record of a hull fit: its equations, spectra, gap ratios and residual."""
    return {
        "method": method,
        "reweight_iter": reweight_iter,
        "n_equations": int(stats["n_equations"]),
        "n_rows": int(stats["n_rows"]),
        "spectrum": spectrum,
        "augmented_spectrum": aug,
        "gap_ratio": _ratio(spectrum, m - 1) if m >= 2 else np.nan,
        "augmented_gap_ratio": _ratio(aug, m),
        "rms_residual": float(np.sqrt(max(sq, 0.0) / stats["n_equations"])),
        "solver": solver,
    }


def _fit_matrix_free(stats, m, method, huber_delta, reweight_iter, n_eig, start):
    """:func:`fit_affine_hull` on factored statistics (iterative eigensolver)."""
    d = stats["n_features"]
    d2 = d * d
    if start is not None:
        start = np.asarray(start, dtype=float).reshape(-1, d2).T
    point, directions, spectrum, aug, it_info = iterative_hull(
        stats, m, n_eigenvalues=n_eig, start=start
    )
    if spectrum[m - 1] <= 1e-12:
        raise CertificationError(
            "The certified constraints do not determine the affine hull: the normal "
            f"operator has {int(np.sum(spectrum <= 1e-12))} null directions, more "
            f"than n_heads - 1 = {m - 1}. Certify more diverse rows: relax the "
            f"tolerance (tol={stats.get('tol', np.nan):g}) or pass more samples."
        )
    if method == "huber":
        point = _huber_point(stats, point, directions, huber_delta)
    cons = stats["constraints"]
    fitted = constraint_matvec(cons["x_row"], cons["v"], point[:, None])
    sq = float(np.sum(fitted**2) - 2 * point @ stats["rhs"] + stats["rhs_norm2"])
    info = _hull_info(stats, m, method, reweight_iter, spectrum, aug, sq, "matrix-free")
    info["iterative"] = it_info
    return (point.reshape(d, d), directions.T.reshape(m - 1, d, d)), info


def _lstsq_hull(stats, m):
    """Least-squares point (d, d) and directions (d^2, m - 1) of the hull."""
    d = stats["n_features"]
    if stats.get("normal") is None:
        point, directions, spectrum, _, _ = iterative_hull(stats, m)
        if spectrum[m - 1] <= 1e-12:
            raise CertificationError(
                "The reweighted constraints do not determine the affine hull; use "
                "fewer reweighting iterations (reweight_iter) or more samples."
            )
        return point.reshape(d, d), directions
    evals, evecs = np.linalg.eigh(stats["normal"])
    top = max(evals[-1], np.finfo(float).tiny)
    rest_vals, rest_vecs = evals[m - 1 :], evecs[:, m - 1 :]
    if rest_vals[0] <= 1e-12 * top:
        raise CertificationError(
            "The reweighted constraints do not determine the affine hull; use "
            "fewer reweighting iterations (reweight_iter) or more samples."
        )
    point = rest_vecs @ (rest_vecs.T @ stats["rhs"] / rest_vals)
    return point.reshape(d, d), evecs[:, : m - 1]


def _ratio(values, j):
    """``values[j] / values[j - 1]`` (ascending values), inf when the latter is 0."""
    if j < 1 or j >= values.size:
        return np.nan
    return float(values[j] / values[j - 1]) if values[j - 1] > 0 else np.inf


def _cvxpy():
    """cvxpy, imported where the Huber fit needs it: ``import skattn``, the
    random-start path and the lstsq hull run without it (GPU machines often
    lack it)."""
    try:
        import cvxpy
    except ImportError as exc:
        raise ImportError(
            "hull_method='huber' needs cvxpy, a dependency of skattn that is "
            "missing here: pip install cvxpy (or use hull_method='lstsq')."
        ) from exc
    return cvxpy


def _huber_point(stats, point, directions, delta):
    """Huber fit of the point on the kept equations, orthogonal to the directions."""
    A, b = stats.get("equations"), stats["targets"]
    if A is None:  # matrix-free statistics keep the equations factored
        eq_x, eq_v = stats["equation_factors"]
        A = np.einsum("ei,ej->eij", eq_x, eq_v).reshape(b.size, -1)
    if A.shape[0] < A.shape[1]:
        raise CertificationError(
            _too_few({**stats, "n_equations": A.shape[0]}, A.shape[1])
        )
    if delta is None:
        # 1.5 x the median absolute residual, floored so that clean constraints
        # (residuals ~ 0) do not make the scaled problem ill conditioned.
        floor = 1e-4 * (1.0 + float(np.sqrt(np.mean(b**2))))
        delta = max(1.5 * float(np.median(np.abs(A @ point - b))), floor)
    cp = _cvxpy()
    # Scale so the Huber threshold is 1 (keeps the solver well conditioned).
    theta = cp.Variable(A.shape[1])
    objective = cp.Minimize(cp.sum(cp.huber((A @ theta - b) / delta, 1.0)))
    constraints = [directions.T @ theta == 0] if directions.shape[1] else []
    gauge = _gauge_indices(stats.get("gauge_features", ()), stats["n_features"])
    if gauge.size:
        constraints.append(theta[gauge] == 0)
    problem = cp.Problem(objective, constraints)
    try:
        problem.solve(solver=cp.CLARABEL)
    except cp.error.SolverError as exc:
        raise ValueError(
            f"The Huber fit of the hull point failed ({exc}); relax the "
            f"certification tolerance (tol={stats.get('tol', np.nan):g}) or use "
            f"method='lstsq'."
        ) from exc
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
        raise ValueError(
            f"The Huber fit of the hull point ended with status {problem.status!r}; "
            f"relax the certification tolerance (tol={stats.get('tol', np.nan):g}) "
            f"or use method='lstsq'."
        )
    return np.asarray(theta.value, dtype=float)


def hull_distance(attention, point, directions):
    """Distance of each ``Theta_i`` to an affine hull, relative to ``||Theta_i||_F``.

    Parameters
    ----------
    attention : ndarray of shape (m, d, d)
    point : ndarray of shape (d, d)
    directions : ndarray of shape (r, d, d)
        Orthonormal in the Frobenius inner product.

    Returns
    -------
    distances : ndarray of shape (m,)

    Examples
    --------
    >>> import numpy as np
    >>> theta = np.stack([np.eye(2), -np.eye(2)])
    >>> hull_distance(theta, np.zeros((2, 2)), (np.eye(2) / np.sqrt(2))[None])
    array([0., 0.])
    """
    m, d, _ = attention.shape
    diff = (attention - point).reshape(m, d * d)
    D = np.asarray(directions).reshape(-1, d * d)
    resid = diff - (diff @ D.T) @ D
    return np.linalg.norm(resid, axis=1) / np.linalg.norm(
        attention.reshape(m, -1), axis=1
    )


def sculpt_hull(
    X,
    Y,
    n_heads,
    *,
    W_sum=None,
    tol=_HULL.tol,
    tol_final=_HULL.tol_final,
    n_rounds=_HULL.n_rounds,
    refine_iter=_HULL.refine_iter,
    sample_weight=None,
    p_min=_HULL.p_min,
    weight_power=2.0,
    max_rows=_HULL.max_rows,
    method=_HULL.method,
    select="gap",
    min_rows=None,
    batch_size=_HULL.batch_size,
    max_heads=_HULL.max_heads,
    random_state=None,
    confidence_floor=_HULL.confidence_floor,
    reweight_iter=0,
    gauge_features=(),
    solver=_HULL.solver,
):
    """Phases 2-4: refine ``W_sum`` and fit the hull with a tightening tolerance.

    Round ``r`` uses the tolerance ``tol * (tol_final / tol) ** (r / (n_rounds-1))``
    (geometric from ``tol`` to ``tol_final``): phase 3
    (:func:`~skattn.phased._projection_sum.refine_projection_sum`, ``refine_iter``
    alternations) refines ``W_sum``, then the certified rows under the refined
    ``W_sum`` give the hull (:func:`hull_constraints`, :func:`fit_affine_hull`).
    A round that certifies too few rows stops the loop with a warning and the
    previous round's estimates are returned.  ``W_sum`` is the last round's (each
    round refines it); the hull is the one of the round with the clearest spectral
    evidence (largest augmented gap ratio, ``select="gap"``): tighter tolerances
    cut the bias of the constraints until too few rows remain, and the gap ratio
    tracks the hull error without knowing the truth.

    Parameters
    ----------
    X : ndarray of shape (n_samples, n_tokens, n_features)
    Y : ndarray of shape (n_samples, n_tokens, n_outputs)
    n_heads : int or "auto"
        ``"auto"`` estimates it each round from the spectral gap
        (:func:`~skattn.phased._span.estimate_n_heads`).
    W_sum : ndarray of shape (n_features, n_outputs), default=None
        Starting estimate; default phase 1
        (:func:`~skattn.phased._projection_sum.crude_projection_sum`).
    tol, tol_final : float, default=0.3, 0.02
        First and last certification tolerance.
    n_rounds : int, default=5
    refine_iter : int, default=2
        Alternations of phase 3 per round (0 keeps ``W_sum`` fixed).
    sample_weight : ndarray of shape (n_samples,), default=None
    p_min, weight_power, max_rows : see :func:`hull_constraints`.
    method : {"lstsq", "huber"}, default="lstsq"
        See :func:`fit_affine_hull`.
    select : {"gap", "last"}, default="gap"
        Which round's hull to return: the one with the largest augmented gap ratio,
        or the last one.
    min_rows : int, default=None
        See :func:`~skattn.phased._projection_sum.refine_projection_sum`.
    batch_size : int, default=4096
        Samples certified at a time.  ``X`` and ``Y`` may be
        :class:`~skattn.utils._batches.TokenBatches` of out-of-core arrays; on dask
        arrays every pass of phases 1-4 over the samples runs as dask tasks on
        the chunks (see :func:`hull_constraints`).
    max_heads : int, default=6
        Largest number of heads ``n_heads="auto"`` may return.
    random_state : int or None, default=None
    confidence_floor : float, default=None
        See :func:`hull_constraints` (``None``: equal row weights).
    reweight_iter : int, default=0
        See :func:`fit_affine_hull` (0: no reweighting).
    gauge_features : tuple of int, default=()
        Constant token features; see :func:`hull_constraints`.
    solver : {"auto", "dense", "matrix-free"}, default="auto"
        How the hull's system is solved; see :func:`hull_constraints`.  The
        matrix-free solver starts each round from the previous round's hull.

    Returns
    -------
    W_sum : ndarray of shape (n_features, n_outputs)
    point : ndarray of shape (d, d)
    directions : ndarray of shape (m - 1, d, d)
    info : dict
        ``rounds``: one dict per round (``tol``, ``certified_fraction``,
        ``n_equations``, ``w_change``, ``gap_ratio``, ``augmented_gap_ratio``,
        ``rms_residual``, ``n_heads``, ``seconds``); ``best_round`` (whose hull is
        returned);
        ``n_heads``, ``spectrum``, ``augmented_spectrum``, ``gap_ratio`` and
        ``augmented_gap_ratio`` of that round; ``stopped_early``;
        ``certified_fraction`` of the last round.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(2000, 3, 4))
    >>> theta, W = rng.normal(size=(1, 4, 4)) / 2, rng.normal(size=(1, 4, 6))
    >>> W_sum, point, directions, info = sculpt_hull(X, forward(X, theta, W), 1)
    >>> bool(np.linalg.norm(point - theta[0]) < 0.05 * np.linalg.norm(theta[0]))
    True
    """
    from ._span import estimate_n_heads

    X, Y, w = _check_token_arrays(X, Y, sample_weight)
    _check_certifiable(X.shape[1], Y.shape[2])
    auto = isinstance(n_heads, str)
    if auto and n_heads != "auto":
        raise ValueError(f"n_heads must be a positive int or 'auto', got {n_heads!r}.")
    if W_sum is None:
        W_sum, _ = crude_projection_sum(X, Y, w)
    n_rounds = max(int(n_rounds), 1)
    tols = tol * (tol_final / tol) ** (np.arange(n_rounds) / max(n_rounds - 1, 1))
    if select not in ("gap", "last"):
        raise ValueError(f"select must be 'gap' or 'last', got {select!r}.")
    # Phase 3 and phase 2 with their own defaults, as the public functions have
    # them; each round's phase-2 scan also makes the next round's first phase-3
    # pass (both certify every row under the same W_sum): one pass fewer a round.
    refine_options = _signature_defaults(refine_projection_sum)
    refine_options.update(
        sample_weight=w, max_iter=refine_iter, min_rows=min_rows, batch_size=batch_size
    )
    hull_options = _signature_defaults(hull_constraints)
    hull_options.update(
        sample_weight=w,
        p_min=p_min,
        weight_power=weight_power,
        max_rows=max_rows,
        batch_size=batch_size,
        random_state=random_state,
        confidence_floor=confidence_floor,
        keep_rows=reweight_iter > 0,
        gauge_features=gauge_features,
        solver=solver,
    )
    fuse = refine_iter > 0 and refine_options["rcond"] == hull_options["rcond"]
    rounds = []
    result = best = None
    stopped_early = False
    next_scan = None
    for r, tol_r in enumerate(tols):
        round_start = time.perf_counter()
        try:
            W_prev = W_sum
            if refine_iter > 0:
                W_sum, _ = _refine_projection_sum(
                    X, Y, W_sum, tol=tol_r, first_scan=next_scan, **refine_options
                )
            next_refine = None
            if fuse and r + 1 < n_rounds:
                next_refine = {
                    key: refine_options[key]
                    for key in ("screen", "optimizer", "hessian_rows")
                }
                next_refine["tol"] = tols[r + 1]
            stats, cinfo, next_scan = _hull_constraints(
                X, Y, W_sum, tol=tol_r, next_refine=next_refine, **hull_options
            )
            if auto:
                m, _ = estimate_n_heads(
                    fit_affine_hull(stats, 1, n_eigenvalues=max_heads + 2)[1][
                        "augmented_spectrum"
                    ],
                    max_heads=max_heads,
                )
            else:
                m = int(n_heads)
            start = None
            if result is not None and result[2].shape[0] == m - 1:
                start = np.concatenate([result[1][None], result[2]])
            (point, directions), hinfo = fit_affine_hull(
                stats, m, method=method, reweight_iter=reweight_iter, start=start
            )
        except CertificationError as exc:
            if result is None:
                raise
            warnings.warn(
                f"sculpt_hull stopped at round {r} (tol={tol_r:.3g}): {exc} "
                f"Returning round {r - 1}; set tol_final >= {tols[r - 1]:.3g}.",
                CertificationWarning,
                stacklevel=2,
            )
            W_sum = result[0]
            stopped_early = True
            break
        result = (W_sum, point, directions, hinfo, m)
        evidence = hinfo["augmented_gap_ratio"]
        if (
            select == "last"
            or best is None
            or evidence >= best[3]["augmented_gap_ratio"]
        ):
            best = (r, point, directions, hinfo, m)
        rounds.append(
            {
                "round": r,
                "tol": float(tol_r),
                "certified_fraction": cinfo["certified_fraction"],
                "n_rows_used": cinfo["n_rows_used"],
                "n_equations": cinfo["n_equations"],
                "w_change": float(
                    np.linalg.norm(W_sum - W_prev) / np.linalg.norm(W_prev)
                ),
                "n_heads": m,
                "gap_ratio": hinfo["gap_ratio"],
                "augmented_gap_ratio": hinfo["augmented_gap_ratio"],
                "rms_residual": hinfo["rms_residual"],
                "seconds": time.perf_counter() - round_start,
            }
        )
    W_sum = result[0]
    best_round, point, directions, hinfo, m = best
    info = {
        "rounds": rounds,
        "n_rounds": len(rounds),
        "best_round": best_round,
        "n_heads": m,
        "stopped_early": stopped_early,
        "spectrum": hinfo["spectrum"],
        "augmented_spectrum": hinfo["augmented_spectrum"],
        "gap_ratio": hinfo["gap_ratio"],
        "augmented_gap_ratio": hinfo["augmented_gap_ratio"],
        "certified_fraction": rounds[-1]["certified_fraction"],
    }
    return W_sum, point, directions, info
