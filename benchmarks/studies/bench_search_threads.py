"""The minibatch search's steps on one thread against two, side by side.

Each step of :func:`skattn.solvers.minibatch_search` computes its batch in two
halves whose sums make the result; with ``n_jobs=2`` the halves run at once, each
on one BLAS thread (the estimator does so when BLAS has two threads or more).  This
script times ``--steps`` steps of the search from the layer saved by
``bench_decoupled_precision.py --state`` (a searched all-MiniLM-L6-v2 layer: 12
heads of rank 32 at d = 384, batches of 256 sequences), alternately with one and
two threads, ``--repeats`` times, prints the seconds per step of each and their
ratio, and checks that both give the same parameters.

Example::

    python benchmarks/studies/bench_search_threads.py --state /tmp/layer4.npz
"""

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from skattn.solvers import FactoredHeads, minibatch_search
from skattn.solvers.kernels._varpro import _intercept_direction


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", required=True, help=".npz of a searched layer")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    state = np.load(args.state)
    X, Y, params = state["X"], state["Y"], state["params"]
    m, d, r = (int(v) for v in state["shape"])
    par = FactoredHeads(m, d, r)
    direction = _intercept_direction(X) if bool(state["intercept"]) else None
    print(f"# {args.state}: {m} heads of rank {r}, d={d}, {args.steps} steps a run")
    print("\n| run | one thread [s/step] | two threads [s/step] | ratio |")
    print("|---|---|---|---|")
    for run in range(args.repeats):
        seconds, ends = [], []
        for n_jobs in (1, 2):
            with threadpool_limits(limits=1, user_api="blas"):
                clock = time.perf_counter()
                end, info = minibatch_search(
                    X,
                    Y,
                    params,
                    par,
                    intercept_direction=direction,
                    max_steps=args.steps,
                    stop_residual=0.0,
                    patience=args.steps,
                    n_jobs=n_jobs,
                    random_state=run,
                )
                seconds.append((time.perf_counter() - clock) / info["n_steps"])
            ends.append(end)
        same = "same bits" if np.array_equal(*ends) else "DIFFERENT parameters"
        print(
            f"| {run} | {seconds[0]:.3f} | {seconds[1]:.3f} | "
            f"{seconds[1] / seconds[0]:.2f} ({same}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
