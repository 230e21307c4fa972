"""skattn.diagnostics._jacobian: the Jacobian of a layer in its parameters."""

import numpy as np

from skattn.diagnostics import jacobian_singular_values, layer_jacobian
from skattn.diagnostics._jacobian import low_rank_tangent_basis
from skattn.layer._math import forward


def test_jacobian_matches_finite_differences_and_its_qr():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 3, 3))
    th, W = rng.normal(size=(2, 3, 3)), rng.normal(size=(2, 3, 4))
    J = layer_jacobian(X, th, W)
    step = 1e-6 * rng.normal(size=J.shape[1])
    th2 = th + step[: th.size].reshape(th.shape)
    W2 = W + step[th.size :].reshape(W.shape)
    change = (forward(X, th2, W2) - forward(X, th, W)).ravel()
    np.testing.assert_allclose(J @ step, change, atol=1e-10)
    np.testing.assert_allclose(
        jacobian_singular_values(X, th, W),
        np.linalg.svd(J, compute_uv=False),
        rtol=1e-10,
    )


def test_low_rank_tangent_basis_is_the_tangent_space():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 2)), rng.normal(size=(4, 2))
    basis = low_rank_tangent_basis(a @ b.T, 2)
    assert basis.shape == (20, 2 * (5 + 4 - 2))
    np.testing.assert_allclose(basis.T @ basis, np.eye(basis.shape[1]), atol=1e-12)
    # a move of the factors is in the span
    da, db = rng.normal(size=a.shape), rng.normal(size=b.shape)
    move = (da @ b.T + a @ db.T).ravel()
    np.testing.assert_allclose(basis @ (basis.T @ move), move, atol=1e-10)
