"""skattn.metrics._scorers: the scorers' values, signs and errors."""

import numpy as np
import pytest
from _helpers import one_head_regression, two_heads_regression

from skattn import (
    AttentionLayer,
    RandomFeatureAttentionRegressor,
    make_attention_layer,
)
from skattn.metrics import (
    make_recovery_scorer,
    parameter_error,
    relative_prediction_error,
)

K, D = 3, 4  # tokens per sequence, features per token


@pytest.fixture(scope="module")
def two_heads():
    """A planted 2-head layer."""
    return two_heads_regression(K, D)


@pytest.fixture(scope="module")
def one_head():
    """A planted 1-head layer."""
    return one_head_regression(K, D)


def test_recovery_scorer_rejects_a_model_without_parameters(one_head):
    X, y, true = one_head
    est = RandomFeatureAttentionRegressor(n_heads=5, n_tokens=K).fit(X, y[:, :4])
    with pytest.raises(TypeError, match="attention_ and projection_"):
        make_recovery_scorer(true)(est, X, y)
    with pytest.raises(TypeError, match="true_layer must be an AttentionLayer"):
        make_recovery_scorer(np.eye(4))
    with pytest.raises(ValueError, match="'on' parameter"):
        make_recovery_scorer(true, on="heads")


def test_relative_prediction_error_values():
    rng = np.random.default_rng(0)
    y, y_hat = rng.normal(size=(6, 4)), rng.normal(size=(6, 4))
    expected = np.linalg.norm(y_hat - y) / np.linalg.norm(y)
    assert relative_prediction_error(y, y_hat) == pytest.approx(expected)
    # An integer weight counts a sample that many times.
    weights = np.array([1, 2, 1, 3, 1, 1])
    repeated = np.repeat(np.arange(6), weights)
    assert relative_prediction_error(y, y_hat, sample_weight=weights) == pytest.approx(
        relative_prediction_error(y[repeated], y_hat[repeated])
    )
    assert relative_prediction_error(y[:, 0], y_hat[:, 0]) == pytest.approx(
        np.linalg.norm(y_hat[:, 0] - y[:, 0]) / np.linalg.norm(y[:, 0])
    )
    zeros = np.zeros((3, 2))
    assert relative_prediction_error(zeros, zeros) == 0.0
    assert relative_prediction_error(zeros, zeros + 1) == np.inf


def test_recovery_scorer_ignores_head_order(two_heads):
    X, y, true = two_heads
    swapped = AttentionLayer(true.attention[::-1], true.projection[::-1])
    for on in ("attention", "projection", "both"):
        assert make_recovery_scorer(true, on=on)(swapped) == 0.0
    other = make_attention_layer(2, D, n_outputs=8, random_state=5)
    err = parameter_error(true, other)
    assert make_recovery_scorer(true, on="attention")(other) == -err.attention_error
    assert make_recovery_scorer(true, on="projection")(other) == -err.projection_error
    assert make_recovery_scorer(true)(other) == pytest.approx(
        -np.hypot(err.attention_error, err.projection_error)
    )
