"""The joint polish, its solver choice and its warm-up (``stages/_polish.py``)."""

import numpy as np
import pytest
from _helpers import (
    blas_threads,
    factored_planted,
    planted,
    record_polish_threads,
    relative,
)

from skattn.layer._math import forward, squared_loss_gradient
from skattn.solvers import FactoredHeads, choose_solver, polish
from skattn.solvers.stages._polish import staged_polish


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


def test_choose_solver():
    assert choose_solver(2, 8) == "dense"
    assert choose_solver(6, 8) == "dense"
    assert choose_solver(2, 16) == "matrix-free"
    assert choose_solver(2, 32) == "matrix-free"
    assert choose_solver(2, 16, head_rank=4) == "matrix-free"
    assert choose_solver(2, 64, hull=(None, None)) == "dense"


@pytest.mark.parametrize("solver", ["dense", "matrix-free"])
def test_polish_recovers_with_either_solver(solver):
    X, Y, attention, projection = planted(400, 4, 5, 2, 6)
    start = attention + 0.05 * np.random.default_rng(7).normal(size=attention.shape)
    th, W, info = polish(X, Y, start, solver=solver)
    assert info["solver"] == solver and info["converged"]
    assert (info["n_products"] > 0) == (solver == "matrix-free")
    np.testing.assert_allclose(th, attention, atol=1e-9)
    np.testing.assert_allclose(W, projection, atol=1e-9)


def test_staged_polish_runs_the_final_stage_with_noise():
    X, Y, attention, _ = planted(600, 4, 4, 1, 4, noise=0.01)
    _, _, info = staged_polish(
        X, Y, attention + 0.01, n_warmup_samples=200, random_state=0
    )
    assert info["final_stage"] == "ran" and info["warmup"] is not None
    assert info["n_polish_samples"] == 600


def test_polish_rejects_unsupported_combinations():
    X, Y, attention, _ = planted(50, 3, 4, 1)
    with pytest.raises(ValueError, match="solver must be"):
        polish(X, Y, attention, solver="cg")
    with pytest.raises(ValueError, match="head_rank needs the matrix-free"):
        polish(X, Y, attention, head_rank=2, solver="dense")
    with pytest.raises(ValueError, match="ridge alpha"):
        polish(X, Y, attention, solver="matrix-free", alpha=0.1)


@pytest.mark.parametrize("n_warmup_samples", [300, 1000])
def test_warm_up_on_the_principal_outputs_of_low_rank_heads(n_warmup_samples):
    # rank-2 heads into 40 outputs: the warm-up fits 2 * 2 + 9 = 13 directions, on a
    # subset or (no more examples than a warm-up) on all of them
    rng = np.random.default_rng(10)
    X = rng.normal(size=(800, 4, 6))
    attention = rng.normal(size=(2, 6, 2)) @ rng.normal(size=(2, 2, 6)) / 3
    projection = rng.normal(size=(2, 6, 2)) @ rng.normal(size=(2, 2, 40)) / 3
    Y = forward(X, attention, projection)
    th, W, info = staged_polish(
        X,
        Y,
        attention + 0.02 * rng.normal(size=attention.shape),
        head_rank=2,
        n_warmup_samples=n_warmup_samples,
        random_state=0,
    )
    assert info["warmup"]["output_rank"] == 13
    assert info["final_stage"] == "skipped: realisable"
    np.testing.assert_allclose(th, attention, atol=1e-8)
    np.testing.assert_allclose(W, projection, atol=1e-8)


def test_staged_polish_does_not_polish_an_exact_start():
    X, Y, attention, _ = planted(400, 4, 5, 2, 5, seed=14)
    _, _, info = staged_polish(
        X, Y, attention, n_warmup_samples=100, solver="matrix-free", random_state=0
    )
    assert info["warmup"]["stop_reason"] == "start"
    assert info["final_stage"] == "skipped: realisable"
    assert info["n_iter"] == 0 and info["relative_residual"] < 1e-12


def test_polish_with_factored_values_recovers_an_intercept():
    X, Y, truth = factored_planted(300, 4, 5, 2, 2, 12, seed=1, intercept=True)
    par = FactoredHeads(2, 6, 2)
    start = par.attention(truth) + 0.05
    attention, projection, info = polish(
        X, Y, start, head_rank=2, intercept=True, factor_values=True
    )
    assert info["stages"][0]["factored_values"]
    assert info["converged"]
    np.testing.assert_allclose(forward(X, attention, projection), Y, atol=1e-9)
    # the last column of Theta_i on [x, 1] tokens is a gauge (constant in a row)
    np.testing.assert_allclose(
        attention[:, :, :-1], par.attention(truth)[:, :, :-1], atol=1e-8
    )
    # without the intercept column a rank-2 V_i O_i cannot fit these outputs
    _, _, info = polish(X, Y, start, head_rank=2, factor_values=True, max_iter=30)
    assert info["loss"] > 1e-6


def test_the_matrix_free_polish_takes_its_products_jobs_from_blas_threads(
    monkeypatch,
):
    # the products' chunks in as many jobs as BLAS has threads (at most 2), each
    # job on one BLAS thread inside the problem; the polish itself leaves BLAS's
    # threads to the evaluations' Gram
    from threadpoolctl import threadpool_limits

    import skattn.solvers.stages._polish as polish_module

    X, Y, attention, _ = planted(400, 4, 5, 2, 6)
    start = attention + 0.05 * np.random.default_rng(0).normal(size=attention.shape)
    seen = record_polish_threads(monkeypatch, polish_module)
    for threads in (1, 2):
        seen.clear()
        with threadpool_limits(threads, user_api="blas"):
            available = blas_threads()  # a BLAS built for one thread: 1
            found, _, info = polish(X, Y, start, solver="matrix-free")
        assert seen == [(min(2, available), available)]
        assert relative(found, attention) < 1e-6 and info["converged"]
