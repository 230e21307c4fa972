"""
==================================================
What each phase did: reading ``phase_report_``
==================================================

:class:`~skattn.estimators.MultiHeadAttentionRegressor` runs the phases of
Chen & Li and records what each one saw and decided in ``phase_report_``, one
:class:`~skattn.phased._report.PhaseReport` per phase (and per round of phases
2-4).  This example reads those records for planted layers with one, two and
three heads, with the number of heads left to the learner (``n_heads="auto"``):

* how many rows each round of certification accepted, at which tolerance;
* the spectrum of the hull's constraint system and its gap, the evidence for
  the number of heads;
* what the epsilon-net alone achieves (``polish=False``) and what the polish adds.
"""

# %%
# Planted layers with one, two and three heads
# ---------------------------------------------
# Sequences of ``k = 3`` standard Gaussian tokens with ``d = 6`` features and
# ``d_out = 12`` outputs per token (so ``d_out > m k`` for up to three heads),
# 4000 examples each.  The learner is told nothing about the number of heads.
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np

from skattn.datasets import make_attention_regression
from skattn.estimators import MultiHeadAttentionRegressor
from skattn.metrics import parameter_error

N_TOKENS, N_FEATURES, N_OUTPUTS, N_SAMPLES = 3, 6, 12, 4000

problems, fits = {}, {}
for m in (1, 2, 3):
    X, y, layer = make_attention_regression(
        N_SAMPLES,
        N_TOKENS,
        N_FEATURES,
        m,
        n_outputs=N_OUTPUTS,
        distribution="gaussian",
        random_state=0,
        return_layer=True,
    )
    problems[m] = (X, y, layer)
    est = MultiHeadAttentionRegressor(n_heads="auto", n_tokens=N_TOKENS, random_state=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, y)
    fits[m] = est
    messages = sorted({str(w.message).split(":")[0] for w in caught})
    print(f"m={m}: estimated n_heads_={est.n_heads_}; warnings: {messages or 'none'}")

# %%
# The whole report of the two-head fit
# ------------------------------------
# Printing a record gives one line: the phase, the round, its wall time and its
# scalar findings.  Indexing a record (``record["certified_fraction"]``) reads any
# of them, including the arrays left out of the line.
for record in fits[2].phase_report_:
    print(record)

# %%
# Certification, round by round
# -----------------------------
# Phases 2-4 run ``n_rounds`` rounds; the certification tolerance tightens
# geometrically from ``certify_tol`` to ``certify_tol_final``.  A tighter
# tolerance certifies fewer rows (fewer constraints) but cleaner ones.  Each
# round also estimates the number of heads from its own spectrum, and reports
# ``w_change``, how much phase 3 still moved ``sum_i W_i``.
print(" m  round    tol  certified  equations  w_change  heads  gap ratio")
for m, est in fits.items():
    for r in est.phase_report_:
        if r.phase == "2-4-certify-refine-hull":
            print(
                f"{m:2d}  {r['round']:5d}  {r['tol']:5.3f}"
                f"  {r['certified_fraction']:9.3f}"
                f"  {r['n_equations']:9d}  {r['w_change']:8.3f}  {r['n_heads']:5d}"
                f"  {r['augmented_gap_ratio']:9.3g}"
            )

# %%
# The spectrum: evidence for the number of heads
# ----------------------------------------------
# A certified row gives affine equations ``A vec(Theta) = b`` that every
# ``Theta_i`` satisfies.  The augmented matrix ``[A, -b]^T Omega [A, -b]`` then
# has ``m`` near-zero eigenvalues (the homogeneous points ``(vec Theta_i, 1)``)
# and a gap before the bulk.  The record ``2-4-hull-selected`` holds the
# spectrum of the round whose hull was kept (``augmented_spectrum``, ascending,
# divided by the largest eigenvalue) and the ratio at the gap.
SCI = {"float_kind": lambda value: f"{value:.1e}"}
for m, est in fits.items():
    selected = next(r for r in est.phase_report_ if r.phase == "2-4-hull-selected")
    spectrum = selected["augmented_spectrum"][:6]
    print(
        f"m={m}: best round {selected.round}, n_heads={selected['n_heads']}, "
        f"gap ratio {selected['augmented_gap_ratio']:.3g}, "
        f"smallest eigenvalues {np.array2string(spectrum, formatter=SCI)}"
    )

