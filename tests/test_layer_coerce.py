"""Tests of skattn.layer.as_layer: what it accepts, what it refuses."""

from types import SimpleNamespace

import numpy as np
import pytest
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import Ridge

from skattn import GradientAttentionRegressor, make_attention_regression
from skattn.datasets import make_attention_layer
from skattn.layer import AttentionLayer, as_layer


class Stub(RegressorMixin, BaseEstimator):
    """A fitted estimator with the given fitted attributes (no ``layer_``)."""

    def __init__(self, attributes=None):
        self.attributes = attributes

    def fit(self, X=None, y=None):
        for key, value in self.attributes.items():
            setattr(self, key, value)
        return self


@pytest.fixture
def layer():
    return make_attention_layer(2, 3, n_outputs=4, random_state=0)


def test_a_layer_is_returned_as_it_is(layer):
    assert as_layer(layer) is layer  # unfitted: a layer needs no fit
    fitted = AttentionLayer(layer.attention, layer.projection).fit(np.ones((2, 6)))
    assert as_layer(fitted) is fitted


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_a_fitted_estimator_gives_its_layer():
    X, y = make_attention_regression(40, 3, 2, 1, random_state=0)
    est = GradientAttentionRegressor(n_tokens=3, fit_intercept=True, max_iter=3)
    est.fit(X, y)
    got = as_layer(est)
    assert got is est.layer_
    assert got.n_tokens == 3
    np.testing.assert_array_equal(got.key_bias, est.key_bias_)
    np.testing.assert_array_equal(got.intercept, est.intercept_)


def test_a_fitted_estimator_without_layer_gives_a_layer_of_its_attributes(layer):
    attributes = {
        "attention_": layer.attention,
        "projection_": layer.projection,
        "n_tokens_": 5,
        "key_bias_": np.ones((2, 3)),
        "intercept_": np.arange(4.0),
    }
    est = Stub(attributes).fit()
    got = as_layer(est)
    assert isinstance(got, AttentionLayer)
    assert got.attention is layer.attention and got.projection is layer.projection
    assert got.n_tokens == 5
    np.testing.assert_array_equal(got.key_bias, np.ones((2, 3)))
    np.testing.assert_array_equal(got.intercept, np.arange(4.0))
    # a layer_ that is not an AttentionLayer is passed over for the attributes
    est.layer_ = "not a layer"
    np.testing.assert_array_equal(as_layer(est).attention, layer.attention)


def test_an_object_without_fit_is_read_by_its_attributes():
    single = SimpleNamespace(attention_=np.eye(3), projection_=np.ones((3, 2)))
    got = as_layer(single)
    assert got.attention.shape == (1, 3, 3) and got.projection.shape == (1, 3, 2)
    assert got.n_tokens is None and got.key_bias is None and got.intercept is None


def test_an_unfitted_estimator_is_not_fitted(layer):
    est = Stub({"attention_": layer.attention, "projection_": layer.projection})
    with pytest.raises(NotFittedError, match="Stub instance is not fitted"):
        as_layer(est, "learned")
    with pytest.raises(NotFittedError):
        as_layer(GradientAttentionRegressor())


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_a_fitted_estimator_without_parameters_is_refused():
    X, y = make_attention_regression(20, 1, 2, 1, random_state=0)
    with pytest.raises(TypeError, match="^learned must be an AttentionLayer, a fitted"):
        as_layer(Ridge().fit(X, y), "learned")


@pytest.mark.parametrize(
    "obj", [np.zeros((2, 3, 3)), None, "layer", SimpleNamespace(attention_=1.0)]
)
def test_anything_else_is_a_type_error_that_says_what_is_accepted(obj):
    with pytest.raises(TypeError) as info:
        as_layer(obj, "true_layer")
    message = str(info.value)
    assert message.startswith("true_layer must be an AttentionLayer")
    assert "attention_ and projection_" in message
    assert type(obj).__name__ in message


@pytest.mark.parametrize(
    "kind, match",
    [
        ("layer", "true_layer: attention must have shape"),
        ("estimator", "true_layer: attention must have shape"),
        ("object", "true_layer: attention must have shape"),
        ("bias", "true_layer: key_bias must have shape"),
    ],
)
def test_invalid_arrays_are_a_value_error_naming_the_argument(kind, match):
    bad, W = np.zeros((2, 3, 4)), np.zeros((2, 3, 2))
    obj = {
        "layer": AttentionLayer(bad, W),
        "estimator": Stub({"attention_": bad, "projection_": W}).fit(),
        "object": SimpleNamespace(attention_=bad, projection_=W),
        "bias": AttentionLayer(np.zeros((2, 3, 3)), W, key_bias=np.zeros(3)),
    }[kind]
    with pytest.raises(ValueError, match=match):
        as_layer(obj, "true_layer")


def test_a_layer_s_arrays_have_zero_biases_where_it_has_none(layer):
    attention, projection, key_bias, intercept, n_tokens = layer._arrays()
    assert attention is layer.attention and projection is layer.projection
    np.testing.assert_array_equal(key_bias, np.zeros((2, 3)))
    np.testing.assert_array_equal(intercept, np.zeros(4))
    assert n_tokens is None
    layer.fit(np.ones((1, 3, 3)))  # n_tokens_ once fitted
    assert layer._arrays()[4] == 3
