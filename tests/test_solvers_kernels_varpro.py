"""The reduced problem's residual and Jacobian products (``kernels/_varpro.py``)."""

import numpy as np
import pytest
from _helpers import blas_threads, factored_planted, planted

import skattn.solvers.kernels._loss as objective
import skattn.solvers.kernels._varpro as varpro
from skattn.solvers import (
    FactoredHeads,
    FullRank,
    LowRank,
    VarproProblem,
    reduced_loss_gradient,
    solve_projections,
)
from skattn.solvers.optimizers._lm_dense import _gauss_newton_system
from skattn.solvers.optimizers._lm_matrix_free import jacobian_operator


def dense_jacobian(problem, params):
    return jacobian_operator(problem, params) @ np.eye(problem.shape[1])


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
    J = jacobian_operator(VarproProblem(X, Y, rng.uniform(0.5, 2, 30), par), params)
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
    monkeypatch.setattr(varpro, "_KEEP_FLOATS_PER_CHUNK_FLOAT", 64)
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


def test_products_in_threads_run_one_blas_thread_each_and_the_gram_the_callers(
    monkeypatch,
):
    # two BLAS threads on a product's thin GEMMs were slower than one (a small
    # planted layer's pair 0.034 s against 0.019; bench_polish_threads.py): the
    # jobs run on one BLAS thread each, the evaluation's one large GEMM (the
    # Gram) on the threads BLAS had, which are back after every product
    from threadpoolctl import threadpool_limits

    X, Y, _, _ = planted(60, 3, 4, 2, 3, noise=0.1)
    par = LowRank(2, 4, 2)
    rng = np.random.default_rng(6)
    params, v = rng.normal(size=par.size) / 2, rng.normal(size=par.size)
    monkeypatch.setattr(objective, "_CHUNK_FLOATS", 200)
    seen = {"product": set(), "gram": set()}
    logits_jvp, factor = par.logits_jvp, varpro._factor

    def recorded_jvp(*args, **kwargs):
        seen["product"].add(blas_threads())
        return logits_jvp(*args, **kwargs)

    def recorded_factor(gram):
        seen["gram"].add(blas_threads())
        return factor(gram)

    monkeypatch.setattr(par, "logits_jvp", recorded_jvp)
    monkeypatch.setattr(varpro, "_factor", recorded_factor)
    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()  # a BLAS built for one thread: 1
        problem = VarproProblem(X, Y, None, par, n_jobs=2)
        problem.matvec(params, v)
        assert blas_threads() == before
        problem.matvec(params + v / 10, v)  # a new point: the Gram again
    assert seen == {"product": {1}, "gram": {before}}