# %%
# One head gives an exactly zero eigenvalue (every certified equation is exact up
# to rounding) and two heads a clear gap after the second eigenvalue, so
# the spectrum gives the right count.  With three heads the certified rows are too
# few and too biased at this sample size, and the spectrum's count is wrong (one
# head here).  ``n_heads="auto"`` therefore decides by
# held-out error (it fits m = 1, 2, ... with the polish and stops when adding a
# head no longer helps; ``model_selection_`` has every candidate) and keeps the
# spectral count only as a second opinion, recorded with whether it agrees.
#
# The net and the polish
# ----------------------
# Phase 6 searches an epsilon-net over the hull for the ``Theta_i`` (the ``W_i``
# follow by least squares); ``polish=True`` (the default) then refines the
# winner by Levenberg-Marquardt on the variable-projection problem.  With
# ``polish=False`` the result is the phased estimate alone.
errors, fixed = {}, {}
for m in (1, 2):
    X, y, layer = problems[m]
    for polish in (False, True):
        est = MultiHeadAttentionRegressor(
            n_heads=m, n_tokens=N_TOKENS, polish=polish, random_state=0
        )
        start = time.perf_counter()
        est.fit(X, y)
        seconds = time.perf_counter() - start
        fixed[m, polish] = est
        err = parameter_error(layer, est)
        errors[m, polish] = (err.attention_error, err.projection_error)
        print(
            f"m={m} polish={polish!s:5}: attention error {err.attention_error:.1e}, "
            f"projection error {err.projection_error:.1e}  ({seconds:.1f} s)"
        )
net = next(r for r in fixed[2, True].phase_report_ if r.phase == "6-net")
polish = next(r for r in fixed[2, True].phase_report_ if r.phase == "6-polish")
print(f"net: {net['n_candidates']} candidates on a {net['resolution']}-point grid")
print(f"polish: loss {polish['loss_start']:.2e} -> {polish['loss']:.2e}")

# %%
# With one head the hull is a single point, so the net has nothing to search and
# even ``polish=False`` is accurate to many digits.  With two heads the net's
# winner is within a few percent of the truth (its resolution is the grid
# spacing), and the polish takes it the rest of the way, to machine precision.
# Studying the phases themselves (their tolerances, their sample needs) is done
# with ``polish=False``: the polish hides their errors whenever the net lands in
# the right basin.
#
# All in one figure
# -----------------
fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
for m, est in fits.items():
    rounds = [r for r in est.phase_report_ if r.phase == "2-4-certify-refine-hull"]
    axes[0].plot(
        [r["tol"] for r in rounds],
        [r["certified_fraction"] for r in rounds],
        "o-",
        color=colors[m],
        label=f"m={m}",
    )
    selected = next(r for r in est.phase_report_ if r.phase == "2-4-hull-selected")
    spectrum = np.maximum(selected["augmented_spectrum"][:8], 1e-18)
    axes[1].semilogy(
        np.arange(1, len(spectrum) + 1),
        spectrum,
        "o-",
        color=colors[m],
        label=f"m={m} (estimated {selected['n_heads']})",
    )
axes[0].set(
    xscale="log",
    yscale="log",
    xlabel="certification tolerance of the round",
    ylabel="fraction of rows certified",
    title="phases 2-4: certification",
)
tolerances = [
    r["tol"] for r in fits[2].phase_report_ if r.phase == "2-4-certify-refine-hull"
]
axes[0].set_xticks(tolerances, [f"{tol:.2g}" for tol in tolerances])
axes[0].minorticks_off()
axes[0].invert_xaxis()
axes[0].legend()
axes[1].set(
    xlabel="eigenvalue index (ascending)",
    ylabel="eigenvalue / largest",
    title="augmented spectrum of the selected hull",
)
axes[1].legend()

labels = [f"m={m}\n{'polish' if p else 'net only'}" for m in (1, 2) for p in (0, 1)]
values = [max(errors[m, bool(p)][0], 1e-17) for m in (1, 2) for p in (0, 1)]
axes[2].bar(labels, values, color=["tab:gray", "tab:purple"] * 2)
axes[2].set(yscale="log", ylabel="relative attention error", title="phase 6")
plt.show()
