"""
===========================================
Non-degeneracy conditions of planted layers
===========================================

The guarantee of the phased learner holds for layers that satisfy non-degeneracy
conditions: heads that are told apart, attention matrices whose mass is spread over
many directions and whose diagonal is not too heavy, projections that a row-wise
fit can see.  :func:`skattn.diagnostics.check_conditions` measures each of them and
compares it with a documented threshold.

Here we plant layers with the three structures of
:func:`skattn.datasets.make_attention_layer` -- random, diagonal and low-rank
attention matrices -- and compare their condition reports.
"""

# %%
# One layer of each structure
# ---------------------------
# Three heads on tokens of 8 features, 16 outputs per token, sequences of 4
# tokens (so that ``d_out > m k``: certification is unambiguous).
import matplotlib.pyplot as plt
import numpy as np

from skattn.datasets import make_attention_layer
from skattn.diagnostics import THRESHOLDS, check_conditions

N_HEADS, N_FEATURES, N_OUTPUTS, N_TOKENS = 3, 8, 16, 4
STRUCTURES = ["random", "diagonal", "low_rank"]

for structure in STRUCTURES:
    layer = make_attention_layer(
        N_HEADS, N_FEATURES, n_outputs=N_OUTPUTS, structure=structure, random_state=0
    )
    report = check_conditions(layer, n_tokens=N_TOKENS)
    print(f"--- structure={structure!r}")
    print(report)
    print()

# %%
# A report is a sequence of conditions: each has a value, the relation and
# threshold it must satisfy, and a verdict.
report = check_conditions(
    make_attention_layer(
        N_HEADS, N_FEATURES, n_outputs=N_OUTPUTS, structure="low_rank", random_state=0
    ),
    n_tokens=N_TOKENS,
)
print("failed:", report.failed)
line = report["attention_stable_rank"]
print(line.value, line.relation, line.threshold, line.passed)
print("per head:", np.round(line.per_head, 3))

# %%
# Many layers of each structure
# -----------------------------
# One layer can pass or fail by chance.  Planting 50 layers per structure shows
# where each structure sits relative to the thresholds.  Low-rank heads (rank
# ``d // 4 = 2`` here) have stable ranks between 1 and 2, and a good share of
# them fall below the threshold: a head that is nearly rank one ranks tokens
# along a single direction.  Diagonal heads are more coherent with each other
# (two random diagonals overlap more than two random full matrices) and carry
# a heavier trace, so a few of them fail on incoherence or diagonal weight.
# Random heads leave a wide margin everywhere.
QUANTITIES = [
    "attention_stable_rank",
    "diagonal_weight",
    "attention_incoherence",
    "attention_separation",
]
N_LAYERS = 50

values = {structure: {name: [] for name in QUANTITIES} for structure in STRUCTURES}
pass_rate = {}
for structure in STRUCTURES:
    passed = 0
    for seed in range(N_LAYERS):
        layer = make_attention_layer(
            N_HEADS,
            N_FEATURES,
            n_outputs=N_OUTPUTS,
            structure=structure,
            random_state=seed,
        )
        report = check_conditions(layer, n_tokens=N_TOKENS)
        passed += report.passed
        for name in QUANTITIES:
            values[structure][name].append(report[name].value)
    pass_rate[structure] = passed / N_LAYERS
    print(f"{structure:>9}: {pass_rate[structure]:.0%} of the layers pass every check")

# %%
# Each panel shows one quantity for every planted layer (a dot per layer), with
# its threshold (``skattn.diagnostics.THRESHOLDS``) as a dashed line; the shaded
# side of it fails.
fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(13, 3.6), layout="constrained")
rng = np.random.default_rng(0)
for ax, name in zip(axes, QUANTITIES, strict=True):
    relation, threshold = THRESHOLDS[name]
    for position, structure in enumerate(STRUCTURES):
        v = np.asarray(values[structure][name])
        jitter = rng.uniform(-0.15, 0.15, size=v.size)
        ax.scatter(position + jitter, v, s=10, alpha=0.6)
    ax.axhline(threshold, color="k", linestyle="--", linewidth=1)
    low, high = ax.get_ylim()
    if relation.startswith(">"):
        ax.axhspan(min(low, threshold), threshold, color="red", alpha=0.08)
    else:
        ax.axhspan(threshold, max(high, threshold), color="red", alpha=0.08)
    ax.set_ylim(low, high)
    ax.set_xticks(range(len(STRUCTURES)), STRUCTURES)
    ax.set_title(f"{name}\n(required {relation} {threshold:g})", fontsize=9)
fig.suptitle(
    f"Condition quantities of {N_LAYERS} planted layers per structure "
    f"(m={N_HEADS}, d={N_FEATURES}, d_out={N_OUTPUTS}, k={N_TOKENS})"
)
plt.show()
