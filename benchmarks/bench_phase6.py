"""Phase 6 (epsilon-net on the affine hull + polish): time and accuracy.

Given the exact affine hull of the planted Theta_i (a point and an orthonormal basis of
the differences), measures for each (m, d, k):

* the net: time, candidates, relative test error of its winner (before any polish),
  head-matched relative parameter errors;
* the polish: Levenberg-Marquardt on the variable projection problem (the default) and
  L-BFGS-B (variable projection, then all parameters), time and final errors;
* optionally (``--scan-n``) the smallest n at which the polish recovers the layer.

Run (about 2-4 minutes on one core)::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_phase6.py
    python benchmarks/bench_phase6.py --quick          # m=2, 3 at (8, 4) only
    python benchmarks/bench_phase6.py --scan-n         # smallest n that recovers
    python benchmarks/bench_phase6.py --lbfgs --n 200  # also L-BFGS-B; 200 examples
"""

import argparse
import time

import numpy as np
from scipy.optimize import linear_sum_assignment

from skattn.datasets import make_attention_regression
from skattn.layer._math import forward
from skattn.phased._net import net_search
from skattn.solvers import polish


def planted(n, k, d, m, seed):
    X, y, layer = make_attention_regression(
        n, k, d, m, random_state=seed, return_layer=True
    )
    return X.reshape(n, k, d), y.reshape(n, k, -1), layer.attention, layer.projection


def exact_hull(attention):
    m, d, _ = attention.shape
    point = attention.mean(axis=0)
    if m == 1:
        return point, np.zeros((0, d, d))
    q, _ = np.linalg.qr((attention[1:] - attention[0]).reshape(m - 1, -1).T)
    return point, q.T.reshape(m - 1, d, d)


def matched(attention, projection, true_attention, true_projection):
    cost = np.linalg.norm(attention[:, None] - true_attention[None], axis=(2, 3))
    r, c = linear_sum_assignment(cost)
    return (
        np.linalg.norm(attention[r] - true_attention[c])
        / np.linalg.norm(true_attention),
        np.linalg.norm(projection[r] - true_projection[c])
        / np.linalg.norm(true_projection),
    )


def test_error(X, Y, attention, projection):
    return np.linalg.norm(forward(X, attention, projection) - Y) / np.linalg.norm(Y)


def run(m, d, k, n, seed, methods):
    X, Y, th, W = planted(n + 2000, k, d, m, seed)
    X, Y, Xt, Yt = X[:n], Y[:n], X[n:], Y[n:]
    point, directions = exact_hull(th)
    t0 = time.perf_counter()
    th0, W0, info = net_search(X, Y, point, directions, m, random_state=0)
    t_net = time.perf_counter() - t0
    e_th0, e_w0 = matched(th0, W0, th, W)
    row = {
        "m": m,
        "d": d,
        "k": k,
        "n": n,
        "seed": seed,
        "net_s": t_net,
        "candidates": info["n_candidates"],
        "resolution": info["resolution"],
        "net_test_err": test_error(Xt, Yt, th0, W0),
        "net_theta_err": e_th0,
        "net_w_err": e_w0,
    }
    for method in methods:
        mode = "both" if method == "lbfgs" else "varpro"
        t0 = time.perf_counter()
        th1, W1, pinfo = polish(
            X, Y, th0, method=method, mode=mode, max_iter=3000, tol=1e-10
        )
        key = "lm" if method != "lbfgs" else "lbfgs"
        row[f"{key}_s"] = time.perf_counter() - t0
        row[f"{key}_iter"] = pinfo["n_iter"]
        e_th, e_w = matched(th1, W1, th, W)
        row[f"{key}_err"] = max(e_th, e_w)
        row[f"{key}_test_err"] = test_error(Xt, Yt, th1, W1)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scan-n", action="store_true")
    parser.add_argument("--lbfgs", action="store_true", help="also time L-BFGS-B")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--n", type=int, default=1000, help="training examples")
    args = parser.parse_args()
    shapes = [(8, 4)] if args.quick else [(8, 4), (16, 4), (16, 8)]
    methods = ["levenberg-marquardt"] + (["lbfgs"] if args.lbfgs else [])
    if args.scan_n:
        print("m d k  n    seed  polished-error  test-error")
        for m in (2, 3):
            for d, k in shapes:
                for n in (10, 20, 30, 50, 100):
                    for seed in range(args.seeds):
                        r = run(m, d, k, n, seed, methods)
                        print(
                            f"{m} {d:2d} {k} {n:4d} {seed:4d}  {r['lm_err']:.1e}"
                            f"  {r['lm_test_err']:.1e}"
                        )
        return
    for m in (2, 3):
        for d, k in shapes:
            for seed in range(args.seeds):
                r = run(m, d, k, args.n, seed, methods)
                line = (
                    f"m={m} d={d:2d} k={k} seed={seed} net {r['net_s']:.2f}s "
                    f"({r['candidates']} cand, res {r['resolution']}) "
                    f"test err {r['net_test_err']:.3f} "
                    f"theta err {r['net_theta_err']:.3f} | "
                    f"LM {r['lm_s']:.2f}s {r['lm_iter']} it "
                    f"err {r['lm_err']:.1e}"
                )
                if "lbfgs_s" in r:
                    line += (
                        f" | L-BFGS {r['lbfgs_s']:.2f}s {r['lbfgs_iter']} it "
                        f"err {r['lbfgs_err']:.1e}"
                    )
                print(line, flush=True)


if __name__ == "__main__":
    main()
