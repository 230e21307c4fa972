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
