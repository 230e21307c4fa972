"""A planted previous-token head beside an ordinary head: can 2·10⁴ sequences pin it,
and does skattn learn it (issue 51)?

The layer (d = 32, k = 16, two heads of rank 16): each token is ``[g, p(l)]``, 24
standard Gaussian features ``g`` and 8 positional ones ``p(l) = (cos(2 pi f l / k),
sin(2 pi f l / k))`` for f = 1, 3, 5, 7 (the sinusoids of position embeddings).
Head 0 is a previous-token head: its logit between query l and key a is

    c * sum_f cos(2 pi f (a - l + 1) / k) + g_l^T B g_a,

which is ``4 c`` at ``a = l - 1`` (mod k) and 0 or ``-4 c`` elsewhere: a margin of
``4 c = --margin`` nats (10) before the Gaussian term ``B`` (rank 8, so the head has
rank 16), whose scale is set by bisection so that ``--split`` of the rows (0.2 %)
split their attention (largest weight <= 0.99, as
:func:`skattn.metrics.sharp_head_pinning` counts).  Head 1 and both heads' values are
``make_attention_layer(n_heads=2, n_features=32, head_rank=16)``'s.

Printed: the head's profile (median largest weight, split share, margin quantiles),
the pinning count (split rows against the rows the counting bound asks for), the
pre-fit verdict, then a fit of ``MultiHeadAttentionRegressor(n_heads=2,
head_rank=16)`` on ``--n`` sequences, stopped at ``--budget`` seconds (SIGALRM): its
time (wall and CPU seconds: on a shared machine the CPU seconds over the threads
are the time on idle cores) and its held-out relative error on 2000 fresh
sequences.

    python benchmarks/studies/study_previous_token_head.py [--n 20000]
        [--budget 600] [--margin 10] [--split 0.002]
        [--start-search {auto,minibatch,none}] [--json out.json]
"""

import argparse
import json
import signal
import sys
import time

import numpy as np

from skattn import AttentionLayer, MultiHeadAttentionRegressor
from skattn.datasets import make_attention_layer
from skattn.metrics import sharp_head_pinning, sharpness_profile

D, K, R, N_POS = 32, 16, 16, 8
FREQUENCIES = (1, 3, 5, 7)


def positions(k=K):
    """``(k, 8)``: the sinusoidal features of positions 0..k-1."""
    angle = 2 * np.pi * np.outer(np.arange(k), FREQUENCIES) / k
    return np.concatenate([np.cos(angle), np.sin(angle)], axis=1)


def tokens(n, rng):
    """``(n, k, d)``: Gaussian features then the positions' sinusoids."""
    g = rng.standard_normal((n, K, D - N_POS))
    return np.concatenate([g, np.broadcast_to(positions(), (n, K, N_POS))], axis=2)


def previous_token_theta(margin, noise, rng):
    """Head 0's ``Theta``: the positional block that peaks at key l - 1 by
    ``margin`` nats, and a rank-8 Gaussian block of scale ``noise``."""
    c = margin / len(FREQUENCIES)
    theta = np.zeros((D, D))
    # p(l)^T A p(a) = c sum_f cos(phi_f (a - l + 1)): per f the 2x2 block
    # [[cos s, -sin s], [sin s, cos s]] with s = phi_f, on (cos, sin) pairs
    g = D - N_POS
    nf = len(FREQUENCIES)
    for j, f in enumerate(FREQUENCIES):
        s = 2 * np.pi * f / K
        ci, si = g + j, g + nf + j
        theta[ci, ci] = theta[si, si] = c * np.cos(s)
        theta[ci, si] = c * np.sin(s)
        theta[si, ci] = -c * np.sin(s)
    left = rng.standard_normal((g, R - N_POS))
    right = rng.standard_normal((g, R - N_POS))
    theta[:g, :g] = noise * left @ right.T / np.sqrt(g * (R - N_POS))
    return theta


def plant(margin, split, seed):
    base = make_attention_layer(
        n_heads=2, n_features=D, head_rank=R, n_tokens=K, random_state=seed
    )
    X_probe = tokens(4000, np.random.default_rng(seed + 1))
    noise_rng = np.random.default_rng(seed + 2)
    left, right = 1e-3, 1e3  # bisection on the Gaussian block's log scale
    state = noise_rng.bit_generator.state
    for _ in range(40):
        mid = np.sqrt(left * right)
        noise_rng.bit_generator.state = state
        theta = previous_token_theta(margin, mid, noise_rng)
        share = sharpness_profile(theta[None], X_probe).sharp_share[0]
        if 1 - share < split:
            left = mid
        else:
            right = mid
    noise_rng.bit_generator.state = state
    theta0 = previous_token_theta(margin, left, noise_rng)
    attention = np.array(base.attention)
    attention[0] = theta0
    layer = AttentionLayer(
        attention, np.array(base.projection), n_tokens=K, head_rank=R
    )
    return layer, left


class _Budget(Exception):
    pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--budget", type=float, default=600.0)
    parser.add_argument("--margin", type=float, default=10.0)
    parser.add_argument("--split", type=float, default=0.002)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--start-search", default="auto", choices=["auto", "minibatch", "none"]
    )
    parser.add_argument("--no-fit", action="store_true")
    parser.add_argument("--verbose", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    layer, noise = plant(args.margin, args.split, args.seed)
    rng = np.random.default_rng(args.seed + 10)
    X = tokens(args.n, rng)
    X_test = tokens(2000, rng)
    y, y_test = layer.predict(X), layer.predict(X_test)
    profile = sharpness_profile(layer, X)
    pinning = sharp_head_pinning(layer, X, head_rank=R)
    out = {
        "n": args.n,
        "margin": args.margin,
        "noise_scale": float(noise),
        "median_largest_weight": profile.median_largest_weight.tolist(),
        "split_share": (1 - profile.sharp_share).tolist(),
        "margin_quantiles": profile.margin_quantiles.tolist(),
        "split_rows": [int(s) for s in pinning.n_split_rows],
        "rows_needed": [int(s) for s in pinning.n_needed],
    }
    print(json.dumps(out), flush=True)
    if not args.no_fit:
        est = MultiHeadAttentionRegressor(
            n_heads=2,
            head_rank=R,
            n_tokens=K,
            start_search=args.start_search,
            random_state=args.seed,
            verbose=args.verbose,
        )

        def stop(signum, frame):
            raise _Budget

        signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, args.budget)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            est.fit(X.reshape(args.n, -1), y.reshape(args.n, -1))
            out["fit_seconds"] = time.perf_counter() - start
            # on a shared machine: CPU seconds / threads is the time on idle cores
            out["fit_cpu_seconds"] = time.process_time() - cpu
        except _Budget:
            out["fit_seconds"] = None
            out["stopped"] = f"budget of {args.budget:.0f} s"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if out["fit_seconds"] is not None:
            pred = est.predict(X_test.reshape(len(X_test), -1))
            target = y_test.reshape(len(X_test), -1)
            out["held_out_relative_error"] = float(
                np.linalg.norm(pred - target) / np.linalg.norm(target)
            )
            out["data_verdict"] = getattr(est, "data_verdict_", None)
        print(json.dumps(out, default=str), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
