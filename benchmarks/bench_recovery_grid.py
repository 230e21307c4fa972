"""Recovery of planted layers by the phased learner over the grid of issue 3.

For Boolean and Gaussian inputs, m in {1, 2, 3}, (d, k) in {(8, 4), (16, 4), (16, 8)}
and d_out in {d, 2d}: fit MultiHeadAttentionRegressor with and without the polish and
print head-matched relative parameter errors, relative test prediction error, the
hull's spectral evidence and wall time, as a Markdown table.

    python benchmarks/bench_recovery_grid.py [--n 30000] [--quick] [--noise 0.0]
"""

import argparse
import time
import warnings

import numpy as np

from skattn import (
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
    prediction_error,
)
from skattn.datasets import sample_inputs


def run(distribution, m, d, k, d_out, n, noise, seed, polish):
    X, y, layer = make_attention_regression(
        n,
        k,
        d,
        m,
        n_outputs=d_out,
        distribution=distribution,
        noise=noise,
        random_state=seed,
        return_layer=True,
    )
    X_test = sample_inputs(distribution, 2000, k, d, random_state=seed + 1000)
    est = MultiHeadAttentionRegressor(
        n_heads=m,
        n_tokens=k,
        input_distribution=distribution,
        polish=polish,
        random_state=seed,
    )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(X, y)
        except ValueError as exc:
            return {"error": str(exc)[:60], "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    errors = parameter_error(layer, est)
    hull = next(r for r in est.phase_report_ if r.phase == "2-4-hull-selected")
    return {
        "theta": errors.attention_error,
        "W": errors.projection_error,
        "pred": prediction_error(layer, est, X_test),
        "gap": hull["augmented_gap_ratio"],
        "weak": any("Weak spectral" in str(w.message) for w in caught),
        "seconds": seconds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30000)
    parser.add_argument("--noise", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="Boolean, (8, 4) only")
    args = parser.parse_args()
    shapes = [(8, 4)] if args.quick else [(8, 4), (16, 4), (16, 8)]
    dists = ["boolean"] if args.quick else ["boolean", "gaussian"]
    print(f"n={args.n} noise={args.noise} seed={args.seed}\n")
    print(
        "| dist | m | d | k | d_out | d_out>mk | gap | weak | phases: Theta err "
        "| W err | test err | s | polished: Theta err | W err | test err | s |"
    )
    print("|" + "---|" * 16)
    for dist in dists:
        for d, k in shapes:
            for d_out in (d, 2 * d):
                for m in (1, 2, 3):
                    rows = [
                        run(dist, m, d, k, d_out, args.n, args.noise, args.seed, p)
                        for p in (False, True)
                    ]
                    cells = [dist, m, d, k, d_out, "yes" if d_out > m * k else "no"]
                    if "error" in rows[1]:
                        print(
                            "| "
                            + " | ".join(map(str, cells))
                            + f" | failed: {rows[1]['error']} |",
                            flush=True,
                        )
                        continue
                    cells += [f"{rows[1]['gap']:.3g}", "W" if rows[1]["weak"] else ""]
                    for r in rows:
                        cells += [
                            f"{r['theta']:.1e}",
                            f"{r['W']:.1e}",
                            f"{r['pred']:.1e}",
                            f"{r['seconds']:.1f}",
                        ]
                    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
