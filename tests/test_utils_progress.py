"""Progress bars: one per stage of a verbose fit, nothing when quiet."""

import pytest
from _helpers import refine_planted

from skattn import MultiHeadAttentionRegressor
from skattn.utils._progress import current_bar, iteration_bar, shown, stage_bar


def _fit(verbose, **params):
    X, Y = refine_planted(1000, 6, 12, 3, 2, 12, seed=1, intercept=False)[:2]
    MultiHeadAttentionRegressor(
        n_heads=3,
        head_rank=2,
        n_tokens=6,
        init="random",
        random_state=0,
        verbose=verbose,
        **params,
    ).fit(X.reshape(len(X), -1), Y.reshape(len(Y), -1))


def test_quiet_fit_prints_nothing(capfd):
    _fit(0, start_search="minibatch")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.parametrize(
    "params, bars",
    [
        ({"start_search": "minibatch"}, ["search:", "refine:", "polish:"]),
        ({"start_search": "none"}, ["polish:"]),
    ],
)
def test_verbose_fit_shows_a_bar_per_stage_with_its_count(capfd, params, bars):
    _fit(1, **params)
    err = capfd.readouterr().err
    for bar in bars:
        assert bar in err
    if "refine:" in bars:  # heads refined of 3, each with its residual
        assert "3/3" in err and "head 2:" in err
    if params["start_search"] == "none":  # polish iterations, with the loss
        assert "iter" in err and "loss" in err


def test_bars_outside_a_shown_fit_are_silent():
    with stage_bar("search", 10, "step") as bar:
        bar.update(5)
        assert current_bar() is bar and bar.n == 0  # silent: counts nothing
    with shown(1), stage_bar("polish", 3, "iter", iterations=True) as bar:
        assert iteration_bar() is bar
    assert iteration_bar() is not bar
