"""A planted decoder layer learned by MultiHeadAttentionRegressor (issue 50).

The issue's case: a causal layer with rotary positions and 8 query heads sharing
2 key/value heads, d = 64, head dimension 16, k = 32 tokens, Gaussian tokens
(``make_attention_regression(..., causal=True, rope=True, n_kv_heads=2)``).  The
estimator fits the first ``n`` sequences (``causal=True, rope=True,
n_kv_heads=2, head_rank=16``; the decoder random-start path: minibatch search,
then the joint Levenberg-Marquardt polish), and the held-out relative error
``||F_hat(X) - Y|| / ||Y||`` is measured on ``--held-out`` more.

``--setting wide`` (issue 62): heads of 64, 4 query heads sharing 2, d = 256,
k = 64, 192 sequences (the search's margin of 16 output values an unknown);
with ``--rope-theta 500000``, Llama 3's base.

    python benchmarks/bench_decoder.py [--setting issue|small|wide] [--n N]
        [--threads T] [--restarts R] [--rope-theta B] [--polish-max-iter I]
        [--memory DIR] [--out F.json]

``--memory DIR`` keeps the fit's stages there (the estimator's ``memory=``):
a run stopped and started again with the same arguments resumes after the last
(a fit of hours, such as ``--setting wide``, pieced together).

Prints the fit's time, peak resident memory, stages and the held-out error;
``--out`` writes them as JSON.
"""

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from skattn import MultiHeadAttentionRegressor, make_attention_regression  # noqa: E402

# (n, heads, kv heads, d, k, head dimension)
SETTINGS = {
    "small": (3000, 2, 2, 8, 6, 2),
    "issue": (2000, 8, 2, 64, 32, 16),
    # issue 62: heads of 64 (4 query heads sharing 2 key/value heads, d = 256)
    "wide": (192, 4, 2, 256, 64, 64),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="issue")
    parser.add_argument("--n", type=int, default=None, help="training sequences")
    parser.add_argument("--held-out", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument(
        "--polish-max-iter",
        type=int,
        default=100,
        help="residual evaluations of each polish stage (a cap on the fit's time)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rope-theta", type=float, default=10000.0, help="RoPE's base (both layers)"
    )
    parser.add_argument("--verbose", type=int, default=1)
    parser.add_argument("--memory", default=None, help="keep the fit's stages here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n, m, m_kv, d, k, r = SETTINGS[args.setting]
    n = args.n or n
    X, y = make_attention_regression(
        n + args.held_out,
        k,
        d,
        m,
        head_rank=r,
        causal=True,
        rope=True,
        n_kv_heads=m_kv,
        distribution="gaussian",
        rope_theta=args.rope_theta,
        random_state=args.seed,
    )
    est = MultiHeadAttentionRegressor(
        m,
        k,
        head_rank=r,
        causal=True,
        rope=True,
        n_kv_heads=m_kv,
        rope_theta=args.rope_theta,
        n_restarts=args.restarts,
        polish_max_iter=args.polish_max_iter,
        random_state=args.seed,
        verbose=args.verbose,
        memory=args.memory,
    )
    start = time.perf_counter()
    with threadpool_limits(args.threads):
        est.fit(X[:n], y[:n])
    seconds = time.perf_counter() - start
    held = est.predict(X[n:])
    error = float(np.linalg.norm(held - y[n:]) / np.linalg.norm(y[n:]))
    info = est.phase_report_[0].info
    search = info.get("start_search") or {}
    record = {
        "setting": args.setting,
        "n": n,
        "n_heads": m,
        "n_kv_heads": m_kv,
        "n_features": d,
        "n_tokens": k,
        "head_rank": r,
        "rope_theta": args.rope_theta,
        "threads": args.threads,
        "fit_seconds": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "held_out_relative_error": error,
        "train_relative_residual": info["relative_residual"],
        "n_starts_run": info["n_starts_run"],
        "start_residuals": info["start_residuals"],
        "search_steps": search.get("n_steps"),
        "search_residual": search.get("residual"),
        "polish_iterations": info["n_iter"],
        "polish_products": info["n_products"],
        "final_stage": info["final_stage"],
        "stop_reason": info["stop_reason"],
        "memory": info["memory"],  # the stages read back and computed
    }
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
