"""The matrix-free hull (phases 2 and 4) against the dense one, on planted layers."""

import numpy as np
import pytest
from _helpers import phased_planted as _plant

from skattn import MultiHeadAttentionRegressor
from skattn.layer._math import forward
from skattn.phased import sculpt_hull
from skattn.phased._affine_hull import (
    fit_affine_hull,
    hull_constraints,
    hull_distance,
)
from skattn.phased._hull_operator import (
    _NormalOperator,
    constraint_matrix,
    constraint_matvec,
    constraint_rmatvec,
)


def _subspace_gap(A, B):
    """Spectral distance of the row spaces of orthonormal stacks (r, d, d)."""
    A, B = A.reshape(A.shape[0], -1), B.reshape(B.shape[0], -1)
    return np.linalg.norm(A.T @ A - B.T @ B, 2)


@pytest.mark.parametrize("b", [1, 3])
def test_constraint_products_match_the_dense_matrix(b):
    rng = np.random.default_rng(0)
    L, k, d = 40, 5, 4
    x_row, v = rng.normal(size=(L, d)), rng.normal(size=(L, k, d))
    A = constraint_matrix(x_row, v)
    assert A.shape == (L * k, d * d)
    # row (l, a) of A is x_l kron v_la: <Theta, x_l v_la^T> = x_l^T Theta v_la
    theta = rng.normal(size=(d, d))
    np.testing.assert_allclose(A[3 * k + 2] @ theta.ravel(), x_row[3] @ theta @ v[3, 2])
    U, R = rng.normal(size=(d * d, b)), rng.normal(size=(L, k, b))
    np.testing.assert_allclose(
        constraint_matvec(x_row, v, U).reshape(L * k, b), A @ U, rtol=1e-12
    )
    np.testing.assert_allclose(
        constraint_rmatvec(x_row, v, R), A.T @ R.reshape(L * k, b), rtol=1e-12
    )


@pytest.mark.parametrize("gauge", [False, True])
def test_normal_operator_matches_the_dense_normal_matrix(gauge):
    X, Y, theta, W = _plant(3000, 4, 6, 2, d_out=12)
    gauge_features = ()
    if gauge:  # a constant feature, as fit_intercept=True appends
        X[:, :, -1] = 1.0
        Y = forward(X, theta, W)
        gauge_features = (5,)
    kwargs = dict(tol=0.1, random_state=0, gauge_features=gauge_features)
    dense, dinfo = hull_constraints(X, Y, W.sum(0), solver="dense", **kwargs)
    free, finfo = hull_constraints(X, Y, W.sum(0), solver="matrix-free", **kwargs)
    assert free["normal"] is None and dense["normal"].shape == (36, 36)
    assert dinfo == finfo
    cons = free["constraints"]
    op = _NormalOperator(
        cons["x_row"], cons["v"], cons["mask"], cons["pin"], free["rhs"], 0.0
    )
    np.testing.assert_allclose(
        op.normal(np.eye(36)), dense["normal"], rtol=1e-10, atol=1e-10
    )
    np.testing.assert_allclose(free["rhs"], dense["rhs"], rtol=1e-10, atol=1e-10)
    assert free["rhs_norm2"] == pytest.approx(dense["rhs_norm2"], rel=1e-12)
    assert free["n_equations"] == dense["n_equations"]
    np.testing.assert_array_equal(free["targets"], dense["targets"])


@pytest.mark.parametrize(
    "distribution, k, m", [("boolean", 4, 2), ("gaussian", 2, 2), ("gaussian", 2, 3)]
)
def test_iterative_hull_matches_the_dense_eigensolver(distribution, k, m):
    # exact W_sum, tight tolerance: a clear spectral gap, as the hull needs
    X, Y, theta, W = _plant(20000, k, 8, m, d_out=16, distribution=distribution)
    hulls = {}
    for solver in ("dense", "matrix-free"):
        stats, _ = hull_constraints(X, Y, W.sum(0), tol=0.03, solver=solver)
        hulls[solver] = fit_affine_hull(stats, m)
    (p0, D0), info0 = hulls["dense"]
    (p1, D1), info1 = hulls["matrix-free"]
    assert info0["solver"] == "dense" and info1["solver"] == "matrix-free"
    assert D1.shape == D0.shape == (m - 1, 8, 8)
    np.testing.assert_allclose(
        np.einsum("iab,jab->ij", D1, D1), np.eye(m - 1), atol=1e-10
    )
    assert _subspace_gap(D0, D1) < 1e-4
    assert np.linalg.norm(p1 - p0) < 1e-4 * np.linalg.norm(p0)
    # the bottom of both spectra, hence the gap ratios
    n1 = info1["spectrum"].size
    assert n1 == m + 1 and info1["augmented_spectrum"].size == m + 2
    # up to their scale (the largest eigenvalue, estimated to about 1e-3)
    for name, size in (("spectrum", n1), ("augmented_spectrum", n1 + 1)):
        s0, s1 = info0[name][:size], info1[name]
        np.testing.assert_allclose(s1 / s1[-1], s0 / s0[-1], rtol=1e-3)
        assert s1[-1] == pytest.approx(s0[-1], rel=1e-2)
    assert info1["gap_ratio"] == pytest.approx(info0["gap_ratio"], rel=1e-3)
    assert info1["augmented_gap_ratio"] == pytest.approx(
        info0["augmented_gap_ratio"], rel=1e-3
    )
    assert info1["rms_residual"] == pytest.approx(info0["rms_residual"], rel=1e-4)
    np.testing.assert_allclose(
        hull_distance(theta, p1, D1), hull_distance(theta, p0, D0), atol=1e-4
    )
    assert info1["iterative"]["n_products"] > 0


