"""Progress bars: one per stage of a verbose fit, nothing when quiet."""

import io
import re

import pytest
from _helpers import refine_planted

from skattn import MultiHeadAttentionRegressor
from skattn.utils import _progress as progress
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
        (
            {"start_search": "minibatch"},
            ["random starts (at most 3):", "search:", "refine (3 heads", "polish ("],
        ),
        ({"start_search": "none"}, ["random starts (at most 3):", "polish ("]),
    ],
)
def test_verbose_fit_shows_a_bar_per_stage_with_its_count(capfd, params, bars):
    _fit(1, **params)
    err = capfd.readouterr().err
    for bar in bars:
        assert bar in err
    if "search:" in bars:  # heads refined of 3, each with its residual
        assert "refine (3 heads, some solved again): 3 head" in err
        # the last head to finish (heads are refined in threads: any of the 3)
        assert re.search(r"refine \(3 heads.*: 3 head .*, head [012]: \S+", err)
    if params["start_search"] == "none":  # polish iterations, with the loss
        assert "polish (at most 200): " in err and "iter" in err and "loss" in err


def test_a_log_file_gets_plain_lines_and_no_total_that_changes(capfd):
    # stderr is no terminal here: a line when a stage starts and ends, no
    # control codes; a stage that may stop early has an open-ended count
    # (issue 52, point 5)
    _fit(1, start_search="minibatch")
    err = capfd.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert len(lines) <= 20  # 4 bars, a few lines each
    assert all(":" in line and "[" in line for line in lines)
    assert not [line for line in lines if re.search(r": \d+/\d+ ", line)]
    assert sum(line.endswith("(done)") for line in lines) == sum(
        not line.endswith("(done)") and line.split(": ")[1].startswith("0 ")
        for line in lines
    )


def test_on_a_terminal_the_bars_are_tqdms(capfd, monkeypatch):
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: True)
    with shown(1), stage_bar("polish", None, "iter", at_most=5) as bar:
        bar.update(2)
    err = capfd.readouterr().err
    assert "\r" in err and "polish (at most 5): " in err and "2iter" in err


def test_plain_bar_prints_at_most_every_interval():
    out, now = io.StringIO(), [0.0]
    bar = progress.PlainBar("search", 10, "step", file=out, clock=lambda: now[0])
    for _ in range(3):
        now[0] += 4
        bar.update(1)  # at 4, 8 and 12 s: within the interval, no line
    now[0] = 31
    bar.update(1)
    bar.set_postfix_str("residual 0.1")
    bar.close()
    bar.close()  # once
    assert out.getvalue().splitlines() == [
        "search: 0/10 step [0:00]",
        "search: 4/10 step [0:31]",
        "search: 4/10 step [0:31], residual 0.1 (done)",
    ]


def test_bars_outside_a_shown_fit_are_silent():
    with stage_bar("search", 10, "step") as bar:
        bar.update(5)
        assert current_bar() is bar and bar.n == 0  # silent: counts nothing
    with shown(1), stage_bar("polish", 3, "iter", iterations=True) as bar:
        assert iteration_bar() is bar
    assert iteration_bar() is not bar
