"""The matrix-free solver: Jacobian products, parametrizations, solver choice."""

import numpy as np
import pytest

import skattn.solvers._matrix_free as matrix_free
import skattn.solvers._objective as objective
from skattn.layer._math import forward
from skattn.solvers import (
    FactoredHeads,
    FullRank,
    LowRank,
    VarproProblem,
    balanced_factors,
    choose_solver,
    make_parametrization,
    polish,
    reduced_loss_gradient,
    solve_projections,
    varpro_least_squares,
)
from skattn.solvers._dense import _gauss_newton_system
from skattn.solvers._parametrization import random_attention
from skattn.solvers._polish import polish_from_random_starts, staged_polish


def planted(n, k, d, m, d_out=None, seed=0, rank=None, noise=0.0):
    rng = np.random.default_rng(seed)
    d_out = d if d_out is None else d_out
    if rank is None:
        attention = rng.normal(size=(m, d, d))
    else:
        attention = rng.normal(size=(m, d, rank)) @ rng.normal(size=(m, rank, d))
    attention *= 2.0 / np.linalg.norm(attention, axis=(1, 2), keepdims=True)
    projection = rng.normal(size=(m, d, d_out)) / np.sqrt(d)
    X = rng.choice([-1.0, 1.0], size=(n, k, d))
    Y = forward(X, attention, projection) + noise * rng.normal(size=(n, k, d_out))
    return X, Y, attention, projection


def dense_jacobian(problem, params):
    return problem.jacobian(params) @ np.eye(problem.shape[1])


def assert_jacobian_matches_finite_differences(problem, params, n_columns):
    """Random columns of the Jacobian against central differences of the residual."""
    J = dense_jacobian(problem, params)
    eps = 1e-6
    size = problem.shape[1]
    for j in np.random.default_rng(2).choice(size, size=n_columns, replace=False):
        step = np.zeros(size)
        step[j] = eps
        fd = (problem.residual(params + step) - problem.residual(params - step)) / (
            2 * eps
        )
        np.testing.assert_allclose(J[:, j], fd, atol=1e-7)


@pytest.mark.parametrize("par", [FullRank(2, 4), LowRank(2, 4, 2)])
def test_products_are_adjoint(par):
    X, Y, _, _ = planted(30, 3, 4, 2, 5, noise=0.1)
    rng = np.random.default_rng(1)
    params = rng.normal(size=par.size)
    J = VarproProblem(X, Y, rng.uniform(0.5, 2, 30), par).jacobian(params)
    v, u = rng.normal(size=J.shape[1]), rng.normal(size=J.shape[0])
    assert u @ (J @ v) == pytest.approx(v @ (J.T @ u), rel=1e-12)


def test_orthogonal_adjoint_is_exact_on_the_residual_and_the_range():
    X, Y, attention, _ = planted(40, 3, 4, 2, 5, noise=0.1)
    problem = VarproProblem(X, Y, None, FullRank(2, 4))
    params = attention.reshape(-1) + 0.1
    v = np.random.default_rng(9).normal(size=32)
    for u in (problem.residual(params), problem.matvec(params, v)):
        np.testing.assert_allclose(
            problem.rmatvec(params, u, orthogonal=True),
            problem.rmatvec(params, u),
            rtol=1e-9,
            atol=1e-12,
        )


def test_jacobian_matches_finite_differences_at_a_realisable_point():
    # at a zero residual the exact variable-projection Jacobian is Kaufman's
    X, Y, attention, _ = planted(40, 3, 4, 2, 6)
    par = FullRank(2, 4)
    problem = VarproProblem(X, Y, None, par)
    assert_jacobian_matches_finite_differences(
        problem, par.from_attention(attention), n_columns=8
    )


def test_gauss_newton_matrix_and_gradient_match_the_dense_solver():
    X, Y, attention, _ = planted(50, 3, 4, 2, 5, noise=0.2)
    weight = np.random.default_rng(3).uniform(0.5, 2.0, size=50)
    attention = attention + 0.3
    problem = VarproProblem(X, Y, weight, FullRank(2, 4))
    params = attention.reshape(-1)
    J = dense_jacobian(problem, params)
    W = solve_projections(X, Y, attention, weight)
    _, _, g_w, h_tt, h_tw, gram = _gauss_newton_system(X, Y, attention, W, weight, 0)
    z = np.linalg.solve(gram, h_tw.transpose(1, 0, 2).reshape(8, -1))
    schur = h_tt - np.einsum("Pro,rQo->PQ", h_tw, z.reshape(8, -1, 5))
    np.testing.assert_allclose(J.T @ J, schur, rtol=1e-9, atol=1e-12)
    loss, grad, _ = reduced_loss_gradient(X, Y, attention, weight)
    residual = problem.residual(params)
    assert 0.5 * residual @ residual == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(J.T @ residual, grad.reshape(-1), atol=1e-12)
    np.testing.assert_allclose(problem.projection, W, rtol=1e-9, atol=1e-12)


