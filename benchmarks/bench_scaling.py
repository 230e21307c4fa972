"""How the learners scale: time, iterations, peak memory and error against d, m, k, r.

Sweeps (Boolean tokens, logit scale 2, d_out = d, noise-free, n examples):

* d in {16, 32, 64, 128} at k=8, m=2;
* m in {1, 2, 4, 8} at d=32, k=8;
* k in {4, 8, 16, 32} at d=32, m=2;
* head rank r in {4, 8, 16} at d=64, m=4 (Gaussian tokens, planted rank-r heads),
  with the full-rank learner on the same data for comparison.

Each setting plants one layer, draws one training set, and fits
MultiHeadAttentionRegressor (default parameters, plus ``head_rank`` in the rank
sweep) and the gradient baseline (GradientAttentionRegressor, L-BFGS from one random
start, on the first ``--gradient-samples`` examples of the same data, at most
``--gradient-max-iter`` iterations) side by side, every fit in its own process so
that its peak resident memory is its own.  Printed per fit: wall time, iterations
(for the phased learner the polish's Levenberg-Marquardt iterations and its
Jacobian-vector products), peak RSS, which start and solver ran, and the
head-matched relative errors of Theta and W (of the products Theta_i, W_i for
low-rank heads).  Then the growth exponents (least-squares slope of log time
against log d, m, k over each sweep) and, with ``--plot FILE.png``, a log-log plot.

    python benchmarks/bench_scaling.py                       # everything
    python benchmarks/bench_scaling.py --sweep d --no-gradient
    python benchmarks/bench_scaling.py --sweep rank --plot scaling.png

Run it on an otherwise idle machine: the times are the point.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

import numpy as np

SWEEPS = {
    "d": [dict(d=d, k=8, m=2) for d in (16, 32, 64, 128)],
    "m": [dict(d=32, k=8, m=m) for m in (1, 2, 4, 8)],
    "k": [dict(d=32, k=k, m=2) for k in (4, 8, 16, 32)],
    "rank": [dict(d=64, k=8, m=4, r=r) for r in (4, 8, 16)],
}


def run_one(spec):
    """Fit one learner on one setting (in this process); return a result dict."""
    from skattn import (
        GradientAttentionRegressor,
        MultiHeadAttentionRegressor,
        make_attention_regression,
        parameter_error,
    )

    d, k, m, n = spec["d"], spec["k"], spec["m"], spec["n"]
    r = spec.get("r")
    X, y, layer = make_attention_regression(
        n,
        k,
        d,
        m,
        distribution="gaussian" if r else "boolean",
        head_rank=r,
        random_state=spec["seed"],
        return_layer=True,
    )
    learner = spec["learner"]
    if learner == "gradient":
        n_grad = min(n, spec["gradient_samples"])
        X, y = X[:n_grad], y[:n_grad]
        est = GradientAttentionRegressor(
            n_heads=m,
            n_tokens=k,
            max_iter=spec["gradient_max_iter"],
            tol=1e-10,
            random_state=0,
        )
    else:
        est = MultiHeadAttentionRegressor(
            n_heads=m,
            n_tokens=k,
            head_rank=r if learner == "phased-low-rank" else None,
            random_state=0,
        )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(X, y)
            error = None
        except Exception as exc:  # a failed fit is a row, not a crash
            error = f"{type(exc).__name__}: {exc}"[:200]
    seconds = time.perf_counter() - start
    row = dict(spec, seconds=seconds, n_train=len(X), error=error)
    row["warnings"] = sorted({w.category.__name__ for w in caught})
    if error is None:
        errors = parameter_error(layer, est)
        row["theta_err"] = float(errors.attention_error)
        row["w_err"] = float(errors.projection_error)
        if learner == "gradient":
            row["iters"] = int(est.n_iter_)
        else:
            starts = [rec for rec in est.phase_report_ if rec.phase == "0-start"]
            polish = [rec for rec in est.phase_report_ if rec.phase == "6-polish"][-1]
            row["init"] = starts[-1]["init"]
            row["solver"] = polish["solver"]
            row["iters"] = int(polish["n_iter"])
            row["products"] = int(polish.info.get("n_products", 0))
            row["phases_s"] = float(
                sum(
                    rec.seconds
                    for rec in est.phase_report_
                    if rec.phase[0] in "12345"
                    and rec.phase != "2-4-certify-refine-hull"
                )
            )
            row["polish_s"] = float(polish.seconds)
    row["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def run_in_subprocess(spec):
    out = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return dict(spec, error=(out.stderr.strip().splitlines() or ["?"])[-1][:200])
    return json.loads(lines[-1])


def fmt(value, spec=".1e"):
    if value is None:
        return ""
    return format(value, spec) if isinstance(value, float) else str(value)


def print_rows(rows, header=True):
    if header:
        print(
            "| sweep | d | k | m | r | learner | n | s | phases s | polish s | init | "
            "solver | iters | J-products | peak MB | Theta err | W err | note |"
        )
        print("|---" * 18 + "|")
    for row in rows:
        note = row.get("error") or ",".join(row.get("warnings", []))
        print(
            f"| {row['sweep']} | {row['d']} | {row['k']} | {row['m']} | "
            f"{row.get('r') or ''} | {row['learner']} | {row.get('n_train', '')} | "
            f"{fmt(row.get('seconds'), '.1f')} | {fmt(row.get('phases_s'), '.1f')} | "
            f"{fmt(row.get('polish_s'), '.1f')} | {row.get('init', '')} | "
            f"{row.get('solver', '')} | {row.get('iters', '')} | "
            f"{row.get('products', '')} | {fmt(row.get('peak_mb'), '.0f')} | "
            f"{fmt(row.get('theta_err'))} | {fmt(row.get('w_err'))} | {note} |",
            flush=True,
        )


def exponents(rows):
    """Least-squares slope of log(time) against log(axis) per sweep and learner,
    for the whole fit and, for the phased learner, for its polish alone."""
    out = []
    for sweep, axis in (("d", "d"), ("m", "m"), ("k", "k")):
        for learner, key in sorted(
            {(row["learner"], "seconds") for row in rows}
            | {(row["learner"], "polish_s") for row in rows if "polish_s" in row}
        ):
            pts = [
                (row[axis], row[key])
                for row in rows
                if row["sweep"] == sweep
                and row["learner"] == learner
                and row.get("error") is None
                and key in row
            ]
            if sweep == "d":  # the must-show range: d = 32 .. 128
                pts = [p for p in pts if p[0] >= 32]
            if len(pts) >= 2:
                x, t = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
                slope = float(np.polyfit(x, t, 1)[0])
                lo, hi = min(p[0] for p in pts), max(p[0] for p in pts)
                what = "whole fit" if key == "seconds" else "polish only"
                out.append((sweep, learner, what, lo, hi, slope))
    print("\n| sweep | learner | time of | range | exponent |\n|---|---|---|---|---|")
    for sweep, learner, what, lo, hi, slope in out:
        print(f"| {sweep} | {learner} | {what} | {lo}-{hi} | {slope:.2f} |")
    return out


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (sweep, axis) in zip(
        axes, (("d", "d"), ("m", "m"), ("k", "k"), ("rank", "r")), strict=True
    ):
        for learner in sorted({row["learner"] for row in rows}):
            pts = sorted(
                (row[axis], row["seconds"])
                for row in rows
                if row["sweep"] == sweep
                and row["learner"] == learner
                and row.get("error") is None
                and "seconds" in row
            )
            if pts:
                ax.loglog(*zip(*pts, strict=True), "o-", label=learner)
        ax.set_xlabel(axis)
        ax.set_ylabel("wall time (s)")
        ax.set_title(f"sweep over {axis}")
        if ax.get_legend_handles_labels()[0]:  # a sweep not run has no curves
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", choices=[*SWEEPS, "all"], default="all")
    parser.add_argument("--n", type=int, default=50000, help="training examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gradient", action="store_true")
    parser.add_argument("--gradient-samples", type=int, default=5000)
    parser.add_argument("--gradient-max-iter", type=int, default=1000)
    parser.add_argument("--plot", default=None, help="write a log-log plot here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    sweeps = list(SWEEPS) if args.sweep == "all" else [args.sweep]
    rows = []
    for sweep in sweeps:
        for setting in SWEEPS[sweep]:
            learners = ["phased"]
            if sweep == "rank":
                learners = ["phased-low-rank", "phased"]
            if not args.no_gradient:
                learners.append("gradient")
            for learner in learners:
                spec = dict(
                    setting,
                    sweep=sweep,
                    learner=learner,
                    n=args.n,
                    seed=args.seed,
                    gradient_samples=args.gradient_samples,
                    gradient_max_iter=args.gradient_max_iter,
                )
                row = run_in_subprocess(spec)
                rows.append(row)
                print_rows([row], header=len(rows) == 1)
    print()
    print_rows(rows)
    exponents(rows)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
