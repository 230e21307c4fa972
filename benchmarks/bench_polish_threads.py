"""The matrix-free polish's products on two cores: BLAS threads against product jobs.

The variable-projection problem (:class:`~skattn.solvers.kernels._varpro.
VarproProblem`) evaluates a point (the patterns and the projections' Gram, one
large GEMM) and then takes tens of Jacobian products, each a sum over chunks of
sequences of thin GEMMs.  Three ways to spend two cores, side by side:

- ``BLAS 1, 1 job``: one core;
- ``BLAS 2, 1 job``: BLAS's two threads on everything (the encoder polish before
  the fourteenth session);
- ``BLAS 2, 2 jobs``: the evaluation on BLAS's two threads, the products' chunks
  in two jobs of one BLAS thread each (now, the encoder's and the decoder's).

Two planted shapes: a small one (d = 32, 2 full-rank heads, k = 8, 2000
sequences) and a MiniLM-shaped one (d = 384, 12 heads of rank 32, k = 64).

    python benchmarks/bench_polish_threads.py [--shapes small minilm]
        [--evaluations E] [--pairs P] [--out F.json]

Prints per shape and way the seconds of one evaluation (the mean of ``E`` points)
and of one product pair (``J v`` and ``J^T u``, the mean of ``P``), and their
ratio to ``BLAS 2, 1 job``.  Wall-clock time: run it on an otherwise idle
machine of two cores or more.
"""

import argparse
import json
import time

import numpy as np
from threadpoolctl import threadpool_limits

from skattn.datasets import make_attention_regression
from skattn.solvers.kernels._parametrization import FullRank, LowRank
from skattn.solvers.kernels._varpro import VarproProblem

SHAPES = {  # n, k, d, m, r
    "small": (2000, 8, 32, 2, None),
    "minilm": (100, 64, 384, 12, 32),
}
WAYS = (("BLAS 1, 1 job", 1, 1), ("BLAS 2, 1 job", 2, 1), ("BLAS 2, 2 jobs", 2, 2))


def measure(shape, n_evaluations, n_pairs):
    """Seconds of an evaluation and of a product pair, per way."""
    n, k, d, m, r = SHAPES[shape]
    X, y = make_attention_regression(n, k, d, m, head_rank=r, random_state=0)
    X, Y = X.reshape(n, k, d), y.reshape(n, k, d)
    par = LowRank(m, d, r) if r else FullRank(m, d)
    rng = np.random.default_rng(0)
    point = 0.1 * rng.normal(size=par.size)
    direction = rng.normal(size=par.size)
    rows = []
    for name, blas, jobs in WAYS:
        with threadpool_limits(blas, user_api="blas"):
            problem = VarproProblem(X, Y, None, par, n_jobs=jobs)
            problem.residual(point - 1e-3 * direction)  # warm (the jobs' pool)
            clock = time.perf_counter()
            for step in range(1, n_evaluations + 1):
                problem.residual(point + 1e-3 * step * direction)
            evaluation = (time.perf_counter() - clock) / n_evaluations
            problem.residual(point)  # the products' point, evaluated untimed
            clock = time.perf_counter()
            for _ in range(n_pairs):
                u = problem.matvec(point, direction)
                problem.rmatvec(point, u, orthogonal=True)
            pair = (time.perf_counter() - clock) / n_pairs
        rows.append({"way": name, "evaluation_s": evaluation, "pair_s": pair})
    before = rows[1]
    for row in rows:
        row["evaluation_ratio"] = row["evaluation_s"] / before["evaluation_s"]
        row["pair_ratio"] = row["pair_s"] / before["pair_s"]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--evaluations", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {}
    for shape in args.shapes or list(SHAPES):
        results[shape] = measure(shape, args.evaluations, args.pairs)
        print(f"{shape} (n, k, d, m, r = {SHAPES[shape]}):")
        for row in results[shape]:
            print(
                f"  {row['way']:15s} evaluation {row['evaluation_s']:7.3f} s "
                f"({row['evaluation_ratio']:.2f})  product pair "
                f"{row['pair_s']:7.3f} s ({row['pair_ratio']:.2f})",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
