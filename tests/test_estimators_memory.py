"""``memory=``: a fit killed at any stage resumes after its last finished stage.

Each fault is real: a child process fits with ``memory`` and is SIGKILLed (by
itself, from inside the stage named) during the search, during the per-head
refinement or during the polish; the fit is then run again here, with the same
arguments, and must give the layer of an uninterrupted fit, bit for bit, without
computing again the stages that had finished.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from _helpers import refine_planted

from skattn import MultiHeadAttentionRegressor, make_attention_regression
from skattn.solvers import _checkpoints
from skattn.solvers._checkpoints import DamagedCacheError

PARAMS = dict(
    n_heads=3,
    head_rank=2,
    n_tokens=6,
    init="random",
    start_search="minibatch",
    fit_intercept=False,
    n_restarts=1,
    random_state=0,
)


# no search: the polish starts from a random point and takes many iterations
POLISH_PARAMS = {**PARAMS, "start_search": "none"}


def _data():
    X, Y = refine_planted(2000, 6, 12, 3, 2, 12, seed=1, intercept=False)[:2]
    return X.reshape(len(X), -1), Y.reshape(len(Y), -1)


def _stages(estimator):
    report = next(r for r in estimator.phase_report_ if r.phase == "6-polish")
    return report.info["memory"]


# the child: fits with memory, killing itself inside the stage named by argv[2]
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import test_estimators_memory as t
    from skattn.solvers import _checkpoints
    from skattn.solvers.optimizers import _lm_matrix_free, _trf
    from skattn.solvers.stages import _rounds
    from skattn.solvers import _driver

    where, stage = sys.argv[1], sys.argv[2]
    _checkpoints.ITERATE_INTERVAL = 0.0  # keep every iterate of the polish

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "search":  # the search ran, before it was kept
        search = _driver.minibatch_search
        def killed(*args, **kwargs):
            search(*args, **kwargs)
            die()
        _driver.minibatch_search = killed
    elif stage == "refinement":  # after two heads' problems, mid-refinement
        solve = _rounds._solve_head
        import threading
        calls, lock = [], threading.Lock()
        def killed(*args, **kwargs):
            solved = solve(*args, **kwargs)  # kept before it returns
            with lock:  # heads may be solved in threads: one of them kills
                calls.append(1)
                if len(calls) == 2:
                    die()
            return solved
        _rounds._solve_head = killed
    else:  # the polish, after its fifth kept iterate
        trf = _lm_matrix_free.trf
        n = []
        def killed(*args, callback=None, **kwargs):
            def dying(result):
                if callback is not None:
                    callback(result)
                n.append(1)
                if len(n) == 5:
                    die()
            return trf(*args, callback=dying, **kwargs)
        _lm_matrix_free.trf = killed
    X, y = t._data()
    params = t.POLISH_PARAMS if stage == "polish" else t.PARAMS
    t.MultiHeadAttentionRegressor(memory=where, **params).fit(X, y)
    """
)


@pytest.fixture(scope="module")
def uninterrupted():
    X, y = _data()
    return {
        "search": MultiHeadAttentionRegressor(**PARAMS).fit(X, y),
        "polish": MultiHeadAttentionRegressor(**POLISH_PARAMS).fit(X, y),
    }


def _kill_during(where, stage):
    code = CHILD.format(tests=str(Path(__file__).parent))
    # the same BLAS threads as this process: a product's last bits depend on them
    env = dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-c", code, str(where), stage],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]


