"""The loss, its gradient and the eliminated projections (``kernels/_loss.py``)."""

import tracemalloc

import numpy as np
import pytest
from _helpers import planted
from hypothesis import given, settings
from hypothesis import strategies as st

import skattn.solvers.kernels._loss as optimize
import skattn.solvers.optimizers._lbfgs as lbfgs
from skattn.layer._math import attention_patterns, forward, squared_loss_gradient
from skattn.solvers import (
    projection_normal_equations,
    reduced_loss_gradient,
    solve_projections,
)
from skattn.solvers.kernels._loss import _loss_gradient


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("d_out", [8, 16])
def test_solve_projections_recovers_w_exactly(m, d_out):
    X, Y, attention, projection = planted(400, 4, 8, m, d_out, seed=m)
    W = solve_projections(X, Y, attention)
    assert W.shape == (m, 8, d_out)
    np.testing.assert_allclose(W, projection, rtol=0, atol=1e-10)


def test_solve_projections_weights_equal_repetitions():
    X, Y, attention, _ = planted(60, 3, 4, 2, 3, seed=1)
    Y = Y + np.random.default_rng(2).normal(size=Y.shape)  # not realisable
    counts = np.random.default_rng(3).integers(1, 4, size=60)
    weighted = solve_projections(X, Y, attention, sample_weight=counts)
    repeated = solve_projections(
        np.repeat(X, counts, axis=0), np.repeat(Y, counts, axis=0), attention
    )
    np.testing.assert_allclose(weighted, repeated, rtol=1e-9, atol=1e-11)


def test_solve_projections_ridge_matches_explicit_design():
    X, Y, attention, _ = planted(50, 3, 4, 2, 2, seed=4)
    Y = Y + np.random.default_rng(5).normal(size=Y.shape)
    alpha = 0.3
    n, k, d = X.shape
    feats = np.matmul(attention_patterns(X, attention), X[:, None])
    A = feats.transpose(0, 2, 1, 3).reshape(n * k, -1) / np.sqrt(n)
    # min ||A W - Y/sqrt(n)||^2 / 2 + alpha ||W||^2 / 2, by an augmented lstsq
    aug = np.vstack([A, np.sqrt(alpha) * np.eye(A.shape[1])])
    rhs = np.vstack([Y.reshape(n * k, -1) / np.sqrt(n), np.zeros((A.shape[1], 2))])
    expected = np.linalg.lstsq(aug, rhs, rcond=None)[0].reshape(2, d, 2)
    W = solve_projections(X, Y, attention, alpha=alpha)
    np.testing.assert_allclose(W, expected, rtol=1e-10, atol=1e-12)


def test_solve_projections_singular_gram_falls_back():
    # two identical heads: the Gram matrix is singular, Cholesky fails
    X, Y, attention, projection = planted(80, 3, 4, 1, 2, seed=6)
    twin = np.concatenate([attention, attention])
    W = solve_projections(X, Y, twin)
    np.testing.assert_allclose(forward(X, twin, W), Y, atol=1e-10)
    np.testing.assert_allclose(W.sum(axis=0), projection[0], atol=1e-10)


def test_normal_equations_do_not_depend_on_chunking(monkeypatch):
    X, Y, attention, _ = planted(50, 3, 4, 2, 3, seed=7)
    weight = np.random.default_rng(8).uniform(0.5, 2.0, size=50)
    whole = projection_normal_equations(X, Y, attention, weight)
    monkeypatch.setattr(optimize, "_CHUNK_FLOATS", 100)
    assert len(optimize._chunks(50, 2 * 3 * (3 + 4))) > 5
    chunked = projection_normal_equations(X, Y, attention, weight)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("alpha", [0.0, 0.3])
