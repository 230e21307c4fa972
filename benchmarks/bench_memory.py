"""The cost of ``memory=`` on a fit that is not interrupted (issue 40).

A planted layer of low-rank heads (the random-start path: minibatch search,
per-head refinement, joint polish) is fitted with ``memory=None`` and with
``memory=<a fresh folder>``, alternating, ``--repeat`` times each; the fitted
layers must be bit-identical and the median times are compared.  What the
memory adds: hashing the data once, writing each finished stage (the search, each
head's solve, the polish) and the polish's iterates every 30 s.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py --repeat 3
"""

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np

from skattn import MultiHeadAttentionRegressor, make_attention_regression


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-samples", type=int, default=6000)
    parser.add_argument("--n-tokens", type=int, default=8)
    parser.add_argument("--n-features", type=int, default=32)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--head-rank", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    X, y = make_attention_regression(
        args.n_samples,
        args.n_tokens,
        args.n_features,
        args.n_heads,
        n_outputs=args.n_features,
        distribution="gaussian",
        head_rank=args.head_rank,
        random_state=0,
    )
    params = dict(
        n_heads=args.n_heads,
        n_tokens=args.n_tokens,
        head_rank=args.head_rank,
        init="random",
        start_search="minibatch",
        input_distribution="gaussian",
        random_state=0,
    )
    times = {"none": [], "memory": []}
    layers = {}
    for _ in range(args.repeat):
        for kind in times:
            folder = tempfile.mkdtemp() if kind == "memory" else None
            start = time.perf_counter()
            est = MultiHeadAttentionRegressor(memory=folder, **params).fit(X, y)
            times[kind].append(time.perf_counter() - start)
            layers[kind] = est.attention_.tobytes() + est.projection_.tobytes()
            if folder:
                shutil.rmtree(folder)
    none, memory = (statistics.median(times[k]) for k in ("none", "memory"))
    print("| setting | memory=None s | memory=folder s | ratio | same layer |")
    print("|---|---|---|---|---|")
    print(
        f"| n={args.n_samples}, k={args.n_tokens}, d={args.n_features}, "
        f"m={args.n_heads}, r={args.head_rank} | {none:.2f} | {memory:.2f} | "
        f"{memory / none:.3f} | {layers['none'] == layers['memory']} |"
    )
    print("times:", {k: [round(t, 2) for t in v] for k, v in times.items()})


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
