"""The held-out error of a layer (skattn/metrics/_held_out.py)."""

import numpy as np
import pytest

import skattn.diagnostics
from skattn.layer._math import forward
from skattn.metrics._held_out import held_out_error


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(3000, 3, 4))
    th, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 5))
    clean = forward(X, th, W)
    return X, clean, clean + 0.1 * rng.normal(size=clean.shape), th, W


def test_is_the_public_diagnostic():
    assert skattn.diagnostics.held_out_error is held_out_error


def test_exact_layer_has_zero_error(data):
    X, clean, _, th, W = data
    err, (low, high), losses = held_out_error(X, clean, th, W)
    assert err == low == high == 0.0
    assert losses.shape == (len(X),) and not losses.any()


def test_interval_covers_the_noise_level(data):
    X, clean, noisy, th, W = data
    expected = np.sqrt(0.01 * noisy[0].size / np.mean(np.sum(noisy**2, axis=(1, 2))))
    err, (low, high), losses = held_out_error(X, noisy, th, W)
    assert low < expected < high and err == pytest.approx(expected, rel=0.05)
    np.testing.assert_allclose(losses, np.sum((noisy - clean) ** 2, axis=(1, 2)))
    wider = held_out_error(X, noisy, th, W, level=0.99)[1]
    assert wider[0] < low and high < wider[1]


def test_sample_weight(data):
    X, _, noisy, th, W = data
    unweighted = held_out_error(X, noisy, th, W)
    ones = held_out_error(X, noisy, th, W, sample_weight=np.full(len(X), 3.0))
    assert ones[0] == pytest.approx(unweighted[0]) and ones[1] == pytest.approx(
        unweighted[1]
    )
    # a zero weight leaves an example out
    weight = np.r_[np.zeros(1000), np.ones(2000)]
    left_out = held_out_error(X, noisy, th, W, sample_weight=weight)
    assert left_out[0] == pytest.approx(
        held_out_error(X[1000:], noisy[1000:], th, W)[0]
    )


def test_zero_targets_give_the_absolute_error(data):
    X, clean, _, th, W = data
    err, interval, _ = held_out_error(X, np.zeros_like(clean), th, W)
    assert err == pytest.approx(np.sqrt(np.mean(np.sum(clean**2, axis=(1, 2)))))
    assert interval == (err, err)
