"""Why does the hull of phases 2-4 fail for three heads?  A diagnosis with the truth.

Planted layers from ``make_attention_regression`` (d=8, d_out=16; m=3, and m=2
for reference).  All rows but ``sculpt*`` use the EXACT ``W_sum`` (phase 2 alone,
no phase 3), certify every row once and fit the hull (``fit_affine_hull``) from
different subsets / weightings of the rows certified at tol=0.1.  ``err`` is the
hull error (max over heads of the distance of ``Theta_i`` to the hull, relative
to ``||Theta_i||``), ``gap`` the augmented spectral gap ratio, ``rows`` the rows
used (for the study's own variants: rows that give equations).  Variants:

* ``base``        the library's ``hull_constraints`` (tol=0.1, p_min=0.05, power 2);
* ``tol=t``       the same at another certification tolerance;
* ``huber``       ``fit_affine_hull(method="huber")``;
* ``conf``, ``conf/30``  each row's weight divided by ``residual^2 + (tol/f)^2``
                  (f = 10, 30): inverse-variance weights from the residual;
* ``conf@0.3``    the same weights (f=10) on the rows certified at 3 * tol;
* ``pmin=..,pow=..``  other p_min / weight_power on the same rows;
* ``top2``        only the two most probable tokens of each row give equations;
* ``irls``        row-level Cauchy reweighting by each row's equation residual over
                  the fitted hull (3 iterations; no truth); ``conf+irls`` both;
* ``lib:cf+rw``   the library's opt-in: ``hull_constraints(confidence_floor=0.03,
                  keep_rows=True)`` + ``fit_affine_hull(reweight_iter=3)``;
* ``sculpt``, ``sculpt:cf``, ``sculpt:cf+rw``  phases 2-4 end to end
                  (``sculpt_hull``, ESTIMATED ``W_sum``; ``W`` its relative
                  error, ``sec`` wall time): default, ``confidence_floor=0.03``,
                  and that plus ``reweight_iter=3``;
* ``orc<e``       ORACLE (truth, diagnosis only): certified rows whose estimated
                  centred log-ratios are within ``e`` of every head's true ones;
* ``ceil<e``      ORACLE: ALL rows (certified or not) whose heads' true centred
                  log-ratios agree within ``e``, with the true mean pattern: what
                  a perfect certifier could use at this n.

Truth columns of the ``base`` / ``tol=`` rows, over the certified rows that give
equations (``urows``): ``bad`` = % whose heads disagree (true centred log-ratio
spread > 0.1 on a kept token), ``eqerr`` = median of the max abs error of the
estimated centred log-ratios, ``corr`` = Spearman correlation of the residual and
that error.

Run (default < 3 minutes on one core)::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        python benchmarks/studies/study_three_heads.py

``--quick`` runs two settings; ``--n`` changes the number of samples;
``--no-sculpt`` skips the end-to-end ``sculpt_hull`` rows; ``--scores`` prints
only the precision of truth-free certification scores (``score_precision``);
``--rules`` compares our certification rule with the paper's (``rule_comparison``:
samples streamed ``--chunk`` at a time, so ``--n 10000000`` fits in about 1 GB;
``--dist``, ``--no-phases``)::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        python benchmarks/studies/study_three_heads.py --rules --n 10000000
"""

import argparse
import time
import warnings

import numpy as np
from scipy.stats import spearmanr
from study_phases import _plant  # same planted problems as the phase study

from skattn.layer._math import attention_patterns
from skattn.phased import sculpt_hull
from skattn.phased._affine_hull import fit_affine_hull, hull_constraints, hull_distance
from skattn.phased._projection_sum import _certify_batch


def _row_equations(tokens, x_row, p, omega):
    """Centred weighted equations of rows: ``v`` (L, k, d), ``beta`` (L, k)."""
    total = np.maximum(omega.sum(axis=1, keepdims=True), 1e-300)
    logp = np.where(omega > 0, np.log(np.clip(p, 1e-300, None)), 0.0)
    xbar = np.einsum("la,lad->ld", omega / total, tokens)
    lbar = np.sum(omega / total * logp, axis=1, keepdims=True)
    root = np.sqrt(omega)
    v = root[:, :, None] * (tokens - xbar[:, None])
    beta = root * (logp - lbar)
    return v, beta


