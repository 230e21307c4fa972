"""Dense against matrix-free hull (phases 2 and 4): the crossover of ``solver="auto"``.

Boolean tokens, k=8, m=2, n=5e4 (the d sweep of bench_scaling.py).  For each d:
phase 1 and three alternations of phase 3 at ``tol`` give ``W_sum``; then, for
each solver in turn (alternating, ``--repeat`` times), one round of phase 2:
``hull_constraints`` (the certification scan plus the dense normal matrix or the
factored rows) and ``fit_affine_hull`` (dense eigendecomposition, or LOBPCG and
CG on the operator).  Printed: the seconds of each step (best of the repeats),
operator products of the iterative solver, the augmented gap ratio of both and
the largest hull distance of the heads (truth known) of both.

    python benchmarks/studies/bench_hull_solvers.py --d 8 16 24 32 --tol 0.3 0.08
"""

import argparse
import json
import time

import numpy as np

from skattn import make_attention_regression
from skattn.phased import crude_projection_sum, refine_projection_sum
from skattn.phased._affine_hull import fit_affine_hull, hull_constraints, hull_distance


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", nargs="+", type=int, default=[8, 16, 24, 32])
    parser.add_argument("--tol", nargs="+", type=float, default=[0.3, 0.08])
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    k, m = 8, 2
    for d in args.d:
        X, y, layer = make_attention_regression(
            args.n, k, d, m, distribution="boolean", random_state=0, return_layer=True
        )
        X, Y = X.reshape(args.n, k, d), y.reshape(args.n, k, -1)
        theta = layer.attention
        W_sum, _ = crude_projection_sum(X, Y)
        for tol in args.tol:
            W_sum, _ = refine_projection_sum(X, Y, W_sum, tol=tol, max_iter=3)
            row = dict(d=d, tol=tol)
            for _ in range(args.repeat):
                for solver in ("dense", "matrix-free"):
                    t0 = time.perf_counter()
                    stats, _ = hull_constraints(
                        X, Y, W_sum, tol=tol, solver=solver, random_state=0
                    )
                    t1 = time.perf_counter()
                    (point, directions), info = fit_affine_hull(stats, m)
                    t2 = time.perf_counter()
                    for name, sec in (("constraints", t1 - t0), ("fit", t2 - t1)):
                        key = f"{solver}:{name}"
                        row[key] = round(min(row.get(key, np.inf), sec), 3)
                    row[f"{solver}:gap"] = round(info["augmented_gap_ratio"], 4)
                    dist = hull_distance(theta, point, directions)
                    row[f"{solver}:hull_err"] = round(float(np.max(dist)), 5)
                    if solver == "matrix-free":
                        row["products"] = info["iterative"]["n_products"]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
