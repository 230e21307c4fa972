"""Tests of skattn.layer.AttentionLayer and check_layer_parameters."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer

from skattn import AttentionLayer
from skattn.layer import check_layer_parameters
from skattn.layer._math import attention_patterns, forward
from skattn.utils.estimator_checks import parametrize_with_checks


def random_layer(seed=0, m=2, d=3, d_out=4, n_tokens=None):
    rng = np.random.default_rng(seed)
    return AttentionLayer(
        rng.standard_normal((m, d, d)),
        rng.standard_normal((m, d, d_out)),
        n_tokens=n_tokens,
    )


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 5),
    k=st.integers(1, 5),
    d=st.integers(1, 4),
    m=st.integers(1, 3),
    d_out=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_transform_equals_forward(n, k, d, m, d_out, seed):
    rng = np.random.default_rng(seed)
    th = rng.standard_normal((m, d, d))
    W = rng.standard_normal((m, d, d_out))
    X3 = rng.standard_normal((n, k, d))
    layer = AttentionLayer(th, W)
    expected = forward(X3, th, W).reshape(n, k * d_out)
    np.testing.assert_array_equal(layer.transform(X3.reshape(n, -1)), expected)
    # 3-D and 2-D inputs agree, fitted or not, with an explicit n_tokens too
    np.testing.assert_array_equal(layer.transform(X3), expected)
    fitted = AttentionLayer(th, W, n_tokens=k).fit(X3.reshape(n, -1))
    np.testing.assert_array_equal(fitted.transform(X3.reshape(n, -1)), expected)
    np.testing.assert_array_equal(fitted.transform(X3), expected)
    np.testing.assert_array_equal(
        layer.attention_patterns(X3), attention_patterns(X3, th)
    )


@settings(max_examples=30, deadline=None)
@given(k=st.integers(2, 6), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_token_permutation_equivariance(k, seed, data):
    """F(P X) = P F(X): attention has no notion of position."""
    perm = np.array(data.draw(st.permutations(range(k))))
    layer = random_layer(seed % 1000, m=2, d=3, d_out=2)
    X3 = np.random.default_rng(seed).standard_normal((4, k, 3))
    Y3 = layer.transform(X3).reshape(4, k, 2)
    Y3_perm = layer.transform(X3[:, perm]).reshape(4, k, 2)
    np.testing.assert_allclose(Y3_perm, Y3[:, perm], rtol=1e-12, atol=1e-12)


def test_single_token_is_linear():
    layer = random_layer(0)
    X = np.random.default_rng(1).standard_normal((5, 3))
    np.testing.assert_allclose(
        layer.transform(X), X @ layer.projection.sum(axis=0), rtol=1e-12
    )


def test_docstring_example_and_properties():
    layer = AttentionLayer(np.zeros((1, 2, 2)), np.eye(2)[None])
    np.testing.assert_array_equal(
        layer.transform(np.array([[1.0, -1.0, 1.0, 1.0]])), [[1.0, 0.0, 1.0, 0.0]]
    )
    layer = random_layer(0, m=3, d=5, d_out=2)
    assert (layer.n_heads, layer.n_features, layer.n_outputs) == (3, 5, 2)


def test_fit_sets_shape_attributes_and_names():
    layer = random_layer(0, n_tokens=None)
    X = np.random.default_rng(0).standard_normal((6, 4, 3))
    fitted = layer.fit(X)
    assert fitted is layer
    assert layer.n_tokens_ == 4 and layer.n_features_in_ == 12
    names = layer.get_feature_names_out()
    assert list(names[:5]) == ["token0_out0", "token0_out1", "token0_out2"] + [
        "token0_out3",
        "token1_out0",
    ]
    assert len(names) == 16
    with pytest.raises(NotFittedError):
        random_layer(0).get_feature_names_out()


def test_pipeline_and_clone():
    layer = random_layer(0, n_tokens=2)
    X = np.random.default_rng(0).standard_normal((5, 6))
    pipe = make_pipeline(FunctionTransformer(), clone(layer))
    np.testing.assert_allclose(pipe.fit_transform(X), layer.transform(X))


# -- bad input -------------------------------------------------------------------------


@pytest.fixture
def layer():
    return random_layer(0, m=2, d=3, d_out=4)


@pytest.mark.parametrize("fitted", [False, True])
@pytest.mark.parametrize("value, word", [(np.nan, "NaN"), (np.inf, "infinity")])
def test_non_finite_X(layer, fitted, value, word):
    X = np.ones((4, 6))
    if fitted:
        layer.fit(X)
    X[2, 3] = value
    with pytest.raises(ValueError, match=f"Input X contains {word}"):
        layer.transform(X)


@pytest.mark.parametrize("which", ["attention", "projection"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_parameters(which, value):
    layer = random_layer(0)
    getattr(layer, which)[1, 0, 2] = value
    with pytest.raises(ValueError, match=f"{which} contains 1 NaN or infinite"):
        layer.transform(np.ones((2, 6)))
    with pytest.raises(ValueError, match=f"{which} contains 1 NaN or infinite"):
        layer.fit(np.ones((2, 6)))


@pytest.mark.parametrize(
    "shape, dims", [((6,), "1-D"), ((2, 2, 2, 3), "4-D"), ((), "0-D")]
)
def test_wrong_rank_of_X(layer, shape, dims):
    with pytest.raises(ValueError, match=rf"X must be 2-D .* or 3-D .*got a {dims}"):
        layer.transform(np.ones(shape))
    with pytest.raises(ValueError, match=rf"X must be 2-D .* or 3-D .*got a {dims}"):
        layer.fit(np.ones(shape))


def test_wrong_rank_of_parameters():
    W = np.ones((2, 3, 4))
    with pytest.raises(
        ValueError,
        match=r"attention must have shape \(n_heads, n_features, n_features\), "
        r"got \(3,\)",
    ):
        AttentionLayer(np.ones(3), W).transform(np.ones((2, 6)))
    with pytest.raises(ValueError, match=r"attention .* got \(2, 3, 4\)"):
        AttentionLayer(np.ones((2, 3, 4)), W).transform(np.ones((2, 6)))
    with pytest.raises(
        ValueError,
        match=r"projection must have shape \(n_heads, n_features, n_outputs\), "
        r"got \(1, 2, 3, 4\)",
    ):
        AttentionLayer(np.ones((2, 3, 3)), np.ones((1, 2, 3, 4))).transform(
            np.ones((2, 6))
        )


def test_attention_matrices_that_are_not_square_name_the_expected_shape():
    layer = AttentionLayer(np.ones((2, 3, 4)), np.ones((2, 3, 5)))  # not validated
    match = (
        r"got \(2, 3, 4\): its matrices are 3 x 4, not square .* projection of "
        r"shape \(2, 3, 5\) has n_features=3, so attention of shape \(2, 3, 3\) "
        r"is expected"
    )
    for use in (
        lambda: layer.transform(np.ones((1, 6))),
        lambda: layer.fit(np.ones((1, 6))),
        layer.factors,
        lambda: layer.n_features,  # the properties validate too
        lambda: layer.n_outputs,
    ):
        with pytest.raises(ValueError, match=match):
            use()


def test_mismatched_head_counts_and_widths():
    with pytest.raises(ValueError, match="attention has 2 heads but projection has 3"):
        AttentionLayer(np.ones((2, 3, 3)), np.ones((3, 3, 4))).transform(
            np.ones((1, 6))
        )
    with pytest.raises(
        ValueError, match=r"attention acts on 3 features .* projection expects 5"
    ):
        AttentionLayer(np.ones((2, 3, 3)), np.ones((2, 5, 4))).transform(
            np.ones((1, 6))
        )


def test_widths_not_divisible(layer):
    with pytest.raises(
        ValueError, match="X has 7 columns, not a multiple of the layer's n_features=3"
    ):
        layer.transform(np.ones((2, 7)))
    with_k = random_layer(0, n_tokens=4)
    with pytest.raises(
        ValueError, match="X has 6 columns.*not divisible by n_tokens=4"
    ):
        with_k.transform(np.ones((2, 6)))
    with pytest.raises(
        ValueError, match="X has 6 columns.*not divisible by n_tokens=4"
    ):
        with_k.fit(np.ones((2, 6)))
    with pytest.raises(ValueError, match="n_tokens=3 but X is 3-D with 2 tokens"):
        random_layer(0, n_tokens=3).transform(np.ones((2, 2, 3)))
    with pytest.raises(
        ValueError, match="X has 8 columns = 2 tokens x 4 features, but the layer "
    ):
        layer.transform(np.ones((2, 2, 4)))
    layer.fit(np.ones((2, 6)))
    with pytest.raises(ValueError, match="X has 9 features, but AttentionLayer"):
        layer.transform(np.ones((2, 9)))


def test_bad_n_tokens_parameter():
    with pytest.raises(ValueError, match="'n_tokens' parameter"):
        random_layer(0, n_tokens=0).fit(np.ones((2, 6)))


def test_inputs_left_unmodified():
    rng = np.random.default_rng(0)
    th = rng.standard_normal((2, 3, 3))
    W = rng.standard_normal((2, 3, 4))
    X = rng.standard_normal((5, 6))
    X3 = X.reshape(5, 2, 3).copy()
    copies = [a.copy() for a in (th, W, X, X3)]
    layer = AttentionLayer(th, W)
    layer.transform(X)
    layer.transform(X3)
    layer.attention_patterns(X)
    layer.fit(X).transform(X)
    for original, copy in zip((th, W, X, X3), copies, strict=True):
        np.testing.assert_array_equal(original, copy)
    assert layer.attention is th and layer.projection is W  # stored as given


def test_check_layer_parameters_promotes_single_head():
    th, W = check_layer_parameters(np.eye(3), np.ones((3, 2)))
    assert th.shape == (1, 3, 3) and W.shape == (1, 3, 2)
    assert th.dtype == W.dtype == np.float64


def test_factors_refuse_heads_of_higher_rank_than_head_rank():
    rng = np.random.default_rng(0)
    full = AttentionLayer(rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 4)))
    # head_rank=1 used to truncate: max |Q K^T - Theta| of 1.1 without a word
    declared = clone(full).set_params(head_rank=1)
    match = (
        r"head_rank=1 but the attention matrices have ranks \[4, 4\] \(singular "
        r"values above 1e-08 times the largest\); factors of rank 1 would truncate "
        r"them\. Pass head_rank >= 4 or head_rank=None\."
    )
    for call in (declared.factors, lambda: declared.fit(np.ones((2, 8)))):
        with pytest.raises(ValueError, match=match):
            call()
    # heads of rank 1 up to rounding pass, and their factors are the heads
    q, k, v = rng.normal(size=(3, 2, 4, 1))
    theta = q @ k.transpose(0, 2, 1) + 1e-12 * rng.normal(size=(2, 4, 4))
    low = AttentionLayer(theta, v @ rng.normal(size=(2, 1, 4)), head_rank=1)
    query, key, _, _ = low.factors()
    assert query.shape == (2, 4, 1)
    np.testing.assert_allclose(query @ key.transpose(0, 2, 1), theta, atol=1e-10)
    assert len(full.factors()[0][0, 0]) == 4  # head_rank=None: full rank


def test_a_failed_refit_keeps_the_fitted_widths():
    layer = random_layer(0, d=3).fit(np.ones((2, 6)))
    with pytest.raises(ValueError, match="not a multiple of the layer's n_features"):
        layer.fit(np.ones((2, 8)))  # validated the width (8) before failing
    assert (layer.n_features_in_, layer.n_tokens_) == (6, 2)
    assert layer.transform(np.ones((2, 6))).shape == (2, 8)


# scikit-learn's and skattn's checks on a planted decoder layer: causal, rotary,
# two query heads sharing one key/value head (5 features per token).
DECODER_LAYER = AttentionLayer(
    np.zeros((2, 5, 5)),
    np.random.default_rng(1).normal(size=(2, 5, 5)),
    causal=True,
    rotary_query=np.random.default_rng(2).normal(size=(2, 6, 2)),
    rotary_key=np.random.default_rng(3).normal(size=(1, 6, 2)),
    rope_theta=100.0,
)


@parametrize_with_checks([DECODER_LAYER])
def test_decoder_layer_passes_the_estimator_checks(estimator, check):
    check(estimator)


def test_a_layer_is_callable_and_predicts_what_it_transforms():
    # a layer read back from a file stands in for the estimator (issue 52, point 6)
    layer = random_layer(seed=3, n_tokens=4)
    X = np.random.default_rng(0).standard_normal((5, 12))
    expected = layer.transform(X)
    np.testing.assert_array_equal(layer(X), expected)
    np.testing.assert_array_equal(layer.predict(X), expected)
    np.testing.assert_array_equal(layer(X.reshape(5, 4, 3)), expected)
