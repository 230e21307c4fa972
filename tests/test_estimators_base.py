"""Shared machinery of the regressors: weights, augmented tokens, the base class
(``estimators/_base.py``)."""

import numpy as np
import pytest

from skattn.estimators._base import (
    BaseAttentionRegressor,
    augment_tokens,
    check_weights,
    join_augmented,
    split_augmented,
)
from skattn.layer._math import forward


class _Given(BaseAttentionRegressor):
    """A regressor whose fit sets the layer it is given (model coordinates)."""

    def __init__(
        self, attention=None, projection=None, n_tokens=None, fit_intercept=False
    ):
        self.attention = attention
        self.projection = projection
        self.n_tokens = n_tokens
        self.fit_intercept = fit_intercept

    def fit(self, X, y, sample_weight=None):
        self._validate_fit_data(X, y, sample_weight)
        self._set_layer(self.attention, self.projection)
        return self


def test_check_weights_rejects_negative_and_all_zero_weights():
    w = np.array([0.0, 2.0])
    assert check_weights(w) is w
    with pytest.raises(ValueError, match="1 negative value"):
        check_weights(np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="sums to zero"):
        check_weights(np.zeros(3))


def test_augmented_layer_is_the_layer_with_key_bias_and_intercept():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(6, 3, 4))
    theta, W = rng.normal(size=(2, 5, 5)), rng.normal(size=(2, 5, 3))
    attention, key_bias, projection, intercept = split_augmented(theta, W)
    np.testing.assert_allclose(
        forward(X, attention, projection, key_bias=key_bias, intercept=intercept),
        forward(augment_tokens(X), theta, W),
        atol=1e-12,
    )
    # join, then split: the identifiable parameters come back
    again = split_augmented(*join_augmented(attention, key_bias, projection, intercept))
    for got, expected in zip(
        again, (attention, key_bias, projection, intercept), strict=True
    ):
        np.testing.assert_allclose(got, expected, atol=1e-15)


@pytest.mark.parametrize("fit_intercept", [False, True])
def test_predict_is_the_forward_pass_of_the_layer_set(fit_intercept):
    rng = np.random.default_rng(1)
    d = 4 + fit_intercept
    theta, W = rng.normal(size=(2, d, d)), rng.normal(size=(2, d, 3))
    X = rng.normal(size=(5, 3, 4))
    y = rng.normal(size=(5, 9))
    model = _Given(theta, W, n_tokens=3, fit_intercept=fit_intercept).fit(
        X.reshape(5, -1), y
    )
    assert (model.n_tokens_, model.n_features_per_token_) == (3, 4)
    assert model.n_outputs_per_token_ == 3
    tokens = augment_tokens(X) if fit_intercept else X
    expected = forward(tokens, theta, W).reshape(5, -1)
    np.testing.assert_allclose(model.predict(X.reshape(5, -1)), expected, atol=1e-12)
    np.testing.assert_allclose(model.predict(X), expected, atol=1e-12)  # 3-D input
    np.testing.assert_allclose(model.layer_.transform(X), expected, atol=1e-12)
    if not fit_intercept:
        assert not model.key_bias_.any() and not model.intercept_.any()


def test_fit_data_errors_name_the_layout():
    X, y = np.zeros((4, 6)), np.zeros((4, 5))
    with pytest.raises(ValueError, match="not divisible by n_tokens=2"):
        _Given(n_tokens=2).fit(X, y)
    with pytest.raises(ValueError, match="y is 1-D but n_tokens=2"):
        _Given(n_tokens=2).fit(X, np.zeros(4))
    with pytest.raises(ValueError, match="y must be 2-D"):
        _Given(n_tokens=2).fit(X, np.zeros((4, 2, 3)))
