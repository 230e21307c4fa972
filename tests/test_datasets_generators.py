"""Tests of skattn.datasets' planted layers (skattn/datasets/_generators.py)."""

import numpy as np
import pytest

from skattn import AttentionLayer
from skattn.datasets import (
    BooleanTokens,
    TokenizedMixture,
    make_attention_layer,
    make_attention_regression,
    resolve_distribution,
)
from skattn.layer._math import attention_logits, forward
from skattn.metrics import sharpness_profile

# -- planted layers --------------------------------------------------------------------


@pytest.mark.parametrize("structure", ["random", "diagonal", "low_rank"])
def test_make_attention_layer_shapes_and_norms(structure):
    layer = make_attention_layer(
        3, 8, n_outputs=5, attention_scale=3.0, structure=structure, random_state=0
    )
    assert isinstance(layer, AttentionLayer)
    assert layer.attention.shape == (3, 8, 8)
    assert layer.projection.shape == (3, 8, 5)
    np.testing.assert_allclose(np.linalg.norm(layer.attention, axis=(1, 2)), 3.0)
    if structure == "diagonal":
        off = layer.attention * (1 - np.eye(8))
        np.testing.assert_array_equal(off, 0.0)
    if structure == "low_rank":
        assert all(np.linalg.matrix_rank(t) == 2 for t in layer.attention)
    if structure == "random":
        assert all(np.linalg.matrix_rank(t) == 8 for t in layer.attention)
    # heads are distinct
    flat = layer.attention.reshape(3, -1)
    for i in range(3):
        for j in range(i + 1, 3):
            assert np.linalg.norm(flat[i] - flat[j]) > 0.1


def test_make_attention_layer_rank_and_defaults():
    layer = make_attention_layer(2, 12, structure="low_rank", rank=5, random_state=0)
    assert all(np.linalg.matrix_rank(t) == 5 for t in layer.attention)
    assert layer.projection.shape == (2, 12, 12)  # n_outputs defaults to d
    with pytest.raises(ValueError, match="rank=9 exceeds n_features=8"):
        make_attention_layer(2, 8, structure="low_rank", rank=9)
    with pytest.raises(ValueError, match="n_features=1"):
        make_attention_layer(3, 1)
    one = make_attention_layer(2, 1, random_state=0)
    np.testing.assert_allclose(one.attention[0], -one.attention[1])


def test_make_attention_layer_validates_parameters():
    with pytest.raises(ValueError, match="'structure' parameter"):
        make_attention_layer(2, 4, structure="sparse")
    with pytest.raises(ValueError, match="'n_heads' parameter"):
        make_attention_layer(0, 4)
    with pytest.raises(ValueError, match="'attention_scale' parameter"):
        make_attention_layer(2, 4, attention_scale=-1.0)


@pytest.mark.parametrize("seed", [0, np.random.RandomState(0), None])
def test_generators_deterministic(seed):
    def draw(state):
        return make_attention_regression(
            40, 3, 4, 2, noise=0.1, random_state=state, return_layer=True
        )

    if seed is None:
        np.random.seed(0)  # noqa: NPY002 (None means the global state)
        a = draw(None)
        np.random.seed(0)  # noqa: NPY002 (None means the global state)
        b = draw(None)
    elif isinstance(seed, np.random.RandomState):
        a, b = draw(np.random.RandomState(0)), draw(np.random.RandomState(0))
    else:
        a, b = draw(seed), draw(seed)
    for u, v in zip(a[:2], b[:2], strict=True):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(a[2].attention, b[2].attention)
    np.testing.assert_array_equal(a[2].projection, b[2].projection)
    c = make_attention_regression(40, 3, 4, 2, random_state=1)
    assert not np.array_equal(a[0], c[0])


def test_generator_accepts_numpy_generator():
    a = make_attention_layer(2, 4, random_state=np.random.default_rng(3))
    b = make_attention_layer(2, 4, random_state=np.random.default_rng(3))
    np.testing.assert_array_equal(a.attention, b.attention)


