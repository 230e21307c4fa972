"""Why the decoder polish crawls (issue 50): start from the search's end or from
the planted layer perturbed, then polish jointly or in key/value-group rounds.

A planted causal layer with rotary positions (base 10000) and grouped heads,
Gaussian tokens (``make_attention_regression(..., causal=True, rope=True,
n_kv_heads=G)``).  ``--start search`` runs the decoder path's minibatch search
(``FactoredHeads``, as ``fit_decoder_from_random_starts`` does); ``--start
perturbed`` takes the planted ``Q_i``, ``K_g`` with i.i.d. noise of ``--eps``
times their RMS (only in the columns of rotary pairs ``--pairs``, if given).
Then ``--mode joint`` runs the joint polish (``varpro_least_squares`` on
``LowRank``, full ``W_i`` eliminated) for
``--iters`` evaluations; ``--mode groups`` runs ``--rounds`` rounds of one
polish per key/value group (its query heads and shared key map, the other
groups' outputs fixed, ``--iters`` evaluations each, Gauss-Seidel).

    python benchmarks/studies/study_decoder_polish.py --n 1000 --m 4 --kv 2 \
        --d 32 --k 16 --r 8 --start search --mode joint --iters 30

The polish lifts the slow rotary pairs' mixings (and, with an ``[x, 1]``
coordinate, the key shifts) into its variables unless ``--near-gauge off``;
``--max-products`` caps its LSMR iterations a step, ``--verbose 2`` prints
its iterations:

    python benchmarks/studies/study_decoder_polish.py --n 160 --m 4 --kv 2 \
        --d 64 --k 32 --r 16 --start perturbed --eps 0.01 --pairs 4 5 6 7 \
        --iters 30 --max-products 40 --near-gauge off

``--lift-sequences N`` whitens the lift on N of the sequences (evenly spaced)
in place of ``lift_sequences``' share:

    python benchmarks/studies/study_decoder_polish.py --n 160 --m 4 --kv 2 \
        --d 64 --k 32 --r 16 --start perturbed --eps 0.05 --pairs 4 5 6 7 \
        --rope-theta 500000 --iters 60 --lift-sequences 10

Prints the relative residual (``||F - Y|| / ||Y||`` on the training sequences)
after each stage or round, and the seconds.
"""

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from sklearn.utils import check_random_state  # noqa: E402

from skattn import make_attention_regression  # noqa: E402
from skattn.layer._math import softmax  # noqa: E402
from skattn.solvers._decoder import random_decoder_start  # noqa: E402
from skattn.solvers.kernels._parametrization import (  # noqa: E402
    FactoredHeads,
    LowRank,
)
from skattn.solvers.kernels._varpro import VarproProblem  # noqa: E402
from skattn.solvers.optimizers import _lm_matrix_free  # noqa: E402
from skattn.solvers.optimizers._lm_matrix_free import (  # noqa: E402
    varpro_least_squares,
)
from skattn.solvers.stages._search import minibatch_search  # noqa: E402


