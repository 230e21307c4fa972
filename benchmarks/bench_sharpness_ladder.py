"""The sharpness ladder: how many sequences and how long a planted layer needs, by
how sharp its heads are, for skattn and for PyTorch anchors on the same data.

Planted layers (``make_attention_layer``): ``--n-heads`` low-rank heads of rank
``--head-rank`` on ``d = --d`` features, ``k = --n-tokens`` tokens of standard
Gaussian entries, every head with a key bias in its keys' span (``u_i = K_i c_i``,
so a head of rank r represents it) and an output intercept, then every head
rescaled to median largest attention weight ``s`` (each rung of ``--sharpness``)
as ``make_attention_layer(sharpness=s)`` does it.  For each rung, skattn
(``MultiHeadAttentionRegressor(n_heads=m, head_rank=r, fit_intercept=True)``,
stopped by SIGALRM at ``--budget`` seconds) climbs ``--n-samples`` until its
held-out relative error ``||F_hat(X) - F(X)|| / ||F(X)||`` on ``--n-test`` fresh
sequences is at most ``--target``.  The anchors (``bench_torch_anchors``: torch
Adam in float32 and L-BFGS in float64 on ``nn.MultiheadAttention``'s maps, which
carry the key biases and the intercept) get the same training arrays and
skattn's time on the top rung it reached (``--budget`` where it reached none).

``--source DIR`` imports skattn from another source tree (e.g. a git worktree of
an earlier commit: "before" and "after" from one script).  ``--json FILE``
writes every row; ``--plot FILE.png`` draws success against sharpness and
sequences.

Examples::

    python benchmarks/bench_sharpness_ladder.py --d 32 --n-heads 2
    python benchmarks/bench_sharpness_ladder.py --d 64 --n-heads 4 \\
        --sharpness 0.99 0.9999 --learners skattn --json ladder.json
"""

import argparse
import json
import math
import os
import sys
import warnings


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--d", type=int, nargs="+", default=[32], help="features d (= d_out)")
    add("--n-heads", type=int, nargs="+", default=[2], help="heads m")
    add("--head-rank", type=int, default=16, help="r (>= k for the pattern reading)")
    add("--n-tokens", type=int, default=16, help="k")
    add(
        "--sharpness",
        type=float,
        nargs="+",
        default=[0.5, 0.9, 0.99, 0.999, 0.9999],
        help="rungs: median largest attention weight of every head",
    )
    add(
        "--n-samples",
        type=int,
        nargs="+",
        default=[500, 1000, 2000, 4000],
        help="training sequences, climbed until skattn reaches --target",
    )
    add("--n-test", type=int, default=1000)
    add("--target", type=float, default=1e-6, help="held-out relative error")
    add("--budget", type=float, default=300.0, help="seconds per skattn fit")
    add(
        "--learners",
        nargs="+",
        choices=["skattn", "adam", "lbfgs"],
        default=["skattn", "adam", "lbfgs"],
    )
    add("--threads", type=int, default=1, help="BLAS and torch threads")
    add("--seed", type=int, default=0)
    add("--source", metavar="DIR", help="import skattn from this source tree")
    add("--json", metavar="FILE", help="write the rows here")
    add("--plot", metavar="FILE.png", help="success against sharpness and sequences")
    # the anchors' settings, as bench_torch_anchors has them
    add("--batch-size", type=int, default=256, help="Adam minibatch")
    add("--lr", type=float, default=1e-3, help="Adam learning rate")
    add("--chunk", type=int, default=2000, help="sequences per forward pass")
    args = parser.parse_args(argv)
    args.marks, args.checkpoints = [], []
    return args


def _median_largest(logits):
    """Median over rows of the largest softmax weight."""
    import numpy as np

    gaps = logits - logits.max(axis=-1, keepdims=True)
    return float(np.median(1.0 / np.exp(gaps).sum(axis=-1)))


