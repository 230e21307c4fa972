"""Shared machinery of the regressors: weights, augmented tokens, the base class,
fit as all or nothing (``estimators/_base.py``)."""

import numpy as np
import pytest

import skattn.estimators._gradient as gradient_module
from skattn import (
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    RandomAttentionFeatures,
    RandomFeatureAttentionRegressor,
    make_attention_layer,
    make_attention_regression,
)
from skattn.estimators._base import (
    BaseAttentionRegressor,
    augment_tokens,
    available_if_explained,
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


def test_available_if_explained_raises_the_checks_reason():
    def adam_only(self):
        if self.optimizer != "adam":
            raise AttributeError("partial_fit needs optimizer='adam'.")
        return True

    def falsy(self):
        return False

    class Est:
        optimizer = "lbfgs"

        @available_if_explained(adam_only)
        def partial_fit(self):
            """One epoch."""
            return "epoch"

        @available_if_explained(falsy)
        def other(self):
            return "other"

    est = Est()
    assert not hasattr(est, "partial_fit") and Est.partial_fit.__doc__ == "One epoch."
    with pytest.raises(AttributeError, match="needs optimizer='adam'") as info:
        est.partial_fit()
    assert info.value.__cause__ is None
    with pytest.raises(AttributeError, match="has no attribute 'other'"):
        est.other()  # a check that returns False: scikit-learn's own message
    est.optimizer = "adam"
    assert est.partial_fit() == "epoch"


# -- fit is all or nothing: a failed refit leaves the previous fit as it was ---------

K, D, D_OUT, N = 3, 4, 8, 60
_X, _Y = make_attention_regression(N, K, D, 1, n_outputs=D_OUT, random_state=0)
_X6 = _X[:, :6]  # another valid width: 3 tokens of 2 features
_NAN = _X6.copy()
_NAN[2, 3] = np.nan
_BAD_WEIGHTS = -np.ones(N)

# name -> (factory, y of the first fit, bad refits (X, y, fit_params))
_REFITS = {
    "MultiHeadAttentionRegressor": (
        lambda: MultiHeadAttentionRegressor(n_tokens=K, polish=False, random_state=0),
        _Y,
        [
            (_X6, _Y[:, :6], {"sample_weight": _BAD_WEIGHTS}),  # (i) bad weights
            (_X6, _Y[:, :7], {}),  # (ii) y of another width (not k * d_out)
            (_NAN, _Y[:, :6], {}),  # (iii) X with NaN
            (_X6 * 1e200, _Y[:, :6], {}),  # X too large
        ],
    ),
    "GradientAttentionRegressor": (
        lambda: GradientAttentionRegressor(n_tokens=K, max_iter=5, random_state=0),
        _Y,
        [
            (_X6, _Y[:, :6], {"sample_weight": _BAD_WEIGHTS}),
            (_X, _Y[:, :3].ravel(), {}),  # y of another shape: 1-D, 3 tokens
            (_X, _Y[:, :7], {}),
            (_NAN, _Y[:, :6], {}),
            (_X6, _Y[:, :6] * 1e200, {}),  # y too large
        ],
    ),
    "RandomFeatureAttentionRegressor": (
        lambda: RandomFeatureAttentionRegressor(n_heads=5, n_tokens=K, random_state=0),
        _Y[:, :D_OUT],
        [
            (_X6, _Y[:, :2], {"sample_weight": _BAD_WEIGHTS}),
            (_X6, np.full((N, 2), 1e200), {}),  # y of another width, too large
            (_X6, _Y.reshape(N, K, D_OUT), {}),  # per-token (3-D) y
            (_NAN, _Y[:, :2], {}),
            (_X6[:1], _Y[:1, :2], {}),  # leave-one-out on 1 sample
        ],
    ),
    "RandomAttentionFeatures": (
        lambda: RandomAttentionFeatures(n_heads=5, n_tokens=K, random_state=0),
        None,
        [
            (_NAN, None, {}),
            (_X6 * 1e200, None, {}),
            (_X[:, :8], None, {}),  # 8 columns: not divisible by n_tokens=3
            (_X6.reshape(N, 2, 3), None, {}),  # 3-D with 2 tokens, n_tokens=3
        ],
    ),
    "AttentionLayer": (
        lambda: make_attention_layer(1, D, n_outputs=D_OUT, random_state=0),
        None,
        [
            (_NAN, None, {}),
            (_X[:, :10], None, {}),  # not a multiple of the layer's 4 features
        ],
    ),
}


def _apply(est, X):
    return est.predict(X) if hasattr(est, "predict") else est.transform(X)


@pytest.mark.parametrize("name", sorted(_REFITS))
def test_a_failed_refit_leaves_the_previous_fit_intact(name):
    factory, y, bad_refits = _REFITS[name]
    est = factory()
    est.fit(_X) if y is None else est.fit(_X, y)
    expected = _apply(est, _X)
    before = dict(vars(est))
    for X, y_bad, fit_params in bad_refits:
        with pytest.raises(ValueError):
            est.fit(X, **fit_params) if y is None else est.fit(X, y_bad, **fit_params)
        assert vars(est).keys() == before.keys()
        changed = [key for key, value in before.items() if vars(est)[key] is not value]
        assert not changed
        np.testing.assert_array_equal(_apply(est, _X), expected, strict=True)


def test_an_interrupted_fit_leaves_the_previous_fit_intact(monkeypatch):
    est = GradientAttentionRegressor(n_tokens=K, max_iter=5, random_state=0)
    expected = est.fit(_X, _Y).predict(_X)
    before = dict(vars(est))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gradient_module, "_lbfgs_curve", interrupt)
    with pytest.raises(KeyboardInterrupt):
        est.fit(_X6, _Y[:, :6])  # n_features_in_ and the layout were set by then
    assert all(vars(est)[key] is value for key, value in before.items())
    assert vars(est).keys() == before.keys()
    np.testing.assert_array_equal(est.predict(_X), expected)