@pytest.mark.parametrize("alpha_attention", [0.0, 0.2])
def test_loss_gradient_in_chunks_matches_whole_batch(alpha, alpha_attention):
    X, Y, attention, projection = planted(50, 3, 4, 2, 3, seed=11)
    rng = np.random.default_rng(12)
    Y = Y + rng.normal(size=Y.shape)
    projection = projection + 0.1 * rng.normal(size=projection.shape)
    weight = rng.integers(0, 3, size=50).astype(float)  # zero-weight chunks too
    loss, g_t, g_w = squared_loss_gradient(X, Y, attention, projection, weight)
    loss += 0.5 * alpha * np.sum(projection**2)
    loss += 0.5 * alpha_attention * np.sum(attention**2)
    expected = (loss, g_t + alpha_attention * attention, g_w + alpha * projection)
    for chunk_size in (50, 7, 1):
        got = _loss_gradient(
            X,
            Y,
            attention,
            projection,
            weight,
            alpha,
            chunk_size,
            alpha_attention=alpha_attention,
        )
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
        loss_only = _loss_gradient(
            X,
            Y,
            attention,
            projection,
            weight,
            alpha,
            chunk_size,
            alpha_attention=alpha_attention,
            gradient=False,
        )
        assert loss_only[0] == pytest.approx(expected[0], rel=1e-12)
        assert loss_only[1] is None and loss_only[2] is None