@pytest.mark.parametrize("intercept", [False, True])
def test_factored_products_are_adjoint(intercept):
    X, Y, truth = factored_planted(30, 3, 5, 2, 2, 7, intercept=intercept)
    rng = np.random.default_rng(1)
    par = FactoredHeads(2, X.shape[2], 2)
    params = truth + 0.3 * rng.normal(size=par.size)
    problem = VarproProblem(X, Y, rng.uniform(0.5, 2, 30), par, intercept=intercept)
    J = jacobian_operator(problem, params)
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
    monkeypatch.setattr(varpro, "_KEEP_FLOATS_PER_CHUNK_FLOAT", 64)
    chunked = VarproProblem(X, Y, weight, par, intercept=True)
    assert len(chunked.slices) > 5 and not chunked._keep
    for a, b in zip(products(chunked), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def test_factored_intercept_needs_a_constant_coordinate():
    X, Y, _ = factored_planted(20, 3, 4, 2, 2, 6)
    with pytest.raises(ValueError, match="constant coordinate"):
        VarproProblem(X, Y, None, FactoredHeads(2, 4, 2), intercept=True)


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


def test_fixed_columns_are_eliminated_as_explicit_design_columns():
    # the residual is the least-squares residual of [S X, F] against the targets
    rng = np.random.default_rng(1)
    X, T, F = (rng.normal(size=(30, 3, w)) for w in (4, 2, 5))
    par = LowRank(1, 4, 2)
    params = rng.normal(size=par.size)
    problem = VarproProblem(X, T, None, par, fixed_columns=F)
    theta = par.attention(params)[0]
    logits = np.einsum("nkd,de,nle->nkl", X, theta, X)
    S = np.exp(logits - logits.max(-1, keepdims=True))
    S /= S.sum(-1, keepdims=True)
    design = np.concatenate([S @ X, F], axis=2).reshape(90, 9)
    coef = np.linalg.lstsq(design, T.reshape(90, 2), rcond=None)[0]
    # the problem's residual carries the normalised weights' root, 1 / sqrt(n)
    expected = (design @ coef - T.reshape(90, 2)) / np.sqrt(30)
    np.testing.assert_allclose(problem.residual(params), expected.ravel(), atol=1e-10)
    np.testing.assert_allclose(problem.projection[0], coef[:4], atol=1e-9)
    np.testing.assert_allclose(problem.fixed_coefficients, coef[4:], atol=1e-9)


def test_fixed_columns_jacobian_matches_finite_differences_and_is_adjoint():
    rng = np.random.default_rng(2)
    X, T, F = (rng.normal(size=(40, 3, w)) for w in (4, 2, 3))
    par = LowRank(1, 4, 2)
    params = rng.normal(size=par.size)
    problem = VarproProblem(X, T, rng.uniform(0.5, 2, 40), par, fixed_columns=F)
    J = jacobian_operator(problem, params) @ np.eye(par.size)
    v, u = rng.normal(size=par.size), rng.normal(size=J.shape[0])
    assert u @ (J @ v) == pytest.approx(v @ (problem.rmatvec(params, u)), rel=1e-12)
    # Kaufman's Jacobian is exact at a zero residual: make T realisable
    truth = rng.normal(size=par.size)
    exact = VarproProblem(X, T, None, par, fixed_columns=F)
    exact.residual(truth)
    theta = par.attention(truth)[0]
    logits = np.einsum("nkd,de,nle->nkl", X, theta, X)
    S = np.exp(logits - logits.max(-1, keepdims=True))
    S /= S.sum(-1, keepdims=True)
    T = S @ X @ rng.normal(size=(4, 2)) + F @ rng.normal(size=(3, 2))
    problem = VarproProblem(X, T, None, par, fixed_columns=F)
    J = jacobian_operator(problem, truth) @ np.eye(par.size)
    eps = 1e-6
    for j in range(0, par.size, 3):
        step = np.zeros(par.size)
        step[j] = eps
        fd = (problem.residual(truth + step) - problem.residual(truth - step)) / (
            2 * eps
        )
        np.testing.assert_allclose(J[:, j], fd, atol=1e-7)


def test_fixed_columns_need_full_projections():
    X, Y = np.ones((5, 2, 3)), np.ones((5, 2, 2))
    with pytest.raises(ValueError, match="fixed_columns needs full W_i"):
        VarproProblem(X, Y, None, FactoredHeads(1, 3, 1), fixed_columns=np.ones(1))


@pytest.mark.parametrize("intercept", [False, True])
def test_a_subset_is_the_problem_of_its_sequences(intercept):
    # every third sequence, weights, intercept and precision as they were
    X, Y, truth = factored_planted(30, 3, 4, 2, 2, 6, intercept=intercept)
    rng = np.random.default_rng(4)
    par = FactoredHeads(2, X.shape[2], 2)
    params = truth + 0.1 * rng.normal(size=par.size)
    weight = rng.uniform(0.5, 2.0, size=30)
    problem = VarproProblem(
        X, Y, weight, par, intercept=intercept, dtype=np.float32, n_jobs=2
    )
    part = problem.subset(10)
    rows = slice(0, 30, 3)
    own = VarproProblem(
        X[rows], Y[rows], weight[rows], par, intercept=intercept, dtype=np.float32
    )
    assert (part.dtype, part.n_jobs, part.shape) == (own.dtype, 2, own.shape)
    v = rng.normal(size=par.size)
    np.testing.assert_array_equal(part.residual(params), own.residual(params))
    np.testing.assert_array_equal(part.matvec(params, v), own.matvec(params, v))
    assert problem.subset(30) is problem and problem.subset(31) is problem
