"""The minibatch search on all heads of a real layer: how far it takes a random start.

The teacher is all-MiniLM-L6-v2 layer ``--layer`` restricted to ``--n-heads``
heads with its biases (``bench_minilm_teacher.teacher``), on ``--n-samples``
sequences of 16 embedded random vocabulary tokens (or real text with ``--text``).
The tokens ``[x, 1]`` are whitened as the estimator's random starts are
(``whitening_map``), a random start is drawn as ``fit_from_random_starts``
draws it, and ``skattn.solvers.minibatch_search`` runs with its defaults
(``--batch-size``, ``--learning-rate`` to override).  Printed: the search's
trace (relative residual of its evaluation batch, in-sample), the relative
residual on held-out sequences with the output factors fitted on other
sequences, and, per real head, how close its learned match comes (heads matched
by the Hungarian assignment on the total variation of their patterns): total
variation, relative error of the row-centred logits, median margins, and the
residual left when only that head's patterns are replaced by the real ones,
which shows which heads carry the residual.  ``--save``/``--load`` keep a
searched point (``--load`` skips the search).  With
``--lm N`` the matrix-free Levenberg-Marquardt polish
(``varpro_least_squares``) then runs N iterations from there on
``--lm-samples`` sequences, one line an iteration.

Examples::

    OMP_NUM_THREADS=2 python benchmarks/studies/study_minibatch_search.py \\
        --n-heads 12 --n-samples 4000 --lm 4 --lm-samples 600
"""

import argparse
import os
import sys
import time

import numpy as np
from scipy.optimize import linear_sum_assignment

from skattn.layer._math import softmax
from skattn.solvers import FactoredHeads, minibatch_search, whitening_map
from skattn.solvers.kernels._parametrization import random_attention
from skattn.solvers.kernels._varpro import _intercept_direction
from skattn.solvers.optimizers._lm_matrix_free import varpro_least_squares

# bench_minilm_teacher.py is in benchmarks/, one level up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_minilm_teacher import teacher  # noqa: E402


def held_out_residual(X_fit, Y_fit, X_test, Y_test, params, par, direction):
    """Relative residual on held-out sequences, output factors from other ones."""
    m, r = par.n_heads, par.rank

    def design(X, p):
        cache = par.cache(X, p)
        patterns = softmax(par.logits(X, p, cache), axis=-1)
        features = np.matmul(patterns, par.values(X, p, cache))
        n, k = X.shape[:2]
        flat = features.transpose(0, 2, 1, 3).reshape(n * k, m * r)
        return np.concatenate([flat, np.ones((n * k, 1))], axis=1)

    D = design(X_fit, params)
    coef = np.linalg.lstsq(D, Y_fit.reshape(len(D), -1), rcond=None)[0]
    residual = design(X_test, params) @ coef - Y_test.reshape(-1, Y_test.shape[2])
    return np.linalg.norm(residual) / np.linalg.norm(Y_test)


