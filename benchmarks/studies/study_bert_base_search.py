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

What it showed (one thread, the other core busy; benchmarks/HISTORY.md, "issue
49"): from a random start the residual falls for one check (output factors and
intercept), then sits on a plateau while the heads' overlap with the real ones
grows, then falls fast.  The plateau lasts about 150 steps at d = 192 (12 heads of
rank 16), 550 at d = 384 (12 of rank 32): about 3.4e-4 m d^2, so some 2400 steps
predicted at d = 768.  The stall rule (patience 3 checks of 50 steps) read the
plateau as the step size's noise floor and cut the step size on it, which only
lengthens it (``plain_lr03``: a third of the step size never left it at d = 192);
a larger step size (``nocut_lr3``) or a sharper or softer start (``nocut_scale3``,
``nocut_scale03``) does not shorten it.  Since issue 49 the search makes no cut
on the plateau in its first ``ceil(7e-4 m d^2)`` steps (``plateau_steps``).

Examples::

    OMP_NUM_THREADS=1 python benchmarks/studies/study_bert_base_search.py \\
        --d 192 --m 12 --r 16 --n 5000 --max-steps 1500 --trace 1 \\
        --variants default,plain,plain_lr03,nocut_scale3,nocut_scale03
    OMP_NUM_THREADS=1 python benchmarks/studies/study_bert_base_search.py \\
        --d 384 --m 12 --r 32 --n 5000 --max-steps 1500 --trace 1 \\
        --variants plain,nocut,nocut_lr3,default
    OMP_NUM_THREADS=1 python benchmarks/studies/study_bert_base_search.py \\
        --d 384 --m 12 --r 32 --n 5000 --fit --verbose 2
"""

import argparse
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
    # the stall rule before issue 49: step-size cuts on the start's plateau too
    "plain": ({"plateau_steps": 0}, {}),
    "plain_lr03": ({"plateau_steps": 0, "learning_rate": 0.03}, {}),
    "plain_lr01": ({"plateau_steps": 0, "learning_rate": 0.01}, {}),
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


def fit_end_to_end(X, Y, m, r, args):
    """The estimator's random-start path on the first ``--n`` sequences: its
    held-out relative error on the rest and its time (``--verbose 2``: the
    search's trace and the polish's iterations)."""
    from skattn import MultiHeadAttentionRegressor

    n, k, d = X.shape
    fit = slice(0, args.n)
    est = MultiHeadAttentionRegressor(
        n_heads=m,
        n_tokens=k,
        head_rank=r,
        fit_intercept=True,
        init="random",
        n_restarts=1,
        random_state=args.seed,
        verbose=args.verbose,
    )
    clock = time.perf_counter()
    est.fit(X[fit].reshape(args.n, -1), Y[fit].reshape(args.n, -1))
    seconds = time.perf_counter() - clock
    test = slice(args.n, n)
    pred = est.predict(X[test].reshape(n - args.n, -1))
    truth = Y[test].reshape(n - args.n, -1)
    error = np.linalg.norm(pred - truth) / np.linalg.norm(truth)
    print(f"end to end: {seconds:.0f} s, held-out relative error {error:.3g}")


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
    add("--fit", action="store_true", help="also fit the estimator end to end")
    add("--n-test", type=int, default=500, help="held out, with --fit")
    args = parser.parse_args(argv)
    clock = time.perf_counter()
    n_all = args.n + (args.n_test if args.fit else 0)
    teacher, X, Y = planted(args.d, args.m, args.r, n_all, args.seed)
    profile = sharpness_profile(teacher, X[:500])
    if args.fit:
        fit_end_to_end(X, Y, args.m, args.r, args)
        return
    X, Y = X[: args.n], Y[: args.n]
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


if __name__ == "__main__":
    main()
