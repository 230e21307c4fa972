"""Phases 1-5 of the phased learner at transformer sizes, two source trees side by side.

Boolean tokens, k=8, m=2, n=5e4 (bench_scaling.py's d sweep), ``init="phased"``:
for each d, fits MultiHeadAttentionRegressor once per tree, each fit in its own
process (``PYTHONPATH`` = the tree), alternating the trees, and prints the wall
time of phases 1-5 (phase 1 + the selected hull report of phases 2-4 + phase 5,
from ``phase_report_``; also each of the three), of phase 6 (net + polish), the
polish's iterations and Jacobian products, the hull solver, the augmented gap
ratio, the relative test error, and the whole fit.  ``--init random`` times the
random-start fit instead (the polish's work from a random start, for the
comparison of starts).

    python benchmarks/bench_phases_scale.py --trees /work/main /work/wt-20 --d 16 32
    python benchmarks/bench_phases_scale.py --trees . --d 64 128 --timeout 900

Timings on a shared machine are noisy: compare the trees within one run.
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time, warnings
import numpy as np
import skattn
from skattn import MultiHeadAttentionRegressor, make_attention_regression
spec = json.loads(sys.argv[1])
d, k, m, n = spec["d"], spec["k"], spec["m"], spec["n"]
X, y, layer = make_attention_regression(
    n + 2000, k, d, m, distribution="boolean", random_state=spec["seed"],
    return_layer=True,
)
Xt, yt, X, y = X[n:], y[n:], X[:n], y[:n]
est = MultiHeadAttentionRegressor(
    n_heads=m, n_tokens=k, init=spec["init"], random_state=0, **spec["params"]
)
start = time.perf_counter()
error = None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        est.fit(X, y)
    except Exception as exc:  # report the phases that ran, and what raised
        error = f"{type(exc).__name__}: {exc}"[:300]
total = time.perf_counter() - start
rep = est.phase_report_
phases = sum(
    r.seconds for r in rep
    if r.phase in ("1-crude-projection-sum", "2-4-hull-selected", "5-span")
)
by_phase = {
    name: round(sum(r.seconds for r in rep if r.phase == phase), 2)
    for name, phase in (
        ("phase_1", "1-crude-projection-sum"),
        ("phases_2_4", "2-4-hull-selected"),
        ("phase_5", "5-span"),
    )
}
phase6 = sum(r.seconds for r in rep if r.phase in ("6-net", "6-polish"))
polish = ([r.info for r in rep if r.phase == "6-polish"] or [{}])[-1]
hull = [r.info for r in rep if r.phase == "2-4-hull-selected"]
err = None
if error is None:
    err = float(np.linalg.norm(est.predict(Xt) - yt) / np.linalg.norm(yt))
print(json.dumps(dict(
    tree=skattn.__file__.rsplit("/skattn/", 1)[0], d=d, init=spec["init"],
    total=round(total, 2), phases_1_5=round(phases, 2), **by_phase,
    phase_6=round(phase6, 2),
    rounds=[round(r.seconds, 2) for r in rep if r.phase == "2-4-certify-refine-hull"],
    polish_iter=polish.get("n_iter"),
    polish_products=polish.get("n_products"),
    gap=hull[0].get("augmented_gap_ratio") if hull else None,
    test_error=err,
    error=error,
    warnings=sorted({w.category.__name__ for w in caught}),
)))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=["."])
    parser.add_argument("--d", nargs="+", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--m", type=int, default=2)
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", default="phased")
    parser.add_argument("--params", default="{}", help="JSON estimator parameters")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    for d in args.d:
        for tree in args.trees:
            spec = dict(d=d, k=args.k, m=args.m, n=args.n, seed=args.seed)
            spec.update(init=args.init, params=json.loads(args.params))
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            env.setdefault("OMP_NUM_THREADS", "1")
            try:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, json.dumps(spec)],
                    env=env,
                    cwd=os.path.abspath(tree),  # not this directory's skattn
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                line = out.stdout.strip().splitlines()
                print(line[-1] if line else out.stderr.strip()[-400:], flush=True)
            except subprocess.TimeoutExpired:
                timed_out = dict(tree=tree, d=d, timeout=args.timeout)
                print(json.dumps(timed_out), flush=True)


if __name__ == "__main__":
    main()
