"""The random-start path as it runs: ``fit_from_random_starts`` (``_driver.py``)."""

import numpy as np
import pytest
from _helpers import (
    factored_planted,
    fail_problems,
    nudged,
    planted,
    refine_planted,
    search_planted,
)

from skattn.layer._math import forward
from skattn.solvers import PolishOptions, RandomStartOptions, fit_from_random_starts


def test_polish_low_rank_from_random_starts():
    X, Y, attention, projection = planted(600, 4, 8, 2, 8, rank=2, seed=8)
    th, W, info = fit_from_random_starts(
        X, Y, 2, n_warmup_samples=300, random_state=0, polish=PolishOptions(head_rank=2)
    )
    assert info["solver"] == "matrix-free"
    assert info["relative_residual"] < 1e-10
    order = np.argsort([np.linalg.norm(t - attention[0]) for t in th])
    np.testing.assert_allclose(th[order], attention, atol=1e-8)
    np.testing.assert_allclose(W[order], projection, atol=1e-8)
    assert np.linalg.matrix_rank(th[0], tol=1e-8) == 2


def test_random_starts_with_factored_values_recover_a_planted_layer():
    X, Y, truth = factored_planted(400, 4, 5, 2, 2, 12, seed=3, intercept=True)
    attention, projection, info = fit_from_random_starts(
        X,
        Y,
        2,
        random_state=0,
        polish=PolishOptions(head_rank=2, factor_values=True, intercept=True),
    )
    assert info["stages"][0]["factored_values"]
    assert info["relative_residual"] < 1e-10
    np.testing.assert_allclose(forward(X, attention, projection), Y, atol=1e-9)


def test_random_starts_with_the_search_recover_a_planted_layer():
    X, Y, truth = search_planted(600, 4, 6, 2, 2, 10, seed=6, intercept=True)
    attention, projection, info = fit_from_random_starts(
        X,
        Y,
        2,
        random_state=0,
        polish=PolishOptions(head_rank=2, factor_values=True, intercept=True),
        starts=RandomStartOptions(start_search="minibatch"),
    )
    assert info["start_search"]["n_steps"] > 0
    assert info["start_search"]["residual"] < info["start_search"]["residuals"][0]
    assert info["relative_residual"] < 1e-10
    np.testing.assert_allclose(forward(X, attention, projection), Y, atol=1e-9)


def test_search_auto_runs_only_with_factored_values():
    X, Y, _ = search_planted(200, 3, 5, 1, 2, 6, seed=7)
    _, _, info = fit_from_random_starts(
        X, Y, 1, random_state=0, polish=PolishOptions(head_rank=2)
    )
    assert info["start_search"] is None  # one head of d = 5: no factored values
    with pytest.raises(ValueError, match="start_search must be"):
        fit_from_random_starts(X, Y, 1, starts=RandomStartOptions(start_search="adam"))
    with pytest.raises(ValueError, match="low-rank heads"):
        fit_from_random_starts(
            X, Y, 1, starts=RandomStartOptions(start_search="minibatch")
        )


def test_random_starts_decouple_after_the_search():
    X, Y, _, _ = refine_planted(600, 6, 6, 3, 2, 6, seed=9)
    X_test, Y_test, _, _ = refine_planted(100, 6, 6, 3, 2, 6, seed=9)
    attention, projection, info = fit_from_random_starts(
        X,
        Y,
        3,
        random_state=0,
        polish=PolishOptions(head_rank=2, intercept=True),
        starts=RandomStartOptions(start_search="minibatch"),
    )
    decoupled = info["start_search"]["decoupled"]
    assert len(decoupled["heads"]) == 3
    assert info["relative_residual"] < 1e-10
    # off: no decoupled record; asked for where the heads do not fit: an error
    _, _, info = fit_from_random_starts(
        X,
        Y,
        3,
        random_state=0,
        polish=PolishOptions(head_rank=2, intercept=True),
        starts=RandomStartOptions(start_search="minibatch", decouple=False, n_starts=1),
    )
    assert "decoupled" not in info["start_search"]
    with pytest.raises(ValueError, match="decouple=True needs"):
        fit_from_random_starts(
            X,
            Y[:, :, :5],
            3,
            polish=PolishOptions(head_rank=2, intercept=True),
            starts=RandomStartOptions(decouple=True),
        )
    with pytest.raises(ValueError, match="decouple must be"):
        fit_from_random_starts(
            X,
            Y,
            3,
            polish=PolishOptions(head_rank=2),
            starts=RandomStartOptions(decouple="yes"),
        )


def test_no_joint_polish_where_a_head_stayed_unconverged(monkeypatch):
    # head 1's problem ends near but unconverged in every round (1e-5, slightly
    # off): the joint polish does not run from there (it crawls on large layers);
    # the start comes back, its projections fitted, flagged unconverged
    fail_problems(
        monkeypatch, lambda head: head == 1, residual=1e-5, end=nudged(1e-6, 18)
    )
    X, Y, _, _ = refine_planted(600, 6, 6, 3, 2, 6, seed=9)
    _, _, info = fit_from_random_starts(
        X,
        Y,
        3,
        random_state=0,
        polish=PolishOptions(head_rank=2, intercept=True),
        starts=RandomStartOptions(start_search="minibatch", n_starts=1),
    )
    decoupled = info["start_search"]["decoupled"]
    assert not decoupled["heads"][1]["converged"] and decoupled["heads"][0]["converged"]
    assert info["n_iter"] == 0 and info["n_products"] == 0
    assert not info["converged"] and info["stop_reason"] == "heads_unconverged"
    assert info["unconverged_heads"] == [1]
    assert 1e-10 < info["relative_residual"] < 1e-3


def test_auto_search_where_the_heads_are_refined_alone():
    from skattn.solvers._driver import _plan

    starts = RandomStartOptions()

    def plan(m, d, r, d_out):
        return _plan(m, d, d_out, starts, PolishOptions(head_rank=r))

    # factored values: the search, as before (12 heads of MiniLM's shape)
    assert plan(12, 385, 32, 384) == (True, True, True)
    # above 16 features, m r <= d_out: searched, then refined alone
    assert plan(2, 32, 16, 32) == (False, True, True)
    assert plan(2, 17, 4, 17) == (False, True, True)
    # m r > d_out (no refinement alone), few features, full-rank heads: no search
    assert plan(4, 32, 16, 32) == (False, False, False)
    assert plan(2, 8, 2, 8) == (False, False, False)
    assert plan(2, 32, None, 32) == (False, False, False)
    # the user's choice stands
    none = RandomStartOptions(start_search="none")
    assert _plan(2, 32, 32, none, PolishOptions(head_rank=16))[1] is False
