"""Issue 61's two planted families, built from their description with numpy alone
(no skattn code in the teachers), fitted with the estimator's defaults.

Family ``soft``: m heads of rank r at d = 32, k = 8, d_out = 32, standard Gaussian
tokens; ``Theta_i`` the rank-r truncation (SVD) of a Gaussian 32 x 32 matrix scaled
by 2/d (logits of standard deviation about 1.3: soft heads), ``W_i ~ N(0, 1/d)``;
4000 sequences, 1000 held out.  Each instance is fitted twice, side by side: with
``head_rank=r`` (the truth's rank, what ``skattn layer`` passes) and without.

Family ``positional``: d = 32, k = 16; a token is a word vector (3000 words,
Gaussian, in the first 16 dimensions) plus its position's vector (16 Gaussian
vectors times 0.8, in the other 16); head 0 = 10 P^+ S P^+^T (S the shift
t -> t - 1, P^+ the pseudo-inverse of the position vectors: weight 0.9994 on
token l - 1 in every row but the first), head 1 a random rank-16 head over all 32
dimensions (Q, K ~ N(0, 1/d)); ``W_i ~ N(0, 1/d)``; 2e4 sequences, 2000 held out;
fitted with the estimator's defaults (full-rank heads; ``--head-rank 16``: the
heads' rank, which also bounds the ``W_i``'s in the search's model, so that
full-rank ``W_i`` are outside it).  With ``--values low`` the same layer's values have
the rank of its heads, as in a transformer: ``W_i = V_i O_i``, ``V_i`` the first 16
columns of the ``W_i`` above and ``O_i ~ N(0, 1/16)`` (16 x 32).

Printed: one JSON line per fit (family, m, r, seed, head_rank, held-out relative
error, seconds, the fit's route), each fit stopped at ``--budget`` seconds.

    OMP_NUM_THREADS=1 python benchmarks/bench_outside_families.py --family soft \\
        [--heads 2 4 8] [--ranks 2 4] [--seeds 0 1 2] [--budget 600]
    OMP_NUM_THREADS=1 python benchmarks/bench_outside_families.py --family positional \\
        [--values full|low] [--head-rank none|16] [--n 20000]
"""

import argparse
import json
import signal
import time
import warnings

import numpy as np

from skattn import MultiHeadAttentionRegressor


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _forward(X, theta, W):
    return sum(
        _softmax(X @ t @ X.transpose(0, 2, 1)) @ X @ w
        for t, w in zip(theta, W, strict=True)
    )


def soft_family(m, r, seed, d=32, k=8, n=4000, n_test=1000):
    """``(X, Y, X_test, Y_test)`` of m soft heads of rank r (see the module)."""
    rng = np.random.default_rng(seed)
    theta = []
    for _ in range(m):
        U, s, Vt = np.linalg.svd(rng.normal(size=(d, d)) * 2 / d)
        theta.append((U[:, :r] * s[:r]) @ Vt[:r])
    W = rng.normal(scale=1 / np.sqrt(d), size=(m, d, d))
    X = rng.normal(size=(n + n_test, k, d))
    Y = _forward(X, np.array(theta), W)
    return X[:n], Y[:n], X[n:], Y[n:]


def positional_family(
    seed, d=32, k=16, n=20000, n_test=2000, vocab=3000, values="full"
):
    """``(X, Y, X_test, Y_test)`` of the positional previous-token head beside a
    random rank-16 head (see the module); ``values="low"``: ``W_i`` of rank 16."""
    rng = np.random.default_rng(seed)
    words = rng.normal(size=(vocab, d // 2))
    positions = np.zeros((k, d))
    positions[:, d // 2 :] = 0.8 * rng.normal(size=(k, d // 2))
    P_plus = np.linalg.pinv(positions)  # (d, k): P_plus^T x_a = e_a
    previous = 10 * P_plus @ np.eye(k, k=-1) @ P_plus.T
    Q, K = rng.normal(scale=1 / np.sqrt(d), size=(2, d, 16))
    theta = np.array([previous, Q @ K.T])
    W = rng.normal(scale=1 / np.sqrt(d), size=(2, d, d))
    ids = rng.integers(vocab, size=(n + n_test, k))
    if values == "low":  # drawn apart: the tokens and heads stay those above
        out = np.random.default_rng([seed, 1]).normal(scale=0.25, size=(2, 16, d))
        W = W[:, :, :16] @ out
    X = np.concatenate(
        [words[ids], np.broadcast_to(positions[:, d // 2 :], (n + n_test, k, d // 2))],
        axis=-1,
    )
    Y = _forward(X, theta, W)
    return X[:n], Y[:n], X[n:], Y[n:]


class _Budget(Exception):
    pass


def fit(X, Y, X_test, Y_test, budget, **params):
    """Held-out relative error, seconds and route of one fit (None past budget)."""
    n, k = X.shape[:2]
    est = MultiHeadAttentionRegressor(n_tokens=k, random_state=0, **params)

    def stop(signum, frame):
        raise _Budget

    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, budget)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X.reshape(n, -1), Y.reshape(n, -1))
    except _Budget:
        return {"held_out": None, "seconds": None, "stopped": f"budget {budget:.0f} s"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - start
    pred = est.predict(X_test.reshape(len(X_test), -1))
    target = Y_test.reshape(len(X_test), -1)
    info = est.phase_report_[-1].info
    route = (
        "rank-free"
        if info.get("rank_free")
        else ("search" if info.get("start_search") else "polish")
    )
    return {
        "held_out": float(np.linalg.norm(pred - target) / np.linalg.norm(target)),
        "seconds": round(seconds, 2),
        "route": route,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["soft", "positional"], default="soft")
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=float, default=600.0)
    parser.add_argument("--values", choices=["full", "low"], default="full")
    parser.add_argument("--n", type=int, default=20000, help="positional: sequences")
    parser.add_argument(
        "--head-rank",
        default="none",
        help="positional: the estimator's head_rank (default 'none': full-rank heads)",
    )
    args = parser.parse_args(argv)
    if args.family == "positional":
        for seed in args.seeds:
            data = positional_family(seed, n=args.n, values=args.values)
            head_rank = None if args.head_rank == "none" else int(args.head_rank)
            row = fit(*data, args.budget, n_heads=2, head_rank=head_rank)
            line = {"family": "positional", "values": args.values, "seed": seed}
            line["head_rank"] = head_rank
            print(json.dumps({**line, "n": args.n, **row}), flush=True)
        return
    for m in args.heads:
        for r in args.ranks:
            for seed in args.seeds:
                data = soft_family(m, r, seed)
                for head_rank in (r, None):
                    row = fit(*data, args.budget, n_heads=m, head_rank=head_rank)
                    line = {"family": "soft", "m": m, "r": r, "seed": seed}
                    print(
                        json.dumps({**line, "head_rank": head_rank, **row}), flush=True
                    )


if __name__ == "__main__":
    main()
