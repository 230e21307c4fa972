"""Negligible and duplicate heads (skattn/metrics/_redundancy.py)."""

import numpy as np
import pytest

import skattn.diagnostics
from skattn.layer._math import forward
from skattn.metrics._redundancy import head_redundancy


@pytest.fixture(scope="module")
def X():
    return np.random.default_rng(0).normal(size=(300, 3, 4))


def test_is_the_public_diagnostic():
    assert skattn.diagnostics.head_redundancy is head_redundancy


def test_distinct_heads_are_needed(X):
    rng = np.random.default_rng(1)
    th, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 6))
    redundant, notes, drop, share = head_redundancy(X, forward(X, th, W), th, W, 1e-6)
    assert redundant == () and notes == ("", "")
    assert np.all(drop > 1e-3) and np.all(share > 0.1)


def test_negligible_and_duplicate_heads(X):
    rng = np.random.default_rng(2)
    th = rng.normal(size=(3, 4, 4))
    th[2] = th[0]  # head 2 duplicates head 0
    W = rng.normal(size=(3, 4, 6))
    W[1] = 0.0  # head 1 contributes nothing
    redundant, notes, drop, share = head_redundancy(X, forward(X, th, W), th, W, 1e-6)
    assert redundant == (0, 1, 2)
    assert notes == ("duplicate of head 2", "negligible", "duplicate of head 0")
    assert share[1] == 0.0 and np.all(drop < 1e-6)


def test_one_head_is_never_redundant(X):
    rng = np.random.default_rng(3)
    th, W = rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 4, 2))
    redundant, notes, drop, share = head_redundancy(X, forward(X, th, W), th, W, 1e-6)
    assert redundant == () and notes == ("",)
    assert drop.tolist() == [np.inf] and share == pytest.approx([1.0])
