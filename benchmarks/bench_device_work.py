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

Prints one row per stage (operations, host reads, round trips of every kind) and
the fit's time and held-out error; ``--out`` writes them as JSON, to compare versions.
"""

import argparse
import json
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
        "--sources", type=int, default=15, help="print the N sources of most reads"
    )
    parser.add_argument(
        "--polish-nudge",
        type=float,
        default=None,
        help="count the polish alone, from the planted layer nudged by this",
    )
    args = parser.parse_args(argv)
    if args.polish_nudge is not None:
        return count_polish(args)
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
    if args.sources:
        print("host reads by source:")
        for source, count in work.reads_by_source.most_common(args.sources):
            print(f"{count:>10}  {source}")
    record = {
        "settings": vars(args),
        "stages": table,
        "seconds": seconds,
        "reads_by_source": dict(work.reads_by_source.most_common()),
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
    row = work.summary()["polish"]
    print(f"{'stage':<12} {'operations':>12} {'host reads':>12} {'round trips':>12}")
    print(
        f"{'polish':<12} {row['operations']:>12} {row['host_reads']:>12} "
        f"{row['round_trips']:>12}"
    )
    print(
        f"polish {seconds:.1f} s (counting included), {info['n_iter']} iterations, "
        f"relative residual {info['relative_residual']:.3g}"
    )
    if args.sources:
        print("host reads by source:")
        for source, count in work.reads_by_source.most_common(args.sources):
            print(f"{count:>10}  {source}")
    if args.out:
        record = {
            "settings": vars(args),
            "stages": work.summary(),
            "seconds": seconds,
            "n_iter": info["n_iter"],
            "relative_residual": info["relative_residual"],
            "reads_by_source": dict(work.reads_by_source.most_common()),
            "torch": torch.__version__,
        }
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
