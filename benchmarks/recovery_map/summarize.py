"""The recovery map's table and figure from the sweep's result file.

Each cell (one fit) is **exact** (held-out prediction error at most 1e-6),
**not pinned** (the fit said before its long work that the data cannot pin a
head: an ``IdentifiabilityWarning``), **approximate** (neither; its reason is the
first sentence of its convergence warning) or **error** (the fit raised).

    python benchmarks/recovery_map/summarize.py benchmarks/recovery_map/results.csv \\
        [--figure docs/_static/recovery_map.png] [--markdown OUT.md]
"""

import argparse
import json
import math
import re

import numpy as np
import pandas as pd

EXACT = 1e-6
_OUTCOMES = ("exact", "approximate", "not pinned", "error")


def outcome(row):
    """``(outcome, reason)`` of one result row."""
    if row["status"] != "ok":
        return "error", str(row["error"])[:120]
    messages = json.loads(row["warnings"]) if isinstance(row["warnings"], str) else []
    if row["prediction_error"] <= EXACT:
        return "exact", ""
    for message in messages:
        if message.startswith("IdentifiabilityWarning"):
            return "not pinned", _first_sentence(message)
    for message in messages:
        if message.startswith("ConvergenceWarning"):
            reason = _first_sentence(message)
            if "found no head" in message:
                reason += " (the search found no head)"
            return "approximate", reason
    return "approximate", "no warning"


def _first_sentence(message):
    text = message.split(": ", 1)[-1]
    text = re.sub(r"\([^)]*\)", "", text)
    return re.split(r"(?<=[a-z0-9])[.:] ", text, maxsplit=1)[0][:140]


def table(results):
    """One row per cell with its outcome and reason."""
    rows = results.copy()
    rows[["outcome", "reason"]] = rows.apply(lambda r: pd.Series(outcome(r)), axis=1)
    rows["sum_of_ranks"] = rows["n_heads"] * rows["head_rank"]
    keys = ["distribution", "attention_scale", "n_samples", "n_heads", "head_rank"]
    return rows.sort_values(keys)[
        [*keys, "sum_of_ranks", "outcome", "prediction_error", "fit_seconds", "reason"]
    ]


def markdown(cells):
    """Counts, a grid of outcomes and the failing cells, as Markdown."""
    lines = ["| outcome | cells |", "| --- | --- |"]
    for name in _OUTCOMES:
        lines.append(f"| {name} | {int((cells['outcome'] == name).sum())} |")
    lines += ["", "Failing cells:", ""]
    lines.append(
        "| tokens | scale | n | m | r | held-out | seconds | outcome: reason |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for _, c in cells[cells["outcome"] != "exact"].iterrows():
        lines.append(
            f"| {c['distribution']} | {c['attention_scale']:g} | {c['n_samples']} | "
            f"{c['n_heads']} | {c['head_rank']} | {c['prediction_error']:.2g} | "
            f"{c['fit_seconds']:.0f} | {c['outcome']}: {c['reason']} |"
        )
    return "\n".join(lines)


def figure(cells, path):
    """Rows: tokens x logit scale x sequences; columns: heads x rank; colour the
    outcome, text the held-out error's log10."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    rows = sorted(
        {(c.distribution, c.attention_scale, c.n_samples) for c in cells.itertuples()}
    )
    cols = sorted({(c.n_heads, c.head_rank) for c in cells.itertuples()})
    codes = np.full((len(rows), len(cols)), np.nan)
    text = np.full((len(rows), len(cols)), "", dtype=object)
    for c in cells.itertuples():
        i = rows.index((c.distribution, c.attention_scale, c.n_samples))
        j = cols.index((c.n_heads, c.head_rank))
        codes[i, j] = _OUTCOMES.index(c.outcome)
        error = c.prediction_error
        text[i, j] = "" if not error > 0 else f"{math.log10(error):.0f}"
    colours = ListedColormap(["#4c9a2a", "#e8a33d", "#5b7bd5", "#c0392b"])
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(cols), 1.0 + 0.32 * len(rows)))
    ax.imshow(codes, cmap=colours, vmin=-0.5, vmax=3.5, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(cols)):
            ax.text(j, i, text[i, j], ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), [f"m={m}\nr={r}" for m, r in cols], fontsize=7)
    ax.set_yticks(
        range(len(rows)), [f"{d} x{s:g} n={n}" for d, s, n in rows], fontsize=7
    )
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=colours(k)) for k in range(len(_OUTCOMES))
    ]
    ax.legend(
        handles,
        _OUTCOMES,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08),
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    ax.set_title("Recovery map: outcome (text: log10 held-out error)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results")
    parser.add_argument("--figure")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    results = (
        pd.read_parquet(args.results)
        if args.results.endswith(".parquet")
        else pd.read_csv(args.results)
    )
    cells = table(results)
    text = markdown(cells)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    if args.figure:
        figure(cells, args.figure)


if __name__ == "__main__":
    main()
