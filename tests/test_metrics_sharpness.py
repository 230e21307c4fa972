"""sharpness_profile: per head, how concentrated the attention rows are."""

import numpy as np
import pytest

import skattn.metrics._sharpness as sharpness_module
from skattn import AttentionLayer
from skattn.datasets import make_attention_layer, sample_inputs
from skattn.metrics import sharpness_profile


def _basis_sequences(n, k, seed=0):
    """n sequences of the k standard basis vectors of R^k, in random orders."""
    rng = np.random.default_rng(seed)
    return np.stack([np.eye(k)[rng.permutation(k)] for _ in range(n)])


def test_planted_margins_and_weights_are_exact():
    # tokens e_1..e_k, Theta = c I: row l has logit c on itself, 0 elsewhere
    k, c = 5, 3.0
    X = _basis_sequences(40, k)
    profile = sharpness_profile(c * np.eye(k)[None], X)
    expected = np.exp(c) / (np.exp(c) + k - 1)
    np.testing.assert_allclose(profile.median_largest_weight, [expected])
    np.testing.assert_allclose(profile.margin_quantiles, [[c, c, c]])
    assert profile.sharp_share[0] == 0.0  # 0.83 < 0.99
    assert profile.n_rows == 40 * k
    np.testing.assert_array_equal(profile.quantiles, [0.1, 0.5, 0.9])


def test_one_hot_head_and_uniform_head():
    k = 6
    X = _basis_sequences(30, k, seed=1)
    attention = np.stack([50 * np.eye(k), np.zeros((k, k))])
    profile = sharpness_profile(attention, X)
    np.testing.assert_allclose(profile.median_largest_weight, [1.0, 1 / k])
    np.testing.assert_array_equal(profile.sharp_share, [1.0, 0.0])
    np.testing.assert_allclose(profile.margin_quantiles, [[50.0] * 3, [0.0] * 3])


def test_key_bias_sharpens_a_zero_head():
    # logits u^T x_a: every row puts margin 7 on the key e_1
    k = 4
    X = _basis_sequences(10, k)
    key_bias = 7.0 * np.eye(k)[:1]
    profile = sharpness_profile(np.zeros((1, k, k)), X, key_bias)
    np.testing.assert_allclose(profile.margin_quantiles, [[7.0] * 3])
    layer = AttentionLayer(np.zeros((1, k, k)), np.ones((1, k, 2)), key_bias=key_bias)
    from_layer = sharpness_profile(layer, X)  # the layer's key biases are used
    np.testing.assert_allclose(from_layer.margin_quantiles, [[7.0] * 3])
    overridden = sharpness_profile(layer, X, np.zeros((1, k)))
    np.testing.assert_allclose(overridden.margin_quantiles, [[0.0] * 3])


def test_matches_the_patterns_of_the_layer():
    layer = make_attention_layer(3, 5, random_state=0, attention_scale=4.0)
    X = sample_inputs("gaussian", 300, 6, 5, random_state=0)
    profile = sharpness_profile(layer, X, threshold=0.6, quantiles=[0.0, 1.0])
    largest = layer.attention_patterns(X).max(axis=-1)  # (n, m, k)
    np.testing.assert_allclose(
        profile.median_largest_weight, np.median(largest, axis=(0, 2))
    )
    np.testing.assert_allclose(profile.sharp_share, (largest > 0.6).mean(axis=(0, 2)))
    assert profile.margin_quantiles.shape == (3, 2)
    assert np.all(profile.margin_quantiles[:, 0] >= 0)
    assert np.all(profile.margin_quantiles[:, 1] >= profile.margin_quantiles[:, 0])


def test_chunks_do_not_change_the_result(monkeypatch):
    layer = make_attention_layer(2, 4, random_state=1, attention_scale=3.0)
    X = sample_inputs("boolean", 100, 5, 4, random_state=1)
    whole = sharpness_profile(layer.attention, X)
    monkeypatch.setattr(sharpness_module, "_CHUNK_FLOATS", 7)
    chunked = sharpness_profile(layer.attention, X)
    for key in ("median_largest_weight", "sharp_share", "margin_quantiles"):
        np.testing.assert_array_equal(whole[key], chunked[key])


def test_one_token_rows_are_one_hot():
    profile = sharpness_profile(np.ones((2, 3, 3)), np.ones((4, 1, 3)))
    np.testing.assert_array_equal(profile.median_largest_weight, [1.0, 1.0])
    assert np.all(np.isinf(profile.margin_quantiles))


def test_two_dimensional_X_uses_the_layer_tokens():
    layer = make_attention_layer(1, 3, random_state=0)
    X = sample_inputs("gaussian", 20, 4, 3, random_state=0)
    np.testing.assert_array_equal(
        sharpness_profile(layer, X.reshape(20, -1)).margin_quantiles,
        sharpness_profile(layer, X).margin_quantiles,
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attention": np.zeros((2, 3))}, "attention must have shape"),
        ({"attention": np.zeros((1, 3, 4))}, "attention must have shape"),
        ({"key_bias": np.zeros((2, 3))}, "key_bias must have shape"),
        ({"threshold": 1.0}, "threshold must be a number in"),
        ({"threshold": True}, "threshold must be a number in"),
        ({"quantiles": [0.5, 1.5]}, "quantiles must be"),
        ({"quantiles": []}, "quantiles must be"),
        ({"X": np.ones((2, 7))}, "not a multiple"),
        ({"X": np.full((2, 2, 3), np.nan)}, "NaN"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"attention": np.zeros((1, 3, 3)), "X": np.ones((2, 2, 3))} | kwargs
    with pytest.raises(ValueError, match=match):
        sharpness_profile(**args)