def test_low_rank_jacobian_is_the_chain_rule():
    X, Y, _, _ = planted(30, 3, 5, 2, 6, noise=0.1)
    low, full = LowRank(2, 5, 2), FullRank(2, 5)
    params = np.random.default_rng(4).normal(size=low.size)
    J_low = dense_jacobian(VarproProblem(X, Y, None, low), params)
    attention = low.attention(params)
    J_full = dense_jacobian(VarproProblem(X, Y, None, full), attention.reshape(-1))
    eps = 1e-6
    basis = np.eye(low.size)
    dtheta = np.stack(
        [
            (low.attention(params + eps * e) - low.attention(params - eps * e)).ravel()
            / (2 * eps)
            for e in basis
        ],
        axis=1,
    )
    np.testing.assert_allclose(J_low, J_full @ dtheta, atol=1e-8)
    # the gauge: r^2 directions per head leave the logits unchanged
    singular = np.linalg.svd(J_low, compute_uv=False)
    assert np.sum(singular < 1e-10 * singular[0]) == 2 * 2**2


def test_products_do_not_depend_on_chunking(monkeypatch):
    X, Y, attention, _ = planted(60, 3, 4, 2, 3, noise=0.1)
    rng = np.random.default_rng(5)
    weight = rng.uniform(0.5, 2.0, size=60)
    params, v = attention.reshape(-1), rng.normal(size=32)
    u = rng.normal(size=60 * 3 * 3)
    whole = VarproProblem(X, Y, weight, FullRank(2, 4))
    expected = (
        whole.residual(params),
        whole.matvec(params, v),
        whole.rmatvec(params, u),
    )
    monkeypatch.setattr(objective, "_CHUNK_FLOATS", 50)
    monkeypatch.setattr(matrix_free, "_KEEP_FLOATS_PER_CHUNK_FLOAT", 64)
    chunked = VarproProblem(X, Y, weight, FullRank(2, 4))
    assert len(chunked.slices) > 5 and not chunked._keep
    got = (
        chunked.residual(params),
        chunked.matvec(params, v),
        chunked.rmatvec(params, u),
    )
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(
    "par, fixed", [(FullRank(2, 4), False), (LowRank(1, 4, 2), True)]
)
def test_products_in_threads_give_the_same_bits(monkeypatch, par, fixed):
    # the chunks of a product in threads, their sums in the chunks' order
    X, Y, _, _ = planted(60, 3, 4, 2, 3, noise=0.1)
    rng = np.random.default_rng(6)
    weight = rng.uniform(0.5, 2.0, size=60)
    columns = rng.normal(size=(60, 3, 2)) if fixed else None
    params, v = rng.normal(size=par.size) / 2, rng.normal(size=par.size)
    u = rng.normal(size=60 * 3 * 3)
    monkeypatch.setattr(objective, "_CHUNK_FLOATS", 200)
    results = []
    for n_jobs in (1, 2):
        problem = VarproProblem(X, Y, weight, par, fixed_columns=columns, n_jobs=n_jobs)
        assert len(problem.slices) > 3 and problem._keep
        results.append(
            (
                problem.residual(params),
                problem.matvec(params, v),
                problem.rmatvec(params, u),
                problem.rmatvec(params, u, orthogonal=True),
            )
        )
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


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


def test_polish_low_rank_from_random_starts():
    X, Y, attention, projection = planted(600, 4, 8, 2, 8, rank=2, seed=8)
    th, W, info = polish_from_random_starts(
        X, Y, 2, head_rank=2, n_warmup_samples=300, random_state=0
    )
    assert info["solver"] == "matrix-free"
    assert info["relative_residual"] < 1e-10
    order = np.argsort([np.linalg.norm(t - attention[0]) for t in th])
    np.testing.assert_allclose(th[order], attention, atol=1e-8)
    np.testing.assert_allclose(W[order], projection, atol=1e-8)
    assert np.linalg.matrix_rank(th[0], tol=1e-8) == 2


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


