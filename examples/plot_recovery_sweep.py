"""
=================================================
A recovery sweep and its phase diagram
=================================================

A sample-complexity curve is many fits over a grid.
:func:`~skattn.experiments.recovery_sweep` runs the grid (learner x planted
layer x ``n_samples`` x seed) through joblib and returns one row per fit; the
displays read that table.

Here the phased learner of Chen & Li with its polish (the default), the phases
alone (``polish=False``) and gradient training learn planted layers of one and two
heads (``k = 2`` Gaussian tokens of ``d = 4`` features, ``d_out = 8``) from 100 to
1600 examples, three seeds each: 54 small fits.  A fit succeeds when both
head-matched parameter errors are below ``success_tol = 1e-4``.  With
``output="sweep.csv"`` the rows would be written as they finish and a rerun would
skip them; with
``scheduler="tcp://host:8786"`` the fits would run on a Dask cluster.  The same
sweep runs from the command line as ``skattn sweep CONFIG.toml``.
"""

# %%
# The sweep
# ---------
import matplotlib.pyplot as plt

from skattn.estimators import GradientAttentionRegressor, MultiHeadAttentionRegressor
from skattn.experiments import PhaseDiagramDisplay, SweepCurveDisplay, recovery_sweep

learners = {
    "phased": MultiHeadAttentionRegressor(n_heads="planted"),
    "phases alone": MultiHeadAttentionRegressor(n_heads="planted", polish=False),
    "gradient": GradientAttentionRegressor(n_heads="planted", max_iter=200),
}
results = recovery_sweep(
    learners,
    planted={
        "n_heads": [1, 2],
        "n_tokens": 2,
        "n_features": 4,
        "n_outputs": 8,
        "distribution": "gaussian",
    },
    n_samples=[100, 400, 1600],
    seeds=[0, 1, 2],
    n_jobs=1,
    n_test=500,
    success_tol=1e-4,
    progress=False,
)
# Beside the success rate, the precision each fit reached (the larger parameter
# error, median over fits), why the fits stopped, and how many failed (with
# ``polish=False`` a fit whose phases certify too few rows raises: there is no
# phased estimate at that tolerance; the reason is in the column ``error``).
# Inside a sweep the gradient baseline trains to its precision floor
# (``tighten_tol=True``: ``tol=0``).
summary = results.groupby(["learner", "n_heads"]).agg(
    success=("success", "mean"),
    precision=("precision", "median"),
    stopped=("stop_reason", lambda r: ", ".join(sorted(set(r.dropna())))),
    failed=("status", lambda s: int((s != "ok").sum())),
)
print(summary)

# %%
# Success rate and error against n, two heads
# -------------------------------------------
# One curve per learner; the band is the binomial standard error of the success
# rate, or the range of the error over the seeds.
two_heads = results[results.n_heads == 2]
fig, (ax_rate, ax_err) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
SweepCurveDisplay.from_results(two_heads, ax=ax_rate)
SweepCurveDisplay.from_results(two_heads, y="prediction_error", ax=ax_err)

# %%
# A phase diagram: the phases alone over heads and examples
# ---------------------------------------------------------
# The median over seeds would hide failures; the diagram shows the mean test
# prediction error of the phased estimate without its polish.
PhaseDiagramDisplay.from_results(
    results, y="n_heads", learner="phases alone", value="prediction_error"
)
plt.show()
