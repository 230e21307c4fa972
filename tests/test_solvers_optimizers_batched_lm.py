"""The batched heads' trust-region steps (the one core's HeadBatch front): each
head solved as it would be alone (by its outcome), each stopping on its own, the
host read a few times per iteration only."""

import numpy as np
import pytest
from _helpers import array_namespaces

from skattn.layer._math import forward
from skattn.solvers.kernels._head_batch import HeadBatch
from skattn.solvers.optimizers._batched_lm import batched_least_squares
from skattn.utils._array_api import to_numpy


def _planted_heads(h=3, n=300, k=5, d=5, r=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, k, d))
    Q, K = rng.normal(size=(2, h, d, r))
    W = rng.normal(size=(h, d, r))
    targets = np.stack(
        [
            forward(X, Q[i : i + 1] @ K[i : i + 1].transpose(0, 2, 1), W[i : i + 1])
            for i in range(h)
        ],
        axis=2,
    )
    truth = np.concatenate([Q.reshape(h, -1), K.reshape(h, -1)], axis=1)
    return X, targets, truth, rng


@pytest.mark.parametrize("to", [None] + array_namespaces())
def test_every_head_converges_to_its_truth(to):
    X, targets, truth, rng = _planted_heads()
    start = truth + 0.05 * rng.normal(size=truth.shape)
    convert = (lambda a: a) if to is None else to
    problem = HeadBatch(convert(X), convert(targets), None, None)
    norms = to_numpy(problem.target_norms)
    params, coef, info = batched_least_squares(problem, convert(start), max_nfev=30)
    params = to_numpy(params)
    for i in range(3):
        assert np.sqrt(2 * info["loss"][i]) <= 1e-12 * norms[i]
        assert info["status"][i] > 0
        d, r = X.shape[2], targets.shape[3]
        Q, K = params[i, : d * r].reshape(d, r), params[i, d * r :].reshape(d, r)
        Qt, Kt = truth[i, : d * r].reshape(d, r), truth[i, d * r :].reshape(d, r)
        np.testing.assert_allclose(Q @ K.T, Qt @ Kt.T, atol=1e-9)
    # a few host reads a step: one look at the heads' flags, the CGLS checks
    assert info["host_reads"] <= 4 * max(info["n_evaluations"])


def test_the_host_waits_only_where_the_solver_says():
    # issue 63: counted as a device counts them (DeviceWork), not by the
    # solver's own tally: its reads, the preconditioner's two eigh once a
    # stage, and no error check of a factorization (cholesky_ex on the device)
    torch = pytest.importorskip("torch")
    from skattn.utils._device_work import DeviceWork

    X, targets, truth, rng = _planted_heads()
    start = truth + 0.05 * rng.normal(size=truth.shape)
    with DeviceWork() as work:
        problem = HeadBatch(torch.asarray(X), torch.asarray(targets), None, None)
        start = torch.asarray(start)  # the data's copies: not the solver's
        with work.stage("lm"):
            _, _, info = batched_least_squares(problem, start, max_nfev=30)
    assert max(info["n_evaluations"]) > 5
    assert work.host_reads["lm"] == info["host_reads"]
    assert dict(work.waits["lm"]) == {"eigh": 2}
    assert work.round_trips()["lm"] == info["host_reads"] + 2


def test_each_head_has_its_own_budget_and_stops_alone():
    X, targets, truth, rng = _planted_heads(h=3)
    start = truth + 0.05 * rng.normal(size=truth.shape)
    start[2] = truth[2]  # at its minimum: done at the first step
    problem = HeadBatch(X, targets, None, None)
    params, _, info = batched_least_squares(problem, start, max_nfev=3)
    assert max(info["n_evaluations"]) <= 3
    assert info["n_evaluations"][2] <= 2 and info["status"][2] > 0
    # a head that stopped on its budget spent all of it
    for status, spent in zip(info["status"], info["n_evaluations"], strict=True):
        assert status > 0 or spent == 3
    np.testing.assert_allclose(params[2], truth[2], atol=1e-10)
