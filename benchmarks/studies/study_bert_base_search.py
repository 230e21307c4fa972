"""Why the minibatch search stalls on a BERT-base-sized planted layer (issue 49).

A planted layer as ``bench_gpu.py``'s ``planted768`` (``make_attention_layer(m, d,
head_rank=r)``, key biases ``u_i = Theta_i^T v_i`` of norm 1, an ``N(0, 1)``
intercept, Gaussian tokens, k = 16), scaled by ``--d --m --r --n``.  The tokens
``[x, 1]`` are whitened as the estimator's random starts are, a start is drawn as
``fit_from_random_starts`` draws it, and ``skattn.solvers.minibatch_search`` runs
once per variant (``--variants``, comma separated; each a name of ``VARIANTS``).
Printed: the teacher's sharpness (median top probability per head), then one
table row per variant: the search's final relative residual (of its evaluation
batch), its steps and seconds, and the residual trace every ``--trace`` checks.

Examples::

    OMP_NUM_THREADS=1 python benchmarks/studies/study_bert_base_search.py \\
        --d 192 --m 12 --r 16 --n 5000 --max-steps 1500 --variants default,lr03
"""

import argparse
import math
import time

import numpy as np

from skattn.datasets import GaussianTokens, make_attention_layer
from skattn.layer import AttentionLayer
from skattn.metrics import sharpness_profile
from skattn.solvers import FactoredHeads, minibatch_search, whitening_map
from skattn.solvers.kernels._parametrization import random_attention
from skattn.solvers.kernels._varpro import _intercept_direction

# name -> (keyword arguments of minibatch_search, options of the start)
VARIANTS = {
    "default": ({}, {}),
    "lr03": ({"learning_rate": 0.03}, {}),
    "lr01": ({"learning_rate": 0.01}, {}),
    "lr003": ({"learning_rate": 0.003}, {}),
    "lr3": ({"learning_rate": 0.3}, {}),
    "batch1024": ({"batch_size": 1024}, {}),
    "nocut": ({"patience": 10**6}, {}),
    "nocut_lr03": ({"patience": 10**6, "learning_rate": 0.03}, {}),
    "nocut_batch1024": ({"patience": 10**6, "batch_size": 1024}, {}),
    "nocut_lr3": ({"patience": 10**6, "learning_rate": 0.3}, {}),
    "nocut_lr02": ({"patience": 10**6, "learning_rate": 0.2}, {}),
    "nocut_scale3": ({"patience": 10**6}, {"scale": 3.0}),
    "nocut_scale03": ({"patience": 10**6}, {"scale": 0.3}),
    "scale03": ({}, {"scale": 0.3}),
    "scale3": ({}, {"scale": 3.0}),
    "nowhiten": ({}, {"whiten": False}),
    "nointercept": ({}, {"intercept": False}),
}


def planted(d, m, r, n, seed, k=16):
    """The planted teacher (bench_gpu.planted_case's recipe) and its data."""
    base = make_attention_layer(m, d, head_rank=r, random_state=seed)
    rng = np.random.default_rng(seed + 1)
    key_bias = np.einsum("mde,md->me", base.attention, rng.normal(size=(m, d)))
    key_bias /= np.linalg.norm(key_bias, axis=1, keepdims=True)
    teacher = AttentionLayer(
        base.attention,
        base.projection,
        key_bias=key_bias,
        intercept=rng.normal(size=d),
        n_tokens=k,
    )
    X = np.asarray(GaussianTokens(k, d).sample(n, random_state=seed)).reshape(n, k, d)
    Y = teacher.transform(X.reshape(n, -1)).reshape(n, k, -1)
    return teacher, X, Y


def run_variant(X, Y, m, r, name, args):
    """One search: ``(info, seconds)``."""
    kwargs, start = VARIANTS[name]
    n, k, d = X.shape
    intercept = start.get("intercept", True)
    tokens = np.concatenate([X, np.ones((n, k, 1))], axis=2) if intercept else X
    if start.get("whiten", True):
        A, _ = whitening_map(tokens)
        tokens = tokens @ A
    D = tokens.shape[2]
    par = FactoredHeads(m, D, r)
    direction = _intercept_direction(tokens) if intercept else None
    target = Y if intercept else Y - Y.mean(axis=(0, 1))
    rng = np.random.RandomState(args.seed)  # drawn as fit_from_random_starts
    attention = random_attention(m, D, rng, scale=start.get("scale", 1.0))
    values = rng.normal(scale=1.0 / D, size=(m, D, r))
    values = values @ rng.normal(size=(m, r, Y.shape[2]))
    params = par.from_attention(attention, values)
    options = {"max_steps": args.max_steps, **kwargs}
    clock = time.perf_counter()
    _, info = minibatch_search(
        tokens,
        target,
        params,
        par,
        intercept_direction=direction,
        random_state=rng,
        verbose=args.verbose,
        **options,
    )
    return info, time.perf_counter() - clock


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--d", type=int, default=192)
    add("--m", type=int, default=12)
    add("--r", type=int, default=16)
    add("--n", type=int, default=5000)
    add("--max-steps", type=int, default=1500)
    add("--variants", default="default")
    add("--seed", type=int, default=0)
    add("--trace", type=int, default=4, help="print every TRACE-th check")
    add("--verbose", type=int, default=0)
    args = parser.parse_args(argv)
    clock = time.perf_counter()
    teacher, X, Y = planted(args.d, args.m, args.r, args.n, args.seed)
    profile = sharpness_profile(teacher, X[:500])
    top = np.asarray(profile.median_largest_weight)
    print(
        f"d={args.d} m={args.m} r={args.r} n={args.n}: data in "
        f"{time.perf_counter() - clock:.0f} s; teacher median top weight per head "
        f"{np.round(top, 2).tolist()}"
    )
    print("| d | m | r | variant | final residual | steps | cuts | stop | s | trace |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.variants.split(","):
        info, seconds = run_variant(X, Y, args.m, args.r, name, args)
        trace = " ".join(f"{v:.3f}" for v in info["residuals"][:: args.trace])
        print(
            f"| {args.d} | {args.m} | {args.r} | {name} | {info['residual']:.3f} "
            f"| {info['n_steps']} | {info['n_decays']} | {info['stop_reason']} "
            f"| {seconds:.0f} | {trace} |",
            flush=True,
        )
    if not math.isfinite(clock):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
