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
(``dask.array.from_zarr``) under a ``LocalCluster`` of 2 worker processes, where
phases 1-4 scan the chunks on the workers, and the same data loaded into memory
as ndarrays (the polish on the same number of examples), and reports

* ``dask s``   wall time of the dask fit (``ph1-4`` its phases 1-4);
* ``mem s``    wall time of the in-memory fit (``ph1-4`` its phases 1-4);
* ``dask-mem`` the largest absolute difference of their ``attention_`` and
               ``projection_``, ``hull d`` of their phases' estimates
               (``hull_point_`` and ``projection_sum_``).

``--no-disk-fit`` skips the fit from disk in this process (its columns are then
empty), to compare only the dask and in-memory fits.  The in-memory fit holds X
and y: ``8 * n * k * (d + d_out)`` bytes, 7.7 GB at n = 1e7.

Run (one size, about 2-4 minutes on a busy 2-core machine)::

    nice python benchmarks/bench_out_of_core.py --sizes 100000 --format zarr --dask

Dask against in memory alone, at 1e7 (X and y on disk and in memory, ~8 GB each)::

    nice python benchmarks/bench_out_of_core.py --sizes 10000000 --format zarr \
        --dask --no-disk-fit --batch-size 65536

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


def _write(path, n, seed, chunk_size):
    """Child process 1: write the dataset in chunks; print its wall time."""
    from skattn.datasets import write_attention_regression

    start = time.perf_counter()
    write_attention_regression(
        path, n, K, D, M, n_outputs=D_OUT, random_state=seed, chunk_size=chunk_size
    )
    print(json.dumps({"write_s": time.perf_counter() - start}), flush=True)


def _fit(path, n, seed, batch_size, dask_check, disk_fit=True):
    """Child process 2: fit from disk with the memory sampled; print one JSON line."""
    from skattn import MultiHeadAttentionRegressor, parameter_error
    from skattn.datasets import make_attention_regression, open_attention_regression

    # the writer plants the layer first from the seed, as make_attention_regression
    _, _, layer = make_attention_regression(
        1, K, D, M, n_outputs=D_OUT, random_state=seed, return_layer=True
    )
    X, y = open_attention_regression(path)
    params = dict(n_heads=M, n_tokens=K, random_state=seed, batch_size=batch_size)
    row = {"n": n}
    if disk_fit:
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
        row.update(
            fit_s=fit_s,
            peak_anon_mb=monitor.anon,
            peak_rss_mb=monitor.total,
            attention_error=float(errors.attention_error),
            projection_error=float(errors.projection_error),
            certified=float(selected["certified_fraction"]),
            polish_n=int(polish["n_polish_samples"]),
        )
    if dask_check:
        row.update(_dask_versus_memory(X, y, layer, params))
    print(json.dumps(row), flush=True)


def _phases_1_4_seconds(est):
    """Wall time of phases 1-4 of a fit (phase 1 and the rounds of 2-4)."""
    return sum(
        r.seconds
        for r in est.phase_report_
        if r.phase.startswith("1-") or r.phase == "2-4-hull-selected"
    )


def _dask_versus_memory(X, y, layer, params):
    """The dask fit on a LocalCluster against the in-memory fit of the same data."""
    import dask.array as da
    from distributed import Client, LocalCluster

    from skattn import MultiHeadAttentionRegressor, parameter_error

    n = X.shape[0]
    Xd, yd = da.from_zarr(X), da.from_zarr(y)  # workers read the zarr chunks
    # the polish of out-of-core data uses 100000 examples at most: the same here
    params = {**params, "polish_samples": min(n, 100_000)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with (
            LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
            ) as cluster,
            Client(cluster),
        ):
            start = time.perf_counter()
            on_dask = MultiHeadAttentionRegressor(**params).fit(Xd, yd)
            dask_s = time.perf_counter() - start
        X_mem, y_mem = np.asarray(X[:]), np.asarray(y[:])
        start = time.perf_counter()
        in_memory = MultiHeadAttentionRegressor(**params).fit(X_mem, y_mem)
        memory_s = time.perf_counter() - start
    diff = max(
        np.abs(on_dask.attention_ - in_memory.attention_).max(),
        np.abs(on_dask.projection_ - in_memory.projection_).max(),
    )
    hull_diff = max(
        np.abs(on_dask.hull_point_ - in_memory.hull_point_).max(),
        np.abs(on_dask.projection_sum_ - in_memory.projection_sum_).max(),
    )
    return {
        "dask_s": dask_s,
        "dask_phases_s": _phases_1_4_seconds(on_dask),
        "memory_s": memory_s,
        "memory_phases_s": _phases_1_4_seconds(in_memory),
        "dask_vs_memory": float(diff),
        "hull_dask_vs_memory": float(hull_diff),
        "dask_attention_error": float(parameter_error(layer, on_dask).attention_error),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--dir", default=None, help="where the datasets go")
    parser.add_argument("--format", choices=["npy", "zarr", "h5"], default="npy")
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=100_000,
        help="rows per chunk of the files written (a dask task each)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dask", action="store_true", help="also compare dask")
    parser.add_argument(
        "--no-disk-fit",
        action="store_true",
        help="with --dask: skip the fit from disk in process",
    )
    parser.add_argument("--step", choices=["write", "fit"], help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dask and args.format != "zarr":
        parser.error("--dask needs --format zarr (workers read the zarr chunks)")
    if args.no_disk_fit and not args.dask:
        parser.error("--no-disk-fit needs --dask (else nothing is fitted)")
    if args.step == "write":
        _write(args.path, args.n, args.seed, args.chunk_size)
        return
    if args.step == "fit":
        _fit(
            args.path,
            args.n,
            args.seed,
            args.batch_size,
            args.dask,
            disk_fit=not args.no_disk_fit,
        )
        return
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for n in args.sizes:
            path = Path(folder) / f"data_{n}.{args.format}"
            base = [sys.executable, __file__, "--n", str(n), "--path", str(path)]
            base += ["--seed", str(args.seed), "--batch-size", str(args.batch_size)]
            base += ["--chunk-size", str(args.chunk_size)]
            base += ["--format", args.format] + (["--dask"] if args.dask else [])
            base += ["--no-disk-fit"] if args.no_disk_fit else []
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
            f"{'polish n':>9}{'dask s':>8}{'ph1-4':>8}{'mem s':>8}{'ph1-4':>8}"
            f"{'dask-mem':>10}{'hull d':>9}"
        )
    for r in rows:
        disk = (
            f"{r['fit_s']:>9.1f}{1e6 * r['fit_s'] / r['n']:>7.0f}"
            f"{r['peak_anon_mb']:>9.0f}{r['peak_rss_mb']:>8.0f}"
            f"{r['attention_error']:>11.1e}{r['projection_error']:>10.1e}"
            f"{100 * r['certified']:>7.2f}{r['polish_n']:>9}"
            if "fit_s" in r
            else " " * 70
        )
        dask = (
            f"{r['dask_s']:>8.1f}{r['dask_phases_s']:>8.1f}{r['memory_s']:>8.1f}"
            f"{r['memory_phases_s']:>8.1f}{r['dask_vs_memory']:>10.1e}"
            f"{r['hull_dask_vs_memory']:>9.1e}"
            if "dask_s" in r
            else ""
        )
        print(f"{r['n']:>10}{r['write_s']:>9.1f}" + disk + dask, flush=True)


if __name__ == "__main__":
    main()
