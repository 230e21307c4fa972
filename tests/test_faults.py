"""Faults with real components: killed sweeps, damaged result files, data files that
change under a fit, dask workers that die mid-fit.

Each test injects one fault and checks what the user sees and that no data is lost:
the fault table of the closing note of issue 21 (and of docs/user_guide) is this
file, one test per row.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

from skattn.experiments import _sweep, recovery_sweep  # noqa: E402

_TIMEOUT = 120  # seconds any subprocess may take before the test fails

# A sweep of fast fits in another process.  KILL_AT names the moment of the Nth
# write at which the process SIGKILLs itself: "mid-write" (half of the bytes of the
# temporary file written), "before-rename" (temporary file complete and synced,
# not renamed) or "after-rename" (renamed, the folder not yet synced).
SWEEP_SCRIPT = """
import os, signal, sys
from skattn import RandomFeatureAttentionRegressor
from skattn.experiments import _sweep, recovery_sweep

output, kill_at, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
writes = {"n": 0}
real_fdopen, real_fsync, real_replace = os.fdopen, os.fsync, os.replace


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class HalfWriter:
    def __init__(self, file):
        self.file = file

    def write(self, data):
        self.file.write(data[: len(data) // 2])
        self.file.flush()
        real_fsync(self.file.fileno())
        die()

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)


def fdopen(fd, *args, **kwargs):
    writes["n"] += 1
    file = real_fdopen(fd, *args, **kwargs)
    if kill_at == "mid-write" and writes["n"] == nth:
        return HalfWriter(file)
    return file


def fsync(fd):
    real_fsync(fd)
    if kill_at == "before-rename" and writes["n"] == nth:
        die()


def replace(src, dst):
    real_replace(src, dst)
    if kill_at == "after-rename" and writes["n"] == nth:
        die()


_sweep.os.fdopen, _sweep.os.fsync, _sweep.os.replace = fdopen, fsync, replace
recovery_sweep(
    {"rf": RandomFeatureAttentionRegressor(n_heads=5)},
    n_samples=[40, 80],
    planted={"n_tokens": 2, "n_features": 3},
    seeds=list(range(6)),
    output=output,
    n_jobs=1,
    n_test=20,
    progress=False,
)
"""
N_CELLS = 12  # 2 n_samples x 6 seeds


def _learners():
    from skattn import RandomFeatureAttentionRegressor

    return {"rf": RandomFeatureAttentionRegressor(n_heads=5)}


def _sweep_again(output):
    return recovery_sweep(
        _learners(),
        n_samples=[40, 80],
        planted={"n_tokens": 2, "n_features": 3},
        seeds=list(range(6)),
        output=output,
        n_jobs=1,
        n_test=20,
        progress=False,
    )


def _run_script(tmp_path, output, kill_at="never", nth=0):
    script = tmp_path / "sweep.py"
    script.write_text(textwrap.dedent(SWEEP_SCRIPT))
    process = subprocess.run(
        [sys.executable, str(script), str(output), kill_at, str(nth)],
        timeout=_TIMEOUT,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    )
    return process


@pytest.mark.parametrize(
    "kill_at, rows_kept",
    [("mid-write", 4), ("before-rename", 4), ("after-rename", 5)],
)
def test_sweep_killed_while_writing_loses_no_row_and_redoes_none(
    tmp_path, kill_at, rows_kept
):
    output = tmp_path / "results.csv"
    process = _run_script(tmp_path, output, kill_at, nth=5)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]
    # The file the kill left is complete: every row written before the kill.
    before = _sweep._ResultFile(output).frame
    assert len(before) == rows_kept and before["cell_id"].is_unique
    assert len(pd.read_csv(output)) == rows_kept  # readable by anyone
    results = _sweep_again(output)
    assert results.attrs["n_fitted"] == N_CELLS - rows_kept  # none computed twice
    on_disk = pd.read_csv(output, keep_default_na=False, na_values=[""])
    assert len(on_disk) == N_CELLS and on_disk["cell_id"].is_unique
    assert set(results["status"]) == {"ok"}
    # The rows finished before the kill are untouched (same fit_seconds: not redone).
    kept = on_disk.set_index("cell_id").loc[before["cell_id"]].reset_index()
    pd.testing.assert_frame_equal(kept, before, check_dtype=False)


def test_result_file_is_complete_at_every_moment(tmp_path):
    # A reader polls the file while a sweep writes it: every read is a complete
    # sweep file, and the number of rows never goes down.
    output = tmp_path / "results.csv"
    script = tmp_path / "sweep.py"
    script.write_text(textwrap.dedent(SWEEP_SCRIPT))
    process = subprocess.Popen(
        [sys.executable, str(script), str(output), "never", "0"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    )
    counts = []
    try:
        deadline = time.monotonic() + _TIMEOUT
        while process.poll() is None and time.monotonic() < deadline:
            if output.exists():
                counts.append(len(_sweep._ResultFile(output).frame))
    finally:
        process.kill()
        process.wait(timeout=_TIMEOUT)
    counts.append(len(_sweep._ResultFile(output).frame))
    assert counts[-1] == N_CELLS
    assert np.all(np.diff(counts) >= 0)
    assert len(set(counts)) > 2  # the reads did overlap the writes


def _damage(path, how):
    data = path.read_bytes()
    if how == "cut mid-row":
        path.write_bytes(data[: len(data) - 7])
    elif how == "cut inside a quoted field":
        # cell keys are quoted JSON: cut the last one after its opening quote
        path.write_bytes(data[: data.rindex(b'\n"{') + 3] + b"\n")
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif how == "foreign table":
        path.write_text("cell_id,learner,status\nx,y,z\n")
    elif how == "damaged row":
        frame = pd.read_csv(path)
        frame.loc[1, "status"] = "running"
        frame.to_csv(path, index=False)
    elif how == "cut parquet":
        path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "suffix, how, match",
    [
        (".csv", "cut mid-row", "cut short"),
        (".csv", "cut inside a quoted field", "cannot be read as csv"),
        (".csv", "emptied", "is empty"),
        (".csv", "random bytes", "cannot be read|cut short"),
        (".csv", "foreign table", r"has no column\(s\) \[.estimator."),
        (".csv", "damaged row", "damaged row 3"),
        (".parquet", "cut parquet", "cannot be read as parquet"),
        (".parquet", "random bytes", "cannot be read as parquet"),
    ],
)
def test_a_damaged_result_file_is_an_error_that_names_it(tmp_path, suffix, how, match):
    output = tmp_path / f"results{suffix}"
    recovery_sweep(
        _learners(),
        n_samples=[40],
        planted={"n_tokens": 2, "n_features": 3},
        seeds=[0, 1, 2],
        output=output,
        n_jobs=1,
        n_test=20,
        progress=False,
    )
    _damage(output, how)
    damaged = output.read_bytes()
    with pytest.raises(ValueError, match=f"output='{output}' exists but") as info:
        _sweep_again(output)
    assert info.match(match)
    assert output.read_bytes() == damaged  # nothing repaired or overwritten


# -- data files that change or vanish during a fit --------------------------------

from skattn import (  # noqa: E402
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
)
from skattn.datasets import make_attention_regression  # noqa: E402
from skattn.utils import _batches  # noqa: E402
from skattn.utils._batches import SourceChangedError  # noqa: E402

PHASED = dict(n_heads=2, n_tokens=3, random_state=0, batch_size=256)


@pytest.fixture(scope="module")
def planted():
    return make_attention_regression(
        2000, 3, 4, 2, n_outputs=8, random_state=0, return_layer=True
    )


def _write_memmap(path, array):
    out = np.lib.format.open_memmap(path, "w+", "f8", array.shape)
    out[:] = array
    out.flush()
    del out
    return np.load(path, mmap_mode="r")


def _write_zarr(path, array, chunks=250):
    zarr = pytest.importorskip("zarr")
    out = zarr.open_array(
        str(path), mode="w", shape=array.shape, chunks=(chunks, array.shape[1])
    )
    out[:] = array
    return zarr.open_array(str(path), mode="r")


def _memmap_fault(path, how):
    if how == "overwritten":  # same size, other values
        data = np.load(path, mmap_mode="r+")
        data[:] = -data
        data.flush()
        del data
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "deleted":
        os.unlink(path)
    elif how == "replaced":  # a new file under the same name
        data = np.load(path)
        os.unlink(path)
        np.save(path, data)


def _zarr_fault(path, how):
    import shutil

    chunk = next(p for p in sorted(path.rglob("*")) if p.is_file() and "c" in p.parts)
    if how == "chunk rewritten":
        zarr = pytest.importorskip("zarr")
        data = zarr.open_array(str(path), mode="r+")
        data[:250] = 0.5
    elif how == "chunk deleted":  # zarr reads a missing chunk as its fill value
        chunk.unlink()
    elif how == "folder deleted":
        shutil.rmtree(path)


def _inject_after_reads(monkeypatch, n_reads, fault):
    """Run ``fault()`` once, after the ``n_reads``-th read of a TokenBatches."""
    original = _batches.TokenBatches._getitem
    count = {"reads": 0}

    def reading(self, key):
        rows = original(self, key)
        count["reads"] += 1
        if count["reads"] == n_reads:
            fault()
        return rows

    monkeypatch.setattr(_batches.TokenBatches, "_getitem", reading)
    return count


@pytest.mark.parametrize("how", ["overwritten", "truncated", "deleted", "replaced"])
def test_memmap_that_changes_mid_fit_is_a_clear_error(
    tmp_path, planted, monkeypatch, how
):
    X, y, _ = planted
    X_mm = _write_memmap(tmp_path / "X.npy", X)
    y_mm = _write_memmap(tmp_path / "y.npy", y)
    X_before = X.copy()
    count = _inject_after_reads(
        monkeypatch, 20, lambda: _memmap_fault(tmp_path / "X.npy", how)
    )
    with pytest.raises(SourceChangedError, match=f"X's file '{tmp_path / 'X.npy'}'"):
        MultiHeadAttentionRegressor(**PHASED).fit(X_mm, y_mm)
    assert count["reads"] >= 20  # the fault happened mid-fit, after the validation
    np.testing.assert_array_equal(X, X_before)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("how", ["chunk rewritten", "chunk deleted", "folder deleted"])
@pytest.mark.parametrize("learner", ["phased", "gradient"])
def test_zarr_that_changes_mid_fit_is_a_clear_error(
    tmp_path, planted, monkeypatch, how, learner
):
    X, y, _ = planted
    X_z = _write_zarr(tmp_path / "X.zarr", X)
    y_z = _write_zarr(tmp_path / "y.zarr", y)
    est = (
        MultiHeadAttentionRegressor(**PHASED)
        if learner == "phased"
        else GradientAttentionRegressor(n_heads=2, n_tokens=3, max_iter=5)
    )
    fault = lambda: _zarr_fault(tmp_path / "X.zarr", how)  # noqa: E731
    _inject_after_reads(monkeypatch, 12, fault)
    what = "deleted" if how == "folder deleted" else "modified"
    with pytest.raises(SourceChangedError, match=f"X's folder .*X.zarr' was {what}"):
        est.fit(X_z, y_z)


def test_unchanged_files_fit_as_before(tmp_path, planted):
    # The checks do not change a fit whose files stay as they are.
    X, y, _ = planted
    in_memory = MultiHeadAttentionRegressor(**PHASED).fit(X, y)
    for source in (_write_memmap, _write_zarr):
        est = MultiHeadAttentionRegressor(**PHASED).fit(
            source(tmp_path / f"X{source.__name__}", X),
            source(tmp_path / f"y{source.__name__}", y),
        )
        np.testing.assert_allclose(est.attention_, in_memory.attention_, atol=1e-10)


# -- a dask worker killed during phases 1-4 ----------------------------------------

# The fit runs in another process (a hang cannot outlive the timeout) with a real
# LocalCluster of 2 worker processes.  X's chunks pass through die_when_armed, which
# SIGKILLs the worker running it once the ARM_AT-th dask scan of the fit has begun:
# once ("once": dask recomputes the lost chunks elsewhere) or every time ("always":
# every worker that tries dies).
DASK_SCRIPT = """
import json, os, signal, sys, warnings

import numpy as np

warnings.simplefilter("ignore")
tmp, arm_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
armed, fired = os.path.join(tmp, "armed"), os.path.join(tmp, "fired")


def die_when_armed(block):
    if os.path.exists(armed):
        if mode == "always":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            os.close(os.open(fired, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return block
        os.kill(os.getpid(), signal.SIGKILL)
    return block


if __name__ == "__main__":
    import dask
    import dask.array as da
    from distributed import Client, LocalCluster

    from skattn import MultiHeadAttentionRegressor
    from skattn.utils import _batches
    from skattn.datasets import make_attention_regression

    X, y = make_attention_regression(2000, 3, 4, 2, n_outputs=8, random_state=0)
    params = dict(n_heads=2, n_tokens=3, random_state=0, batch_size=256)
    in_memory = MultiHeadAttentionRegressor(**params).fit(X, y)
    scans = []
    original = _batches._dask_map_reduce

    def arming(*args):
        scans.append(args[-1])
        if len(scans) == arm_at:
            open(armed, "w").close()
        return original(*args)

    _batches._dask_map_reduce = arming
    config = {"distributed.scheduler.allowed-failures": 2}
    with dask.config.set(config):
        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, dashboard_address=None
        )
        client = Client(cluster)
        Xd = da.from_array(X, chunks=(500, 12)).map_blocks(die_when_armed)
        yd = da.from_array(y, chunks=(500, 24))
        try:
            est = MultiHeadAttentionRegressor(**params).fit(Xd, yd)
            diff = max(
                float(np.abs(est.attention_ - in_memory.attention_).max()),
                float(np.abs(est.projection_ - in_memory.projection_).max()),
            )
            out = {"fitted": True, "diff": diff}
        except Exception as exc:
            notes = " ".join(getattr(exc, "__notes__", []))
            out = {"fitted": False, "error": f"{type(exc).__name__}: {exc} {notes}"}
        # closing races a nanny still restarting a killed worker ("can only join a
        # started process", distributed's own assertion, seen once on a loaded
        # machine): recorded, but it says nothing about the fit
        try:
            client.close()
            cluster.close()
            out["teardown"] = None
        except Exception as exc:
            out["teardown"] = f"{type(exc).__name__}: {exc}"
    out.update(fired=os.path.exists(fired), scans=scans)
    print(json.dumps(out))
"""


def _fit_on_a_cluster_killing_a_worker(tmp_path, arm_at, mode):
    import json

    pytest.importorskip("distributed")
    script = tmp_path / "dask_fit.py"
    script.write_text(textwrap.dedent(DASK_SCRIPT))
    process = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(arm_at), mode],
        timeout=_TIMEOUT,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    )
    assert process.returncode == 0, process.stderr.decode()[-3000:]
    return json.loads(process.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("arm_at", [1, 4])  # phase 1's token sums; phase 2's scan
def test_dask_worker_killed_mid_fit_gives_the_same_layer(tmp_path, arm_at):
    out = _fit_on_a_cluster_killing_a_worker(tmp_path, arm_at, "once")
    assert out["fired"]  # a worker did die, during the scan armed
    assert out["scans"][0] == "skattn-token-sums"
    assert out["scans"][arm_at - 1] in ("skattn-token-sums", "skattn-certify")
    assert out["fitted"], out.get("error")
    assert out["diff"] <= 1e-10  # dask recomputed the lost chunks: the same layer


def test_dask_workers_that_keep_dying_are_a_clear_error(tmp_path):
    out = _fit_on_a_cluster_killing_a_worker(tmp_path, 4, "always")
    assert not out["fitted"]
    assert out["error"].startswith("KilledWorker")
    # dask names a task that was running on every worker that died: one of X's
    # (die_when_armed) or, when the dying worker was also loading it, one of y's
    # chunks (seen once on a loaded machine: "('array-5decae...', 3, 0)")
    assert "Attempted to run task ('array-" in out["error"]
    assert "the dask scan 'skattn-certify'" in out["error"]  # skattn, the scan