@pytest.mark.parametrize("distribution", ["boolean", "gaussian"])
def test_make_attention_regression(distribution):
    X, y, layer = make_attention_regression(
        300,
        4,
        6,
        2,
        n_outputs=3,
        distribution=distribution,
        random_state=0,
        return_layer=True,
    )
    assert X.shape == (300, 24) and y.shape == (300, 12)
    assert layer.n_tokens == 4
    np.testing.assert_allclose(y, layer.transform(X), rtol=1e-12, atol=1e-12)
    if distribution == "boolean":
        assert set(np.unique(X)) == {-1.0, 1.0}
    X2, y2 = make_attention_regression(
        300, 4, 6, 2, n_outputs=3, distribution=distribution, random_state=0
    )
    np.testing.assert_array_equal(X2, X)
    np.testing.assert_array_equal(y2, y)


def test_make_attention_regression_noise():
    X, y, layer = make_attention_regression(
        2000, 3, 4, 2, noise=0.3, random_state=0, return_layer=True
    )
    residual = y - layer.transform(X)
    assert abs(residual.std() - 0.3) < 0.01
    assert abs(residual.mean()) < 0.01


def test_make_attention_regression_with_distribution_instance():
    dist = TokenizedMixture(5, 4, noise=0.5)
    X, y = make_attention_regression(50, 5, 4, 2, distribution=dist, random_state=0)
    assert X.shape == (50, 20)
    with pytest.raises(ValueError, match="expected n_tokens=3"):
        make_attention_regression(50, 3, 4, 2, distribution=dist)


def test_head_outputs_are_order_one():
    d = 16
    X, _, layer = make_attention_regression(
        2000, 4, d, 3, n_outputs=d, random_state=0, return_layer=True
    )
    X3 = X.reshape(2000, 4, d)
    for i in range(3):
        out = forward(X3, layer.attention[i : i + 1], layer.projection[i : i + 1])
        assert 0.2 < out.std() < 1.2


@pytest.mark.parametrize("distribution", ["boolean", "gaussian"])
@pytest.mark.parametrize("structure", ["random", "diagonal", "low_rank"])
@pytest.mark.parametrize("scale", [0.5, 5.0])
def test_attention_scale_is_the_cross_logit_std(distribution, structure, scale):
    """Var(x_a^T Theta x_b) = ||Theta||_F^2 = scale^2 for independent tokens a != b."""
    k, d, n = 6, 8, 4000
    layer = make_attention_layer(
        3, d, attention_scale=scale, structure=structure, random_state=1
    )
    X = resolve_distribution(distribution, k, d).sample(n, random_state=2)
    logits = attention_logits(X.reshape(n, k, d), layer.attention)  # (n, m, k, k)
    off = ~np.eye(k, dtype=bool)
    for i in range(3):
        cross = logits[:, i][:, off]  # (n, k(k-1)): pairs of distinct tokens
        # 4000 * 30 logits (pairs share tokens, so fewer independent ones); the
        # measured deviations are below 0.8 %, a wrong normalisation (e.g. a
        # missing sqrt(2) or 1/d) would be off by > 30 %.
        assert abs(cross.std() / scale - 1.0) < 0.03
        assert abs(cross.mean()) < 0.03 * scale


def test_diagonal_logits_on_boolean_tokens_are_the_trace():
    layer = make_attention_layer(2, 6, structure="diagonal", random_state=0)
    X = BooleanTokens(3, 6).sample(50, random_state=0).reshape(50, 3, 6)
    logits = attention_logits(X, layer.attention)
    for i in range(2):
        diag = np.diagonal(logits[:, i], axis1=1, axis2=2)
        np.testing.assert_allclose(diag, np.trace(layer.attention[i]))


# -- planted sharpness ----------------------------------------------------------------


def _measured_sharpness(layer, distribution, k, d, n=4000, seed=123):
    X = resolve_distribution(distribution, k, d).sample(n, random_state=seed)
    return sharpness_profile(layer, X).median_largest_weight


