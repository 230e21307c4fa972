"""Biases in the model: forward pass, fit_intercept, metrics and conditions."""

import numpy as np
import pytest

from skattn import (
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    check_conditions,
)
from skattn.datasets import make_attention_layer
from skattn.estimators._base import augment_tokens, join_augmented, split_augmented
from skattn.layer._math import attention_patterns, forward
from skattn.metrics import parameter_error, prediction_error


def _biased_layer(m=2, d=4, d_out=8, seed=0):
    rng = np.random.default_rng(seed)
    base = make_attention_layer(m, d, n_outputs=d_out, random_state=seed)
    return AttentionLayer(
        base.attention,
        base.projection,
        key_bias=rng.normal(size=(m, d)),
        intercept=rng.normal(size=d_out),
    )


def test_forward_with_biases_matches_naive_loop():
    layer = _biased_layer()
    X = np.random.default_rng(1).normal(size=(5, 3, 4))
    out = np.zeros((5, 3, 8))
    for n in range(5):
        for i in range(2):
            logits = X[n] @ layer.attention[i] @ X[n].T + X[n] @ layer.key_bias[i]
            S = np.exp(logits - logits.max(1, keepdims=True))
            S /= S.sum(1, keepdims=True)
            out[n] += S @ X[n] @ layer.projection[i]
    out += layer.intercept
    np.testing.assert_allclose(layer.transform(X).reshape(out.shape), out, atol=1e-12)


def test_augmented_tokens_represent_the_biased_layer_exactly():
    layer = _biased_layer()
    X = np.random.default_rng(2).normal(size=(7, 3, 4))
    theta, W = join_augmented(
        layer.attention, layer.key_bias, layer.projection, layer.intercept
    )
    theta[:, :, -1] = np.random.default_rng(3).normal(size=(2, 5))  # the gauge
    Xa = augment_tokens(X)
    np.testing.assert_allclose(
        forward(Xa, theta, W).reshape(7, -1), layer.transform(X), atol=1e-12
    )
    np.testing.assert_allclose(
        attention_patterns(Xa, theta), layer.attention_patterns(X), atol=1e-12
    )
    th, u, proj, c = split_augmented(theta, W)
    np.testing.assert_allclose(u, layer.key_bias)
    np.testing.assert_allclose(c, layer.intercept)


@pytest.mark.parametrize(
    "est",
    [
        MultiHeadAttentionRegressor(
            n_heads=2, n_tokens=3, fit_intercept=True, random_state=0
        ),
        GradientAttentionRegressor(
            n_heads=2,
            n_tokens=3,
            fit_intercept=True,
            max_iter=3000,
            tol=1e-10,
            random_state=0,
        ),
    ],
    ids=["phased", "gradient"],
)
def test_learners_recover_a_biased_layer(est):
    true = _biased_layer()
    rng = np.random.default_rng(4)
    X = rng.normal(size=(1500, 3, 4))
    est.fit(X, true.transform(X))
    X_test = rng.normal(size=(500, 3, 4))
    assert prediction_error(true, est, X_test) < 1e-6
    err = parameter_error(true, est)
    assert max(err.attention_error, err.projection_error) < 1e-5
    assert max(err.key_bias_error, err.intercept_error) < 1e-5
    assert est.key_bias_.shape == (2, 4) and est.intercept_.shape == (8,)
    np.testing.assert_allclose(est.layer_.transform(X_test), est.predict(X_test))


def test_fit_intercept_false_has_zero_biases():
    true = make_attention_layer(1, 4, n_outputs=6, random_state=0)
    X = np.random.default_rng(5).normal(size=(300, 3, 4))
    est = GradientAttentionRegressor(n_tokens=3, random_state=0).fit(
        X, true.transform(X)
    )
    assert not np.any(est.key_bias_) and not np.any(est.intercept_)
    assert est.layer_.key_bias is None and est.layer_.intercept is None


