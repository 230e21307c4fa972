"""Torch operations and host reads of one random-start fit, by stage (issue 49).

On a GPU the refinement is bound by launches and by the host waiting on the
device; both are counted here on torch CPU tensors, which take the same code
path (``skattn.utils._device_work``): every torch operation (a kernel launch on
a GPU) and every host read (``aten._local_scalar_dense``, copies to numpy or to
lists), by stage of the random-start path, in one thread.  The default is the
setting of issue 49: 8 heads of rank 4, d = 32, k = 8, 4000 Gaussian sequences,
``start_search="minibatch"`` (a setting for counting, not a showcase: that fit
ends far from exact).  The polish of that fit finds its start fitted already and
stops at once; ``--polish-nudge EPS`` counts the polish alone instead, from the
planted layer with its attention nudged by ``EPS`` times its largest entry, where
its trust-region steps (LSMR's included) run.

    python benchmarks/bench_device_work.py [--n 4000 --heads 8 ...] [--out FILE.json]
    python benchmarks/bench_device_work.py --polish-nudge 0.02 [--n 2000 ...]
    python benchmarks/bench_device_work.py --decoder-polish 1e-4 [--rope-theta B]

``--decoder-polish EPS`` counts the decoder polish alone (issue 63): a planted
causal rotary layer of 4 query heads sharing 2 key/value heads, d = 64, head
dimension 16, k = 32, 160 Gaussian sequences, its query and key maps nudged by
``EPS`` of their RMS in the slow rotary pairs, polished jointly
(``varpro_least_squares``, the slow pairs' mixings lifted) with
``--polish-iters`` evaluations: operations and round trips per LM step.

Prints one row per stage (operations, host reads, round trips of every kind) and
the fit's time and held-out error; ``--out`` writes them as JSON, to compare versions.
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("SCIPY_ARRAY_API", "1")  # before scipy is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

from skattn import MultiHeadAttentionRegressor, make_attention_regression  # noqa: E402
from skattn.solvers import _driver  # noqa: E402
from skattn.solvers.stages._polish import staged_polish  # noqa: E402
from skattn.utils import estimator_to_numpy  # noqa: E402
from skattn.utils._device_work import DeviceWork, count_fit  # noqa: E402

# the random-start path's stages, where the driver looks them up
STAGES = (
    (_driver, "minibatch_search", "search"),
    (_driver, "refine_heads", "refinement"),
    (_driver, "staged_polish", "polish"),
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--sources",
        type=int,
        default=15,
        help="print the N sources of most reads and of most copies",
    )
    parser.add_argument(
        "--polish-nudge",
        type=float,
        default=None,
        help="count the polish alone, from the planted layer nudged by this",
    )
    parser.add_argument(
        "--decoder-polish",
        type=float,
        default=None,
        help="count the decoder polish alone, from a planted rotary layer nudged",
    )
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--polish-iters", type=int, default=8)
    args = parser.parse_args(argv)
    if args.polish_nudge is not None:
        return count_polish(args)
    if args.decoder_polish is not None:
        return count_decoder_polish(args)
    n_test = 1000
    X, y = make_attention_regression(
        args.n + n_test,
        args.tokens,
        args.features,
        args.heads,
        distribution="gaussian",
        head_rank=args.rank,
        random_state=args.seed,
    )
    estimator = MultiHeadAttentionRegressor(
        n_heads=args.heads,
        n_tokens=args.tokens,
        head_rank=args.rank,
        init="random",
        start_search="minibatch",
        random_state=args.seed,
    )
    start = time.perf_counter()
    estimator, work = count_fit(
        estimator,
        torch.asarray(X[: args.n]),
        torch.asarray(y[: args.n]),
        STAGES,
        where=args.sources > 0,
    )
    seconds = time.perf_counter() - start
    fitted = estimator_to_numpy(estimator)
    residual = fitted.predict(X[args.n :]) - y[args.n :]
    held_out = float(np.linalg.norm(residual) / np.linalg.norm(y[args.n :]))
    table = work.summary()
    print(f"{'stage':<12} {'operations':>12} {'host reads':>12} {'round trips':>12}")
    for stage, row in table.items():
        print(
            f"{stage:<12} {row['operations']:>12} {row['host_reads']:>12} "
            f"{row['round_trips']:>12}"
        )
    print(f"fit {seconds:.1f} s (counting included), held-out error {held_out:.3g}")
    _print_sources(work, args)
    record = {
        "settings": vars(args),
        "stages": table,
        "seconds": seconds,
        "reads_by_source": dict(work.reads_by_source.most_common()),
        "copies_by_source": dict(work.copies_by_source.most_common()),
        "held_out_relative_error": held_out,
        "torch": torch.__version__,
    }
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)
    return 0


def count_polish(args):
    """The polish alone (matrix-free, one stage) from the planted layer with its
    attention nudged: its operations and host reads on torch CPU."""
    from sklearn import config_context
    from threadpoolctl import threadpool_limits

    n, k, d = args.n, args.tokens, args.features
    X, y, layer = make_attention_regression(
        n,
        k,
        d,
        args.heads,
        distribution="gaussian",
        head_rank=args.rank,
        random_state=args.seed,
        return_layer=True,
    )
    attention = np.asarray(layer.attention)
    nudge = np.random.default_rng(args.seed + 1).normal(size=attention.shape)
    start = attention + args.polish_nudge * np.abs(attention).max() * nudge
    work = DeviceWork(where=args.sources > 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clock = time.perf_counter()
    try:
        with threadpool_limits(1), config_context(array_api_dispatch=True):
            with work, work.stage("polish"):
                _, _, info = staged_polish(
                    torch.asarray(X.reshape(n, k, d)),
                    torch.asarray(y.reshape(n, k, -1)),
                    torch.asarray(start),
                    head_rank=args.rank,
                    solver="matrix-free",
                    n_warmup_samples=None,
                    random_state=args.seed,
                )
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - clock
    _report(
        work,
        "polish",
        args,
        f"polish {seconds:.1f} s (counting included), {info['n_iter']} iterations, "
        f"relative residual {info['relative_residual']:.3g}",
        {
            "seconds": seconds,
            "n_iter": info["n_iter"],
            "relative_residual": info["relative_residual"],
        },
    )
    return 0


def count_decoder_polish(args):
    """The decoder polish alone (the slow rotary pairs lifted) on torch CPU,
    from a planted layer nudged in its slow pairs: operations and round trips
    per LM step."""
    from threadpoolctl import threadpool_limits

    from skattn.solvers.kernels._near_gauge import slow_rotary_dims
    from skattn.solvers.kernels._parametrization import LowRank
    from skattn.solvers.optimizers._lm_matrix_free import varpro_least_squares

    n, m, m_kv, d, k, r = 160, 4, 2, 64, 32, 16
    X, y, layer = make_attention_regression(
        n, k, d, m, head_rank=r, causal=True, rope=True, n_kv_heads=m_kv,
        rope_theta=args.rope_theta, distribution="gaussian",
        random_state=args.seed, return_layer=True,
    )  # fmt: skip
    par = LowRank(m, d, r, n_kv_heads=m_kv, causal=True, rope_theta=args.rope_theta)
    truth = np.concatenate([layer.rotary_query.ravel(), layer.rotary_key.ravel()])
    noise = np.zeros((m + m_kv, d, r))
    dims = slow_rotary_dims(r, args.rope_theta, "half", k)
    rng = np.random.default_rng(args.seed + 1)
    noise[..., dims] = rng.normal(size=noise[..., dims].shape)
    start = truth + args.decoder_polish * np.sqrt(np.mean(truth**2)) * noise.ravel()
    work = DeviceWork(where=args.sources > 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clock = time.perf_counter()
    try:
        with threadpool_limits(1), work, work.stage("decoder polish"):
            _, _, info = varpro_least_squares(
                torch.asarray(X.reshape(n, k, d)),
                torch.asarray(y.reshape(n, k, -1)),
                torch.asarray(start),
                par,
                max_iter=args.polish_iters,
                coarse=False,
                max_products=40,
            )
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - clock
    steps = max(info["n_iter"], 1)
    relative = math.sqrt(2 * info["loss"]) / float(np.linalg.norm(y))
    trips = work.summary()["decoder polish"]["round_trips"]
    _report(
        work,
        "decoder polish",
        args,
        f"{info['n_iter']} LM steps, {info['n_evaluations']} evaluations: "
        f"{trips / steps:.1f} round trips a step; {seconds:.1f} s (counting "
        f"included), relative residual {relative:.3g}",
        {
            "seconds": seconds,
            "n_iter": info["n_iter"],
            "n_evaluations": info["n_evaluations"],
            "relative_residual": relative,
        },
    )
    return 0


def _print_sources(work, args):
    """The ``--sources`` lines of most host reads and of most copies from the
    host."""
    if not args.sources:
        return
    for what, counts in (
        ("host reads", work.reads_by_source),
        ("copies from the host", work.copies_by_source),
    ):
        print(f"{what} by source:")
        for source, count in counts.most_common(args.sources):
            print(f"{count:>10}  {source}")


def _report(work, stage, args, line, record):
    """Print a stage's row of ``work``, ``line`` and the sources of most round
    trips; with ``--out``, write them with ``record``."""
    row = work.summary()[stage]
    width = max(12, len(stage))
    names = ("operations", "host reads", "round trips")
    print(f"{'stage':<{width}} " + " ".join(f"{name:>12}" for name in names))
    print(
        f"{stage:<{width}} {row['operations']:>12} {row['host_reads']:>12} "
        f"{row['round_trips']:>12}"
    )
    print(line)
    _print_sources(work, args)
    if args.out:
        record = {
            "settings": vars(args),
            "stages": work.summary(),
            **record,
            "reads_by_source": dict(work.reads_by_source.most_common()),
            "copies_by_source": dict(work.copies_by_source.most_common()),
            "torch": torch.__version__,
        }
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    sys.exit(main())
