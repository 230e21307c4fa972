"""skattn.solvers._options: the frozen options of the random-start path's
stages, and the driver honouring or rejecting each of them."""

import dataclasses
import inspect

import numpy as np
import pytest

from skattn.layer._math import forward
from skattn.solvers import (
    PolishOptions,
    RandomStartOptions,
    fit_from_random_starts,
    polish,
)


def test_polish_kwargs_are_the_polish_stages_keywords():
    kwargs = PolishOptions().polish_kwargs()
    signature = inspect.signature(polish).parameters
    assert set(kwargs) <= set(signature)
    for name, value in kwargs.items():  # and their defaults agree
        assert signature[name].default == value, name
    # the polish set and the switch are the caller's, not the stage's
    assert not {"enabled", "n_samples"} & set(kwargs)


def test_options_are_frozen_and_compare_by_value():
    options = PolishOptions(max_iter=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_iter = 6
    assert options == PolishOptions(max_iter=5) != PolishOptions()


def test_random_start_options_reject_bad_values():
    with pytest.raises(ValueError, match="whiten must be"):
        RandomStartOptions(whiten="yes")
    with pytest.raises(ValueError, match="start_search must be"):
        RandomStartOptions(start_search="adam")
    with pytest.raises(ValueError, match="decouple must be"):
        RandomStartOptions(decouple="sometimes")


def _layer():
    rng = np.random.default_rng(0)
    X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    th, W = rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 4, 4))
    return X, forward(X, th, W)


def test_the_driver_rejects_a_disabled_polish():
    X, Y = _layer()
    with pytest.raises(ValueError, match="needs the polish"):
        fit_from_random_starts(X, Y, 1, polish=PolishOptions(enabled=False))


def test_the_driver_honours_its_options():
    X, Y = _layer()
    _, _, info = fit_from_random_starts(
        X,
        Y,
        1,
        random_state=0,
        starts=RandomStartOptions(n_starts=1, whiten=True),
        polish=PolishOptions(max_iter=2, tol=1e-3),
    )
    assert info["n_starts_run"] == 1
    assert info["whitening"]["applied"]
    assert info["n_iter"] <= 2 * 2  # warm-up and final stage, 2 each at most


def test_the_search_needs_low_rank_heads():
    X, Y = _layer()
    with pytest.raises(ValueError, match="needs low-rank heads"):
        fit_from_random_starts(
            X, Y, 1, starts=RandomStartOptions(start_search="minibatch")
        )
