"""Decoupled one-head problems: how many sequences they are solved on.

The decoupled refinement (:func:`skattn.solvers.decoupled_refine`) solves one
problem per head on :func:`~skattn.solvers.stages._rounds.decoupled_size` random
sequences of the training set.  A Jacobian product costs in proportion to the
sequences; more sequences make each head's problem better conditioned (fewer
products) and pin the head better on sequences it was not solved on.  This
script measures the trade on real heads, side by side in one run:

1. it runs ``bench_minilm_teacher.py`` (the default ``MultiHeadAttentionRegressor``)
   with the arguments after ``--`` up to the decoupled refinement, and saves the
   search's end with the whole training set to ``--state`` (reused when the file
   exists);
2. for each of ``--heads`` and each of ``--sizes`` it takes that many random
   sequences (nested: the first ``N`` of one permutation) and solves the head's
   one-head problem there as the refinement does: rounds of ``--max-iter``
   Levenberg-Marquardt iterations, the decoupling map recomputed at the head's
   new point each round, until the relative residual is at most ``--target``
   or ``--rounds`` rounds ran; one BLAS thread, one setting after the other;
3. it prints per head and size the rounds, products, products times sequences
   (the work), seconds, the relative residual, and the residual on
   ``--n-held-out`` other sequences of the training set (the head's value map
   and the other heads' coefficients fitted on its own sequences).

Example (layer 2 of real text; the numbers of benchmarks/HISTORY.md)::

    OMP_NUM_THREADS=1 python benchmarks/studies/bench_decoupled_rows.py \
        --state /tmp/layer2.npz --heads 2 3 5 --sizes 376 752 1128 -- \
        --text --layer 2 --n-heads 12 --n-samples 5000 --n-test 1000
"""

import argparse
import os
import sys

import numpy as np
from threadpoolctl import threadpool_limits

from skattn.layer._math import softmax
from skattn.solvers.kernels._decoupling import _one_head_problem, _shares
from skattn.solvers.stages._rounds import _solve_head


def held_out_residual(X, Y, params, par, head, fit, test, intercept):
    """The head's relative residual on ``test``, its value map and the other heads'
    coefficients fitted on ``fit`` (both as the one-head problem's design)."""
    parts = []
    for rows in (fit, test):
        target, fixed = _one_head_problem(
            X[rows], Y[rows], params, par, head, None, intercept
        )
        patterns = softmax(par.logits(X[rows], params)[:, head], axis=-1)
        design = np.concatenate([patterns @ X[rows], fixed], axis=2)
        parts.append(
            (design.reshape(-1, design.shape[2]), target.reshape(-1, par.rank))
        )
    coef = np.linalg.lstsq(*parts[0], rcond=None)[0]
    design, target = parts[1]
    return float(np.linalg.norm(design @ coef - target) / np.linalg.norm(target))


def solve(X, Y, params, par, head, rows, intercept, args):
    """The head's problem on ``rows`` in rounds; its parameters and totals."""
    Q, K, V = (f.copy() for f in par.factors(params))
    Xd, Yd = X[rows], Y[rows]
    total = {"rounds": 0, "products": 0, "seconds": 0.0, "residual": np.inf}
    for _ in range(args.rounds):
        flat = np.concatenate([Q.ravel(), K.ravel(), V.ravel()])
        shares = _shares(Xd, Yd, flat, par, None, intercept)
        q, kk, v, info = _solve_head(Xd, shares, head, Q, K, None, args.max_iter, 1e-10)
        Q[head], K[head], V[head] = q, kk, v
        total["rounds"] += 1
        total["products"] += info["n_products"]
        total["seconds"] += info["seconds"]
        total["residual"] = info["relative_residual"]
        if total["residual"] <= args.target:
            break
    return np.concatenate([Q.ravel(), K.ravel(), V.ravel()]), total


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", required=True, help=".npz of the search's end")
    parser.add_argument("--heads", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--sizes", type=int, nargs="+", default=[376, 752])
    parser.add_argument("--max-iter", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--target", type=float, default=1e-12)
    parser.add_argument("--n-held-out", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv[:split])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decoupled_precision import load_state

    X, Y, params, par, intercept = load_state(args.state, argv[split + 1 :], whole=True)
    m, d, r = par.n_heads, par.n_features, par.rank
    n, k = X.shape[:2]
    if max(args.sizes) + args.n_held_out > n:
        raise SystemExit(
            f"{n} sequences: too few for {max(args.sizes)} plus "
            f"{args.n_held_out} held out"
        )
    order = np.random.default_rng(args.seed).permutation(n)
    test = np.sort(order[-args.n_held_out :])
    print(f"# {args.state}: {n} sequences of {k} tokens, d={d}, {m} heads of rank {r}")
    print(
        "\n| head | sequences | rounds | products | products x sequences | seconds "
        "| relative residual | held out | seconds / first size's |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with threadpool_limits(limits=1, user_api="blas"):
        for head in args.heads:
            first = None
            for size in args.sizes:
                rows = np.sort(order[:size])
                found, total = solve(X, Y, params, par, head, rows, intercept, args)
                held_out = held_out_residual(
                    X, Y, found, par, head, rows, test, intercept
                )
                first = total["seconds"] if first is None else first
                print(
                    f"| {head} | {size} | {total['rounds']} | {total['products']} "
                    f"| {total['products'] * size:.3g} | {total['seconds']:.0f} "
                    f"| {total['residual']:.2g} | {held_out:.2g} "
                    f"| {total['seconds'] / first:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