def _same_layer(a, b):
    for name in ("attention_", "projection_", "key_bias_", "intercept_"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


@pytest.mark.parametrize(
    "stage, finished",
    [
        ("search", []),
        ("refinement", ["search-1"]),
        ("polish", []),
    ],
)
def test_killed_fit_resumes_to_the_uninterrupted_layer(
    tmp_path, uninterrupted, stage, finished
):
    params = POLISH_PARAMS if stage == "polish" else PARAMS
    reference = uninterrupted["polish" if stage == "polish" else "search"]
    _kill_during(tmp_path, stage)
    X, y = _data()
    start = time.perf_counter()
    resumed = MultiHeadAttentionRegressor(memory=str(tmp_path), **params).fit(X, y)
    seconds = time.perf_counter() - start
    _same_layer(resumed, reference)
    memory = _stages(resumed)
    # the finished stages are read back, not computed again
    for name in finished:
        assert name in memory["reused"] and name not in memory["computed"]
    if stage == "refinement":  # heads' solves had finished, not the stage
        # (two or more: with two threads another head may finish meanwhile)
        assert sum(".head" in name for name in memory["reused"]) >= 2
        assert "refine-1" in memory["computed"]
    if stage == "polish":  # it went on from a kept iterate
        assert any(name.endswith("iterate") for name in memory["reused"])
    # and a third fit computes nothing
    again = MultiHeadAttentionRegressor(memory=str(tmp_path), **params).fit(X, y)
    _same_layer(again, reference)
    assert _stages(again)["computed"] == []
    print(f"{stage}: reused {memory['reused']}, rerun {seconds:.2f} s")


def test_changed_data_or_parameter_reuses_nothing(tmp_path):
    X, y = _data()
    MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    X2 = X.copy()
    X2[0, 0] += 1e-9
    changed_x = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS)
    assert _stages(changed_x.fit(X2, y))["reused"] == []
    changed_param = MultiHeadAttentionRegressor(
        memory=str(tmp_path), **{**PARAMS, "polish_tol": 1e-9}
    )
    assert _stages(changed_param.fit(X, y))["reused"] == []
    other_seed = MultiHeadAttentionRegressor(
        memory=str(tmp_path), **{**PARAMS, "random_state": 1}
    )
    assert _stages(other_seed.fit(X, y))["reused"] == []


def test_stages_kept_by_another_version_are_computed_again_and_said(
    tmp_path, monkeypatch
):
    # a folder written by "0.0.1" (as an older skattn would): the same fit under
    # this version finds every entry, reuses none, says so in phase_report_, and
    # replaces them, so that a third fit reuses all
    X, y = _data()
    monkeypatch.setattr(_checkpoints, "__version__", "0.0.1")
    old = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    monkeypatch.undo()
    kept = _stages(old)["computed"]
    assert kept and _stages(old)["stale"] == []
    new = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    memory = _stages(new)
    assert memory["folder"] == _stages(old)["folder"]
    assert memory["reused"] == []
    assert {entry["stage"] for entry in memory["stale"]} >= set(kept) - {
        name for name in kept if name.endswith("iterate")
    }
    assert {entry["written_by"] for entry in memory["stale"]} == {"0.0.1"}
    assert "another skattn version" in memory["note"] and "0.0.1" in memory["note"]
    _same_layer(new, old)
    third = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    assert _stages(third)["computed"] == [] and _stages(third)["stale"] == []
    assert "note" not in _stages(third)


def test_a_stage_of_another_schema_is_computed_again(tmp_path, monkeypatch):
    # the polish's schema raised (what it keeps changed): the search and the
    # refinement are reused, the polish computed again
    X, y = _data()
    MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    written = _checkpoints.SCHEMAS["polish"]
    monkeypatch.setitem(_checkpoints.SCHEMAS, "polish", 99)
    again = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    memory = _stages(again)
    assert "search-1" in memory["reused"] and "polish-1" in memory["computed"]
    assert [entry["stage"] for entry in memory["stale"]] == ["polish-1"]
    assert memory["stale"][0]["schema"] == written


def test_damaged_entry_is_an_error_naming_it(tmp_path):
    X, y = _data()
    first = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    entry = Path(_stages(first)["folder"]) / "search-1.joblib"
    raw = bytearray(entry.read_bytes())
    raw[-20] ^= 0xFF
    entry.write_bytes(bytes(raw))
    estimator = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS)
    with pytest.raises(DamagedCacheError, match="search-1.joblib"):
        estimator.fit(X, y)
    assert not hasattr(estimator, "attention_")


def test_ctrl_c_leaves_the_estimator_unfitted_and_says_how_to_resume(
    tmp_path, monkeypatch
):
    from skattn.solvers.stages import _rounds

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_rounds, "_solve_head", interrupted)
    X, y = _data()
    estimator = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS)
    with pytest.raises(KeyboardInterrupt, match="fit again with the same data"):
        estimator.fit(X, y)
    assert not hasattr(estimator, "attention_")
    with pytest.raises(KeyboardInterrupt, match="Pass memory="):
        MultiHeadAttentionRegressor(**PARAMS).fit(X, y)
    monkeypatch.undo()
    resumed = MultiHeadAttentionRegressor(memory=str(tmp_path), **PARAMS).fit(X, y)
    assert "search-1" in _stages(resumed)["reused"]