def _stats(tokens, x_row, p, omega):
    """Sufficient statistics (as ``hull_constraints``) from rows and weights."""
    L, k, d = tokens.shape
    v, beta = _row_equations(tokens, x_row, p, omega)
    V = np.einsum("lad,lae->lde", v, v, optimize=True)
    h = np.einsum("lad,la->ld", v, beta)
    XX = np.einsum("li,lj->lij", x_row, x_row)
    T = XX.reshape(-1, d * d).T @ V.reshape(-1, d * d)
    normal = T.reshape(d, d, d, d).transpose(0, 2, 1, 3).reshape(d * d, d * d)
    n_eq = int(np.sum(np.maximum((omega > 0).sum(axis=1) - 1, 0)))
    return {
        "normal": normal,
        "rhs": np.einsum("li,lj->ij", x_row, h).reshape(d * d),
        "rhs_norm2": float(np.sum(beta**2)),
        "n_rows": L,
        "n_equations": n_eq,
        "n_features": d,
        "tol": np.nan,
        "n_samples": 0,
    }


def _row_residual(tokens, x_row, p, omega, point, directions):
    """Per-row RMS equation residual over the hull: at the point and its sensitivity
    along the directions (every hull point satisfies an agreeing row's equations)."""
    v, beta = _row_equations(tokens, x_row, p, omega)
    r = np.einsum("ld,de,lae->la", x_row, point, v) - beta
    out = np.sum(r**2, axis=1)
    scale = np.linalg.norm(point)
    for D in directions:
        out += scale**2 * np.sum(np.einsum("ld,de,lae->la", x_row, D, v) ** 2, axis=1)
    n_tok = np.maximum((omega > 0).sum(axis=1), 1)
    return np.sqrt(out / n_tok)


def _fit(stats, m, theta, **kw):
    try:
        (point, directions), info = fit_affine_hull(stats, m, **kw)
    except ValueError:
        return np.nan, np.nan, None
    err = float(np.max(hull_distance(theta, point, directions)))
    return err, info["augmented_gap_ratio"], (point, directions)


def _centred_log(p, mask):
    """Centred log-probabilities over the masked tokens: (..., k)."""
    lp = np.where(mask, np.log(np.clip(p, 1e-300, None)), 0.0)
    cnt = np.maximum(mask.sum(axis=-1, keepdims=True), 1)
    return np.where(mask, lp - lp.sum(axis=-1, keepdims=True) / cnt, 0.0)


def _truth(X, theta, P, residual, tol, p_min):
    """Truth about the rows certified at ``tol`` that give equations.

    ``bad``: % whose heads disagree (centred log-ratio spread > 0.1 on a kept
    token); ``eqerr``: median max abs error of the estimated centred log-ratios
    against the heads' true ones; ``corr``: Spearman correlation of the residual
    and that error; ``_eq``: the error of every certified row (diagnosis only).
    """
    s_idx, r_idx = np.nonzero(residual < tol)
    p = P[s_idx, r_idx]
    kept = p >= p_min
    usable = kept.sum(axis=1) >= 2
    # (L, m, k): every head's true pattern on the row
    Ptrue = attention_patterns(X[s_idx], theta)[np.arange(s_idx.size), :, r_idx]
    c_hat = _centred_log(p, kept)
    c_true = _centred_log(Ptrue, kept[:, None, :])
    spread = np.max(np.ptp(c_true, axis=1), axis=1)
    eq_err = np.max(np.abs(c_true - c_hat[:, None]), axis=(1, 2))
    out = {"_eq": eq_err, "urows": int(usable.sum())}
    if usable.sum() > 2:
        out["bad"] = float(np.mean(spread[usable] > 0.1)) * 100
        out["eqerr"] = float(np.median(eq_err[usable]))
        out["corr"] = float(
            spearmanr(residual[s_idx, r_idx][usable], eq_err[usable]).statistic
        )
    return out