def test_coarse_steps_far_from_the_minimum_then_exact_ones():
    from skattn.solvers import varpro_least_squares

    X, Y, attention, _ = planted(400, 4, 6, 2, 6, seed=12)
    par = FullRank(2, 6)
    start = np.random.default_rng(3).normal(size=par.size) * 0.3
    results = {
        coarse: varpro_least_squares(X, Y, start, par, coarse=coarse)
        for coarse in (True, False)
    }
    for _, _, info in results.values():
        assert info["converged"] and info["loss"] < 1e-24 * info["loss_start"]
    assert results[True][2]["n_coarse_iter"] >= 1
    assert results[False][2]["n_coarse_iter"] == 0
    np.testing.assert_allclose(results[True][0], results[False][0], atol=1e-9)


@pytest.mark.parametrize("coarse", [True, False])
def test_a_start_that_fits_already_is_returned_as_it_is(coarse):
    X, Y, attention, projection = planted(300, 4, 5, 2, 5, seed=13)
    par = FullRank(2, 5)
    exact = attention.reshape(-1)
    params, W, info = varpro_least_squares(
        X, Y, exact, par, coarse=coarse, stop_below=1e-10
    )
    assert info["stop_reason"] == "start" and info["converged"]
    assert info["n_iter"] == 0 and info["n_products"] == 0
    np.testing.assert_array_equal(params, exact)
    np.testing.assert_allclose(W, projection, atol=1e-10)
    # a start that does not fit is solved as without the rule
    start = exact + 0.01 * np.random.default_rng(0).normal(size=par.size)
    with_rule = varpro_least_squares(X, Y, start, par, coarse=coarse, stop_below=1e-10)
    without = varpro_least_squares(X, Y, start, par, coarse=coarse)
    np.testing.assert_array_equal(with_rule[0], without[0])
    assert with_rule[2]["n_iter"] == without[2]["n_iter"] > 0


def test_staged_polish_does_not_polish_an_exact_start():
    X, Y, attention, _ = planted(400, 4, 5, 2, 5, seed=14)
    _, _, info = staged_polish(
        X, Y, attention, n_warmup_samples=100, solver="matrix-free", random_state=0
    )
    assert info["warmup"]["stop_reason"] == "start"
    assert info["final_stage"] == "skipped: realisable"
    assert info["n_iter"] == 0 and info["relative_residual"] < 1e-12


def factored_planted(n, k, d, m, r, d_out, seed=0, intercept=False):
    """Planted low-rank heads with W_i = V_i O_i on tokens [x, 1] (with an
    intercept that no rank-r W_i holds) or on Boolean x."""
    rng = np.random.default_rng(seed)
    X = rng.choice([-1.0, 1.0], size=(n, k, d))
    if intercept:
        X = np.concatenate([X, np.ones((n, k, 1))], axis=2)
        d += 1
    Q, K, V = (rng.normal(size=(m, d, r)) / np.sqrt(d) for _ in range(3))
    out = rng.normal(size=(m, r, d_out))
    projection = V @ out
    if intercept:
        projection[0, -1] += rng.normal(size=d_out)
    Y = forward(X, Q @ np.swapaxes(K, 1, 2), projection)
    return X, Y, np.concatenate([Q.ravel(), K.ravel(), V.ravel()])


@pytest.mark.parametrize("intercept", [False, True])
def test_factored_products_are_adjoint(intercept):
    X, Y, truth = factored_planted(30, 3, 5, 2, 2, 7, intercept=intercept)
    rng = np.random.default_rng(1)
    par = FactoredHeads(2, X.shape[2], 2)
    params = truth + 0.3 * rng.normal(size=par.size)
    problem = VarproProblem(X, Y, rng.uniform(0.5, 2, 30), par, intercept=intercept)
    J = problem.jacobian(params)
    assert J.shape == (30 * 3 * 7, 3 * 2 * X.shape[2] * 2)
    v, u = rng.normal(size=J.shape[1]), rng.normal(size=J.shape[0])
    assert u @ (J @ v) == pytest.approx(v @ (J.T @ u), rel=1e-12)


@pytest.mark.parametrize("intercept", [False, True])
def test_factored_jacobian_matches_finite_differences(intercept):
    # at a zero residual Kaufman's Jacobian is the exact one
    X, Y, truth = factored_planted(40, 3, 4, 2, 2, 6, intercept=intercept)
    par = FactoredHeads(2, X.shape[2], 2)
    problem = VarproProblem(X, Y, None, par, intercept=intercept)
    assert np.abs(problem.residual(truth)).max() < 1e-12
    assert_jacobian_matches_finite_differences(problem, truth, n_columns=12)