def test_memory_without_an_int_seed_warns_and_promises_no_resume(tmp_path, monkeypatch):
    # random_state=None draws other starts at every fit: nothing kept can be
    # reused, and the fit says so at once; interrupted, it promises no resume
    from skattn.solvers.stages import _rounds

    X, y = _data()
    params = {**PARAMS, "random_state": None}
    with pytest.warns(UserWarning, match="computes everything anew"):
        first = MultiHeadAttentionRegressor(memory=str(tmp_path), **params).fit(X, y)
    with pytest.warns(UserWarning, match="Pass an int random_state"):
        again = MultiHeadAttentionRegressor(memory=str(tmp_path), **params).fit(X, y)
    assert _stages(again)["reused"] == [] and _stages(first)["computed"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_rounds, "_solve_head", interrupted)
    estimator = MultiHeadAttentionRegressor(memory=str(tmp_path), **params)
    with (
        pytest.warns(UserWarning),
        pytest.raises(KeyboardInterrupt, match="cannot resume") as caught,
    ):
        estimator.fit(X, y)
    assert "fit again with the same data" not in str(caught.value)


def test_memory_parameter_is_validated():
    X, y = _data()
    with pytest.raises(ValueError, match="memory"):
        MultiHeadAttentionRegressor(memory=3, **PARAMS).fit(X, y)


def test_a_whitening_that_rounds_otherwise_still_resumes(tmp_path, monkeypatch):
    # the kept stages are keyed by the tokens as given: a second run whose
    # whitening map rounds otherwise (another number of BLAS threads) reads
    # every stage back (keyed by the whitened tokens, it recomputed them all)
    import skattn.solvers._driver as driver_module

    X, y = make_attention_regression(
        2000, 4, 8, 2, head_rank=2, distribution="gaussian", random_state=0
    )
    X = (X.reshape(2000, 4, 8) * np.logspace(-1, 1, 8)).reshape(2000, -1)

    def learner():
        return MultiHeadAttentionRegressor(
            n_heads=2,
            n_tokens=4,
            head_rank=2,
            init="random",
            random_state=0,
            input_distribution="gaussian",
            memory=str(tmp_path),
        )

    first = learner().fit(X, y)
    assert first.phase_report_[-1].info["whitening"]["applied"]
    whiten = driver_module._whiten

    def rounded(X, sample_weight, option):
        _, A, record = whiten(X, sample_weight, option)
        A = A * (1 + 4e-16)
        return X @ A, A, record

    monkeypatch.setattr(driver_module, "_whiten", rounded)
    again = learner().fit(X, y)
    kept = again.phase_report_[-1].info["memory"]
    assert kept["computed"] == [] and len(kept["reused"]) > 0


def test_a_raised_polish_max_iter_goes_on_from_the_kept_stages(
    tmp_path, uninterrupted, monkeypatch
):
    # the fit the ConvergenceWarning asks for: polish_max_iter raised after a
    # polish cut short.  The kept stages are read back from the first fit's
    # folder (the polish gone on from its kept iterates), and the layer is the
    # uninterrupted fit's under the raised cap, bit for bit
    from sklearn.exceptions import ConvergenceWarning

    monkeypatch.setattr(_checkpoints, "ITERATE_INTERVAL", 0.0)
    X, y = _data()
    short = {**POLISH_PARAMS, "polish_max_iter": 5}
    with pytest.warns(ConvergenceWarning, match="polish_max_iter"):
        MultiHeadAttentionRegressor(memory=str(tmp_path), **short).fit(X, y)
    raised = MultiHeadAttentionRegressor(memory=str(tmp_path), **POLISH_PARAMS)
    memory = _stages(raised.fit(X, y))
    _same_layer(raised, uninterrupted["polish"])
    assert memory["inherited"] is not None and memory["inherited"] != memory["folder"]
    assert "polish-1" in memory["continued"]
    assert any(name.endswith("iterate") for name in memory["reused"])
    # lowered again: the layer of a fit under that cap alone
    lowered = MultiHeadAttentionRegressor(memory=str(tmp_path), **short)
    with pytest.warns(ConvergenceWarning):
        lowered.fit(X, y)
    with pytest.warns(ConvergenceWarning):
        alone = MultiHeadAttentionRegressor(**short).fit(X, y)
    _same_layer(lowered, alone)
