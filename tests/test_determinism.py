"""The same fit in every execution mode gives the same layer (to 1e-10).

Modes: in memory, from a memmap, from zarr, from a dask array (the phases' scans as
dask tasks), each with 1 BLAS thread here and with 2 BLAS threads in another
process (BLAS threads change the order of floating-point sums, so only rounding may
differ).
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from skattn import MultiHeadAttentionRegressor
from skattn.datasets import make_attention_regression

PARAMS = dict(n_heads=2, n_tokens=3, random_state=0, batch_size=256)
MODES = ["memory", "memmap", "zarr", "dask"]
TOL = 1e-10


def _data():
    return make_attention_regression(1500, 3, 4, 2, n_outputs=8, random_state=0)


def _source(mode, array, folder, name):
    if mode == "memory":
        return array
    if mode == "memmap":
        path = os.path.join(folder, f"{name}.npy")
        np.save(path, array)
        return np.load(path, mmap_mode="r")
    if mode == "zarr":
        import zarr

        out = zarr.open_array(
            os.path.join(folder, f"{name}.zarr"),
            mode="w",
            shape=array.shape,
            chunks=(400, array.shape[1]),
        )
        out[:] = array
        return zarr.open_array(os.path.join(folder, f"{name}.zarr"), mode="r")
    import dask.array as da

    return da.from_array(array, chunks=(400, array.shape[1]))


def _fit(mode, folder):
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = MultiHeadAttentionRegressor(**PARAMS).fit(
            _source(mode, X, folder, "X"), _source(mode, y, folder, "y")
        )
    return np.concatenate([est.attention_.ravel(), est.projection_.ravel()])


SCRIPT = """
import json, sys
from threadpoolctl import threadpool_info, threadpool_limits
sys.path.insert(0, sys.argv[1])
import test_determinism as t

with threadpool_limits(limits=2, user_api="blas"):
    threads = {p["filepath"].split("/")[-2]: p["num_threads"]
               for p in threadpool_info() if p["user_api"] == "blas"}
    layers = {mode: t._fit(mode, sys.argv[2]).tolist() for mode in t.MODES}
print(json.dumps({"threads": threads, "layers": layers}))
"""


@pytest.fixture(scope="module")
def one_thread(tmp_path_factory):
    pytest.importorskip("zarr")
    pytest.importorskip("dask.array")
    folder = str(tmp_path_factory.mktemp("one-thread"))
    with threadpool_limits(limits=1, user_api="blas"):
        return {mode: _fit(mode, folder) for mode in MODES}


def test_every_mode_gives_the_in_memory_layer(one_thread):
    for mode in MODES:
        np.testing.assert_allclose(
            one_thread[mode], one_thread["memory"], rtol=0, atol=TOL, err_msg=mode
        )


def test_two_blas_threads_give_the_same_layer(one_thread, tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "OPENBLAS_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
    }
    process = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(SCRIPT),
            os.path.dirname(__file__),
            str(tmp_path),
        ],
        capture_output=True,
        timeout=300,
        env=env,
    )
    assert process.returncode == 0, process.stderr.decode()[-3000:]
    out = json.loads(process.stdout.decode().strip().splitlines()[-1])
    # numpy's and scipy's BLAS ran with 2 threads (scs's, used by no fit here,
    # may ignore the limit)
    assert out["threads"]["numpy.libs"] == out["threads"]["scipy.libs"] == 2
    for mode in MODES:
        np.testing.assert_allclose(
            out["layers"][mode], one_thread["memory"], rtol=0, atol=TOL, err_msg=mode
        )