def test_factored_values_of_full_rank_are_the_unstructured_problem():
    # with V_i square and invertible the design S_i X V_i spans what S_i X spans:
    # the same residual, the same Jacobian along (Q, K), none along V (a gauge)
    X, Y, _, _ = planted(30, 3, 4, 2, 6, noise=0.1)
    rng = np.random.default_rng(3)
    factored, unstructured = FactoredHeads(2, 4, 4), LowRank(2, 4, 4)
    qk = rng.normal(size=unstructured.size)
    params = np.concatenate([qk, rng.normal(size=2 * 4 * 4)])
    weight = rng.uniform(0.5, 2.0, size=30)
    one = VarproProblem(X, Y, weight, factored)
    other = VarproProblem(X, Y, weight, unstructured)
    np.testing.assert_allclose(one.residual(params), other.residual(qk), atol=1e-12)
    np.testing.assert_allclose(one.projection, other.projection, atol=1e-10)
    J_one, J_other = dense_jacobian(one, params), dense_jacobian(other, qk)
    np.testing.assert_allclose(J_one[:, : qk.size], J_other, atol=1e-10)
    assert np.abs(J_one[:, qk.size :]).max() < 1e-10


def test_factored_products_do_not_depend_on_chunking(monkeypatch):
    X, Y, truth = factored_planted(60, 3, 4, 2, 2, 5, intercept=True)
    rng = np.random.default_rng(5)
    weight = rng.uniform(0.5, 2.0, size=60)
    par = FactoredHeads(2, 5, 2)
    params, v = truth + 0.2 * rng.normal(size=par.size), rng.normal(size=par.size)
    u = rng.normal(size=60 * 3 * 5)

    def products(problem):
        return (
            problem.residual(params),
            problem.matvec(params, v),
            problem.rmatvec(params, u),
        )

    expected = products(VarproProblem(X, Y, weight, par, intercept=True))
    monkeypatch.setattr(objective, "_CHUNK_FLOATS", 50)
    monkeypatch.setattr(matrix_free, "_KEEP_FLOATS_PER_CHUNK_FLOAT", 64)
    chunked = VarproProblem(X, Y, weight, par, intercept=True)
    assert len(chunked.slices) > 5 and not chunked._keep
    for a, b in zip(products(chunked), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


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


def test_factored_intercept_needs_a_constant_coordinate():
    X, Y, _ = factored_planted(20, 3, 4, 2, 2, 6)
    with pytest.raises(ValueError, match="constant coordinate"):
        VarproProblem(X, Y, None, FactoredHeads(2, 4, 2), intercept=True)


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


@pytest.mark.parametrize(
    "par", [FullRank(2, 4), LowRank(2, 4, 2), FactoredHeads(2, 4, 2)]
)
def test_single_precision_products_agree_with_double(par):
    X, Y, _, _ = planted(40, 3, 4, 2, 6, noise=0.1)
    rng = np.random.default_rng(7)
    params, v = rng.normal(size=par.size) / 2, rng.normal(size=par.size)
    u = rng.normal(size=40 * 3 * 6)
    double = VarproProblem(X, Y, None, par)
    single = VarproProblem(X, Y, None, par, dtype=np.float32)
    for name in ("residual", "matvec", "rmatvec"):
        args = (
            (params,) if name == "residual" else (params, v if name == "matvec" else u)
        )
        a, b = getattr(single, name)(*args), getattr(double, name)(*args)
        assert a.dtype == np.float64
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)
    np.testing.assert_allclose(
        single.projection, double.projection, rtol=1e-4, atol=1e-5
    )


def test_single_precision_loose_stage_ends_in_a_double_precision_optimum():
    X, Y, attention, _ = planted(300, 3, 5, 2, 8, seed=2)
    par = FullRank(2, 5)
    start = par.from_attention(attention + 0.3)
    results = [
        varpro_least_squares(X, Y, start, par, coarse_dtype=dtype)
        for dtype in (np.float32, np.float64)
    ]
    for params, projection, info in results:
        assert info["n_coarse_iter"] > 0 and info["converged"]
        np.testing.assert_allclose(par.attention(params), attention, atol=1e-10)
        np.testing.assert_allclose(forward(X, attention, projection), Y, atol=1e-10)


def test_random_starts_with_factored_values_recover_a_planted_layer():
    X, Y, truth = factored_planted(400, 4, 5, 2, 2, 12, seed=3, intercept=True)
    attention, projection, info = polish_from_random_starts(
        X, Y, 2, head_rank=2, factor_values=True, intercept=True, random_state=0
    )
    assert info["stages"][0]["factored_values"]
    assert info["relative_residual"] < 1e-10
    np.testing.assert_allclose(forward(X, attention, projection), Y, atol=1e-9)
