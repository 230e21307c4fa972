"""Out-of-core fits: time, peak memory and recovery against n, data on disk.

For each n it writes a planted dataset (d=8, k=4, m=2, d_out=16, Boolean inputs)
with ``write_attention_regression`` in chunks (one child process), then fits
``MultiHeadAttentionRegressor`` on the arrays opened from disk (another child
process, so that its memory is the fit's alone).
It reports, per n:

* ``write s``  wall time of writing the dataset;
* ``fit s``    wall time of the fit from disk, and ``us/ex`` per example;
* ``anon MB``  peak anonymous resident memory of the fitting process (what it
               holds, imports included), sampled every 50 ms;
* ``rss MB``   peak total resident memory, which also counts the file pages a
               memmap maps (page cache the kernel evicts under pressure);
* ``Theta err``, ``W err`` head-matched relative parameter errors;
* ``cert%``    certified rows of the hull the phases kept;
* ``polish n`` examples the in-memory polish used (100000 at most by default).

``--dask`` (with ``--format zarr``) also fits the same files as dask arrays
(``dask.array.from_zarr``) under a ``LocalCluster`` of 2 workers, and in memory,
and reports the dask fit's time and the largest difference of the two layers.

Run (one size, about 2-4 minutes on a busy 2-core machine)::

    nice python benchmarks/bench_out_of_core.py --sizes 100000 --format zarr --dask

The issue's sizes are ``--sizes 100000 1000000 10000000`` (10^7 needs 7.7 GB of
disk in ``--dir`` and hours on 2 shared cores).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np

D, K, M, D_OUT = 8, 4, 2, 16


def _status_mb(field):
    """A memory field of /proc/self/status (Linux), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _PeakMemory(threading.Thread):
    """Samples the resident memory every 50 ms: anonymous (what the process holds)
    and total (which also counts the file pages of a memmap, evictable cache)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.anon = self.total = 0.0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.05):
            self.anon = max(self.anon, _status_mb("RssAnon"))
            self.total = max(self.total, _status_mb("VmRSS"))


def _write(path, n, seed):
    """Child process 1: write the dataset in chunks; print its wall time."""
    from skattn.datasets import write_attention_regression

    start = time.perf_counter()
    write_attention_regression(path, n, K, D, M, n_outputs=D_OUT, random_state=seed)
    print(json.dumps({"write_s": time.perf_counter() - start}), flush=True)


def _fit(path, n, seed, batch_size, dask_check):
    """Child process 2: fit from disk with the memory sampled; print one JSON line."""
    from skattn import MultiHeadAttentionRegressor, parameter_error
    from skattn.datasets import make_attention_regression, open_attention_regression

    # the writer plants the layer first from the seed, as make_attention_regression
    _, _, layer = make_attention_regression(
        1, K, D, M, n_outputs=D_OUT, random_state=seed, return_layer=True
    )
    X, y = open_attention_regression(path)
    params = dict(n_heads=M, n_tokens=K, random_state=seed, batch_size=batch_size)
    monitor = _PeakMemory()
    monitor.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        est = MultiHeadAttentionRegressor(**params, verbose=1).fit(X, y)
        fit_s = time.perf_counter() - start
    monitor.stop.set()
    monitor.join()
    errors = parameter_error(layer, est)
    selected = [r for r in est.phase_report_ if r.phase == "2-4-hull-selected"][0]
    polish = [r for r in est.phase_report_ if r.phase == "6-polish"][0]
    row = {
        "n": n,
        "fit_s": fit_s,
        "peak_anon_mb": monitor.anon,
        "peak_rss_mb": monitor.total,
        "attention_error": float(errors.attention_error),
        "projection_error": float(errors.projection_error),
        "certified": float(selected["certified_fraction"]),
        "polish_n": int(polish["n_polish_samples"]),
    }
    if dask_check:
        row.update(_dask_versus_memory(X, y, est, params))
    print(json.dumps(row), flush=True)


def _dask_versus_memory(X, y, est, params):
    import dask.array as da
    from distributed import Client, LocalCluster

    from skattn import MultiHeadAttentionRegressor

    Xd, yd = da.from_zarr(X), da.from_zarr(y)  # workers read the zarr chunks
    polish = [r for r in est.phase_report_ if r.phase == "6-polish"][0]
    params = {**params, "polish_samples": polish["n_polish_samples"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, dashboard_address=None
            ) as cluster,
            Client(cluster),
        ):
            start = time.perf_counter()
            on_dask = MultiHeadAttentionRegressor(**params).fit(Xd, yd)
            dask_s = time.perf_counter() - start
        in_memory = MultiHeadAttentionRegressor(**params).fit(np.asarray(X), y[:])
    diff = max(
        np.abs(on_dask.attention_ - in_memory.attention_).max(),
        np.abs(on_dask.projection_ - in_memory.projection_).max(),
    )
    return {"dask_s": dask_s, "dask_vs_memory": float(diff)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--dir", default=None, help="where the datasets go")
    parser.add_argument("--format", choices=["npy", "zarr", "h5"], default="npy")
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dask", action="store_true", help="also compare dask")
    parser.add_argument("--step", choices=["write", "fit"], help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dask and args.format != "zarr":
        parser.error("--dask needs --format zarr (workers read the zarr chunks)")
    if args.step == "write":
        _write(args.path, args.n, args.seed)
        return
    if args.step == "fit":
        _fit(args.path, args.n, args.seed, args.batch_size, args.dask)
        return
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for n in args.sizes:
            path = Path(folder) / f"data_{n}.{args.format}"
            base = [sys.executable, __file__, "--n", str(n), "--path", str(path)]
            base += ["--seed", str(args.seed), "--batch-size", str(args.batch_size)]
            base += ["--format", args.format] + (["--dask"] if args.dask else [])
            row = {}
            for step in ("write", "fit"):  # separate processes: separate peaks
                out = subprocess.run(
                    [*base, "--step", step], stdout=subprocess.PIPE, text=True
                )
                if out.returncode:
                    raise SystemExit(f"the {step} step for n={n} failed")
                row.update(json.loads(out.stdout.strip().splitlines()[-1]))
            rows.append(row)
            _print(rows[-1:], header=len(rows) == 1)
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _print(rows, header):
    if header:
        print(
            f"{'n':>10}{'write s':>9}{'fit s':>9}{'us/ex':>7}{'anon MB':>9}"
            f"{'rss MB':>8}{'Theta err':>11}{'W err':>10}{'cert%':>7}"
            f"{'polish n':>9}{'dask s':>8}{'dask-mem':>10}"
        )
    for r in rows:
        dask = (
            f"{r['dask_s']:>8.1f}{r['dask_vs_memory']:>10.1e}" if "dask_s" in r else ""
        )
        print(
            f"{r['n']:>10}{r['write_s']:>9.1f}{r['fit_s']:>9.1f}"
            f"{1e6 * r['fit_s'] / r['n']:>7.0f}{r['peak_anon_mb']:>9.0f}"
            f"{r['peak_rss_mb']:>8.0f}"
            f"{r['attention_error']:>11.1e}{r['projection_error']:>10.1e}"
            f"{100 * r['certified']:>7.2f}{r['polish_n']:>9}" + dask,
            flush=True,
        )


if __name__ == "__main__":
    main()
