"""Parametrizations of the heads: full, low-rank, factored values
(``kernels/_parametrization.py``)."""

import numpy as np
import pytest
from _helpers import factored_planted

from skattn.solvers import (
    FactoredHeads,
    FullRank,
    LowRank,
    VarproProblem,
    balanced_factors,
    make_parametrization,
)
from skattn.solvers.kernels._parametrization import random_attention


def test_balanced_factors_and_parametrizations():
    rng = np.random.default_rng(6)
    M = rng.normal(size=(3, 5, 2)) @ rng.normal(size=(3, 2, 4))
    A, B = balanced_factors(M, 2)
    np.testing.assert_allclose(A @ np.swapaxes(B, 1, 2), M, atol=1e-12)
    np.testing.assert_allclose(
        np.linalg.norm(A, axis=1), np.linalg.norm(B, axis=1), rtol=1e-10
    )
    low = make_parametrization(2, 6, 3)
    theta = low.attention(low.from_attention(rng.normal(size=(2, 6, 6))))
    assert np.linalg.matrix_rank(theta[0]) == 3
    assert isinstance(make_parametrization(2, 6, 6), FullRank)


@pytest.mark.parametrize("par", [FullRank(2, 4), LowRank(2, 4, 2)])
def test_attention_vjp_is_the_gradient_of_a_linear_function_of_theta(par):
    # the gradient of p -> <G, Theta(p)> at p, against central differences
    rng = np.random.default_rng(7)
    params, G = rng.normal(size=par.size), rng.normal(size=(2, 4, 4))
    grad = par.attention_vjp(params, G)
    eps = 1e-6
    numeric = [
        (
            np.sum(G * par.attention(params + eps * e))
            - np.sum(G * par.attention(params - eps * e))
        )
        / (2 * eps)
        for e in np.eye(par.size)
    ]
    np.testing.assert_allclose(grad, numeric, rtol=1e-7, atol=1e-9)


def test_random_attention_has_the_scale_asked_for():
    small = random_attention(3, 40, random_state=0, scale=0.5)
    assert small.shape == (3, 40, 40)
    np.testing.assert_allclose(np.linalg.norm(small, axis=(1, 2)), 0.5, rtol=0.05)
    np.testing.assert_array_equal(random_attention(3, 40, random_state=0), small / 0.5)


def test_low_rank_preconditioner_is_a_change_of_variables():
    par = LowRank(3, 6, 2)
    rng = np.random.default_rng(11)
    params = rng.normal(size=par.size)
    apply, transpose, inverse = par.preconditioner(params)
    z, g = rng.normal(size=par.size), rng.normal(size=par.size)
    np.testing.assert_allclose(apply(inverse(params)), params, rtol=1e-12)
    # transpose is the adjoint of apply: <M z, g> = <z, M^T g>
    assert apply(z) @ g == pytest.approx(z @ transpose(g), rel=1e-12)
    # the same Theta_i along the new variables' path: Q K^T = Z^Q C^K (Z^K C^Q)^T
    np.testing.assert_allclose(
        par.attention(apply(inverse(params))), par.attention(params), atol=1e-12
    )
    # at params the new variables are balanced: the logits' derivative along
    # Z^Q_i is X dZ^Q_i (X K_i C^K_i)^T with K_i C^K_i orthonormal (same for Z^K)
    unit = np.zeros((3, 6, 2))
    unit[:, :2, :] = np.eye(2)
    c_k, c_q = (
        f[:, :2, :] for f in par.factors(apply(np.concatenate([unit.ravel()] * 2)))
    )
    Q, K = par.factors(params)
    for factor, c in ((K, c_k), (Q, c_q)):
        balanced = factor @ c
        np.testing.assert_allclose(
            np.swapaxes(balanced, 1, 2) @ balanced,
            np.broadcast_to(np.eye(2), (3, 2, 2)),
            atol=1e-8,
        )
    assert FullRank(2, 3).preconditioner(np.zeros(18)) is None


def test_regauge_balances_the_values_and_keeps_the_model():
    X, Y, truth = factored_planted(40, 3, 4, 2, 2, 6, intercept=True)
    par = FactoredHeads(2, 5, 2)
    params = truth + 0.2 * np.random.default_rng(6).normal(size=par.size)
    problem = VarproProblem(X, Y, None, par, intercept=True)
    residual, projection = problem.residual(params).copy(), problem.projection
    balanced = par.regauge(params, problem.output_factors)
    np.testing.assert_allclose(problem.residual(balanced), residual, atol=1e-12)
    np.testing.assert_allclose(problem.projection, projection, atol=1e-10)
    grams = problem.output_factors @ np.swapaxes(problem.output_factors, 1, 2)
    np.testing.assert_allclose(
        grams, np.broadcast_to(np.eye(2), grams.shape), atol=1e-8
    )
    np.testing.assert_allclose(par.attention(balanced), par.attention(params))
