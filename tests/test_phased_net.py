import math

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from skattn.layer._math import forward
from skattn.phased import fit_from_hull
from skattn.phased._net import (
    _MAX_GRID_GRAM,
    _candidate_residuals,
    _default_resolution,
    hull_grid,
    minimum_norm_point,
    net_search,
)
from skattn.solvers import projection_normal_equations, solve_projections


def planted(n, k, d, m, d_out=None, scale=2.0, seed=0):
    """Noise-free Boolean data: ||Theta_i||_F = scale, W entries ~ N(0, 1/d)."""
    rng = np.random.default_rng(seed)
    d_out = d if d_out is None else d_out
    attention = rng.normal(size=(m, d, d))
    attention *= scale / np.linalg.norm(attention, axis=(1, 2), keepdims=True)
    projection = rng.normal(size=(m, d, d_out)) / np.sqrt(d)
    X = rng.choice([-1.0, 1.0], size=(n, k, d))
    return X, forward(X, attention, projection), attention, projection


def exact_hull(attention, weight_of_point=None):
    """A point of the affine hull of the Theta_i and an orthonormal basis of it."""
    m, d, _ = attention.shape
    if weight_of_point is None:
        weight_of_point = np.full(m, 1.0 / m)
    point = np.einsum("m,mde->de", weight_of_point, attention)
    if m == 1:
        return point, np.zeros((0, d, d))
    diffs = (attention[1:] - attention[0]).reshape(m - 1, d * d)
    q, _ = np.linalg.qr(diffs.T)
    return point, q.T.reshape(m - 1, d, d)


def matched_errors(attention, projection, true_attention, true_projection):
    """Head-matched relative errors of Theta and W (Hungarian assignment)."""
    cost = np.linalg.norm(attention[:, None] - true_attention[None], axis=(2, 3))
    rows, cols = linear_sum_assignment(cost)
    e_theta = np.linalg.norm(attention[rows] - true_attention[cols]) / np.linalg.norm(
        true_attention
    )
    e_w = np.linalg.norm(projection[rows] - true_projection[cols]) / np.linalg.norm(
        true_projection
    )
    return e_theta, e_w


def test_minimum_norm_point_is_in_the_hull_and_orthogonal_to_it():
    _, _, attention, _ = planted(1, 2, 4, 3)
    point, directions = exact_hull(attention, np.array([2.0, -0.5, -0.5]))
    center = minimum_norm_point(point, directions)
    np.testing.assert_allclose(
        np.einsum("de,rde->r", center, directions), 0, atol=1e-12
    )
    coords = np.einsum("de,rde->r", point - center, directions)
    np.testing.assert_allclose(
        center + np.einsum("r,rde->de", coords, directions), point, atol=1e-12
    )


def test_hull_grid():
    grid = hull_grid(2, 3, 2.0)
    assert grid.shape == (9, 2)
    assert set(np.unique(grid)) == {-2.0, 0.0, 2.0}
    assert hull_grid(0, 5, 1.0).shape == (1, 0)


def test_candidate_residuals_match_a_direct_least_squares_fit():
    X, Y, attention, _ = planted(120, 3, 4, 2, 3, seed=1)
    Y = Y + 0.1 * np.random.default_rng(0).normal(size=Y.shape)
    grid_thetas = np.concatenate([attention, attention + 0.3, attention - 0.2])
    gram, rhs, y_sq = projection_normal_equations(X, Y, grid_thetas)
    g, d = grid_thetas.shape[0], 4
    blocks = gram.reshape(g, d, g, d).transpose(0, 2, 1, 3)
    candidates = np.array([[0, 1], [2, 5], [1, 3]])
    res, W = _candidate_residuals(blocks, rhs.reshape(g, d, 3), y_sq, candidates, 0.0)
    for c, cand in enumerate(candidates):
        W_direct = solve_projections(X, Y, grid_thetas[cand])
        np.testing.assert_allclose(W[c], W_direct, atol=1e-9)
        loss2 = np.mean(
            np.sum((forward(X, grid_thetas[cand], W_direct) - Y) ** 2, (1, 2))
        )
        np.testing.assert_allclose(res[c], loss2, rtol=1e-8)


def test_net_enumerates_unordered_subsets():
    X, Y, attention, _ = planted(200, 3, 4, 3, seed=2)
    point, directions = exact_hull(attention)
    _, _, info = net_search(X, Y, point, directions, 3, resolution=4, random_state=0)
    assert info["strategy"] == "exhaustive"
    assert info["n_grid"] == 16
    assert info["n_candidates"] == math.comb(16, 3)
    assert info["residual_min"] == pytest.approx(info["residual"])
    assert info["residual_min"] <= info["residual_median"] <= info["residual_max"]