def run_setting(
    n, k, m, distribution, scale, *, d=8, d_out=16, seed=0, tol=0.1, sculpt=True
):
    X, Y, theta, W_sum = _plant(n, k, d, m, d_out, distribution, scale, seed)
    P, residual, _ = _certify_batch(X, Y, W_sum, 1e-8)
    rows = []
    head = {"dist": distribution[:4], "k": k, "scale": scale, "n": n}

    def add(name, err, gap, n_rows, **extra):
        rows.append(
            {**head, "variant": name, "err": err, "gap": gap, "rows": n_rows, **extra}
        )

    p_min, power = 0.05, 2.0
    # ---- library baseline and the tolerance sweep (truth: how many agree)
    for t in (0.3, 0.1, 0.03, 0.01):
        stats, cinfo = hull_constraints(X, Y, W_sum, tol=t, random_state=0)
        err, gap, _ = _fit(stats, m, theta)
        add(
            "base" if t == tol else f"tol={t:g}",
            err,
            gap,
            cinfo["n_rows_used"],
            **_truth(X, theta, P, residual, t, p_min),
        )
        if t == tol:
            try:
                err_h, gap_h, _ = _fit(stats, m, theta, method="huber")
            except ValueError:
                err_h = gap_h = np.nan
            huber = (err_h, gap_h, cinfo["n_rows_used"])
    # ---- certified rows at tol (all of them: max_rows is not binding here)
    s_idx, r_idx = np.nonzero(residual < tol)
    tokens = X[s_idx]
    x_row = tokens[np.arange(s_idx.size), r_idx]
    p = P[s_idx, r_idx]
    res = residual[s_idx, r_idx]
    kept = p >= p_min
    usable = kept.sum(axis=1) >= 2  # rows that give an equation
    omega0 = np.where(kept, np.clip(p, p_min, None) ** power, 0.0)
    omega0 *= usable[:, None]
    eq_err = np.where(usable, _truth(X, theta, P, residual, tol, p_min)["_eq"], np.inf)
    add("huber", *huber)
    # ---- confidence weighting from the residual
    for f in (30,):
        cf = omega0 / (res**2 + (tol / f) ** 2)[:, None]
        err, gap, _ = _fit(_stats(tokens, x_row, p, cf), m, theta)
        add(f"conf/{f}", err, gap, int(usable.sum()))
    conf = omega0 / (res**2 + (tol / 10) ** 2)[:, None]
    err, gap, _ = _fit(_stats(tokens, x_row, p, conf), m, theta)
    add("conf", err, gap, int(usable.sum()))
    # the same weights on the rows certified at 3 * tol (floor tol / 10)
    s3, r3 = np.nonzero(residual < 3 * tol)
    tk3 = X[s3]
    p3 = P[s3, r3]
    kp3 = p3 >= p_min
    om3 = np.where(kp3, np.clip(p3, p_min, None) ** power, 0.0)
    om3 *= ((kp3.sum(1) >= 2) / (residual[s3, r3] ** 2 + (tol / 10) ** 2))[:, None]
    err, gap, _ = _fit(_stats(tk3, tk3[np.arange(s3.size), r3], p3, om3), m, theta)
    add(f"conf@{3 * tol:g}", err, gap, int((kp3.sum(1) >= 2).sum()))
    # ---- other p_min / weight_power (same rows)
    for pm, pw in ((0.15, 2.0), (0.05, 4.0), (0.05, 1.0)):
        kp = p >= pm
        om = np.where(kp, np.clip(p, pm, None) ** pw, 0.0) * (kp.sum(1) >= 2)[:, None]
        err, gap, _ = _fit(_stats(tokens, x_row, p, om), m, theta)
        add(f"pmin={pm:g},pow={pw:g}", err, gap, int((kp.sum(1) >= 2).sum()))
    # ---- top-2 tokens only
    top = np.argsort(-p, axis=1)[:, :2]
    mask2 = np.zeros_like(kept)
    np.put_along_axis(mask2, top, True, axis=1)
    omega2 = np.where(mask2 & kept, omega0, 0.0)
    err, gap, _ = _fit(_stats(tokens, x_row, p, omega2), m, theta)
    add("top2", err, gap, int(usable.sum()))
    # ---- IRLS (row-level Cauchy weights of the residual over the hull)
    omega = omega0.copy()
    err, gap, hull = _fit(_stats(tokens, x_row, p, omega), m, theta)
    for _ in range(3):
        if hull is None:
            break
        rr = _row_residual(tokens, x_row, p, omega0, *hull)
        c = 1.5 * np.median(rr[usable]) + 1e-12
        omega = omega0 / (1 + (rr / c) ** 2)[:, None]
        err, gap, hull = _fit(_stats(tokens, x_row, p, omega), m, theta)
    add("irls", err, gap, int(usable.sum()))
    # ---- confidence weights, then IRLS
    omega = conf.copy()
    err, gap, hull = _fit(_stats(tokens, x_row, p, omega), m, theta)
    for _ in range(3):
        if hull is None:
            break
        rr = _row_residual(tokens, x_row, p, omega0, *hull)
        c = 1.5 * np.median(rr[usable]) + 1e-12
        omega = conf / (1 + (rr / c) ** 2)[:, None]
        err, gap, hull = _fit(_stats(tokens, x_row, p, omega), m, theta)
    add("conf+irls", err, gap, int(usable.sum()))
    # ---- the library's opt-in: confidence_floor=0.03, reweight_iter=3
    stats, cinfo = hull_constraints(
        X, Y, W_sum, tol=tol, random_state=0, confidence_floor=0.03, keep_rows=True
    )
    err, gap, _ = _fit(stats, m, theta, reweight_iter=3)
    add("lib:cf+rw", err, gap, cinfo["n_rows_used"])
    # ---- phases 2-4 end to end (estimated W_sum), default and opt-in
    if sculpt:
        for name, kw in (
            ("sculpt", {}),
            ("sculpt:cf", {"confidence_floor": 0.03}),
            ("sculpt:cf+rw", {"confidence_floor": 0.03, "reweight_iter": 3}),
        ):
            start = time.perf_counter()
            try:
                W_hat, point, directions, info = sculpt_hull(
                    X, Y, m, random_state=0, **kw
                )
                err = float(np.max(hull_distance(theta, point, directions)))
                gap = info["augmented_gap_ratio"]
                w_err = float(np.linalg.norm(W_hat - W_sum) / np.linalg.norm(W_sum))
            except ValueError:
                err = gap = w_err = np.nan
            add(name, err, gap, np.nan, W=w_err, sec=time.perf_counter() - start)
    # ---- oracles (truth): certified rows with small equation error
    for e in (0.1, 0.03):
        good = eq_err < e
        err, gap, _ = _fit(
            _stats(tokens[good], x_row[good], p[good], omega0[good]), m, theta
        )
        add(f"orc<{e:g}", err, gap, int(good.sum()))
    # ---- ceiling: all truly agreeing rows (spread < e), with the true mean pattern
    Pall = attention_patterns(X, theta)  # (n, m, k, k)
    Pmean = Pall.mean(axis=1)  # (n, k, k)
    kept_all = Pmean >= p_min
    c_all = _centred_log(Pall, kept_all[:, None])
    spread_all = np.max(np.ptp(c_all, axis=1), axis=-1)
    for e in (0.2, 0.5):
        agree = (spread_all < e) & (kept_all.sum(axis=-1) >= 2)
        sa, ra = np.nonzero(agree)
        tk = X[sa]
        pm = Pmean[sa, ra]
        om = np.where(pm >= p_min, pm**power, 0.0)
        err, gap, _ = _fit(_stats(tk, tk[np.arange(sa.size), ra], pm, om), m, theta)
        add(f"ceil<{e:g}", err, gap, int(sa.size))
    cert_frac = 100 * s_idx.size / (n * k)
    for r in rows:
        r["cert"] = cert_frac
    return rows


