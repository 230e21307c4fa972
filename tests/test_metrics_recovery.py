"""Tests of skattn.metrics: head-matched parameter, prediction and pattern errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.base import BaseEstimator, RegressorMixin, clone
from sklearn.exceptions import NotFittedError

from skattn import AttentionLayer
from skattn.datasets import (
    make_attention_layer,
    make_attention_regression,
    sample_inputs,
)
from skattn.metrics import attention_pattern_error, parameter_error, prediction_error


def permuted(layer, order):
    return AttentionLayer(layer.attention[order], layer.projection[order])


class FittedStub(RegressorMixin, BaseEstimator):
    """A 'fitted estimator' exposing attention_ and projection_."""

    def __init__(self, attention=None, projection=None):
        self.attention = attention
        self.projection = projection

    def fit(self, X=None, y=None):
        self.attention_ = np.asarray(self.attention)
        self.projection_ = np.asarray(self.projection)
        return self


class PredictOnly(RegressorMixin, BaseEstimator):
    """An estimator known only through predict (e.g. a random-feature model)."""

    def __init__(self, layer=None):
        self.layer = layer

    def fit(self, X=None, y=None):
        self.n_tokens_ = 3
        return self

    def predict(self, X):
        return self.layer.transform(X)


@pytest.fixture
def true_layer():
    return make_attention_layer(3, 4, n_outputs=5, random_state=0)


@pytest.fixture
def X():
    return sample_inputs("boolean", 200, 3, 4, random_state=0)


# -- parameter_error -------------------------------------------------------------------


def test_parameter_error_zero_against_itself(true_layer):
    err = parameter_error(true_layer, true_layer)
    assert err.attention_error == 0.0 and err.projection_error == 0.0
    np.testing.assert_array_equal(err.attention_errors, 0.0)
    np.testing.assert_array_equal(err.projection_errors, 0.0)
    np.testing.assert_array_equal(err.assignment, [0, 1, 2])
    assert err.unmatched.size == 0


@settings(max_examples=30, deadline=None)
@given(
    perm_true=st.permutations(range(4)),
    perm_learned=st.permutations(range(4)),
    seed=st.integers(0, 1000),
)
def test_parameter_error_invariant_to_head_permutations(perm_true, perm_learned, seed):
    true = make_attention_layer(4, 3, n_outputs=2, random_state=seed)
    rng = np.random.default_rng(seed)
    learned = AttentionLayer(
        true.attention + 0.2 * rng.standard_normal(true.attention.shape),
        true.projection + 0.2 * rng.standard_normal(true.projection.shape),
    )
    base = parameter_error(true, learned)
    assert base.attention_error > 0 and base.projection_error > 0
    err = parameter_error(
        permuted(true, list(perm_true)), permuted(learned, perm_learned)
    )
    assert err.attention_error == pytest.approx(base.attention_error, rel=1e-12)
    assert err.projection_error == pytest.approx(base.projection_error, rel=1e-12)
    # per-head errors follow the true heads
    np.testing.assert_allclose(
        err.attention_errors, base.attention_errors[list(perm_true)], rtol=1e-12
    )
    # a permuted copy is matched exactly
    exact = parameter_error(true, permuted(true, list(perm_learned)))
    assert exact.attention_error == 0.0 and exact.projection_error == 0.0
    np.testing.assert_array_equal(
        np.asarray(perm_learned)[exact.assignment], np.arange(4)
    )


def test_parameter_error_values(true_layer):
    th, W = true_layer.attention, true_layer.projection
    learned = AttentionLayer(1.1 * th[[1, 2, 0]], W[[1, 2, 0]])
    err = parameter_error(true_layer, learned)
    assert err.attention_error == pytest.approx(0.1)
    assert err.projection_error == 0.0
    np.testing.assert_allclose(err.attention_errors, 0.1)
    np.testing.assert_array_equal(err.assignment, [2, 0, 1])


def test_parameter_error_more_learned_heads(true_layer):
    rng = np.random.default_rng(0)
    extra_th = rng.standard_normal((2, 4, 4))
    extra_W = rng.standard_normal((2, 4, 5))
    learned = AttentionLayer(
        np.concatenate([extra_th[:1], true_layer.attention, extra_th[1:]])[
            [4, 1, 0, 3, 2]
        ],
        np.concatenate([extra_W[:1], true_layer.projection, extra_W[1:]])[
            [4, 1, 0, 3, 2]
        ],
    )
    err = parameter_error(true_layer, learned)
    assert err.attention_error == 0.0 and err.projection_error == 0.0
    np.testing.assert_array_equal(err.assignment, [1, 4, 3])
    np.testing.assert_array_equal(err.unmatched, [0, 2])


def test_parameter_error_accepts_fitted_estimators(true_layer):
    est = FittedStub(true_layer.attention[::-1], true_layer.projection[::-1]).fit()
    err = parameter_error(true_layer, est)
    assert err.attention_error == 0.0
    err = parameter_error(est, true_layer)
    assert err.projection_error == 0.0


def test_parameter_error_bad_input(true_layer):
    with pytest.raises(NotFittedError):
        parameter_error(true_layer, FittedStub())
    with pytest.raises(TypeError, match="learned must be an AttentionLayer, a fitted"):
        parameter_error(true_layer, PredictOnly(true_layer).fit())
    with pytest.raises(TypeError, match="true_layer must be an AttentionLayer"):
        parameter_error("layer", true_layer)
    fewer = AttentionLayer(true_layer.attention[:2], true_layer.projection[:2])
    with pytest.raises(ValueError, match="learned has 2 head.* true_layer has 3"):
        parameter_error(true_layer, fewer)
    other = make_attention_layer(3, 4, n_outputs=2, random_state=0)
    with pytest.raises(ValueError, match="same n_features and n_outputs"):
        parameter_error(true_layer, other)
    nan = true_layer.attention.copy()
    nan[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="learned: attention contains 1 NaN"):
        parameter_error(true_layer, AttentionLayer(nan, true_layer.projection))


def test_parameter_error_leaves_inputs_unmodified(true_layer):
    th, W = true_layer.attention.copy(), true_layer.projection.copy()
    parameter_error(true_layer, permuted(true_layer, [2, 1, 0]))
    np.testing.assert_array_equal(true_layer.attention, th)
    np.testing.assert_array_equal(true_layer.projection, W)


# -- prediction_error ------------------------------------------------------------------


def test_prediction_error_zero_for_identical_layers(true_layer, X):
    assert prediction_error(true_layer, true_layer, X) == 0.0
    assert prediction_error(true_layer, permuted(true_layer, [1, 2, 0]), X) < 1e-15
    assert prediction_error(true_layer, true_layer, X.reshape(200, 3, 4)) == 0.0


def test_prediction_error_positive_otherwise(true_layer, X):
    other = make_attention_layer(3, 4, n_outputs=5, random_state=1)
    err = prediction_error(true_layer, other, X)
    assert err > 0.5
    close = AttentionLayer(true_layer.attention, 1.01 * true_layer.projection)
    assert prediction_error(true_layer, close, X) == pytest.approx(0.01)
    zero = AttentionLayer(true_layer.attention, 0 * true_layer.projection)
    assert prediction_error(true_layer, zero, X) == pytest.approx(1.0)
    assert prediction_error(zero, true_layer, X) == np.inf
    assert prediction_error(zero, zero, X) == 0.0


def test_prediction_error_any_number_of_heads_and_predict(true_layer, X):
    fewer = AttentionLayer(true_layer.attention[:1], true_layer.projection[:1])
    assert prediction_error(true_layer, fewer, X) > 0
    stub = PredictOnly(true_layer).fit()
    assert prediction_error(true_layer, stub, X) == 0.0


def test_prediction_error_bad_input(true_layer, X):
    bad = X.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="Input X contains infinity"):
        prediction_error(true_layer, true_layer, bad)
    with pytest.raises(ValueError, match="X has 7 columns, not a multiple"):
        prediction_error(true_layer, true_layer, np.ones((3, 7)))
    with pytest.raises(ValueError, match="not divisible by n_tokens=4"):
        layer4 = AttentionLayer(true_layer.attention, true_layer.projection, n_tokens=4)
        prediction_error(layer4, true_layer, np.ones((3, 10)))


# -- attention_pattern_error -----------------------------------------------------------


def test_pattern_error_zero_for_identical_layers(true_layer, X):
    assert attention_pattern_error(true_layer, true_layer, X) == 0.0
    assert (
        attention_pattern_error(true_layer, permuted(true_layer, [2, 0, 1]), X) == 0.0
    )
    # only attention matters
    other_W = AttentionLayer(true_layer.attention, -true_layer.projection)
    assert attention_pattern_error(true_layer, other_W, X) == 0.0


def test_pattern_error_positive_otherwise(true_layer, X):
    other = make_attention_layer(3, 4, n_outputs=5, random_state=1)
    err = attention_pattern_error(true_layer, other, X)
    assert 0.05 < err <= 1.0
    # uniform attention vs a one-hot pattern: TV = 1 - 1/k
    k, d = 3, 4
    sharp = AttentionLayer(100.0 * np.eye(d)[None], np.eye(d)[None])
    uniform = AttentionLayer(np.zeros((1, d, d)), np.eye(d)[None])
    # distinct unit tokens: self logit 100, cross logits 0
    Xb = np.stack([np.eye(d)[list(p)] for p in [(0, 1, 2), (3, 1, 0), (2, 3, 1)]])
    np.testing.assert_allclose(
        attention_pattern_error(sharp, uniform, Xb), 1 - 1 / k, atol=1e-6
    )


def test_pattern_error_more_learned_heads(true_layer, X):
    rng = np.random.default_rng(0)
    learned = AttentionLayer(
        np.concatenate([true_layer.attention, rng.standard_normal((1, 4, 4))]),
        np.concatenate([true_layer.projection, rng.standard_normal((1, 4, 5))]),
    )
    assert attention_pattern_error(true_layer, learned, X) == 0.0
    with pytest.raises(ValueError, match="at least as many learned heads"):
        attention_pattern_error(learned, true_layer, X)


def test_prediction_and_pattern_errors_compare_decoder_layers():
    X, _, true = make_attention_regression(
        40, 6, 8, 2, head_rank=2, causal=True, rope=True, n_kv_heads=1,
        random_state=0, return_layer=True,
    )  # fmt: skip
    assert prediction_error(true, true, X) == 0.0
    assert attention_pattern_error(true, true, X) == 0.0
    unmasked = clone(true).set_params(causal=False)  # the same maps, no mask
    Y, Y_hat = true.transform(X), unmasked.transform(X)
    expected = np.linalg.norm(Y_hat - Y) / np.linalg.norm(Y)
    assert prediction_error(true, unmasked, X) == pytest.approx(expected, rel=1e-12)
    patterns = true.attention_patterns(X), unmasked.attention_patterns(X)
    tv = 0.5 * np.abs(patterns[0] - patterns[1]).sum(-1).mean(axis=(0, 2))
    assert attention_pattern_error(true, unmasked, X) == pytest.approx(tv.mean())
    with pytest.raises(ValueError, match="prediction_error or attention_pattern_error"):
        parameter_error(true, unmasked)
