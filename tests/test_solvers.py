import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import skattn.solvers._lbfgs as lbfgs
import skattn.solvers._objective as optimize
from skattn.layer._math import attention_patterns, forward, squared_loss_gradient
from skattn.solvers import (
    polish,
    projection_normal_equations,
    reduced_loss_gradient,
    solve_projections,
)
from skattn.solvers._dense import _gauss_newton_system
from skattn.solvers._objective import _loss_gradient


def planted(n, k, d, m, d_out=None, scale=2.0, seed=0, gaussian=False):
    """Noise-free data from a random layer: ||Theta_i||_F = scale, W ~ N(0, 1/d)."""
    rng = np.random.default_rng(seed)
    d_out = d if d_out is None else d_out
    attention = rng.normal(size=(m, d, d))
    attention *= scale / np.linalg.norm(attention, axis=(1, 2), keepdims=True)
    projection = rng.normal(size=(m, d, d_out)) / np.sqrt(d)
    if gaussian:
        X = rng.normal(size=(n, k, d))
    else:
        X = rng.choice([-1.0, 1.0], size=(n, k, d))
    return X, forward(X, attention, projection), attention, projection


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


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
    full_whole = lbfgs._full_lbfgs(X, Y, attention, W_whole, weight, 0.1, 5, 0.0)
    monkeypatch.setattr(optimize, "_CHUNK_FLOATS", 100)
    assert optimize._loss_chunk_size(60, 3, 4, 3, 2) < 10
    W_chunked = solve_projections(X, Y, attention, weight, alpha=0.1)
    np.testing.assert_allclose(W_chunked, W_whole, rtol=1e-12, atol=1e-14)
    reduced_chunked = reduced_loss_gradient(X, Y, attention, weight, alpha=0.1)
    for a, b in zip(reduced_chunked, reduced_whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    full_chunked = lbfgs._full_lbfgs(X, Y, attention, W_whole, weight, 0.1, 5, 0.0)
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


def test_gauss_newton_blocks_match_numeric_jacobian():
    rng = np.random.default_rng(0)
    n, k, d, m, o = 6, 3, 3, 2, 2
    X = rng.choice([-1.0, 1.0], size=(n, k, d))
    attention = rng.normal(size=(m, d, d))
    projection = rng.normal(size=(m, d, o))
    Y = rng.normal(size=(n, k, o))
    weight = rng.uniform(0.5, 2.0, size=n)
    loss, g_t, g_w, h_tt, h_tw, gram = _gauss_newton_system(
        X, Y, attention, projection, weight, 0.0
    )
    ref_loss, ref_gt, ref_gw = squared_loss_gradient(
        X, Y, attention, projection, weight
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    np.testing.assert_allclose(g_t, ref_gt.ravel(), atol=1e-12)
    np.testing.assert_allclose(g_w, ref_gw.reshape(m * d, o), atol=1e-12)
    scale = np.sqrt(weight / weight.sum())[:, None, None]

    def residual(x):
        th = x[: m * d * d].reshape(m, d, d)
        W = x[m * d * d :].reshape(m, d, o)
        return ((forward(X, th, W) - Y) * scale).ravel()

    x0 = np.concatenate([attention.ravel(), projection.ravel()])
    jac = np.empty((residual(x0).size, x0.size))
    for j in range(x0.size):
        e = np.zeros_like(x0)
        e[j] = 1e-6
        jac[:, j] = (residual(x0 + e) - residual(x0 - e)) / 2e-6
    H = jac.T @ jac
    p = m * d * d
    np.testing.assert_allclose(h_tt, H[:p, :p], atol=1e-8)
    np.testing.assert_allclose(h_tw.reshape(p, -1), H[:p, p:], atol=1e-8)
    np.testing.assert_allclose(np.kron(gram, np.eye(o)), H[p:, p:], atol=1e-8)


@pytest.mark.parametrize("method", ["levenberg-marquardt", "lbfgs"])
@pytest.mark.parametrize("m", [1, 2])
def test_polish_converges_from_a_perturbed_start(method, m):
    X, Y, attention, projection = planted(300, 4, 6, m, 6, seed=10 + m)
    start = attention + 0.15 * np.random.default_rng(0).normal(size=attention.shape)
    mode = "both" if method == "lbfgs" else "varpro"
    th, W, info = polish(X, Y, start, method=method, mode=mode, max_iter=500)
    assert relative(th, attention) < 1e-7
    assert relative(W, projection) < 1e-7
    assert info["converged"]
    assert info["loss"] < 1e-14 * info["loss_start"]
    expected = ["varpro", "full"] if mode == "both" else ["varpro"]
    assert [s["stage"] for s in info["stages"]] == expected
    assert info["stages"][0]["method"] == method


def test_polish_full_mode_uses_the_given_projection():
    X, Y, attention, projection = planted(200, 3, 4, 1, 4, seed=3)
    start_th = attention + 0.02
    th, W, info = polish(X, Y, start_th, projection + 0.02, mode="full", tol=1e-12)
    assert [s["stage"] for s in info["stages"]] == ["full"]
    assert relative(th, attention) < 1e-6
    assert relative(W, projection) < 1e-6


@pytest.mark.parametrize("method", ["levenberg-marquardt", "lbfgs"])
def test_polish_in_the_hull_stays_in_the_hull(method):
    X, Y, attention, projection = planted(300, 4, 5, 2, 5, seed=21)
    diff = attention[1] - attention[0]
    directions = (diff / np.linalg.norm(diff))[None]
    point = attention[0] + 0.3 * directions[0]
    hull = (point, directions)
    start = attention + 0.2 * directions[0] * np.array([1.0, -1.0])[:, None, None]
    th, W, info = polish(X, Y, start, hull=hull, method=method, max_iter=300)
    # the true heads lie in this hull, so the restricted optimum is the truth
    assert relative(th, attention) < 1e-7
    coords = np.einsum("mde,rde->mr", th - point, directions)
    residual_off_hull = th - point - np.einsum("mr,rde->mde", coords, directions)
    assert np.abs(residual_off_hull).max() < 1e-12
    assert info["converged"]


def test_polish_rejects_bad_mode_and_method():
    X, Y, attention, _ = planted(20, 2, 2, 1, 2)
    with pytest.raises(ValueError, match="mode"):
        polish(X, Y, attention, mode="all")
    with pytest.raises(ValueError, match="method"):
        polish(X, Y, attention, method="adam")


def test_polish_on_noisy_data_stops_at_a_stationary_point():
    X, Y, attention, _ = planted(300, 4, 5, 2, 5, seed=30)
    Y = Y + 0.05 * np.random.default_rng(1).normal(size=Y.shape)
    weight = np.random.default_rng(2).uniform(0.5, 2.0, size=300)
    th, W, info = polish(X, Y, attention, sample_weight=weight, alpha=1e-3)
    loss, g_t, g_w = squared_loss_gradient(X, Y, th, W, weight)
    assert info["converged"]
    assert np.abs(g_t).max() < 1e-9
    assert np.abs(g_w + 1e-3 * W).max() < 1e-9
    assert info["loss"] == pytest.approx(loss + 0.5e-3 * np.sum(W**2), rel=1e-9)


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


def test_matrix_free_polish_recovers_tokens_on_a_hyperplane():
    """Inputs after a LayerNorm plus the intercept's constant coordinate make every
    Gram matrix of the projections singular; the polish still recovers the layer."""
    rng = np.random.default_rng(1)
    n, k, d = 600, 4, 6
    x = rng.normal(size=(n, k, d))
    x -= x.mean(axis=2, keepdims=True)
    X = np.concatenate([x, np.ones((n, k, 1))], axis=2)
    theta = rng.normal(scale=0.5, size=(2, d + 1, d + 1))
    theta[:, :, d] = 0.0  # the key's constant column is a gauge
    W = rng.normal(size=(2, d + 1, 5))
    Y = forward(X, theta, W)
    start = theta + 0.05 * rng.normal(size=theta.shape)
    th_hat, W_hat, info = polish(X, Y, start, solver="matrix-free")
    assert info["loss"] < 1e-20
    np.testing.assert_allclose(forward(X, th_hat, W_hat), Y, atol=1e-9)
