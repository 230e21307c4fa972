"""Where the decoder search of a Llama-shaped layer stops (issue 62's GPU item).

On one H200 (2026-11-30, ``bench_torch_anchors.py --teacher decoder --setting
llama``: d = 1024, 8 query / 2 key-value heads of 128, base 5e5, k = 32, 2048
sequences) the search of a key head per query head ended at a relative residual
of 0.48 after 2400 steps (two one-head replacements included), and the grouped
search from its tied heads at 0.83, while the plateau of a random start lasts
about 3.4e-4 m d^2 steps (2850 at that shape).  This study runs the same
searches (:func:`minibatch_search` on the ungrouped heads, then the query heads
grouped by :func:`tie_key_heads` and searched grouped) on a planted layer of
that shape scaled by ``--d --m --kv --r``, with the search's keywords of
``--variants`` (each a name of ``VARIANTS``), and prints each search's residual
trace (every ``--trace``-th check of 50 steps), steps, cuts, stop reason and
seconds.

What it showed (2 cores; benchmarks/HISTORY.md, eighteenth session): at that
shape the values alone take the residual from 0.824 to 0.726 by the first check
and it then sits at 0.57, below the plateau rule's level of then (0.9 of the
start's), so the plateau's stalls cut the step size; the level is now half the
start's.  At d = 128-512 (heads of 16-64) there is no plateau to speak of.

Examples::

    OMP_NUM_THREADS=2 python benchmarks/studies/study_decoder_search.py \\
        --d 256 --m 8 --kv 2 --r 32 --n 1024 --variants default
"""

import argparse
import time

import numpy as np

from skattn.datasets import make_attention_regression
from skattn.solvers import FactoredHeads, minibatch_search
from skattn.solvers._decoder import random_decoder_start, tie_key_heads
from skattn.solvers.stages import _search
from skattn.utils._array_api import device, namespace, to_namespace, to_numpy

# name -> (keyword arguments of minibatch_search (both searches), the search
# module's constants set for the variant)
VARIANTS = {
    "default": ({}, {}),
    # the plateau left below 0.9 times the start's residual (the rule before the
    # eighteenth session; now half: the values alone fall by more than a tenth)
    "exit09": ({}, {"_PLATEAU_EXIT": 0.9}),
    "steps20k": ({"max_steps": 20000}, {}),
    # the stall rule's patience in steps: 150 by default (3 checks of 50)
    "patience15": ({"patience": 15}, {}),
    "impatient": ({"check_every": 10, "patience": 1}, {}),
}


def trace(info, every):
    """Every ``every``-th check's residual and the last."""
    residuals = info["residuals"]
    shown = residuals[::every]
    if (len(residuals) - 1) % every:
        shown = [*shown, residuals[-1]]
    return " ".join(f"{r:.3f}" for r in shown)


def say(name, began, info, every):
    replacements = [
        (x["head"], round(x["residual_after"], 3), x["kept"])
        for x in info["replacements"]
    ]
    print(
        f"{name}: from {info['residuals'][0]:.4f} to {info['residual']:.4f} in "
        f"{info['n_steps']} steps ({info['stop_reason']}, {info['n_decays']} cuts, "
        f"replacements {replacements}) {time.perf_counter() - began:.0f} s\n"
        f"  trace {trace(info, every)}",
        flush=True,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--kv", type=int, default=2)
    parser.add_argument("--r", type=int, default=32)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--rope-theta", type=float, default=5e5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=int, default=4)
    parser.add_argument("--grouped", action="store_true", help="the grouped search too")
    parser.add_argument("--variants", default="default")
    parser.add_argument("--verbose", type=int, default=0, help="1: every check")
    parser.add_argument("--device", default=None, help="a torch device (cuda)")
    parser.add_argument("--save", default=None, help="npz: the ungrouped search's end")
    parser.add_argument(
        "--load", default=None, help="npz of --save: the grouped search from there"
    )
    parser.add_argument(
        "--grouped-lr",
        type=float,
        nargs="+",
        default=[None],
        help="the grouped search's learning_rate(s) (default: the variant's)",
    )
    parser.add_argument(
        "--ungrouped-steps",
        type=int,
        default=None,
        help="the ungrouped search's max_steps",
    )
    args = parser.parse_args(argv)
    m, kv, d, r, k, n = args.m, args.kv, args.d, args.r, args.k, args.n
    X, y = make_attention_regression(
        n,
        k,
        d,
        m,
        head_rank=r,
        causal=True,
        rope=True,
        n_kv_heads=kv,
        distribution="gaussian",
        rope_theta=args.rope_theta,
        random_state=args.seed,
    )
    X, Y = X.reshape(n, k, d), y.reshape(n, k, -1)
    if args.device is not None:
        import torch

        X, Y = (torch.asarray(a, device=args.device) for a in (X, Y))
    xp, where = namespace(X), device(X)
    heads = {"causal": True, "rope_theta": args.rope_theta}
    ungrouped = FactoredHeads(m, d, r, **heads)
    grouped = FactoredHeads(m, d, r, n_kv_heads=kv, **heads)
    print(
        f"# m={m}/{kv} d={d} r={r} k={k} n={n} base {args.rope_theta:g}; plateau "
        f"predicted 3.4e-4 m d^2 = {3.4e-4 * m * d * d:.0f} steps"
    )
    for name in args.variants.split(","):
        options, constants = VARIANTS[name]
        saved = {key: getattr(_search, key) for key in constants}
        for key, value in constants.items():
            setattr(_search, key, value)
        options = {**options, "verbose": args.verbose}
        if args.load is None:
            rng = np.random.RandomState(args.seed + 1)
            start = to_namespace(random_decoder_start(ungrouped, rng), xp, where)
            began = time.perf_counter()
            first = options
            if args.ungrouped_steps is not None:
                first = {**options, "max_steps": args.ungrouped_steps}
            free, info = minibatch_search(
                X, Y, start, ungrouped, random_state=rng, **first
            )
            say(f"{name} ungrouped", began, info, args.trace)
            if args.save is not None:
                np.savez(args.save, free=to_numpy(free), residual=info["residual"])
        else:
            end = np.load(args.load)
            free = to_namespace(end["free"], xp, where)
            print(f"the ungrouped end of {args.load}: {float(end['residual']):.4f}")
        if args.grouped:
            tied, groups = tie_key_heads(free, ungrouped, grouped, k)
            for lr in args.grouped_lr:
                second = options if lr is None else {**options, "learning_rate": lr}
                began = time.perf_counter()
                _, info = minibatch_search(
                    X,
                    Y,
                    to_namespace(tied, xp, where),
                    grouped,
                    random_state=np.random.RandomState(args.seed + 2),
                    **second,
                )
                say(f"{name} grouped {groups}, lr {lr}", began, info, args.trace)
        for key, value in saved.items():
            setattr(_search, key, value)


if __name__ == "__main__":
    main()