@pytest.mark.filterwarnings("ignore")  # few samples: this test checks validation
def test_boolean_check_applies_to_user_tokens_only():
    true = _biased_layer()
    X = np.random.default_rng(6).choice([-1.0, 1.0], size=(2000, 3, 4))
    est = MultiHeadAttentionRegressor(
        n_heads=2,
        n_tokens=3,
        fit_intercept=True,
        input_distribution="boolean",
        random_state=0,
    )
    est.fit(X, true.transform(X))  # the appended 1 is not a user token: no error
    X_bad = X.copy()
    X_bad[0, 0, 0] = 0.5
    with pytest.raises(ValueError, match=r"entries in \{-1, \+1\}"):
        est.fit(X_bad, true.transform(X_bad))


def test_gradient_warm_start_with_intercept_continues():
    true = _biased_layer(m=1, d=3, d_out=4)
    X = np.random.default_rng(7).normal(size=(400, 3, 3))
    y = true.transform(X)
    est = GradientAttentionRegressor(
        n_tokens=3, fit_intercept=True, max_iter=20, random_state=0
    )
    with pytest.warns(Warning):
        est.fit(X, y)
    first = est.loss_
    est.set_params(warm_start=True, max_iter=500, tol=1e-10).fit(X, y)
    assert est.loss_ < first


def test_parameter_error_on_reached_subspace():
    # tokens on an affine hyperplane w^T x = 1: Theta + a w^T and W + w e^T (with
    # the intercept reduced by e) compute the same outputs
    rng = np.random.default_rng(8)
    layer = _biased_layer(m=2, d=4, d_out=6)
    w = np.array([1.0, 2.0, -1.0, 0.5])
    raw = rng.normal(size=(200, 3, 4))
    X = raw + ((1 - raw @ w) / (w @ w))[..., None] * w  # project onto w^T x = 1
    a, e = rng.normal(size=(2, 4)), rng.normal(size=6)
    shifted = AttentionLayer(
        layer.attention + a[:, :, None] * w[None, None, :],
        layer.projection + w[None, :, None] * e[None, None, :],
        key_bias=layer.key_bias,
        intercept=layer.intercept - 2 * e,
    )
    np.testing.assert_allclose(shifted.transform(X), layer.transform(X), atol=1e-10)
    raw_err = parameter_error(layer, shifted)
    assert raw_err.attention_error > 0.1 and raw_err.projection_error > 0.1
    err = parameter_error(layer, shifted, X=X)
    assert max(err.attention_error, err.projection_error) < 1e-10
    assert max(err.key_bias_error, err.intercept_error) < 1e-10
    # a genuinely different layer still shows
    other = _biased_layer(m=2, d=4, d_out=6, seed=9)
    assert parameter_error(layer, other, X=X).attention_error > 0.1


def test_check_conditions_sees_key_biases():
    base = make_attention_layer(2, 4, n_outputs=16, random_state=0)
    same = np.repeat(base.attention[:1], 2, axis=0)
    plain = AttentionLayer(same, base.projection)
    assert not check_conditions(plain, n_tokens=3).attention_separation.passed
    u = np.stack([np.zeros(4), 3 * np.ones(4)])
    biased = AttentionLayer(same, base.projection, key_bias=u)
    report = check_conditions(biased, n_tokens=3)
    assert report.attention_separation.value > 0.2  # the heads differ in u
    assert (
        report.diagonal_weight.value
        == check_conditions(plain, n_tokens=3).diagonal_weight.value
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key_bias": np.ones((3, 4))}, r"key_bias must have shape \(n_heads"),
        ({"intercept": np.ones(3)}, r"intercept must have shape \(n_outputs,\)"),
        ({"key_bias": np.full((2, 4), np.nan)}, "key_bias"),
    ],
)
def test_bias_bad_input(kwargs, match):
    base = make_attention_layer(2, 4, random_state=0)
    layer = AttentionLayer(base.attention, base.projection, **kwargs)
    with pytest.raises(ValueError, match=match):
        layer.transform(np.zeros((1, 8)))
