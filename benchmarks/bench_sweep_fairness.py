"""The 120-fit sweep of issue 23: phased vs gradient, as a sweep measures them.

Phased learner and gradient baseline (both with their defaults, ``n_heads`` the
planted one) on planted layers with m = 1, 2 heads (k = 4 tokens, d = 4 features,
d_out = d: the sweep's default layer; ``--n-features 8 --n-outputs 16`` is the
user guide's), n = 100, 300, 1000 examples, 10 seeds: 2 x 2 x 3 x 10 = 120 fits
through :func:`skattn.experiments.recovery_sweep` on a Dask ``LocalCluster`` of 2
single-threaded workers (``--processes``: on 2 local joblib processes instead).
Prints, per learner, m and n: the success rate (both head-matched parameter
errors <= ``success_tol``), the median and worst precision reached (the larger
of the two errors), the median fit time and, when the sweep records them
(skattn after issue 23), why the fits stopped and the tolerance they used
(``--keep-tol``: the learners' own defaults, ``tighten_tol=False``).

It runs on any skattn tree (put the tree first on ``PYTHONPATH``), so the same
command measures the code before and after a change::

    PYTHONPATH=/path/to/tree OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/bench_sweep_fairness.py [--processes] [--csv FILE]
"""

import argparse
import time
from collections import Counter

import numpy as np


def _stop_counts(values):
    counts = Counter(v for v in values if isinstance(v, str) and v)
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "-"


def table(results, success_tol):
    """Markdown table: one line per (learner, m, n)."""
    results = results.copy()
    results["reached"] = results[["attention_error", "projection_error"]].max(axis=1)
    has_stop = "stop_reason" in results.columns
    has_tol = "learner_tol" in results.columns
    head = (
        f"| learner | m | n | success (<= {success_tol:g}) | median precision "
        "| worst precision | median s |"
    )
    rule = "|---|---|---|---|---|---|---|"
    if has_stop:
        head += " stopped |"
        rule += "---|"
    if has_tol:
        head += " tol used |"
        rule += "---|"
    lines = [head, rule]
    for (learner, m, n), group in results.groupby(
        ["learner", "n_heads", "n_samples"], sort=True
    ):
        ok = group[group.status == "ok"]
        line = (
            f"| {learner} | {m} | {n} | {group.success.mean():.1f} "
            f"| {np.median(ok.reached):.1e} | {np.max(ok.reached):.1e} "
            f"| {np.median(ok.fit_seconds):.2f} |"
        )
        if has_stop:
            line += f" {_stop_counts(group.stop_reason)} |"
        if has_tol:
            tols = sorted({f"{v:g}" for v in group.learner_tol.dropna()})
            line += f" {', '.join(tols) or '-'} |"
        lines.append(line)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", action="store_true", help="joblib processes")
    parser.add_argument("--seeds", type=int, default=10, help="number of seeds")
    parser.add_argument("--success-tol", type=float, default=1e-6)
    parser.add_argument("--n-features", type=int, default=4, help="d")
    parser.add_argument("--n-outputs", type=int, default=None, help="d_out (d)")
    parser.add_argument(
        "--keep-tol",
        action="store_true",
        help="tighten_tol=False: the learners' own defaults (trees after issue 23)",
    )
    parser.add_argument("--csv", default=None, help="also write the rows here")
    args = parser.parse_args()

    import skattn
    from skattn import GradientAttentionRegressor, MultiHeadAttentionRegressor
    from skattn.experiments import recovery_sweep

    kwargs = dict(
        planted={
            "n_heads": [1, 2],
            "n_tokens": 4,
            "n_features": args.n_features,
            "n_outputs": args.n_outputs,
        },
        n_samples=[100, 300, 1000],
        seeds=list(range(args.seeds)),  # a list: the older trees reject a range
        success_tol=args.success_tol,
        progress=False,
    )
    if args.keep_tol:
        kwargs["tighten_tol"] = False
    learners = {
        "phased": MultiHeadAttentionRegressor(n_heads="planted"),
        "gradient": GradientAttentionRegressor(n_heads="planted"),
    }
    start = time.perf_counter()
    if args.processes:
        engine = "2 joblib processes"
        results = recovery_sweep(learners, n_jobs=2, **kwargs)
    else:
        from distributed import LocalCluster

        engine = "LocalCluster(n_workers=2, threads_per_worker=1)"
        with LocalCluster(
            n_workers=2, threads_per_worker=1, dashboard_address=None
        ) as cluster:
            results = recovery_sweep(
                learners, scheduler=cluster.scheduler_address, **kwargs
            )
    seconds = time.perf_counter() - start
    if args.csv:
        results.to_csv(args.csv, index=False)
    failed = int((results.status != "ok").sum())
    print(f"skattn from {skattn.__file__}")
    print(f"{len(results)} fits on {engine} in {seconds:.0f} s ({failed} failed)\n")
    print(table(results, args.success_tol))


if __name__ == "__main__":
    main()