def contributions(X, Y, par, params):
    """Each head's outputs ``S_i X W_i`` ``(n, m, k, d_out)`` (W eliminated on
    all heads) and the relative residual."""
    problem = VarproProblem(X, Y, None, par)
    problem.residual(params)
    heads = np.einsum(
        "nmka,nad,mde->nmke", softmax(par.logits(X, params)), X, problem.projection
    )
    rel = np.linalg.norm(heads.sum(1) - Y) / np.linalg.norm(Y)
    return heads, rel


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("n", 1000), ("m", 4), ("kv", 2), ("d", 32)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in [("k", 16), ("r", 8), ("iters", 30), ("rounds", 4)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--start", choices=["search", "perturbed"], default="search")
    parser.add_argument("--eps", type=float, default=0.01)
    parser.add_argument(
        "--pairs",
        type=int,
        nargs="*",
        default=None,
        help="perturb only these rotary pairs (0: the fastest); default all",
    )
    parser.add_argument("--mode", choices=["joint", "groups"], default="joint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--max-products", type=int, default=None)
    parser.add_argument("--verbose", type=int, default=0)
    parser.add_argument(
        "--near-gauge", choices=["auto", "off"], default="auto",
        help="lift the slow rotary pairs' mixings (varpro_least_squares' near_gauge)",
    )  # fmt: skip
    parser.add_argument(
        "--lift-sequences", type=int, default=None,
        help="whiten the lift on this many sequences (default: lift_sequences')",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.lift_sequences is not None:
        _lm_matrix_free.lift_sequences = lambda n, k, columns: min(
            n, args.lift_sequences
        )
    n, m, m_kv, d, k, r = args.n, args.m, args.kv, args.d, args.k, args.r
    X, y, layer = make_attention_regression(
        n, k, d, m, head_rank=r, causal=True, rope=True, n_kv_heads=m_kv,
        distribution="gaussian", random_state=args.seed, return_layer=True,
        rope_theta=args.rope_theta,
    )  # fmt: skip
    X, Y = X.reshape(n, k, d), y.reshape(n, k, -1)
    decoder = {"causal": True, "rope_theta": layer.rope_theta}
    par = LowRank(m, d, r, n_kv_heads=m_kv, **decoder)
    began = time.perf_counter()
    if args.start == "search":
        searched = FactoredHeads(m, d, r, n_kv_heads=m_kv, **decoder)
        rng = check_random_state(args.seed)
        params, info = minibatch_search(
            X, Y, random_decoder_start(searched, rng), searched,
            n_replacements=0, random_state=rng,
        )  # fmt: skip
        params = params[: par.size]
        print(f"search: {info['n_steps']} steps, batch residual {info['residual']:.3g}")
    else:
        truth = np.concatenate([layer.rotary_query.ravel(), layer.rotary_key.ravel()])
        noise = np.random.default_rng(1).normal(size=truth.size)
        if args.pairs is not None:  # "half" layout: pair p is dimensions p, p + r/2
            dims = [p + s for p in args.pairs for s in (0, r // 2)]
            keep = np.zeros(r, dtype=bool)
            keep[dims] = True
            noise *= np.broadcast_to(keep, (truth.size // r, r)).ravel()
        params = truth + args.eps * np.sqrt(np.mean(truth**2)) * noise
    heads, rel = contributions(X, Y, par, params)
    print(f"start: relative residual {rel:.3e}  {time.perf_counter() - began:.0f} s")
    if args.mode == "joint":
        params, _, info = varpro_least_squares(
            X, Y, params, par, max_iter=args.iters, coarse=False,
            max_products=args.max_products, verbose=args.verbose,
            near_gauge="auto" if args.near_gauge == "auto" else False,
        )  # fmt: skip
        heads, rel = contributions(X, Y, par, params)
        print(
            f"joint polish: {info['n_iter']} iterations, {info['n_products']} "
            f"products, relative residual {rel:.3e}  "
            f"{time.perf_counter() - began:.0f} s"
        )
        return 0
    size = m // m_kv
    group = LowRank(size, d, r, n_kv_heads=1, **decoder)
    for round_ in range(args.rounds):
        Q, K = (np.array(f) for f in par.factors(params))
        for g in range(m_kv):
            own = np.arange(g * size, (g + 1) * size)
            target = Y - heads.sum(1) + heads[:, own].sum(1)
            sub = np.concatenate([Q[own].ravel(), K[g].ravel()])
            sub, _, _ = varpro_least_squares(
                X, target, sub, group, max_iter=args.iters, coarse=False
            )
            Q[own] = sub[: size * d * r].reshape(size, d, r)
            K[g] = sub[size * d * r :].reshape(d, r)
            params = np.concatenate([Q.ravel(), K.ravel()])
            heads, rel = contributions(X, Y, par, params)
        print(
            f"round {round_ + 1}: relative residual {rel:.3e}  "
            f"{time.perf_counter() - began:.0f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