def test_iterative_hull_is_exact_for_one_head():
    X, Y, theta, W = _plant(2000, 3, 5, 1, d_out=6, distribution="gaussian")
    stats, _ = hull_constraints(X, Y, W[0], tol=1e-6, solver="matrix-free")
    (point, directions), info = fit_affine_hull(stats, 1)
    assert directions.shape == (0, 5, 5)
    np.testing.assert_allclose(point, theta[0], atol=1e-7)
    assert info["augmented_gap_ratio"] > 1e6


def test_matrix_free_reweighting_matches_dense():
    X, Y, theta, W = _plant(6000, 2, 6, 2, d_out=12)
    hulls = []
    for solver in ("dense", "matrix-free"):
        stats, _ = hull_constraints(
            X,
            Y,
            W.sum(0),
            tol=0.1,
            confidence_floor=0.03,
            keep_rows=True,
            solver=solver,
        )
        hulls.append(fit_affine_hull(stats, 2, reweight_iter=2))
    ((p0, D0), info0), ((p1, D1), info1) = hulls
    assert info1["reweight_iter"] == 2
    assert _subspace_gap(D0, D1) < 1e-3
    assert np.linalg.norm(p1 - p0) < 1e-3 * np.linalg.norm(p0)


def test_matrix_free_huber_point_is_exact_for_one_head():
    X, Y, theta, W = _plant(1500, 3, 4, 1, d_out=6, distribution="gaussian")
    stats, _ = hull_constraints(X, Y, W[0], tol=1e-6, solver="matrix-free")
    assert "equations" not in stats  # kept factored, formed for the Huber fit
    (point, _), info = fit_affine_hull(stats, 1, method="huber")
    assert info["method"] == "huber"
    np.testing.assert_allclose(point, theta[0], atol=1e-4)


def test_sculpt_hull_matrix_free_matches_dense():
    X, Y, theta, _ = _plant(10000, 2, 8, 2, d_out=16)
    results = {
        solver: sculpt_hull(X, Y, 2, random_state=0, solver=solver)
        for solver in ("dense", "matrix-free")
    }
    (W0, p0, D0, info0), (W1, p1, D1, info1) = results.values()
    np.testing.assert_allclose(W1, W0, rtol=1e-10, atol=1e-12)
    assert info1["best_round"] == info0["best_round"]
    assert _subspace_gap(D0, D1) < 1e-4
    assert np.linalg.norm(p1 - p0) < 1e-4 * np.linalg.norm(p0)
    assert np.max(hull_distance(theta, p1, D1)) < 0.05


def test_sculpt_hull_counts_heads_matrix_free():
    X, Y, _, _ = _plant(10000, 2, 8, 2, d_out=16)
    *_, info = sculpt_hull(X, Y, "auto", random_state=0, solver="matrix-free")
    assert info["n_heads"] == 2


def test_estimator_hull_solvers_agree():
    X, Y, theta, W = _plant(4000, 2, 6, 2, d_out=12)
    fits = [
        MultiHeadAttentionRegressor(
            n_heads=2, n_tokens=2, init="phased", hull_solver=solver, random_state=0
        ).fit(X.reshape(4000, -1), Y.reshape(4000, -1))
        for solver in ("dense", "matrix-free")
    ]
    assert _subspace_gap(fits[0].hull_directions_, fits[1].hull_directions_) < 1e-4
    np.testing.assert_allclose(fits[1].hull_point_, fits[0].hull_point_, atol=1e-5)
