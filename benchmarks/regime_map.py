"""Regime map: where gradient training from a random start fails; the phased learner.

For each regime (a family of planted layers and a sample size) and each seed, one
planted layer and one training set of n examples, fitted by
MultiHeadAttentionRegressor (default parameters) on all n and by
GradientAttentionRegressor (L-BFGS from ONE random start, ``tol=1e-10``,
``max_iter`` iterations; its success rate ``r`` means about ``1 / r`` restarts
are needed) on the first ``min(n, --gradient-samples)`` of them (default 5000:
enough to identify the layer, and full-batch L-BFGS costs time linear in n; use
``--gradient-samples 0`` for the same n as the phased learner).  A control,
``varpro-LM``, runs the phased learner's polish alone (Levenberg-Marquardt on the
variable-projection problem, :func:`skattn.solvers.polish`) from the gradient
baseline's random start on the same examples as the gradient baseline: it tells
whether a success of the phased learner is owed to phases 1-6 or to its
optimiser.  A fit is a success when both head-matched relative parameter errors
are <= 1e-4.  Prints a Markdown table (success rate and median wall time per
learner and regime, median errors) and, with ``--plot FILE``, saves a figure of
success rate and time per regime for the three learners.

Regimes (Boolean tokens, d=8, k=4, d_out=16 unless stated):

* ``base``: m=2, attention scale 2 (||Theta_i||_F; the logit standard deviation);
* ``peaked-8``, ``peaked-16``: attention scale 8 / 16 (nearly one-hot attention);
* ``m3``, ``m4``: three heads (d_out=16) and four heads (d_out=20, so d_out > m k);
* ``close-5%``, ``close-1%``: Theta_2 = Theta_1 + a random perturbation of 5 % /
  1 % relative norm (W_1, W_2 independent);
* ``low-rank``, ``diagonal``: ``make_attention_layer(structure=...)``;
* ``n=2000``, ``n=300``, ``n=100``: few examples;
* with ``--full`` also ``m5`` (d_out=24), ``close-20%``, ``n=40``, ``peaked-32``,
  ``gaussian``.

    export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
    python benchmarks/regime_map.py --plot map.png
    python benchmarks/regime_map.py --seeds 5 --full        # bigger run
    python benchmarks/regime_map.py --regimes base close-5% --seeds 4

The default run (2 seeds, 12 regimes) takes about 5 minutes on 2 loaded cores.
"""

import argparse
import time
import warnings

import numpy as np

from skattn import (
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    parameter_error,
)
from skattn.datasets import make_attention_layer, sample_inputs
from skattn.layer import AttentionLayer
from skattn.layer._math import forward
from skattn.solvers import polish

BASE = dict(m=2, d=8, k=4, d_out=16, n=20000, scale=2.0, structure="random", close=None)
BASE["dist"] = "boolean"
REGIMES = {
    "base": {},
    "peaked-8": dict(scale=8.0),
    "peaked-16": dict(scale=16.0),
    "m3": dict(m=3, n=30000),
    "m4": dict(m=4, d_out=20, n=30000),
    "close-5%": dict(close=0.05),
    "close-1%": dict(close=0.01),
    "low-rank": dict(structure="low_rank"),
    "diagonal": dict(structure="diagonal"),
    "n=2000": dict(n=2000),
    "n=300": dict(n=300),
    "n=100": dict(n=100),
}
EXTRA = {
    "m5": dict(m=5, d_out=24, n=40000),
    "close-20%": dict(close=0.2),
    "n=40": dict(n=40),
    "peaked-32": dict(scale=32.0),
    "gaussian": dict(dist="gaussian"),
}
THRESHOLD = 1e-4


class VarproFromRandomStart:
    """Control: the phased learner's polish alone, from a random start.

    Levenberg-Marquardt on the variable-projection problem
    (:func:`skattn.solvers.polish`) from Theta_i with i.i.d.
    ``N(0, 1/d^2)`` entries (the gradient baseline's start), no phases 1-6.
    """

    def __init__(self, n_heads, n_tokens, random_state):
        self.n_heads, self.n_tokens = n_heads, n_tokens
        self.random_state = random_state

    def fit(self, X, y):
        n, k = len(X), self.n_tokens
        X3, Y3 = X.reshape(n, k, -1), y.reshape(n, k, -1)
        d = X3.shape[2]
        rng = np.random.default_rng(self.random_state)
        start = rng.standard_normal((self.n_heads, d, d)) / d
        self.attention_, self.projection_, _ = polish(X3, Y3, start, max_iter=200)
        self.n_tokens_ = k
        return self


def planted_data(regime, seed):
    """Training data and the planted layer of one regime and seed."""
    p = {**BASE, **regime}
    rng = np.random.default_rng(seed)
    layer = make_attention_layer(
        p["m"],
        p["d"],
        n_outputs=p["d_out"],
        attention_scale=p["scale"],
        structure=p["structure"],
        random_state=rng,
    )
    attention = layer.attention.copy()
    if p["close"] is not None:
        # head 2 = head 1 + a perturbation of relative size `close`
        noise = rng.standard_normal(attention[0].shape)
        noise *= p["close"] * np.linalg.norm(attention[0]) / np.linalg.norm(noise)
        attention[1] = attention[0] + noise
    layer = AttentionLayer(attention, layer.projection, n_tokens=p["k"])
    X = sample_inputs(p["dist"], p["n"], p["k"], p["d"], random_state=rng)
    X = X.reshape(p["n"], p["k"], p["d"])
    Y = forward(X, attention, layer.projection)
    return X.reshape(p["n"], -1), Y.reshape(p["n"], -1), layer, p