@pytest.mark.parametrize("distribution", ["boolean", "gaussian"])
@pytest.mark.parametrize("target", [0.5, 0.9, 0.99, 0.999, 0.9999])
def test_sharpness_hits_its_target(distribution, target):
    k, d = 8, 16
    X, y, layer = make_attention_regression(
        50,
        k,
        d,
        3,
        distribution=distribution,
        sharpness=target,
        random_state=0,
        return_layer=True,
    )
    # on fresh inputs, not the calibration sample: the median within 0.01, and the
    # weight left off the largest, 1 - median, within 10 % (gaussian) or 25 %
    # (boolean: few distinct logits, the median sits on a step), so that 0.9999
    # is not 0.9995
    measured = _measured_sharpness(layer, distribution, k, d)
    np.testing.assert_allclose(measured, target, atol=0.01)
    rtol = 0.1 if distribution == "gaussian" else 0.25
    np.testing.assert_allclose(1 - measured, 1 - target, rtol=rtol)
    np.testing.assert_allclose(y, layer.transform(X), rtol=1e-12, atol=1e-12)
    # only Theta_i is rescaled: the inputs, W_i and the heads' directions are the
    # draws of sharpness=None
    X0, _, plain = make_attention_regression(
        50, k, d, 3, distribution=distribution, random_state=0, return_layer=True
    )
    np.testing.assert_array_equal(X, X0)
    np.testing.assert_array_equal(layer.projection, plain.projection)
    norms = np.linalg.norm(layer.attention, axis=(1, 2))
    np.testing.assert_allclose(
        layer.attention / norms[:, None, None], plain.attention / 2.0, rtol=1e-12
    )


def test_sharpness_per_head_and_low_rank_heads():
    k, d = 8, 16
    targets = [0.6, None, 0.99]
    layer = make_attention_layer(
        3, d, n_tokens=k, head_rank=2, sharpness=targets, random_state=1
    )
    plain = make_attention_layer(3, d, head_rank=2, random_state=1)
    assert layer.n_tokens == k and layer.head_rank == 2
    assert all(np.linalg.matrix_rank(t) == 2 for t in layer.attention)
    np.testing.assert_array_equal(layer.attention[1], plain.attention[1])
    measured = _measured_sharpness(layer, "boolean", k, d)
    np.testing.assert_allclose(measured[[0, 2]], [0.6, 0.99], atol=0.01)
    # per-head targets as an array, on Gaussian inputs
    layer = make_attention_layer(
        3,
        d,
        n_tokens=k,
        distribution="gaussian",
        sharpness=np.array([0.3, 0.8, 0.995]),
        random_state=2,
    )
    np.testing.assert_allclose(
        _measured_sharpness(layer, "gaussian", k, d), [0.3, 0.8, 0.995], atol=0.01
    )


def test_sharpness_none_changes_nothing():
    a = make_attention_regression(60, 4, 6, 2, noise=0.1, random_state=3)
    b = make_attention_regression(
        60, 4, 6, 2, noise=0.1, sharpness=None, random_state=3
    )
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
    ("sharpness", "match"),
    [
        (0.125, r"in \(1/n_tokens, 1\) = \(0.125, 1\)"),  # uniform: not above 1/k
        (0.05, "a number in"),
        (1.0, "a number in"),
        (float("nan"), "a number in"),
        (True, "a number in"),
        ("sharp", "a number in"),
        ([0.9, 0.9], "got 2 values for 3 heads"),
        ([0.9, float("nan"), 0.9], "a number in"),
        ([[0.9, 0.9, 0.9]], "got 1 values for 3 heads"),
    ],
)
def test_sharpness_validation(sharpness, match):
    with pytest.raises(ValueError, match=match):
        make_attention_regression(10, 8, 4, 3, sharpness=sharpness)
    with pytest.raises(ValueError, match=match):
        make_attention_layer(3, 4, n_tokens=8, sharpness=sharpness)


def test_sharpness_errors():
    with pytest.raises(ValueError, match="sharpness needs n_tokens"):
        make_attention_layer(2, 4, sharpness=0.9)
    with pytest.raises(ValueError, match="attention_scale=0"):
        make_attention_layer(2, 4, n_tokens=4, attention_scale=0.0, sharpness=0.9)
    # two Boolean features, 8 tokens: the argmax token repeats in most rows, so
    # no scale makes the median row hard
    with pytest.raises(ValueError, match="cannot be planted in head 0"):
        make_attention_layer(1, 2, n_tokens=8, sharpness=0.99, random_state=0)


