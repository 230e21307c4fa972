"""Counting torch operations and host reads by stage (``utils/_device_work.py``),
and the random-start path's counts on a small fit: a regression of the host
reads (each a wait for the device on a GPU) shows here, without a GPU."""

import os

import numpy as np
import pytest

from skattn import MultiHeadAttentionRegressor, make_attention_regression
from skattn.solvers import _driver
from skattn.utils._device_work import DeviceWork, count_fit

torch = pytest.importorskip("torch")


def test_operations_and_reads_are_counted_by_stage():
    original = torch.Tensor.numpy
    with DeviceWork() as work:
        a = torch.ones(4)
        with work.stage("reads"):
            float(a.sum())  # one operation and one read
            a.numpy()  # a copy to numpy: a read, no operation
            with work.stage("inner"):
                bool(a.max() > 0)
        b = a * 2
    assert work.host_reads == {"reads": 2, "inner": 1}
    assert work.operations["reads"] >= 2 and work.operations["inner"] >= 2
    assert work.operations["other"] >= 2  # ones, mul
    assert torch.Tensor.numpy is original  # restored
    assert float(b.sum()) == 8.0  # outside: nothing counted
    assert work.summary()["total"]["host_reads"] == 3


def test_a_wrapped_function_counts_as_its_stage():
    with DeviceWork() as work:
        read = work.wrap(lambda t: t.tolist(), "listing")
        read(torch.zeros(2))
    assert work.host_reads["listing"] == 1


# Host reads of the random-start path's stages on the fit below, at most: the
# counts of 2026-11-27 with a quarter more (search 10, refinement 26, polish 13;
# before issue 49's work 464, 869 and 14: the training steps read their losses,
# the problems compared their last point, every LSMR iteration read three norms,
# heads were solved one after another, and a Cholesky factor was checked on the
# host for NaN where torch raises).  Lower them when a change removes reads; a
# change that adds reads to an inner loop fails here.
MOST_HOST_READS = {"search": 13, "refinement": 33, "polish": 17}


@pytest.mark.skipif(
    os.environ.get("SCIPY_ARRAY_API") != "1",
    reason="array_api_dispatch needs SCIPY_ARRAY_API=1 before scipy is imported",
)
def test_the_random_start_path_reads_the_host_no_more_than_before():
    X, y = make_attention_regression(
        300, 4, 6, 2, distribution="gaussian", head_rank=2, random_state=0
    )
    estimator = MultiHeadAttentionRegressor(
        n_heads=2,
        n_tokens=4,
        head_rank=2,
        init="random",
        start_search="minibatch",
        random_state=0,
    )
    stages = [
        (_driver, "minibatch_search", "search"),
        (_driver, "refine_heads", "refinement"),
        (_driver, "staged_polish", "polish"),
    ]
    estimator, work = count_fit(estimator, torch.asarray(X), torch.asarray(y), stages)
    assert _driver.minibatch_search.__name__ == "minibatch_search"  # restored
    assert not hasattr(_driver.refine_heads, "__wrapped__")
    assert estimator.phase_report_[-1].info["relative_residual"] < 1e-10
    for stage, most in MOST_HOST_READS.items():
        assert 0 < work.host_reads[stage] <= most, (stage, work.summary())
        assert work.operations[stage] > work.host_reads[stage]
    assert isinstance(estimator.attention_, torch.Tensor)
    assert np.isfinite(work.summary()["total"]["operations"])
