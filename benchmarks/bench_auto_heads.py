"""n_heads="auto" on planted layers: does it pick the planted m, and at what cost?

For each planted layer (m = 1-6, Boolean and Gaussian tokens, noise 0 and 0.01,
d in {8, 16}, k in {2, 4, 8}, d_out = m k + 4) it fits
``MultiHeadAttentionRegressor(n_heads="auto")`` and the same estimator told the
planted m, on the same examples, and prints one Markdown row: the selected m, why
the search stopped, the spectral second opinion of phases 2-4 (its m and augmented
gap ratio), what the search did besides fitting m = 1, 2, ... (look-ahead fits cut
at the iteration cap, "capped m", or resumed after it, "m resumed"; redundant heads
dropped, "pruned m -> m'"), both wall times and their ratio, and the relative test
error of both fits on fresh examples.

Run by hand (not by CI), e.g.::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 nice python benchmarks/bench_auto_heads.py
"""

import argparse
import time
import warnings

import numpy as np

from skattn import MultiHeadAttentionRegressor, make_attention_regression

# (m, d, k, distribution, noise)
LAYERS = [
    (1, 8, 4, "boolean", 0.0),
    (1, 16, 8, "gaussian", 0.01),
    (1, 8, 2, "gaussian", 0.01),
    (2, 8, 4, "gaussian", 0.0),
    (2, 16, 4, "boolean", 0.0),
    (2, 8, 8, "boolean", 0.01),
    (2, 16, 8, "gaussian", 0.0),
    (2, 16, 2, "boolean", 0.01),
    (3, 8, 4, "boolean", 0.0),
    (3, 8, 2, "gaussian", 0.01),
    (3, 16, 4, "gaussian", 0.0),
    (3, 8, 4, "boolean", 0.01),
    (4, 8, 2, "boolean", 0.0),
    (4, 8, 4, "gaussian", 0.0),
    (4, 8, 2, "gaussian", 0.01),
    (4, 16, 2, "boolean", 0.0),
    (5, 8, 2, "gaussian", 0.0),
    (5, 8, 2, "boolean", 0.01),
    (5, 8, 4, "boolean", 0.0),
    (6, 8, 2, "boolean", 0.0),
    (6, 8, 2, "gaussian", 0.01),
    (6, 8, 2, "gaussian", 0.0),
]


def _test_error(est, X, y):
    residual = est.predict(X) - y
    return float(np.sqrt(np.sum(residual**2) / np.sum(y**2)))


def run(n, seed, limit):
    print(
        "| dist | m | d | k | d_out | noise | auto m | reason | spectral m (gap) | "
        "search | auto s | told-m s | ratio | auto test err | told-m test err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    n_right, ratios = 0, []
    for i, (m, d, k, dist, noise) in enumerate(LAYERS[:limit]):
        d_out = m * k + 4
        X, y, layer = make_attention_regression(
            n + 2000,
            k,
            d,
            m,
            n_outputs=d_out,
            distribution=dist,
            noise=noise,
            random_state=seed + i,
            return_layer=True,
        )
        X_test, X = X[n:], X[:n]
        y_test, y = layer.transform(X_test), y[:n]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            auto = MultiHeadAttentionRegressor(
                n_heads="auto", n_tokens=k, input_distribution=dist, random_state=0
            ).fit(X, y)
            t_auto = time.perf_counter() - start
            start = time.perf_counter()
            told = MultiHeadAttentionRegressor(
                n_heads=m, n_tokens=k, input_distribution=dist, random_state=0
            ).fit(X, y)
            t_told = time.perf_counter() - start
        sel = auto.model_selection_
        spec = sel["spectral"]
        spectral = (
            f"{spec['n_heads']} ({spec['augmented_gap_ratio']:.3g})"
            if spec["available"]
            else "n/a"
        )
        notes = [
            f"{c['n_heads']} {'resumed' if c['resumed'] else 'capped'}"
            for c in sel["candidates"]
            if c["capped"]
        ]
        notes += [
            f"pruned {p['n_heads'] + 1} -> {p['n_heads']}"
            + ("" if p["accepted"] else " (rejected)")
            for p in sel["pruned"]
        ]
        n_right += auto.n_heads_ == m
        ratios.append(t_auto / t_told)
        print(
            f"| {dist} | {m} | {d} | {k} | {d_out} | {noise:g} | "
            f"{auto.n_heads_}{'' if auto.n_heads_ == m else ' WRONG'} | "
            f"{sel['reason']} | {spectral} | {'; '.join(notes)} | "
            f"{t_auto:.1f} | {t_told:.1f} | "
            f"{t_auto / t_told:.2f} | {_test_error(auto, X_test, y_test):.1e} | "
            f"{_test_error(told, X_test, y_test):.1e} |",
            flush=True,
        )
    print(
        f"\nplanted m picked: {n_right}/{len(ratios)}; time ratio auto / told-m: "
        f"median {np.median(ratios):.2f}, max {np.max(ratios):.2f}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000, help="training examples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the layers")
    parser.add_argument(
        "--limit", type=int, default=len(LAYERS), help="run the first LIMIT layers"
    )
    args = parser.parse_args()
    run(args.n, args.seed, args.limit)


if __name__ == "__main__":
    main()
