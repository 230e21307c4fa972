"""Tests of skattn.datasets: input distributions and planted layers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skattn import AttentionLayer
from skattn.datasets import (
    BooleanTokens,
    GaussianTokens,
    TokenizedMixture,
    make_attention_layer,
    make_attention_regression,
    resolve_distribution,
    sample_inputs,
)
from skattn.layer._math import attention_logits, forward

DISTRIBUTIONS = [
    BooleanTokens(4, 8),
    GaussianTokens(3, 5),
    TokenizedMixture(5, 4, n_classes=3, n_relevant=2, noise_mean=1.5),
    # wide rows: a chunk holds fewer than 1024 rows
    GaussianTokens(16, 64),
]


# -- distributions ---------------------------------------------------------------------


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=repr)
@pytest.mark.parametrize("batch_size", [1, 3, 7, 256, 1023, 1024, 1025, 2500, 5000])
def test_iter_batches_concatenate_to_sample(dist, batch_size):
    n = 2500
    full = dist.sample(n, random_state=7)
    batches = list(dist.iter_batches(n, batch_size, random_state=7))
    assert all(b.shape[0] == batch_size for b in batches[:-1])
    assert 1 <= batches[-1].shape[0] <= batch_size
    np.testing.assert_array_equal(np.concatenate(batches), full)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3000),
    batch_size=st.integers(1, 4000),
    seed=st.integers(0, 2**32 - 1),
)
def test_iter_batches_property(n, batch_size, seed):
    dist = TokenizedMixture(3, 2, n_relevant=2)
    X, labels = dist.sample(n, random_state=seed, return_labels=True)
    parts = list(dist.iter_batches(n, batch_size, seed, return_labels=True))
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), X)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), labels)


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=repr)
def test_sample_is_prefix_and_deterministic(dist):
    big = dist.sample(3000, random_state=11)
    assert big.shape == (3000, dist.n_tokens * dist.n_features)
    assert big.dtype == np.float64 and big.flags.c_contiguous
    np.testing.assert_array_equal(dist.sample(10, random_state=11), big[:10])
    np.testing.assert_array_equal(dist.sample(3000, random_state=11), big)
    assert not np.array_equal(dist.sample(10, random_state=12), big[:10])


@pytest.mark.parametrize("make_state", [np.random.RandomState, np.random.default_rng])
def test_random_state_instances(make_state):
    dist = GaussianTokens(2, 3)
    a = dist.sample(20, random_state=make_state(5))
    b = dist.sample(20, random_state=make_state(5))
    np.testing.assert_array_equal(a, b)
    state = make_state(5)  # an instance is advanced: two draws differ
    assert not np.array_equal(dist.sample(20, state), dist.sample(20, state))
    batches = list(dist.iter_batches(20, 6, random_state=make_state(5)))
    np.testing.assert_array_equal(np.concatenate(batches), a)


def test_random_state_none_uses_global_state():
    dist = BooleanTokens(2, 3)
    np.random.seed(3)  # noqa: NPY002 (None means the global state)
    a = dist.sample(10)
    np.random.seed(3)  # noqa: NPY002 (None means the global state)
    np.testing.assert_array_equal(dist.sample(10), a)


def test_boolean_tokens_support_and_moments():
    X = BooleanTokens(4, 8).sample(4000, random_state=0)
    assert set(np.unique(X)) == {-1.0, 1.0}
    assert abs(X.mean()) < 0.01
    # independent entries: the empirical correlation between columns is small
    corr = np.corrcoef(X[:, :8].T)
    assert np.max(np.abs(corr - np.eye(8))) < 0.07


def test_gaussian_tokens_moments():
    X = GaussianTokens(3, 4).sample(5000, random_state=0)
    assert abs(X.mean()) < 0.02
    assert abs(X.std() - 1.0) < 0.02


def test_tokenized_mixture_generator():
    k, d = 6, 5
    dist = TokenizedMixture(k, d, n_classes=3, n_relevant=2, signal=4.0, noise=0.0)
    X, labels = dist.sample(3000, random_state=0, return_labels=True)
    X3 = X.reshape(-1, k, d)
    assert set(np.unique(labels)) == {0, 1, 2}
    np.testing.assert_allclose(np.bincount(labels) / 3000, 1 / 3, atol=0.03)
    relevant = np.linalg.norm(X3, axis=2) > 0
    np.testing.assert_array_equal(relevant.sum(axis=1), 2)  # n_relevant per row
    # every relevant token is exactly the class mean mu_c = signal * e_c
    rows, cols = np.nonzero(relevant)
    np.testing.assert_array_equal(X3[rows, cols], 4.0 * np.eye(d)[labels[rows]])
    # positions are uniform over the k slots
    np.testing.assert_allclose(relevant.mean(axis=0), 2 / k, atol=0.03)
    np.testing.assert_array_equal(dist.class_means, 4.0 * np.eye(d)[:3])


def test_tokenized_mixture_noise_tokens():
    dist = TokenizedMixture(4, 3, n_classes=2, noise=0.5, noise_mean=2.0)
    np.testing.assert_array_equal(dist.noise_mean_vector, [0.0, 0.0, 2.0])
    X = dist.sample(4000, random_state=1).reshape(-1, 4, 3)
    # noise tokens have zero on the class coordinates up to noise: check the mean
    # of the third coordinate over all tokens (3 of 4 are noise tokens)
    np.testing.assert_allclose(X[:, :, 2].mean(), 2.0 * 3 / 4, atol=0.03)
    np.testing.assert_allclose(X[:, :, 2].std(), np.sqrt(0.25 + 3 / 16 * 4), atol=0.05)


def test_tokenized_mixture_bad_parameters():
    with pytest.raises(ValueError, match="n_relevant=5 exceeds n_tokens=4"):
        TokenizedMixture(4, 3, n_relevant=5)
    with pytest.raises(ValueError, match="n_features >= 3"):
        TokenizedMixture(4, 2, noise_mean=1.0)
    with pytest.raises(ValueError, match="noise"):
        TokenizedMixture(4, 3, noise=-1.0)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_bad_shapes_and_counts(bad):
    with pytest.raises(ValueError, match="n_tokens must be a positive integer"):
        BooleanTokens(bad, 3)
    with pytest.raises(ValueError, match="n_samples must be a positive integer"):
        GaussianTokens(2, 3).sample(bad)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        next(GaussianTokens(2, 3).iter_batches(5, bad))


def test_boolean_check_rejects_non_boolean_values():
    dist = BooleanTokens(2, 2)
    X = dist.sample(5, random_state=0)
    np.testing.assert_array_equal(dist.check(X), X)
    np.testing.assert_array_equal(dist.check(X.reshape(5, 2, 2)), X)
    X[3, 1] = 0.5
    with pytest.raises(ValueError, match=r"found 0.5 at row 3, column 1") as info:
        dist.check(X)
    assert 'input_distribution="gaussian"' in str(info.value)
    with pytest.raises(ValueError, match="X has 3 columns, expected"):
        dist.check(np.ones((2, 3)))
    with pytest.raises(ValueError, match="NaN or infinite"):
        GaussianTokens(1, 2).check([[np.nan, 0.0]])


def test_names_repr_and_resolution():
    assert BooleanTokens(2, 3).name == "boolean"
    assert GaussianTokens(2, 3).name == "gaussian"
    assert TokenizedMixture(2, 3).name == "tokenized_mixture"
    assert repr(BooleanTokens(2, 3)) == "BooleanTokens(n_tokens=2, n_features=3)"
    assert resolve_distribution("gaussian", 2, 3) == GaussianTokens(2, 3)
    with pytest.raises(ValueError, match="distribution must be one of"):
        resolve_distribution("uniform", 2, 3)
    with pytest.raises(ValueError, match="expected n_tokens=4"):
        resolve_distribution(GaussianTokens(2, 3), 4, 3)
    np.testing.assert_array_equal(
        sample_inputs("gaussian", 5, 2, 3, random_state=0),
        GaussianTokens(2, 3).sample(5, random_state=0),
    )


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