def fit_one(est, X, y, layer):
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            est.fit(X, y)
        except ValueError as exc:
            return {
                "ok": False,
                "error": f"{type(exc).__name__}: {str(exc)[:40]}",
                "seconds": time.perf_counter() - start,
                "theta": np.nan,
                "W": np.nan,
            }
    seconds = time.perf_counter() - start
    err = parameter_error(layer, est)
    worst = max(err.attention_error, err.projection_error)
    return {
        "ok": bool(worst <= THRESHOLD),
        "seconds": seconds,
        "theta": err.attention_error,
        "W": err.projection_error,
    }


def run_regime(name, regime, seeds, max_iter, gradient_samples, verbose):
    rows = {"gradient": [], "varpro": [], "phased": []}
    for seed in range(seeds):
        X, y, layer, p = planted_data(regime, seed)
        n_grad = len(X) if not gradient_samples else min(len(X), gradient_samples)
        p["n_gradient"] = n_grad
        gradient = GradientAttentionRegressor(
            n_heads=p["m"],
            n_tokens=p["k"],
            tol=1e-10,
            max_iter=max_iter,
            random_state=seed,
        )
        phased = MultiHeadAttentionRegressor(
            n_heads=p["m"],
            n_tokens=p["k"],
            input_distribution=p["dist"],
            random_state=seed,
        )
        varpro = VarproFromRandomStart(p["m"], p["k"], seed)
        learners = (("gradient", gradient), ("varpro", varpro), ("phased", phased))
        for key, est in learners:
            n_fit = len(X) if key == "phased" else n_grad
            r = fit_one(est, X[:n_fit], y[:n_fit], layer)
            rows[key].append(r)
            if verbose:
                print(
                    f"  {name} seed={seed} {key}: ok={r['ok']} "
                    f"theta={r['theta']:.1e} W={r['W']:.1e} {r['seconds']:.1f}s "
                    f"{r.get('error', '')}",
                    flush=True,
                )
    return p, rows


def summary(results):
    ok = [r["ok"] for r in results]
    errs = [max(r["theta"], r["W"]) for r in results if "error" not in r]
    failed = [r["error"] for r in results if "error" in r]
    return {
        "rate": float(np.mean(ok)),
        "n_ok": int(np.sum(ok)),
        "n": len(ok),
        "seconds": float(np.median([r["seconds"] for r in results])),
        "error": float(np.median(errs)) if errs else np.nan,
        "raised": failed[0] if failed else "",
    }


def plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["name"] for row in table]
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, len(names)), 6), sharex=True)
    bars = ((-0.27, "gradient", "C0"), (0.0, "varpro", "C2"), (0.27, "phased", "C1"))
    for offset, key, color in bars:
        ax1.bar(
            x + offset,
            [row[key]["rate"] for row in table],
            0.27,
            label=key,
            color=color,
        )
        ax2.bar(
            x + offset,
            [row[key]["seconds"] for row in table],
            0.27,
            label=key,
            color=color,
        )
    ax1.set_ylabel("success rate")
    ax1.set_ylim(0, 1.05)
    ax1.legend(loc="lower right")
    ax2.set_ylabel("median wall time (s)")
    ax2.set_yscale("log")
    ax2.set_xticks(x, names, rotation=30, ha="right")
    ax1.set_title(f"success: head-matched parameter errors <= {THRESHOLD:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nfigure saved to {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-iter", type=int, default=2000, help="L-BFGS iterations")
    parser.add_argument(
        "--gradient-samples",
        type=int,
        default=5000,
        help="examples for the gradient baseline (first N; 0: all n)",
    )
    parser.add_argument("--full", action="store_true", help="add the extra regimes")
    parser.add_argument("--regimes", nargs="+", default=None, help="names to run")
    parser.add_argument("--plot", default=None, help="save a figure to this file")
    parser.add_argument("--verbose", action="store_true", help="one line per fit")
    args = parser.parse_args(argv)
    catalogue = {**REGIMES, **EXTRA}
    names = args.regimes or list(REGIMES) + (list(EXTRA) if args.full else [])
    unknown = [name for name in names if name not in catalogue]
    if unknown:
        parser.error(f"unknown regimes {unknown}; choose from {list(catalogue)}")
    print(
        f"seeds={args.seeds} gradient: one random start, max_iter={args.max_iter}, "
        f"first {args.gradient_samples or 'all'} examples; "
        f"success: both errors <= {THRESHOLD:g}\n"
    )
    print(
        "| regime | m | d | k | d_out | n (phased) | n (gradient) | scale | structure "
        "| gradient ok | s (median) | error (median) "
        "| varpro-LM ok | s (median) | error (median) "
        "| phased ok | s (median) | error (median) | phased note |"
    )
    print("|" + "---|" * 19)
    table = []
    for name in names:
        p, rows = run_regime(
            name,
            catalogue[name],
            args.seeds,
            args.max_iter,
            args.gradient_samples,
            args.verbose,
        )
        g, v, ph = (summary(rows[key]) for key in ("gradient", "varpro", "phased"))
        table.append({"name": name, "gradient": g, "varpro": v, "phased": ph})
        structure = p["structure"] + (
            f", close {p['close']:.0%}" if p["close"] is not None else ""
        )
        if p["dist"] != "boolean":
            structure += f", {p['dist']}"
        cells = [
            name,
            p["m"],
            p["d"],
            p["k"],
            p["d_out"],
            p["n"],
            p["n_gradient"],
            p["scale"],
            structure,
        ]
        for s in (g, v, ph):
            cells += [
                f"{s['n_ok']}/{s['n']}",
                f"{s['seconds']:.1f}",
                f"{s['error']:.1e}",
            ]
        cells.append(ph["raised"] or g["raised"])
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    if args.plot:
        plot(table, args.plot)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