def _sharpen(theta, bias, target, X):
    """``(c theta, c bias)`` with median largest weight ``target`` on ``X``:
    bisection on ``log c`` until ``1 - median`` is within 1 % of ``1 - target``
    (here, not skattn's knob, so that every source tree plants the same layers)."""
    import numpy as np

    logits = X @ theta @ np.swapaxes(X, 1, 2) + (X @ bias)[:, None, :]
    lo, hi = -20.0, 20.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        value = _median_largest(math.exp(mid) * logits)
        if abs((1 - value) - (1 - target)) <= 0.01 * (1 - target):
            break
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return math.exp(mid) * theta, math.exp(mid) * bias


def planted(d, m, r, k, sharpness, n, seed):
    """A planted layer with key biases in its keys' span, an intercept, and every
    head at median largest weight ``sharpness``; ``n`` sequences from it."""
    import numpy as np

    from skattn import AttentionLayer
    from skattn.datasets import make_attention_layer

    rng = np.random.default_rng(seed)
    plain = make_attention_layer(m, d, head_rank=r, random_state=seed)
    calibration = rng.normal(size=(4096, k, d))
    attention = np.empty_like(plain.attention)
    bias = np.empty((m, d))
    for i, theta in enumerate(plain.attention):
        keys = np.linalg.svd(theta)[2][:r].T  # the keys' span (d, r)
        # a bias logit as large as a token-pair logit (standard deviation 2 / sqrt(r))
        u = keys @ rng.normal(scale=2.0 / math.sqrt(r), size=r)
        attention[i], bias[i] = _sharpen(theta, u, sharpness, calibration)
    layer = AttentionLayer(
        attention,
        plain.projection,
        n_tokens=k,
        key_bias=bias,
        intercept=rng.normal(scale=0.1, size=d),
        head_rank=r,
    )
    X = rng.normal(size=(n, k * d))
    return layer, X


def fit_skattn(layer, X, y, X_test, y_test, m, r, args):
    from bench_torch_anchors import run_skattn

    from skattn import MultiHeadAttentionRegressor

    est = MultiHeadAttentionRegressor(
        n_heads=m,
        n_tokens=args.n_tokens,
        head_rank=r,
        fit_intercept=True,
        random_state=args.seed,
    )
    seconds, caught, done = run_skattn(est, X, y, args.budget)
    row = {"learner": "skattn", "time": seconds, "done": done}
    if done:
        import numpy as np

        pred = est.predict(X_test)
        row["error"] = float(np.linalg.norm(pred - y_test) / np.linalg.norm(y_test))
    row["warnings"] = [f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught]
    return row


def fit_anchor(name, X, y, X_test, y_test, m, r, budget, args):
    import torch
    from bench_torch_anchors import mha_shaped, run_adam, run_lbfgs

    k, d = args.n_tokens, X_test.shape[1] // args.n_tokens
    torch.manual_seed(args.seed)
    module, _ = mha_shaped(d, m, r, d)
    data = {
        "X": torch.from_numpy(X.reshape(len(X), k, d).copy()),
        "Y": torch.from_numpy(y.reshape(len(y), k, d).copy()),
        "X_test": torch.from_numpy(X_test.reshape(len(X_test), k, d).copy()),
        "Y_test": torch.from_numpy(y_test.reshape(len(y_test), k, d).copy()),
    }
    run = {"adam": run_adam, "lbfgs": run_lbfgs}[name]
    clock, steps, note = run(module, data, args, budget)
    return {
        "learner": name,
        "time": clock.trace[-1][0],
        "error": clock.trace[-1][1],
        "steps": steps,
        "note": note,
    }