# -- planted decoder layers ------------------------------------------------------------


def test_causal_alone_keeps_the_draws_and_masks_them():
    plain = make_attention_layer(3, 8, n_outputs=5, random_state=0)
    causal = make_attention_layer(3, 8, n_outputs=5, causal=True, random_state=0)
    np.testing.assert_array_equal(causal.attention, plain.attention)
    np.testing.assert_array_equal(causal.projection, plain.projection)
    assert causal.causal and not plain.causal
    X = np.random.default_rng(1).normal(size=(4, 6, 8))
    S = causal.attention_patterns(X)
    assert np.all(np.triu(S, 1) == 0)
    # the last token sees every token: its output is the position-free layer's
    np.testing.assert_allclose(
        causal.transform(X).reshape(4, 6, 5)[:, -1],
        plain.transform(X).reshape(4, 6, 5)[:, -1],
        rtol=0,
        atol=1e-14,
    )


@pytest.mark.parametrize("rope", [False, True])
def test_grouped_query_heads_share_keys_and_values(rope):
    layer = make_attention_layer(
        8, 16, head_rank=4, rope=rope, n_kv_heads=2, attention_scale=3.0, random_state=0
    )
    assert layer.n_kv_heads == 2
    if rope:
        assert not np.any(layer.attention)
        P, K = layer.rotary_query, layer.rotary_key
        assert P.shape == (8, 16, 4) and K.shape == (2, 16, 4)
        products = P @ np.swapaxes(K[np.arange(8) // 4], 1, 2)
    else:
        assert layer.rotary_query is None
        products = layer.attention
    np.testing.assert_allclose(np.linalg.norm(products, axis=(1, 2)), 3.0)
    for group in (slice(0, 4), slice(4, 8)):
        # one key map per group: the heads' Theta_i^T span head_rank dimensions,
        # and one value map: the W_i do too
        keys = np.concatenate(np.swapaxes(products[group], 1, 2), axis=1)
        values = np.concatenate(layer.projection[group], axis=1)
        for stacked in (keys, values):
            s = np.linalg.svd(stacked, compute_uv=False)
            assert np.sum(s > 1e-10 * s[0]) == 4


def test_regression_of_a_decoder_layer_is_its_transform():
    X, y, layer = make_attention_regression(
        50,
        12,
        16,
        4,
        distribution="gaussian",
        head_rank=4,
        causal=True,
        rope=True,
        rope_layout="interleaved",
        rope_theta=100.0,
        n_kv_heads=1,
        random_state=0,
        return_layer=True,
    )
    assert layer.causal and layer.rope_layout == "interleaved"
    assert layer.rope_theta == 100.0
    np.testing.assert_array_equal(y, layer.transform(X))
    # positions matter: the same tokens in another order give other outputs
    X3 = X.reshape(50, 12, 16)
    swapped = layer.transform(X3[:, ::-1]).reshape(50, 12, -1)[:, ::-1]
    assert np.abs(swapped[:, 0] - y.reshape(50, 12, -1)[:, 0]).max() > 1e-3


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"rope": True}, "rope=True needs head_rank"),
        ({"n_kv_heads": 2}, "n_kv_heads=2 needs head_rank"),
        ({"rope": True, "head_rank": 3}, "must be even"),
        ({"n_kv_heads": 3, "head_rank": 2}, "does not divide n_heads=4"),
        ({"rope": True, "head_rank": 2, "structure": "diagonal"}, "structure"),
        ({"causal": True, "n_tokens": 4, "sharpness": 0.9}, "sharpness"),
        ({"rope_layout": "gptj"}, "rope_layout"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"causal": "yes"}, "causal"),
    ],
)
def test_bad_decoder_options_give_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match) as info:
        make_attention_layer(4, 8, random_state=0, **kw)
    assert "\n" not in str(info.value)