def test_randomised_net_with_swaps_finds_the_exhaustive_optimum():
    X, Y, attention, _ = planted(300, 4, 6, 2, seed=3)
    point, directions = exact_hull(attention)
    kw = dict(resolution=15, random_state=0)
    th_all, _, info_all = net_search(X, Y, point, directions, 2, **kw)
    th_rand, _, info_rand = net_search(
        X, Y, point, directions, 2, max_candidates=5, **kw
    )
    assert info_rand["strategy"] == "random+swap"
    assert info_rand["n_candidates"] < info_all["n_candidates"]
    assert info_rand["residual"] == pytest.approx(info_all["residual"], rel=1e-9)
    np.testing.assert_allclose(np.sort(th_rand, axis=0), np.sort(th_all, axis=0))


def test_net_subsamples_examples():
    X, Y, attention, _ = planted(500, 3, 4, 2, seed=4)
    point, directions = exact_hull(attention)
    _, _, info = net_search(
        X, Y, point, directions, 2, resolution=5, n_samples=100, random_state=0
    )
    assert info["n_samples"] == 100


@pytest.mark.parametrize(("m", "d_out"), [(1, 8), (2, 16), (3, 8)])
def test_phase6_recovers_the_layer_from_the_exact_hull(m, d_out):
    X, Y, attention, projection = planted(600, 4, 8, m, d_out, seed=10 + m)
    # any point of the hull will do: an affine, not convex, combination
    weights = np.linspace(1.5, -0.5, m) / np.linspace(1.5, -0.5, m).sum()
    point, directions = exact_hull(attention, weights if m > 1 else None)
    th, W, info = fit_from_hull(X, Y, point, directions, m, random_state=0)
    e_theta, e_w = matched_errors(th, W, attention, projection)
    assert e_theta <= 1e-6 and e_w <= 1e-6
    assert info["polish"]["converged"]
    assert info["net"]["n_candidates"] >= 1


@pytest.mark.parametrize(("m", "offset"), [(2, 0.3), (3, 0.1), (3, 0.3)])
def test_phase6_recovers_the_layer_from_a_perturbed_hull(m, offset):
    d = 8
    X, Y, attention, projection = planted(600, 4, d, m, 8, seed=20 + m)
    point, directions = exact_hull(attention)
    rng = np.random.default_rng(0)
    # move the point and tilt the directions by `offset`, relative
    noise = rng.normal(size=point.shape)
    point = point + offset * np.linalg.norm(point) * noise / np.linalg.norm(noise)
    tilt = rng.normal(size=directions.shape)
    tilt *= offset / np.linalg.norm(tilt, axis=(1, 2), keepdims=True)
    q, _ = np.linalg.qr((directions + tilt).reshape(m - 1, d * d).T)
    directions = q.T.reshape(m - 1, d, d)
    th, W, info = fit_from_hull(X, Y, point, directions, m, random_state=0)
    # the net alone cannot be exact (the truth is off the hull), the polish is
    assert info["net"]["residual"] > 1e-6
    e_theta, e_w = matched_errors(th, W, attention, projection)
    assert e_theta <= 1e-6 and e_w <= 1e-6


def test_net_rejects_too_coarse_grids():
    X, Y, attention, _ = planted(50, 3, 4, 3)
    point, directions = exact_hull(attention)
    with pytest.raises(ValueError, match="resolution"):
        net_search(X, Y, point, directions, 3, resolution=1)


def test_net_sample_weight_equals_repetition():
    X, Y, attention, _ = planted(80, 3, 4, 2, seed=5)
    Y = Y + 0.1 * np.random.default_rng(0).normal(size=Y.shape)
    counts = np.random.default_rng(1).integers(1, 4, size=80)
    point, directions = exact_hull(attention)
    kw = dict(resolution=9, random_state=0)
    th_w, W_w, info_w = net_search(
        X, Y, point, directions, 2, sample_weight=counts.astype(float), **kw
    )
    Xr, Yr = np.repeat(X, counts, axis=0), np.repeat(Y, counts, axis=0)
    th_r, W_r, info_r = net_search(Xr, Yr, point, directions, 2, **kw)
    np.testing.assert_allclose(th_w, th_r)
    np.testing.assert_allclose(W_w, W_r, atol=1e-9)
    assert info_w["residual"] == pytest.approx(info_r["residual"], rel=1e-9)


def test_fit_from_hull_without_polish_returns_the_net():
    X, Y, attention, _ = planted(200, 3, 4, 2, seed=6)
    point, directions = exact_hull(attention)
    kw = dict(resolution=11, random_state=0)
    th, W, info = fit_from_hull(X, Y, point, directions, 2, polish=False, **kw)
    th_net, W_net, _ = net_search(X, Y, point, directions, 2, **kw)
    assert info["polish"] is None
    np.testing.assert_array_equal(th, th_net)
    np.testing.assert_array_equal(W, W_net)


@pytest.mark.parametrize("m, d", [(2, 8), (2, 128), (3, 64), (4, 64), (6, 32)])
def test_default_resolution_fits_the_gram_budget(m, d):
    resolution = _default_resolution(m, d)
    assert resolution >= 2
    assert (resolution ** (m - 1) * d) ** 2 <= _MAX_GRID_GRAM
    if (m, d) == (2, 8):  # small layers keep the measured defaults
        assert resolution == 41
