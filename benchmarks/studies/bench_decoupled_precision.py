"""Decoupled one-head problems: Jacobian products in float32 against float64.

The decoupled refinement (:func:`skattn.solvers.decoupled_refine`) solves one
problem per head after the minibatch search; on whole MiniLM layers it is most of
the fit.  Its Jacobian products run in single precision while residuals and
eliminated coefficients stay in double (``jacobian_dtype``).  This script measures
that choice side by side on real heads:

1. it runs ``bench_minilm_teacher.py`` (the default ``MultiHeadAttentionRegressor``)
   with the arguments after ``--`` up to the decoupled refinement, and saves what
   the refinement receives to ``--state`` (reused when the file exists);
2. it builds the heads' problems there, as the refinement's first round does, and
   solves each of ``--heads`` with float64 products, then with float32 products, on
   one BLAS thread, one after the other;
3. it prints per head the iterations, products, relative residual and seconds of
   each, and the ratio of the seconds; with ``--threads``, also those of float32
   products on two threads (a head left alone shares its products' chunks with
   the idle core) and their ratio to one thread.

Example (layer 4 of real text, the state of the search's end saved once)::

    OMP_NUM_THREADS=1 python benchmarks/studies/bench_decoupled_precision.py \
        --state /tmp/layer4.npz --heads 0 1 2 3 -- \
        --text --layer 4 --n-heads 12 --n-samples 5000 --n-test 1000
"""

import argparse
import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

import skattn.solvers._driver as driver_module
import skattn.solvers.stages._refine as refine_module
from skattn.solvers import FactoredHeads
from skattn.solvers.kernels._decoupling import _shares
from skattn.solvers.stages._rounds import _solve_head


class _Saved(Exception):
    pass


def save_state(path, teacher_args, whole=False):
    """Run the teacher benchmark up to the decoupled refinement; save its inputs.

    ``whole``: save the search's end with the whole training set (what
    ``_decouple`` receives) instead of the refinement's own sequences.
    """
    # bench_minilm_teacher.py is in benchmarks/, one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_minilm_teacher

    def save(X, Y, params, par, intercept):
        np.savez(
            path,
            X=X,
            Y=Y,
            params=params,
            shape=[par.n_heads, par.n_features, par.rank],
            intercept=intercept,
        )
        raise _Saved

    def grab_refine(X, Y, params, par, **kwargs):
        save(X, Y, params, par, kwargs.get("intercept_direction") is not None)

    def grab_decouple(X, Y, params, par, direction, *args):
        save(X, Y, params, par, direction is not None)

    if whole:
        module, name, grab = driver_module, "refine_heads", grab_decouple
    else:
        module, name, grab = refine_module, "decoupled_refine", grab_refine
    original = getattr(module, name)
    setattr(module, name, grab)
    try:
        bench_minilm_teacher.main(teacher_args)
    except _Saved:
        pass
    finally:
        setattr(module, name, original)
    if not os.path.exists(path):
        raise SystemExit("the fit did not reach the decoupled refinement")


def load_state(path, teacher_args, whole=False):
    """The state at ``path``, saved first by :func:`save_state` when missing:
    ``(X, Y, params, parametrization, intercept)``."""
    if not os.path.exists(path):
        save_state(path, teacher_args, whole=whole)
    state = np.load(path)
    m, d, r = (int(v) for v in state["shape"])
    par = FactoredHeads(m, d, r)
    return state["X"], state["Y"], state["params"], par, bool(state["intercept"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", required=True, help=".npz of the search's end")
    parser.add_argument("--heads", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-iter", type=int, default=20)
    parser.add_argument("--threads", action="store_true", help="also two threads")
    args = parser.parse_args(argv[:split])
    X, Y, params, par, intercept = load_state(args.state, argv[split + 1 :])
    m, d, r = par.n_heads, par.n_features, par.rank
    n, k = Y.shape[:2]
    print(f"# {args.state}: {n} sequences of {k} tokens, d={d}, {m} heads of rank {r}")
    runs = [(np.float64, 1), (np.float32, 1)] + [(np.float32, 2)] * args.threads
    print(
        "\n| head | float64: iterations, products, residual, s "
        "| float32 products: iterations, products, residual, s | time ratio |"
        + " float32, two threads: the same | ratio to one thread |"
        * args.threads
    )
    print("|---|---|---|---|" + "---|---|" * args.threads)
    with threadpool_limits(limits=1, user_api="blas"):
        shares = _shares(X, Y, params, par, None, intercept)
        Q, K, _ = par.factors(params)
        for head in args.heads:
            cells, seconds = [], []
            for dtype, n_jobs in runs:
                clock = time.perf_counter()
                info = _solve_head(
                    X, shares, head, Q, K, None, args.max_iter, 1e-10, dtype, n_jobs
                )[3]
                seconds.append(time.perf_counter() - clock)
                cells.append(
                    f"{info['n_iter']}, {info['n_products']}, "
                    f"{info['relative_residual']:.2g}, {seconds[-1]:.0f}"
                )
            row = (
                f"| {head} | {cells[0]} | {cells[1]} | {seconds[1] / seconds[0]:.2f} |"
            )
            if args.threads:
                row += f" {cells[2]} | {seconds[2] / seconds[1]:.2f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