def ladder(args):
    import numpy as np

    from skattn.metrics import sharpness_profile

    rows = []
    for d in args.d:
        for m in args.n_heads:
            for s in args.sharpness:
                n_max = max(args.n_samples)
                layer, X_all = planted(
                    d,
                    m,
                    args.head_rank,
                    args.n_tokens,
                    s,
                    n_max + args.n_test,
                    args.seed,
                )
                y_all = layer.transform(X_all)
                X_test, y_test = X_all[: args.n_test], y_all[: args.n_test]
                profile = sharpness_profile(layer, X_test)
                base = {
                    "d": d,
                    "m": m,
                    "r": args.head_rank,
                    "k": args.n_tokens,
                    "sharpness": s,
                    "measured": float(np.median(profile.median_largest_weight)),
                    "split_share": float(1 - np.mean(profile.sharp_share)),
                }
                reached = None
                for n in sorted(args.n_samples):
                    X, y = (
                        X_all[args.n_test : args.n_test + n],
                        y_all[args.n_test : args.n_test + n],
                    )
                    if "skattn" in args.learners:
                        row = dict(
                            base,
                            n=n,
                            **fit_skattn(
                                layer, X, y, X_test, y_test, m, args.head_rank, args
                            ),
                        )
                        rows.append(row)
                        print(_line(row), flush=True)
                        if row.get("error", math.inf) <= args.target:
                            reached = row
                            break
                n = reached["n"] if reached else max(args.n_samples)
                budget = reached["time"] if reached else args.budget
                X, y = (
                    X_all[args.n_test : args.n_test + n],
                    y_all[args.n_test : args.n_test + n],
                )
                for name in ("adam", "lbfgs"):
                    if name in args.learners:
                        row = dict(
                            base,
                            n=n,
                            **fit_anchor(
                                name,
                                X,
                                y,
                                X_test,
                                y_test,
                                m,
                                args.head_rank,
                                budget,
                                args,
                            ),
                        )
                        rows.append(row)
                        print(_line(row), flush=True)
    return rows


def _line(row):
    err = row.get("error")
    err = "no result" if err is None else f"{err:.2e}"
    return (
        f"d={row['d']} m={row['m']} s={row['sharpness']} (measured "
        f"{row['measured']:.5f}) n={row['n']} {row['learner']}: {err} in "
        f"{row['time']:.1f} s"
    )


def table(rows, target):
    print(
        "\n| d | m | sharpness | learner | sequences | held-out rel. error | "
        f"<= {target:g} | time [s] |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        err = r.get("error")
        ok = err is not None and err <= target
        print(
            f"| {r['d']} | {r['m']} | {r['sharpness']} | {r['learner']} | {r['n']} | "
            f"{'no result' if err is None else f'{err:.1e}'} | {'yes' if ok else 'no'} "
            f"| {r['time']:.1f} |"
        )


def plot(rows, path, target):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for learner, marker in (("skattn", "o"), ("adam", "s"), ("lbfgs", "^")):
        pts = [r for r in rows if r["learner"] == learner]
        if not pts:
            continue
        ok = [r.get("error") is not None and r["error"] <= target for r in pts]
        x = [-math.log10(1 - r["sharpness"]) for r in pts]
        y = [
            r["n"] * {"skattn": 1.0, "adam": 1.15, "lbfgs": 0.87}[learner] for r in pts
        ]
        ax.scatter(
            x,
            y,
            marker=marker,
            c=["tab:green" if o else "tab:red" for o in ok],
            label=learner,
            edgecolors="k",
        )
    ax.set_yscale("log")
    ax.set_xlabel("-log10(1 - median largest weight)")
    ax.set_ylabel("training sequences")
    ax.set_title(f"green: held-out relative error <= {target:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nsuccess against sharpness and sequences written to {path}")


def main(argv=None):
    args = parse(argv)
    if args.source:
        sys.path.insert(0, os.path.abspath(args.source))
    sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
    from threadpoolctl import threadpool_limits

    import skattn

    print(f"# skattn from {os.path.dirname(skattn.__file__)}")
    warnings.simplefilter("ignore", UserWarning)
    with threadpool_limits(args.threads):
        if {"adam", "lbfgs"} & set(args.learners):
            import torch

            torch.set_num_threads(args.threads)
        rows = ladder(args)
    table(rows, args.target)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.plot:
        plot(rows, args.plot, args.target)
    return rows


if __name__ == "__main__":
    main()
