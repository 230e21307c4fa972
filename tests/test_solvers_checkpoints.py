"""Kept stages: read back exactly, keyed by data and settings, damage detected."""

import joblib
import numpy as np
import pytest

from skattn.solvers._checkpoints import DamagedCacheError, StageMemory, data_digest


def _memory(where, key=None, X=None):
    X = np.arange(6.0).reshape(2, 3) if X is None else X
    return StageMemory(where, {"n_heads": 2} if key is None else key, (X, None))


def test_no_memory_computes_every_time():
    memory = StageMemory(None, {}, (np.ones(2),))
    assert not memory.enabled
    calls = []
    for _ in range(2):
        memory.stage("search", lambda: calls.append(1) or 1.0)
    assert len(calls) == 2 and memory.computed == ["search", "search"]


def test_stage_read_back_bit_identical(tmp_path):
    value = {"x": np.random.default_rng(0).normal(size=(4, 5)), "n": 3}
    first = _memory(tmp_path)
    first.stage("search", lambda: value)
    again = _memory(tmp_path)
    kept = again.stage("search", lambda: pytest.fail("recomputed a kept stage"))
    assert again.reused == ["search"] and again.computed == []
    assert kept["n"] == 3 and kept["x"].tobytes() == value["x"].tobytes()


def test_joblib_memory_object_is_accepted(tmp_path):
    memory = StageMemory(joblib.Memory(tmp_path, verbose=0), {}, (np.ones(2),))
    memory.stage("a", lambda: 1)
    assert (memory.folder.parent.parent == tmp_path) and memory.load("a") == (True, 1)


@pytest.mark.parametrize(
    "change",
    [
        {"key": {"n_heads": 3}},
        {"X": np.arange(6.0).reshape(2, 3) + 1e-300},
        {"X": np.arange(6.0).reshape(3, 2)},
        {"X": np.arange(6.0, dtype=np.float32).reshape(2, 3)},
    ],
)
def test_changed_data_or_settings_never_reuse(tmp_path, change):
    _memory(tmp_path).stage("search", lambda: "old")
    other = _memory(tmp_path, **change)
    assert other.stage("search", lambda: "new") == "new"
    assert other.computed == ["search"]


def test_damaged_entry_is_an_error_naming_it(tmp_path):
    memory = _memory(tmp_path)
    memory.stage("head_0", lambda: np.ones(100))
    path = memory.folder / "head_0.joblib"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DamagedCacheError, match="head_0.joblib.*Delete the folder"):
        _memory(tmp_path).stage("head_0", lambda: None)


def test_entry_without_its_digest_counts_as_not_written(tmp_path):
    memory = _memory(tmp_path)
    memory.stage("polish", lambda: 1)
    (memory.folder / "polish.sha256").unlink()  # killed between the two renames
    again = _memory(tmp_path)
    assert again.stage("polish", lambda: 2) == 2 and again.computed == ["polish"]


def test_data_digest_sees_values_dtype_and_shape():
    a = np.arange(4.0)
    assert data_digest(a) == data_digest(a.copy())
    assert data_digest(a) != data_digest(a.reshape(2, 2))
    assert data_digest(a, None) != data_digest(a)


def test_a_fit_under_another_cap_reads_the_stages_it_did_not_cut(tmp_path):
    # a fit that differs in the polish's iteration cap alone: its stages before
    # the polish are read back, a polish stage that the cap cut short is not
    # (it is gone on from), one that ended before either cap is
    old = _memory(tmp_path, {"n_heads": 2, "max_iter": 5})
    old.stage("search", lambda: "searched")
    old.stage("polish", lambda: {"stop_reason": "max_iter", "n_evaluations": 5})
    new = _memory(tmp_path, {"n_heads": 2, "max_iter": 50})
    assert new.inherited == old.folder and (new.cap, new.inherited_cap) == (50, 5)
    assert new.stage("search", lambda: pytest.fail("recomputed")) == "searched"
    polished = {"stop_reason": "gradient", "n_evaluations": 12}

    def settled(info):
        return info["stop_reason"] != "max_iter"

    assert new.stage("polish", lambda: polished, settled) == polished
    assert new.reused == ["search"] and new.continued == ["polish"]
    assert new.computed == ["polish"]
    # read back into this fit's own folder: a third run needs the other no more
    assert (new.folder / "search.joblib").exists()
    third = _memory(tmp_path, {"n_heads": 2, "max_iter": 50})
    assert third.stage("polish", lambda: pytest.fail("recomputed"), settled) == polished
    # another setting is no sibling
    assert _memory(tmp_path, {"n_heads": 3, "max_iter": 5}).inherited is None


def test_a_stage_kept_after_one_that_is_kept_again_is_computed_again(tmp_path):
    # a reorientation kept after a polish that was then kept again, to another
    # end (as a run under another cap that went on from it does), followed the
    # other polish: computed again, said as stale ("order")
    def fail():
        pytest.fail("recomputed")

    first = _memory(tmp_path, {"max_iter": 5})
    first.stage("polish", lambda: "short")
    first.stage("reorient", lambda: "after the short polish")
    second = _memory(tmp_path, {"max_iter": 5})
    second.save("polish", "longer")
    assert second.stage("polish", fail) == "longer"
    assert second.stage("reorient", lambda: "again") == "again"
    assert [(e["stage"], e["reason"]) for e in second.stale] == [("reorient", "order")]
    # a fit under another cap: its polish gone on from, to the value it had,
    # keeps the stages after it
    third = _memory(tmp_path, {"max_iter": 50})
    assert third.stage("polish", lambda: "longer", lambda value: False) == "longer"
    assert third.continued == ["polish"]
    assert third.stage("reorient", fail) == "again"
    # to another value: the other fit's later stages followed another polish
    fourth = _memory(tmp_path, {"max_iter": 500})
    fourth.stage("polish", lambda: "longest", lambda value: False)
    assert fourth.stage("reorient", lambda: "third") == "third"
