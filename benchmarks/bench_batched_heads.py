"""The refinement's heads solved one at a time against as one batched problem
(issue 49), side by side in one run, on torch CPU tensors (the device's code
path) and numpy.

For each setting a planted layer (``make_attention_regression``, Gaussian
tokens) is fitted by ``MultiHeadAttentionRegressor(init="random",
start_search="minibatch")``, in torch CPU tensors under
``array_api_dispatch``, twice: with the refinement's heads one after another
(``batched=False``, the route before issue 49) and as one problem with a head
axis (``batched=True``, now the default outside numpy); and in numpy both ways
(threads over heads, the default there, unchanged; and batched).  Each fit
runs in one thread, timed without counting; a second fit of each torch route
counts the refinement's torch operations and host reads (``skattn.utils._device_work``).

    python benchmarks/bench_batched_heads.py [--settings small default] [--out F.json]
    python benchmarks/bench_batched_heads.py --settings soft
    python benchmarks/bench_batched_heads.py --settings soft --alternate 3

``soft`` is issue 63's recipe (8 heads of rank 4, d = 32, k = 8, 4000 Gaussian
sequences, ``Theta_i`` the rank-4 truncation of a Gaussian matrix scaled by
``2 / d``): a fit whose heads do not converge, where the batched route must
not spend more operations than heads one at a time.

Prints one row per (setting, route): fit seconds, refinement operations, host
reads and round trips of every kind (host reads, linear-algebra error checks,
``eigh``, ``nonzero``, boolean masks: ``DeviceWork.round_trips``), held-out
relative error; and the ratios per-head / batched.  ``--alternate N`` times the
refinement alone instead, in fits alternating the two torch routes N times.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("SCIPY_ARRAY_API", "1")  # before scipy is imported
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import sklearn  # noqa: E402
import torch  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from skattn import MultiHeadAttentionRegressor, make_attention_regression  # noqa: E402
from skattn.layer._math import forward  # noqa: E402
from skattn.solvers import _driver  # noqa: E402
from skattn.solvers.stages import _rounds  # noqa: E402
from skattn.utils import estimator_to_numpy  # noqa: E402
from skattn.utils._device_work import count_fit  # noqa: E402

# (n, heads, d, k, r)
SETTINGS = {
    "small": (1000, 4, 16, 6, 2),
    "default": (4000, 8, 32, 8, 4),  # bench_device_work.py's, issue 49's
    "wide": (3000, 8, 64, 8, 8),
    "soft": (4000, 8, 32, 8, 4),  # issue 63's recipe: heads that do not converge
}


def _data(n, m, d, k, r, seed, setting=None):
    if setting == "soft":
        return _soft_data(n, m, d, k, r, seed)
    X, y = make_attention_regression(
        n + 1000, k, d, m, distribution="gaussian", head_rank=r, random_state=seed
    )
    return X[:n], y[:n], X[n:], y[n:]


def _soft_data(n, m, d, k, r, seed):
    """Issue 63's recipe: ``Theta_i`` the rank-``r`` truncation of a Gaussian
    ``d x d`` matrix scaled by ``2 / d``, ``W_i ~ N(0, 1/d)``, ``d_out = d``,
    Gaussian tokens (a fit whose refinement's heads do not all converge)."""
    rng = np.random.default_rng(seed)
    U, s, Vt = np.linalg.svd(rng.normal(size=(m, d, d)) * 2.0 / d)
    attention = (U[:, :, :r] * s[:, None, :r]) @ Vt[:, :r, :]
    projection = rng.normal(scale=d**-0.5, size=(m, d, d))
    X = rng.normal(size=(n + 1000, k, d))
    y = forward(X, attention, projection).reshape(n + 1000, -1)
    X = X.reshape(n + 1000, -1)
    return X[:n], y[:n], X[n:], y[n:]


def _estimator(m, k, r, seed):
    return MultiHeadAttentionRegressor(
        n_heads=m,
        n_tokens=k,
        head_rank=r,
        init="random",
        start_search="minibatch",
        random_state=seed,
    )


def _route(batched):
    """The refinement's ``_solve_heads`` with ``batched`` fixed (restored after)."""
    original = _rounds._solve_heads

    class _Patch:
        def __enter__(self):
            def forced(*args, **kwargs):
                return original(*args, **{**kwargs, "batched": batched})

            _rounds._solve_heads = forced

        def __exit__(self, *exc):
            _rounds._solve_heads = original

    return _Patch()


def _held_out(estimator, X_test, y_test):
    fitted = estimator_to_numpy(estimator)
    residual = fitted.predict(X_test) - y_test
    return float(np.linalg.norm(residual) / np.linalg.norm(y_test))


ROUTES = (
    ("torch, one head at a time", False, False),
    ("torch, batched", True, False),
    ("numpy, threads", False, True),
    ("numpy, batched", True, True),
)


def run(setting, seed, routes=ROUTES):
    n, m, d, k, r = SETTINGS[setting]
    X, y, X_test, y_test = _data(n, m, d, k, r, seed, setting)
    rows = []
    for route, batched, numpy in routes:
        Xa, ya = (X, y) if numpy else (torch.asarray(X), torch.asarray(y))
        with (
            _route(batched),
            threadpool_limits(1),
            sklearn.config_context(array_api_dispatch=not numpy),
        ):
            start = time.perf_counter()
            estimator = _estimator(m, k, r, seed).fit(Xa, ya)
            seconds = time.perf_counter() - start
            row = {
                "setting": setting,
                "route": route,
                "seconds": seconds,
                "held_out": _held_out(estimator, X_test, y_test),
            }
            if not numpy:
                _, work = count_fit(
                    _estimator(m, k, r, seed),
                    Xa,
                    ya,
                    ((_driver, "refine_heads", "refinement"),),
                )
                row["operations"] = work.operations["refinement"]
                row["host_reads"] = work.host_reads["refinement"]
                # every kind of device wait, host reads included (issue 63)
                row["round_trips"] = work.round_trips()["refinement"]
                row["waits"] = dict(work.waits["refinement"])
        rows.append(row)
        print(
            f"{setting:<8} {route:<26} {seconds:8.2f} s "
            f"{row.get('operations', ''):>10} {row.get('host_reads', ''):>8} "
            f"{row.get('round_trips', ''):>8} {row['held_out']:10.2e}",
            flush=True,
        )
    one, batch = rows[0], rows[1]
    print(
        f"{setting:<8} {'ratio one-at-a-time/batched':<26} "
        f"{one['seconds'] / batch['seconds']:8.2f}   "
        f"{one['operations'] / batch['operations']:10.1f} "
        f"{one['host_reads'] / max(1, batch['host_reads']):8.1f} "
        f"{one['round_trips'] / max(1, batch['round_trips']):8.1f}",
        flush=True,
    )
    return rows


def alternate(setting, seed, repeats):
    """The refinement alone (``refine_heads``), timed in fits on torch that
    alternate the two routes ``repeats`` times (the whole fits' times swing with
    a shared machine's load; alternating puts both routes under the same).
    Returns ``{route: [seconds, ...]}``."""
    n, m, d, k, r = SETTINGS[setting]
    X, y, _, _ = _data(n, m, d, k, r, seed, setting)
    Xa, ya = torch.asarray(X), torch.asarray(y)
    seconds = {route: [] for route, _, _ in ROUTES[:2]}
    original = _driver.refine_heads
    for _ in range(repeats):
        for route, batched, _ in ROUTES[:2]:
            spent = []

            def timed(*args, spent=spent, **kwargs):
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    spent.append(time.perf_counter() - start)

            _driver.refine_heads = timed
            try:
                with (
                    _route(batched),
                    threadpool_limits(1),
                    sklearn.config_context(array_api_dispatch=True),
                ):
                    _estimator(m, k, r, seed).fit(Xa, ya)
            finally:
                _driver.refine_heads = original
            seconds[route].append(sum(spent))
            print(
                f"{setting:<8} {route:<26} refinement {sum(spent):8.2f} s", flush=True
            )
    for route, values in seconds.items():
        print(f"{setting:<8} {route:<26} median {np.median(values):8.2f} s", flush=True)
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=["small", "default"]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torch-only",
        action="store_true",
        help="the two torch routes only (the ratios need no more)",
    )
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="N",
        help="instead: time the refinement alone on torch, the two routes "
        "alternating N times (see alternate)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    routes = ROUTES[:2] if args.torch_only else ROUTES
    torch.set_num_threads(1)
    if args.alternate:
        times = {s: alternate(s, args.seed, args.alternate) for s in args.settings}
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"refinement_seconds": times}, handle, indent=1)
        return 0
    print(
        f"{'setting':<8} {'route':<26} {'fit':>10} {'ops':>10} {'reads':>8} "
        f"{'held out':>10}  (refinement's torch ops and host reads)"
    )
    rows = [row for setting in args.settings for row in run(setting, args.seed, routes)]
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(
                {"settings": SETTINGS, "rows": rows, "torch": torch.__version__},
                handle,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