def test_a_failed_partial_fit_leaves_the_previous_state_intact(monkeypatch):
    est = GradientAttentionRegressor(n_tokens=K, optimizer="adam", random_state=0)
    est.partial_fit(_X, _Y).partial_fit(_X, _Y)
    expected = est.predict(_X)
    before = dict(vars(est))
    curve, rng_state = list(est.loss_curve_), est._random_state.get_state()[1].copy()

    def diverge(*args):
        raise ValueError("diverged")

    bad_calls = [
        lambda: est.partial_fit(_X, _Y, sample_weight=_BAD_WEIGHTS),
        lambda: est.partial_fit(_X, _Y[:, :6]),
        lambda: est.partial_fit(_NAN, _Y[:, :6]),
        lambda: est.partial_fit(_X * 1e200, _Y),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    # an epoch that ran, then failed: its shuffling must not advance the generator
    monkeypatch.setattr(gradient_module, "_check_not_diverged", diverge)
    with pytest.raises(ValueError, match="diverged"):
        est.partial_fit(_X, _Y)
    assert vars(est).keys() == before.keys()
    assert all(vars(est)[key] is value for key, value in before.items())
    assert est.loss_curve_ == curve and est.n_iter_ == 2
    np.testing.assert_array_equal(est._random_state.get_state()[1], rng_state)
    np.testing.assert_array_equal(est.predict(_X), expected, strict=True)
    # and the next good call continues exactly as if the failures had not happened
    monkeypatch.undo()
    twin = GradientAttentionRegressor(n_tokens=K, optimizer="adam", random_state=0)
    twin.partial_fit(_X, _Y).partial_fit(_X, _Y).partial_fit(_X, _Y)
    np.testing.assert_array_equal(est.partial_fit(_X, _Y).predict(_X), twin.predict(_X))
