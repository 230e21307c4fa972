"""sharpness_profile: per head, how concentrated the attention rows are;
sharp_head_pinning: whether the rows that split a head's attention pin its logits."""

import numpy as np
import pytest

import skattn.metrics._sharpness as sharpness_module
from skattn import AttentionLayer
from skattn.datasets import (
    make_attention_layer,
    make_attention_regression,
    sample_inputs,
)
from skattn.metrics import sharp_head_pinning, sharpness_profile


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


def _split_rows_by_hand(X, attention, key_bias=None, threshold=0.99):
    """Rows per head whose largest softmax weight is <= threshold, in plain numpy."""
    logits = np.einsum("nld,mde,nae->nmla", X, attention, X)
    if key_bias is not None:
        logits = logits + np.einsum("nad,md->nma", X, key_bias)[:, :, None, :]
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights.max(axis=-1) <= threshold).sum(axis=(0, 2))


@pytest.fixture(scope="module")
def sharp_and_soft():
    """A planted layer with a nearly one-hot head (median largest weight 0.9999)
    and a soft one (0.6): d = 24, full rank, k = 8, so each head has 576 logit
    unknowns and needs ceil(576 / 7) = 83 split rows."""
    return make_attention_regression(
        20,
        8,
        24,
        2,
        sharpness=[0.9999, 0.6],
        distribution="gaussian",
        random_state=0,
        return_layer=True,
    )


def test_few_sequences_pin_the_soft_head_but_not_the_sharp_one(sharp_and_soft):
    X, _, layer = sharp_and_soft
    pinning = sharp_head_pinning(layer, X)
    X3 = X.reshape(20, 8, 24)
    np.testing.assert_array_equal(
        pinning.n_split_rows, _split_rows_by_hand(X3, layer.attention)
    )
    np.testing.assert_array_equal(pinning.n_unknowns, [24 * 24] * 2)
    np.testing.assert_array_equal(pinning.n_needed, [83, 83])
    assert pinning.n_rows == 160 and pinning.n_sequences == 20
    # the sharp head splits under a third of its rows, the soft one nearly all
    assert pinning.median_largest_weight[0] > 0.999
    assert pinning.n_split_rows[0] < 83 <= pinning.n_split_rows[1]
    np.testing.assert_array_equal(pinning.pinned, [False, True])
    expected = np.ceil(20 * 83 / pinning.n_split_rows)
    np.testing.assert_array_equal(pinning.sequences_needed, expected)
    assert pinning.sequences_needed[0] > 20 >= pinning.sequences_needed[1]


def test_the_estimated_number_of_sequences_pins_the_sharp_head(sharp_and_soft):
    X, _, layer = sharp_and_soft
    wanted = int(sharp_head_pinning(layer, X).sequences_needed[0])
    more = sample_inputs("gaussian", 2 * wanted, 8, 24, random_state=1)
    more = more.reshape(2 * wanted, 8, 24)
    pinning = sharp_head_pinning(layer, more)
    np.testing.assert_array_equal(
        pinning.n_split_rows, _split_rows_by_hand(more, layer.attention)
    )
    np.testing.assert_array_equal(pinning.pinned, [True, True])


def test_low_rank_heads_and_key_biases_change_the_count():
    # d = 6, rank 2: 2 (12 - 2) = 20 unknowns, + 6 with key biases; k = 4
    rng = np.random.default_rng(0)
    attention = rng.normal(size=(1, 6, 2)) @ rng.normal(size=(1, 2, 6))
    key_bias = rng.normal(size=(1, 6))
    X = rng.normal(size=(30, 4, 6))
    plain = sharp_head_pinning(attention, X, head_rank=2)
    assert plain.n_unknowns[0] == 20 and plain.n_needed[0] == 7
    biased = sharp_head_pinning(attention, X, key_bias, head_rank=2)
    assert biased.n_unknowns[0] == 26 and biased.n_needed[0] == 9
    assert biased.key_bias and biased.head_rank == 2
    np.testing.assert_array_equal(
        biased.n_split_rows, _split_rows_by_hand(X, attention, key_bias)
    )
    full = sharp_head_pinning(attention, X, head_rank=6)  # rank >= d: full
    assert full.n_unknowns[0] == 36 and full.head_rank is None
    # a layer carries its rank and its key biases
    layer = AttentionLayer(attention, np.ones((1, 6, 3)), key_bias=key_bias)
    layer.set_params(head_rank=2)
    from_layer = sharp_head_pinning(layer, X)
    assert from_layer.n_unknowns[0] == 26
    np.testing.assert_array_equal(from_layer.n_split_rows, biased.n_split_rows)


def test_a_head_that_never_splits_has_no_estimate():
    k = 5
    X = _basis_sequences(12, k)
    pinning = sharp_head_pinning(np.stack([50 * np.eye(k), np.zeros((k, k))]), X)
    np.testing.assert_array_equal(pinning.n_split_rows, [0, 60])
    np.testing.assert_array_equal(pinning.pinned, [False, True])
    assert np.isnan(pinning.sequences_needed[0])
    assert pinning.sequences_needed[1] == np.ceil(12 * 7 / 60)  # ceil(25 / 4) = 7


def test_pinning_threshold_and_two_dimensional_X():
    layer = make_attention_layer(2, 4, random_state=0, attention_scale=3.0)
    X = sample_inputs("gaussian", 50, 5, 4, random_state=0).reshape(50, 5, 4)
    loose = sharp_head_pinning(layer, X.reshape(50, -1), threshold=0.6)
    np.testing.assert_array_equal(
        loose.n_split_rows, _split_rows_by_hand(X, layer.attention, threshold=0.6)
    )
    np.testing.assert_allclose(
        loose.median_largest_weight, sharpness_profile(layer, X).median_largest_weight
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"head_rank": 0}, "head_rank must be a positive integer"),
        ({"head_rank": 1.5}, "head_rank must be a positive integer"),
        ({"head_rank": True}, "head_rank must be a positive integer"),
        ({"threshold": 0.0}, "threshold must be a number in"),
        ({"X": np.ones((2, 1, 3))}, "at least 2 tokens"),
        ({"key_bias": np.zeros((1, 2))}, "key_bias must have shape"),
        ({"attention": np.zeros((3, 3))}, "attention must have shape"),
    ],
)
def test_pinning_bad_input(kwargs, match):
    args = {"attention": np.zeros((1, 3, 3)), "X": np.ones((2, 2, 3))} | kwargs
    with pytest.raises(ValueError, match=match):
        sharp_head_pinning(**args)
