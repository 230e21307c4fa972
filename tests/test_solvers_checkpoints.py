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