def head_match(X_aug, X_white, Y, params, par, layer):
    """Each real head against its learned match (Hungarian, on total variation).

    Per real head: the matched learned head's total variation (TV) of patterns,
    the relative error of its row-centred logits, the median margin (top minus
    second logit) of the real and of the learned patterns, and the relative
    residual of the learned layer when only this head's patterns are replaced by
    the real ones (output factors and intercept refitted): how much of the
    residual this head carries.
    """
    n, k = X_white.shape[:2]
    cache = par.cache(X_white, params)
    learned_logits = par.logits(X_white, params, cache)
    learned = softmax(learned_logits, axis=-1)
    features = np.matmul(learned, par.values(X_white, params, cache))
    m, d = layer.attention.shape[:2]
    augmented = np.zeros((m, d + 1, d + 1))
    augmented[:, :d, :d] = layer.attention
    augmented[:, d, :d] = layer.key_bias
    logits = np.einsum("nkd,mde,nje->nmkj", X_aug, augmented, X_aug, optimize=True)
    real = softmax(logits, axis=-1)
    cost = np.array(
        [
            [0.5 * np.abs(learned[:, i] - real[:, j]).sum(-1).mean() for j in range(m)]
            for i in range(m)
        ]
    )
    targets = Y.reshape(n * k, -1)

    def residual(head_features):
        design = head_features.transpose(0, 2, 1, 3).reshape(n * k, -1)
        design = np.concatenate([design, np.ones((n * k, 1))], axis=1)
        coef = np.linalg.lstsq(design, targets, rcond=None)[0]
        return np.linalg.norm(design @ coef - targets) / np.linalg.norm(targets)

    def centred(z):
        return z - z.mean(-1, keepdims=True)

    def margin(z):
        top = np.sort(z, axis=-1)[..., -2:]
        return float(np.median(top[..., 1] - top[..., 0]))

    values = par.values(X_white, params, cache)
    rows = []
    for i, j in zip(*linear_sum_assignment(cost), strict=True):
        forced = features.copy()
        forced[:, i] = np.matmul(real[:, j], values[:, i])
        error = centred(learned_logits[:, i]) - centred(logits[:, j])
        rows.append(
            (
                int(j),
                float(cost[i, j]),
                float(np.linalg.norm(error) / np.linalg.norm(centred(logits[:, j]))),
                margin(logits[:, j]),
                margin(learned_logits[:, i]),
                residual(forced),
            )
        )
    return residual(features), rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--n-heads", type=int, default=12)
    add("--n-samples", type=int, default=4000)
    add("--n-tokens", type=int, default=16)
    add("--layer", type=int, default=0)
    add("--text", action="store_true")
    add("--batch-size", type=int, default=256)
    add("--learning-rate", type=float, default=0.1)
    add("--max-steps", type=int, default=5000)
    add("--lm", type=int, default=0, help="Levenberg-Marquardt iterations after")
    add("--lm-samples", type=int, default=600)
    add("--seed", type=int, default=0)
    add("--save", metavar="FILE.npy", help="save the searched parameters")
    add("--load", metavar="FILE.npy", help="start from saved parameters, no search")
    args = parser.parse_args(argv)
    args.planted, args.heads = 0, None
    layer, dist, test, name = teacher(args)
    n, k = args.n_samples + 500, args.n_tokens
    X = np.asarray(dist.sample(n, random_state=args.seed)).reshape(n, k, -1)
    Y = layer.transform(X.reshape(n, -1)).reshape(n, k, -1)
    X_aug = np.concatenate([X, np.ones((n, k, 1))], axis=2)
    A, condition = whitening_map(X_aug)
    X_white = X_aug @ A
    d, m = X_white.shape[2], args.n_heads
    par = FactoredHeads(m, d, 32)
    direction = _intercept_direction(X_white)
    print(f"{name}; {args.n_samples} sequences (+500 held out), whitened d = {d}")
    rng = np.random.RandomState(args.seed)  # drawn as fit_from_random_starts
    start = random_attention(m, d, rng)
    values = rng.normal(scale=1.0 / d, size=(m, d, 32))
    params = par.from_attention(start, values)
    fit, held = slice(0, args.n_samples), slice(args.n_samples, n)
    clock = time.perf_counter()
    if args.load:
        params = np.load(args.load)
    else:
        params, info = minibatch_search(
            X_white[fit],
            Y[fit],
            params,
            par,
            intercept_direction=direction,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            max_steps=args.max_steps,
            random_state=rng,
            verbose=1,
        )
        seconds = time.perf_counter() - clock
        print(
            f"search: {info['n_steps']} steps, {info['n_decays']} step-size cuts, "
            f"{seconds:.0f} s, stopped on {info['stop_reason']}; evaluation batch "
            f"{info['residuals'][0]:.3g} -> {info['residual']:.3g}"
        )
    if args.save:
        np.save(args.save, params)
    rows = slice(0, min(args.n_samples, 2000))
    residual = held_out_residual(
        X_white[rows], Y[rows], X_white[held], Y[held], params, par, direction
    )
    print(f"held-out relative residual: {residual:.3g}")
    rows = slice(args.n_samples, args.n_samples + 200)
    base, matches = head_match(X_aug[rows], X_white[rows], Y[rows], params, par, layer)
    print(
        f"per real head, on 200 held-out sequences (relative residual {base:.3g}, "
        "output factors refitted on them):"
    )
    print(
        "| real head | TV | logit error | median margin real / learned "
        "| residual with its real patterns |"
    )
    print("|---|---|---|---|---|")
    for head, tv, logit, real, learned, forced in sorted(matches):
        print(
            f"| {head} | {tv:.2g} | {logit:.2g} | {real:.3g} / {learned:.3g} "
            f"| {forced:.3g} |"
        )
    if args.lm:
        rows = slice(0, args.lm_samples)
        clock = time.perf_counter()
        params, _, lm = varpro_least_squares(
            X_white[rows],
            Y[rows],
            params,
            par,
            max_iter=args.lm,
            intercept=True,
            verbose=2,
        )
        target = np.sqrt(np.mean(np.sum(Y[rows] ** 2, axis=(1, 2))))
        print(
            f"Levenberg-Marquardt: {lm['n_iter']} iterations, {lm['n_products']} "
            f"products, {time.perf_counter() - clock:.0f} s, relative residual "
            f"{np.sqrt(2 * lm['loss']) / target:.3g}"
        )


if __name__ == "__main__":
    main()