def test_solvers_do_not_depend_on_chunking(monkeypatch):
    X, Y, attention, _ = planted(60, 3, 4, 2, 3, seed=13)
    Y = Y + np.random.default_rng(14).normal(size=Y.shape)
    weight = np.random.default_rng(15).uniform(0.5, 2.0, size=60)
    W_whole = solve_projections(X, Y, attention, weight, alpha=0.1)
    reduced_whole = reduced_loss_gradient(X, Y, attention, weight, alpha=0.1)
    full_whole = lbfgs.lbfgs_layer(X, Y, attention, W_whole, weight, 0.1, 5, 0.0)
    monkeypatch.setattr(optimize, "_CHUNK_FLOATS", 100)
    assert optimize._loss_chunk_size(60, 3, 4, 3, 2) < 10
    W_chunked = solve_projections(X, Y, attention, weight, alpha=0.1)
    np.testing.assert_allclose(W_chunked, W_whole, rtol=1e-12, atol=1e-14)
    reduced_chunked = reduced_loss_gradient(X, Y, attention, weight, alpha=0.1)
    for a, b in zip(reduced_chunked, reduced_whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    full_chunked = lbfgs.lbfgs_layer(X, Y, attention, W_whole, weight, 0.1, 5, 0.0)
    np.testing.assert_allclose(full_chunked[0], full_whole[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(full_chunked[1], full_whole[1], rtol=1e-9, atol=1e-12)
    loss_whole = squared_loss_gradient(X, Y, attention, W_whole, weight)[0]
    loss_whole += 0.05 * np.sum(W_whole**2)
    loss = optimize._loss(X, Y, attention, W_whole, weight, 0.1)
    assert loss == pytest.approx(loss_whole, rel=1e-12)


def test_memory_does_not_grow_with_the_number_of_samples(monkeypatch):
    # With small chunks the peak is the chunk's, not the data's: linear growth
    # would give 4x from n=2000 to n=8000 (before chunking the refinement step
    # and the reduced gradient, solve_projections peaked at 38 / 154 MB for
    # n=1e4 / 4e4 with the default budget).
    monkeypatch.setattr(optimize, "_CHUNK_FLOATS", 2**12)
    peaks = []
    for n in (2000, 8000):
        X, Y, attention, _ = planted(n, 4, 8, 2, 8, seed=16)
        for function in (solve_projections, reduced_loss_gradient):
            tracemalloc.start()
            try:
                function(X, Y, attention)
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
    small, large = peaks[:2], peaks[2:]
    for a, b in zip(small, large, strict=True):
        assert b < 1.5 * a


@settings(max_examples=15, deadline=None)
@given(
    m=st.integers(1, 3),
    k=st.integers(2, 4),
    d=st.integers(2, 4),
    d_out=st.integers(1, 4),
    alpha=st.sampled_from([0.0, 0.1]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_reduced_gradient_matches_finite_differences(
    m, k, d, d_out, alpha, weighted, seed
):
    rng = np.random.default_rng(seed)
    n = 30
    X = rng.normal(size=(n, k, d))
    Y = rng.normal(size=(n, k, d_out))  # not realisable: W* != truth
    attention = rng.normal(size=(m, d, d))
    weight = rng.uniform(0.5, 2.0, size=n) if weighted else None
    if alpha == 0.0 and m * d > n * k:
        alpha = 0.1  # keep W* unique
    loss, grad, W = reduced_loss_gradient(X, Y, attention, weight, alpha)
    direction = rng.normal(size=attention.shape)
    eps = 1e-6
    plus = reduced_loss_gradient(X, Y, attention + eps * direction, weight, alpha)[0]
    minus = reduced_loss_gradient(X, Y, attention - eps * direction, weight, alpha)[0]
    numeric = (plus - minus) / (2 * eps)
    analytic = float(np.sum(grad * direction))
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic))
    # W is the minimiser: a perturbation does not decrease the (penalised) loss
    bumped = W + 1e-3 * rng.normal(size=W.shape)
    bumped_loss = squared_loss_gradient(X, Y, attention, bumped, weight)[0]
    assert loss <= bumped_loss + 0.5 * alpha * float(np.sum(bumped**2)) + 1e-12


def test_singular_gram_solve_matches_lstsq():
    """A singular Gram (tokens on a hyperplane plus a constant coordinate) is
    solved by the eigen-factored pseudo-inverse, as scipy's lstsq would."""
    from scipy import linalg

    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(200, 6))
    tokens -= tokens.mean(axis=1, keepdims=True)  # on the hyperplane sum(x) = 0
    design = np.hstack([tokens, np.ones((200, 1))])
    gram = design.T @ design
    rhs = design.T @ rng.normal(size=(200, 3))
    factor = optimize._PseudoInverse(gram)
    assert factor.vectors.shape[1] == 6  # the null direction is dropped
    expected = linalg.lstsq(gram, rhs, cond=7 * np.finfo(float).eps)[0]
    np.testing.assert_allclose(
        optimize._solve_psd(gram, rhs, factor), expected, atol=1e-10
    )
    # where Cholesky breaks down (here: an exactly zero pivot) _factor falls back
    padded = np.zeros((8, 8))
    padded[:7, :7] = gram
    assert isinstance(optimize._factor(padded), optimize._PseudoInverse)
    # a positive definite matrix keeps its Cholesky factor
    assert isinstance(optimize._factor(gram + np.eye(7)), tuple)


def test_uniform_residual_is_the_fit_of_heads_that_attend_uniformly():
    from skattn.solvers.kernels._loss import uniform_residual

    rng = np.random.default_rng(3)
    X, Y = rng.normal(size=(40, 5, 3)), rng.normal(size=(40, 5, 2))
    w = rng.uniform(0.5, 2.0, size=40)
    # every token's row of a uniform head is its sequence's mean token
    design = np.repeat(X.mean(axis=1), 5, axis=0) * np.sqrt(np.repeat(w, 5))[:, None]
    target = Y.reshape(-1, 2) * np.sqrt(np.repeat(w, 5))[:, None]
    coef = np.linalg.lstsq(design, target, rcond=None)[0]
    expected = np.linalg.norm(design @ coef - target) / np.linalg.norm(target)
    assert uniform_residual(X, Y, w) == pytest.approx(expected, rel=1e-12)
    # a layer with Theta_i = 0 is fitted exactly
    Y0 = np.repeat(X.mean(axis=1, keepdims=True), 5, axis=1) @ rng.normal(size=(3, 2))
    assert uniform_residual(X, Y0, w) < 1e-12
