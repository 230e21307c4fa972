"""The helpers the stages share: rows taken in any namespace, the sequence sets a
stage grows, is judged on and takes heads from (``stages/_common.py``)."""

import numpy as np

from skattn.solvers import FactoredHeads
from skattn.solvers.stages._common import _take, _with_heads, _with_more


def test_a_restart_is_judged_on_sequences_it_did_not_use():
    from skattn.solvers.stages._common import _judged_on

    rng = np.random.default_rng(0)
    used, rows = np.arange(0, 1000, 3), np.arange(0, 1000, 9)
    judge = _judged_on(rng, 1000, used, rows)
    assert len(judge) == len(used) and not np.intersect1d(judge, used).size
    assert np.all(np.diff(judge) > 0) and judge.max() < 1000
    most = np.setdiff1d(np.arange(400), np.arange(0, 400, 5))
    # fewer others than used: all of them
    np.testing.assert_array_equal(
        _judged_on(rng, 400, most, rows), np.arange(0, 400, 5)
    )
    # a restart that used every sequence is judged on the refinement's
    np.testing.assert_array_equal(_judged_on(rng, 400, np.arange(400), rows), rows)


def test_sequence_sets_grow_sorted_and_heads_are_copied_over():
    rng = np.random.default_rng(1)
    rows = np.array([2, 5, 11, 17])
    more = _with_more(rng, 30, rows, 12)
    # the old rows and others, each once, sorted, of the size asked
    assert len(more) == 12 and np.all(np.diff(more) > 0)
    assert np.isin(rows, more).all() and more.min() >= 0 and more.max() < 30
    np.testing.assert_array_equal(_with_more(rng, 6, rows[:2], 6), np.arange(6))
    # the entries of those rows along the first axis, a None stays None
    X = np.arange(30 * 2 * 3, dtype=float).reshape(30, 2, 3)
    np.testing.assert_array_equal(_take(np, X, more), X[more])
    assert _take(np, None, more) is None
    # heads 0 and 2 of source, head 1 of params, params left as it was
    par = FactoredHeads(3, 4, 2)
    params, source = rng.normal(size=par.size), rng.normal(size=par.size)
    before = params.copy()
    mixed = _with_heads(np, par, params, source, [0, 2])
    for mine, theirs, got in zip(
        par.factors(params), par.factors(source), par.factors(mixed), strict=True
    ):
        np.testing.assert_array_equal(got[[0, 2]], theirs[[0, 2]])
        np.testing.assert_array_equal(got[1], mine[1])
    np.testing.assert_array_equal(params, before)