COLUMNS = [
    ("dist", "{}"),
    ("k", "{}"),
    ("scale", "{:g}"),
    ("n", "{:.0e}"),
    ("cert", "{:.2f}"),
    ("variant", "{}"),
    ("rows", "{}"),
    ("err", "{:.3f}"),
    ("gap", "{:.3g}"),
    ("W", "{:.3f}"),
    ("sec", "{:.1f}"),
    ("urows", "{}"),
    ("bad", "{:.0f}"),
    ("eqerr", "{:.3f}"),
    ("corr", "{:.2f}"),
]


def _print_row(row, m):
    cells = [str(m)]
    for name, fmt in COLUMNS:
        value = row.get(name, np.nan)
        if isinstance(value, float) and np.isnan(value):
            cells.append("")
        else:
            cells.append(fmt.format(value))
    print("| " + " | ".join(cells) + " |", flush=True)


def score_precision(n=30000, tol=0.3, p_min=0.05):
    """Can any truth-free score of the single-pattern fit find agreeing rows?

    For rows certified at ``tol`` that give equations, ranks them by a score and
    reports the Spearman correlation with the true log-ratio error and the
    share of the best 5 % (at least 200 rows) whose error is below 0.2.
    """
    print("| m | k | dist | rows | score | rho | precision of top 5 % |")
    print("|---|---|---|---|---|---|---|")
    for m, k, dist in (
        (3, 4, "gaussian"),
        (3, 4, "boolean"),
        (2, 4, "boolean"),
        (3, 2, "boolean"),
    ):
        X, Y, theta, W_sum = _plant(n, k, 8, m, 16, dist, 2.0, 0)
        P, residual, _ = _certify_batch(X, Y, W_sum, 1e-8)
        truth = _truth(X, theta, P, residual, tol, p_min)
        s_idx, r_idx = np.nonzero(residual < tol)
        p = P[s_idx, r_idx]
        kept = p >= p_min
        usable = kept.sum(axis=1) >= 2
        Z = X[s_idx] @ W_sum
        smin = np.linalg.svd(Z[:, :-1] - Z[:, -1:], compute_uv=False)[:, -1]
        rel = residual[s_idx, r_idx]
        absr = rel * np.linalg.norm(Y[s_idx, r_idx], axis=1)
        pmin = np.where(kept, p, np.inf).min(axis=1)
        scores = {
            "relative residual": rel,
            "absolute residual": absr,
            "abs / sigma_min(D)": absr / smin,
            "rel / min kept p": rel / pmin,
            "abs / (sigma_min * min p)": absr / (smin * pmin),
        }
        err = truth["_eq"][usable]
        for name, score in scores.items():
            score = score[usable]
            best = np.argsort(score)[: max(200, usable.sum() // 20)]
            rho = spearmanr(score, err).statistic
            prec = np.mean(err[best] < 0.2)
            print(
                f"| {m} | {k} | {dist[:4]} | {usable.sum()} | {name} | "
                f"{rho:.2f} | {prec:.2f} |",
                flush=True,
            )


def _rules(residual, P, lin_res, C, tol):
    """Certified mask and patterns of each rule at ``tol`` (rows on the last axis)."""
    return {
        "ours": (residual < tol, P),
        "ours+simplex": ((residual < tol) & (P.min(axis=-1) >= -tol), P),
        "paper": (
            (lin_res < tol) & (C.min(axis=-1) >= -tol) & (np.abs(C.sum(-1) - 1) <= tol),
            C,
        ),
    }


def _agreement(p, p_true, p_min, spread):
    """Rows that give equations and, among them, those whose heads truly agree.

    ``p`` (L, k) a rule's patterns, ``p_true`` (L, m, k) the heads' true ones;
    agreement is a centred log-ratio spread <= ``spread`` on the tokens ``p`` keeps.
    """
    kept = p >= p_min
    usable = kept.sum(axis=-1) >= 2
    c_true = _centred_log(p_true, kept[:, None, :])
    agree = np.max(np.ptp(c_true, axis=1), axis=1) <= spread
    return usable, agree & usable


def _hull_from_rows(tokens, r_idx, p, m, theta, p_min=0.05, power=2.0):
    """Hull (``_stats`` + ``fit_affine_hull``) from rows and their patterns."""
    kept = p >= p_min
    usable = kept.sum(axis=1) >= 2
    omega = np.where(kept, np.clip(p, p_min, None) ** power, 0.0) * usable[:, None]
    x_row = tokens[np.arange(r_idx.size), r_idx]
    if usable.sum() < 2:
        return np.nan, np.nan, None
    return _fit(_stats(tokens, x_row, p, omega), m, theta)


def _phases_from_hull(hull, m, sample, truth_layer, n_fit=20000, n_test=5000):
    """Phases 5-6 alone (``fit_from_hull(polish=False)``) from a hull: the
    relative test prediction error and the head-matched Theta error."""
    from skattn import AttentionLayer, parameter_error, prediction_error
    from skattn.layer._math import forward
    from skattn.phased import fit_from_hull

    X = sample(n_fit)
    Y = forward(X, truth_layer.attention, truth_layer.projection)
    point, directions = hull
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        th, W, _ = fit_from_hull(
            X, Y, point, directions, m, polish=False, random_state=0
        )
    learned = AttentionLayer(th, W, n_tokens=X.shape[1])
    X_test = sample(n_test)
    return (
        float(prediction_error(truth_layer, learned, X_test)),
        float(parameter_error(truth_layer, learned).attention_error),
    )


def rule_comparison(
    n=100000,
    m=3,
    k=4,
    dist="boolean",
    p_min=0.05,
    spread=0.1,
    chunk=50000,
    tols=(0.3, 0.1, 0.03, 0.01, 0.003),
    keep_tol=0.1,
    phases=True,
    seed=0,
):
    """Our certification rule against the paper's, on the same rows (exact W_sum).

    Rules, each at several tolerances ``t``:

    * ``ours``: affine pattern fit (``sum p = 1``), relative residual < t;
    * ``paper``: the talk's test, ``y_l`` a linear combination of the rows of
      ``X W_sum`` with probability-vector coefficients (the combination is the
      common pattern): residual < t, ``min p >= -t`` and ``|sum p - 1| <= t``
      with ``p`` the unconstrained least-squares coefficients;
    * ``ours+simplex``: ours and ``min p >= -t`` (the paper's sign condition).

    The samples are drawn and certified ``chunk`` at a time (the layer and the
    input stream of ``make_attention_regression(n, ..., random_state=seed)``: one
    chunk of n reproduces its data), so n = 10^7 runs in about 1 GB.  Printed per
    rule and tolerance: rows certified (that give equations), precision (share
    whose heads truly agree: centred log-ratio spread <= ``spread`` on the kept
    tokens), the number of truly agreeing rows, and, for t <= ``keep_tol`` (the
    certified rows are kept), the hull fitted from the certified rows (``err``:
    max relative distance of a Theta_i to it; ``gap``: augmented gap ratio) and,
    with ``phases``, phases 5-6 alone from that hull (``fit_from_hull(polish=
    False)`` on 20000 fresh samples): relative test prediction error and Theta
    error.  Reference hulls: ``oracle`` (certified by ours at ``keep_tol`` and
    truly agreeing), ``ceil<e`` (ALL rows whose heads truly agree within e, with
    the true mean pattern; ``ceil<e,est``: the same rows with our estimated
    patterns) and ``exact`` (the true hull).
    """
    from skattn.datasets import make_attention_layer, resolve_distribution
    from skattn.datasets._distributions import _as_generator
    from skattn.layer import AttentionLayer
    from skattn.layer._math import forward

    d, d_out = 8, 16
    rng = _as_generator(seed)  # as make_attention_regression(random_state=seed)
    planted = make_attention_layer(
        m, d, n_outputs=d_out, attention_scale=2.0, random_state=rng
    )
    layer = AttentionLayer(planted.attention, planted.projection, n_tokens=k)
    theta, W_sum = layer.attention, layer.projection.sum(0)
    sampler = resolve_distribution(dist, k, d)
    counts = {}
    kept_rows, ceil_rows = [], []
    start = time.perf_counter()
    for X in sampler.iter_batches(n, chunk, random_state=rng):
        c = X.shape[0]
        X = X.reshape(c, k, d)
        Y = forward(X, layer.attention, layer.projection)
        P, residual, _ = _certify_batch(X, Y, W_sum, 1e-8)
        Z = X @ W_sum
        # unconstrained coefficients of every row: (c, k rows, k tokens)
        G = Z @ np.swapaxes(Z, 1, 2)
        C = np.swapaxes(np.linalg.pinv(G) @ (Z @ np.swapaxes(Y, 1, 2)), 1, 2)
        lin_res = np.linalg.norm(Y - C @ Z, axis=2) / np.linalg.norm(Y, axis=2)
        lin_res[~np.isfinite(residual)] = np.inf  # the same usable samples for all
        Ptrue = attention_patterns(X, theta)  # (c, m, k, k)
        for tol in tols:
            for name, (cert, patterns) in _rules(residual, P, lin_res, C, tol).items():
                s_idx, r_idx = np.nonzero(cert)
                usable, agree = _agreement(
                    patterns[s_idx, r_idx], Ptrue[s_idx, :, r_idx], p_min, spread
                )
                got = counts.setdefault((name, tol), [0, 0])
                got[0] += int(usable.sum())
                got[1] += int(agree.sum())
        s_idx, r_idx = np.nonzero(np.minimum(residual, lin_res) < keep_tol)
        kept_rows.append(
            (
                X[s_idx],
                r_idx,
                P[s_idx, r_idx],
                C[s_idx, r_idx],
                residual[s_idx, r_idx],
                lin_res[s_idx, r_idx],
                Ptrue[s_idx, :, r_idx],
            )
        )
        # every row of a usable sample (distinct, independent tokens: the rules'
        # rows) whose heads truly agree within 0.2 (on the true mean pattern)
        Pmean = Ptrue.mean(axis=1)
        kept_all = Pmean >= p_min
        c_all = _centred_log(Ptrue, kept_all[:, None])
        spread_all = np.max(np.ptp(c_all, axis=1), axis=-1)
        sa, ra = np.nonzero(
            (spread_all < 0.2) & (kept_all.sum(axis=-1) >= 2) & np.isfinite(residual)
        )
        ceil_rows.append(
            (X[sa], ra, Pmean[sa, ra], P[sa, ra], spread_all[sa, ra], residual[sa, ra])
        )
    seconds = time.perf_counter() - start
    tokens, r_k, P_k, C_k, res_k, lin_k, Pt_k = (
        np.concatenate(a) for a in zip(*kept_rows, strict=True)
    )
    tok_c, r_c, Pm_c, P_c, spr_c, res_c = (
        np.concatenate(a) for a in zip(*ceil_rows, strict=True)
    )

    def sample(size):
        return sampler.sample(size, random_state=rng).reshape(size, k, d)

    def hull_row(hull):
        if not phases or hull is None:
            return ""
        pred, th_err = _phases_from_hull(hull, m, sample, layer)
        return f" {pred:.3f} | {th_err:.3f} |"

    print(f"m={m} k={k} {dist} n={n}: rows {n * k}, streamed in {seconds:.0f} s")
    print(
        "| rule | tol | certified rows | precision | agreeing rows | hull err | gap |"
        + (" phases pred err | phases Θ err |" if phases else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|---|" if phases else ""))
    for tol in tols:
        masks = _rules(res_k, P_k, lin_k, C_k, tol) if tol <= keep_tol else {}
        for name in ("ours", "ours+simplex", "paper"):
            rows, agree = counts[(name, tol)]
            prec = agree / rows if rows else float("nan")
            line = f"| {name} | {tol:g} | {rows} | {prec:.3f} | {agree} |"
            if name in masks:
                cert, patterns = masks[name]
                err, gap, hull = _hull_from_rows(
                    tokens[cert], r_k[cert], patterns[cert], m, theta, p_min
                )
                line += f" {err:.3f} | {gap:.3g} |" + hull_row(hull)
            print(line, flush=True)
    # reference hulls (truth)
    cert = res_k < keep_tol
    usable, agree = _agreement(P_k[cert], Pt_k[cert], p_min, spread)
    good = np.flatnonzero(cert)[agree]
    err, gap, hull = _hull_from_rows(
        tokens[good], r_k[good], P_k[good], m, theta, p_min
    )
    print(
        f"| oracle: ours@{keep_tol:g} and agreeing | | {good.size} | 1 | {good.size} |"
        f" {err:.3f} | {gap:.3g} |" + hull_row(hull),
        flush=True,
    )
    for e in (0.05, 0.1, 0.2):
        sel = spr_c < e
        for label, p in ((f"ceil<{e:g}", Pm_c), (f"ceil<{e:g},est", P_c)):
            err, gap, hull = _hull_from_rows(
                tok_c[sel], r_c[sel], p[sel], m, theta, p_min
            )
            print(
                f"| {label} | | {int(sel.sum())} | 1 | {int(sel.sum())} |"
                f" {err:.3f} | {gap:.3g} |" + hull_row(hull),
                flush=True,
            )
    # phases 5-6 from the exact hull, and from it shifted off the Theta_i by
    # `shift` (relative hull error: the max over heads of the distance / ||Theta_i||)
    flat = theta.reshape(m, -1)
    q, _ = np.linalg.qr((flat[1:] - flat[0]).T)
    directions = q.T.reshape(m - 1, d, d)
    normal = rng.standard_normal(d * d)
    normal -= q @ (q.T @ normal)
    normal *= np.min(np.linalg.norm(flat, axis=1)) / np.linalg.norm(normal)
    for shift in (0.0, 0.01, 0.03, 0.1):
        hull = (theta[0] + shift * normal.reshape(d, d), directions)
        err = float(np.max(hull_distance(theta, *hull)))
        label = "exact hull" if shift == 0 else f"exact hull shifted {shift:g}"
        print(f"| {label} | | | | | {err:.3f} | |" + hull_row(hull), flush=True)
    # how the truly agreeing rows fare under our rule
    for e in (0.05, 0.1):
        sel = spr_c < e
        share = ", ".join(
            f"< {t:g}: {int(np.sum(res_c[sel] < t))}" for t in tols if t <= keep_tol
        )
        q10, q50, q90 = np.quantile(res_c[sel], [0.1, 0.5, 0.9])
        # rank of their equations (true mean patterns, kept tokens): the hull
        # needs d^2 - (m - 1) independent ones
        p = Pm_c[sel]
        omega = np.where(p >= p_min, 1.0, 0.0)
        tk = tok_c[sel]
        v, _ = _row_equations(tk, None, p, omega)
        x_row = tk[np.arange(tk.shape[0]), r_c[sel]]
        eqs = np.einsum("li,laj->laij", x_row, v).reshape(-1, d * d)
        rank = np.linalg.matrix_rank(eqs) if eqs.size else 0
        print(
            f"rows whose heads agree within {e:g}: {int(sel.sum())} (rank of their "
            f"equations {rank} of {d * d}); our residual 10/50/90 % {q10:.3f} / "
            f"{q50:.3f} / {q90:.3f}; residual {share}",
            flush=True,
        )
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30000, help="samples per setting")
    parser.add_argument("--quick", action="store_true", help="two settings")
    parser.add_argument(
        "--no-sculpt", action="store_true", help="skip the end-to-end sculpt_hull"
    )
    parser.add_argument(
        "--scores",
        action="store_true",
        help="only the precision of truth-free certification scores",
    )
    parser.add_argument(
        "--rules",
        action="store_true",
        help="only our certification rule against the paper's (m=3, k=4)",
    )
    parser.add_argument(
        "--chunk", type=int, default=50000, help="--rules: samples per chunk"
    )
    parser.add_argument(
        "--dist",
        nargs="+",
        default=["boolean", "gaussian"],
        help="--rules: input distributions",
    )
    parser.add_argument(
        "--p-min",
        type=float,
        default=0.05,
        help="--rules: smallest pattern probability of a kept token",
    )
    parser.add_argument(
        "--keep-tol",
        type=float,
        default=0.1,
        help="--rules: rows certified at this tolerance are kept for the hull fits",
    )
    parser.add_argument(
        "--no-phases",
        action="store_true",
        help="--rules: skip phases 5-6 from the fitted hulls",
    )
    args = parser.parse_args()
    if args.rules:
        for dist in args.dist:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rule_comparison(
                    args.n,
                    dist=dist,
                    p_min=args.p_min,
                    chunk=args.chunk,
                    keep_tol=args.keep_tol,
                    phases=not args.no_phases,
                )
        return
    if args.scores:
        score_precision(args.n)
        return
    n = args.n
    # (m, k, distribution, scale, n)
    settings = [
        (3, 4, "boolean", 2.0, n),
        (3, 4, "gaussian", 2.0, n),
        (3, 4, "boolean", 4.0, n),
        (3, 4, "gaussian", 4.0, n),
        (3, 2, "boolean", 2.0, n),
        (3, 2, "gaussian", 4.0, n),
        (3, 4, "boolean", 2.0, 100000),
        (3, 4, "gaussian", 2.0, 100000),
        # two heads for reference (where the phases work)
        (2, 4, "boolean", 2.0, n),
        (2, 4, "gaussian", 4.0, n),
        (2, 2, "boolean", 2.0, n),
    ]
    if args.quick:
        settings = settings[:2]
    print("| m | " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|---|" + "|".join("---" for _ in COLUMNS) + "|")
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m, k, dist, scale, n_s in settings:
            for row in run_setting(n_s, k, m, dist, scale, sculpt=not args.no_sculpt):
                _print_row(row, m)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
