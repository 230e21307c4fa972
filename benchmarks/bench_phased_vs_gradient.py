"""The phased learner against the gradient baseline, side by side on the same data.

For each setting (input distribution, m, d, k, d_out, n, attention scale, noise) and
seed, one planted layer and one training set; MultiHeadAttentionRegressor (default
parameters) and GradientAttentionRegressor (L-BFGS from one random start, the
least-squares W start, ``tol=1e-10``) are fitted to the same (X, y) in the same run.
Printed per fit: wall time, head-matched relative parameter errors (Theta, W), the
relative test prediction error on fresh inputs, and per setting the ratio of the
phased to the gradient wall time.  A fit counts as recovered when both parameter
errors are <= 1e-4 (``--threshold``).

    export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
    python benchmarks/bench_phased_vs_gradient.py
    python benchmarks/bench_phased_vs_gradient.py --seeds 3 --full   # bigger grid
    python benchmarks/bench_phased_vs_gradient.py --gradient-samples 5000

The default grid takes a few minutes on 2 loaded single-threaded cores.
"""

import argparse
import time
import warnings

import numpy as np

from skattn import (
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
    prediction_error,
)
from skattn.datasets import sample_inputs

# (distribution, m, d, k, d_out, n, attention scale, noise)
QUICK = [
    ("boolean", 1, 8, 4, 16, 20000, 2.0, 0.0),
    ("boolean", 2, 8, 4, 16, 20000, 2.0, 0.0),
    ("gaussian", 2, 8, 4, 16, 20000, 2.0, 0.0),
    ("boolean", 3, 8, 4, 16, 30000, 2.0, 0.0),
    ("boolean", 2, 8, 4, 16, 20000, 4.0, 0.0),
    ("boolean", 2, 8, 4, 16, 20000, 2.0, 0.01),
    ("boolean", 2, 16, 8, 32, 20000, 2.0, 0.0),
]
FULL = QUICK + [
    ("gaussian", 3, 8, 4, 16, 30000, 2.0, 0.0),
    ("boolean", 2, 16, 4, 32, 20000, 2.0, 0.0),
    ("gaussian", 2, 16, 8, 32, 20000, 2.0, 0.0),
    ("boolean", 3, 16, 4, 32, 30000, 2.0, 0.0),
    ("boolean", 2, 8, 4, 16, 20000, 6.0, 0.0),
]


def fit_and_score(est, X, y, layer, X_test):
    """Fit, time, and measure errors; exceptions become a failed row."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            est.fit(X, y)
        except ValueError as exc:
            return {"error": str(exc)[:50], "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    errors = parameter_error(layer, est)
    return {
        "theta": errors.attention_error,
        "W": errors.projection_error,
        "pred": float(prediction_error(layer, est, X_test)),
        "seconds": seconds,
    }


def run(setting, seed, gradient_samples, max_iter):
    dist, m, d, k, d_out, n, scale, noise = setting
    X, y, layer = make_attention_regression(
        n,
        k,
        d,
        m,
        n_outputs=d_out,
        distribution=dist,
        attention_scale=scale,
        noise=noise,
        random_state=seed,
        return_layer=True,
    )
    X_test = sample_inputs(dist, 2000, k, d, random_state=seed + 1000)
    phased = MultiHeadAttentionRegressor(
        n_heads=m, n_tokens=k, input_distribution=dist, random_state=seed
    )
    gradient = GradientAttentionRegressor(
        n_heads=m, n_tokens=k, tol=1e-10, max_iter=max_iter, random_state=seed
    )
    n_grad = n if gradient_samples is None else min(n, gradient_samples)
    return (
        fit_and_score(phased, X, y, layer, X_test),
        fit_and_score(gradient, X[:n_grad], y[:n_grad], layer, X_test),
    )


def cells(result, threshold):
    if "error" in result:
        return ["failed", "", "", f"{result['seconds']:.1f}", "no"]
    ok = max(result["theta"], result["W"]) <= threshold
    return [
        f"{result['theta']:.1e}",
        f"{result['W']:.1e}",
        f"{result['pred']:.1e}",
        f"{result['seconds']:.1f}",
        "yes" if ok else "no",
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="seeds per setting")
    parser.add_argument("--full", action="store_true", help="the larger grid")
    parser.add_argument(
        "--gradient-samples",
        type=int,
        default=None,
        help="train the gradient baseline on the first N examples only",
    )
    parser.add_argument("--max-iter", type=int, default=2000, help="L-BFGS iterations")
    parser.add_argument("--threshold", type=float, default=1e-4)
    args = parser.parse_args(argv)
    settings = FULL if args.full else QUICK
    print(
        f"seeds={args.seeds} gradient_samples={args.gradient_samples} "
        f"max_iter={args.max_iter} recovered: both errors <= {args.threshold:g}\n"
    )
    print(
        "| dist | m | d | k | d_out | n | scale | noise | seed "
        "| phased: Theta err | W err | test err | s | ok "
        "| gradient: Theta err | W err | test err | s | ok | time ratio p/g |"
    )
    print("|" + "---|" * 20)
    totals = {"phased": 0.0, "gradient": 0.0}
    for setting in settings:
        for seed in range(args.seeds):
            phased, gradient = run(setting, seed, args.gradient_samples, args.max_iter)
            totals["phased"] += phased["seconds"]
            totals["gradient"] += gradient["seconds"]
            ratio = phased["seconds"] / max(gradient["seconds"], 1e-9)
            row = [*map(str, setting), str(seed)]
            row += cells(phased, args.threshold) + cells(gradient, args.threshold)
            row.append(f"{ratio:.2f}")
            print("| " + " | ".join(row) + " |", flush=True)
    print(
        f"\ntotal seconds: phased {totals['phased']:.1f}, gradient "
        f"{totals['gradient']:.1f}, ratio "
        f"{totals['phased'] / max(totals['gradient'], 1e-9):.2f}"
    )


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
