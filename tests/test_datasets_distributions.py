"""Tests of skattn.datasets' input distributions (skattn/datasets/_distributions.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skattn.datasets import (
    BooleanTokens,
    GaussianTokens,
    TokenizedMixture,
    resolve_distribution,
    sample_inputs,
)

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


def test_vocabulary_tokens_are_words_and_positions():
    from skattn.datasets import VocabularyTokens, sample_inputs

    X = sample_inputs("vocabulary", 500, 4, 7, random_state=0).reshape(500, 4, 7)
    dist = VocabularyTokens(4, 7)
    # the last d // 2 features: the same position vector at every sequence
    np.testing.assert_array_equal(
        X[:, :, 4:], np.broadcast_to(dist.positions, (500, 4, 3))
    )
    # the first d - d // 2: rows of the vocabulary, drawn from all of it
    words = X[:, :, :4].reshape(-1, 4)
    table = {tuple(row) for row in dist.words}
    assert all(tuple(word) in table for word in words)
    assert len(np.unique(words, axis=0)) > 1000
    with pytest.raises(ValueError, match="n_features >= 2"):
        VocabularyTokens(4, 1)
