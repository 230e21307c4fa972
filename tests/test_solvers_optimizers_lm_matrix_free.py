"""Matrix-free Levenberg-Marquardt on the reduced problem
(``optimizers/_lm_matrix_free.py``)."""

import numpy as np
import pytest
from _helpers import array_namespaces, factored_planted, planted, refine_planted

from skattn.datasets import make_attention_regression
from skattn.layer._math import forward
from skattn.solvers import (
    FactoredHeads,
    FullRank,
    LowRank,
    VarproProblem,
    varpro_least_squares,
)
from skattn.solvers.kernels._decoupling import decoupling_map
from skattn.solvers.kernels._parametrization import random_attention
from skattn.solvers.kernels._whitening import whitening_map
from skattn.utils._array_api import namespace, to_numpy


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


def test_one_head_problem_with_fixed_columns_is_solved_to_rounding():
    X, Y, truth, factors = refine_planted(300, 5, 6, 3, 2, 6)
    par = FactoredHeads(3, 7, 2)
    D, _ = decoupling_map(factors)
    shares = (Y.reshape(-1, 6) @ D).reshape(300, 5, 3, 2)
    Q, K, _ = par.factors(truth)
    rng = np.random.default_rng(3)
    start = np.concatenate([Q[1].ravel(), K[1].ravel()])
    start += 0.05 * rng.normal(size=start.size)
    params, _, info = varpro_least_squares(
        X,
        shares[:, :, 1],
        start,
        LowRank(1, 7, 2),
        fixed_columns=np.delete(shares, 1, axis=2).reshape(300, 5, 4),
    )
    assert np.sqrt(2 * info["loss"]) < 1e-10 * np.linalg.norm(shares[:, :, 1])


def test_single_precision_products_reach_a_double_precision_optimum(monkeypatch):
    # the one-head problems' products in float32, their residuals in float64: the
    # same optimum, to double-precision rounding, as products in float64
    matvec, used = VarproProblem.matvec, set()

    def spy(self, params, direction):
        used.add(self.dtype)
        return matvec(self, params, direction)

    monkeypatch.setattr(VarproProblem, "matvec", spy)
    X, Y, truth, factors = refine_planted(300, 5, 6, 3, 2, 6, seed=6)
    D, _ = decoupling_map(factors)
    shares = (Y.reshape(-1, 6) @ D).reshape(300, 5, 3, 2)
    Q, K, _ = FactoredHeads(3, 7, 2).factors(truth)
    start = np.concatenate([Q[0].ravel(), K[0].ravel()])
    start += 0.05 * np.random.default_rng(7).normal(size=start.size)
    target = np.linalg.norm(shares[:, :, 0]) / np.sqrt(300)
    ends = {}
    for dtype in (np.float32, np.float64):
        params, _, info = varpro_least_squares(
            X,
            shares[:, :, 0],
            start,
            LowRank(1, 7, 2),
            coarse=False,
            jacobian_dtype=dtype,
            fixed_columns=shares[:, :, 1:].reshape(300, 5, 4),
        )
        assert info["converged"] and info["n_products"] > 0
        assert used == {np.dtype(dtype)}
        used.clear()
        assert np.sqrt(2 * info["loss"]) < 1e-12 * target
        ends[dtype] = LowRank(1, 7, 2).attention(params)[0, :, :-1]
    np.testing.assert_allclose(ends[np.float32], ends[np.float64], atol=1e-9)


@pytest.mark.parametrize("rank", [None, 2])
def test_numpy_run_ends_where_scipys_least_squares_does(rank):
    # the solver it replaced: scipy's least_squares on a LinearOperator of the
    # products, in the preconditioner's variables (one stage, coarse=False)
    from scipy.optimize import least_squares
    from scipy.sparse.linalg import LinearOperator

    from skattn.solvers.optimizers._lm_matrix_free import jacobian_operator

    X, Y, attention, _ = planted(300, 4, 5, 2, 5, seed=21, rank=rank)
    par = FullRank(2, 5) if rank is None else LowRank(2, 5, rank)
    start = par.from_attention(attention + 0.1)
    problem = VarproProblem(X, Y, None, par)
    precond = par.preconditioner(start)
    if precond is None:
        apply, z0 = np.asarray, start
        jacobian = lambda z: jacobian_operator(problem, z, orthogonal=True)  # noqa: E731
    else:
        apply, transpose, inverse = precond
        z0 = inverse(start)
        M = LinearOperator((par.size,) * 2, matvec=apply, rmatvec=transpose)

        def jacobian(z):
            return jacobian_operator(problem, apply(z), orthogonal=True) @ M

    eps = np.finfo(float).eps
    expected = least_squares(
        lambda z: problem.residual(apply(z)),
        z0,
        jac=jacobian,
        method="trf",
        tr_solver="lsmr",
        tr_options={"maxiter": min(par.size, 200)},
        x_scale=1.0,
        max_nfev=100,
        ftol=eps,
        xtol=1e-10,
        gtol=eps,
    )
    params, projection, info = varpro_least_squares(X, Y, start, par, coarse=False)
    # the same outcome (not one scipy version's evaluation counts): both converge
    # on the planted layer, exactly
    assert expected.success and expected.status > 0
    assert info["converged"] and info["stop_reason"] in ("step", "gradient")
    assert np.sqrt(2 * info["loss"]) <= 1e-12 * np.linalg.norm(Y)
    assert np.sqrt(2 * expected.cost) <= 1e-12 * np.linalg.norm(Y)
    np.testing.assert_allclose(
        par.attention(params),
        par.attention(apply(expected.x)),
        rtol=0,
        atol=1e-10 * abs(attention).max(),
    )


def _namespace_cases():
    """``(args, kwargs)`` of varpro_least_squares on small planted problems."""
    X, Y, _, _ = planted(200, 4, 5, 2, 5, seed=12)
    start = np.random.default_rng(3).normal(size=50) * 0.3
    yield "full", (X, Y, start, FullRank(2, 5)), {}
    yield (
        "full_float32_products",
        (X, Y, start, FullRank(2, 5)),
        {
            "coarse": False,
            "jacobian_dtype": np.float32,
            "sample_weight": np.random.default_rng(5).uniform(0.5, 2.0, 200),
        },
    )
    X, Y, attention, _ = planted(200, 4, 6, 2, 6, seed=4, rank=2)
    noise = 0.2 * np.random.default_rng(1).normal(size=attention.shape)
    par = LowRank(2, 6, 2)
    yield "low_rank", (X, Y, par.from_attention(attention + noise), par), {}
    X, Y, truth = factored_planted(200, 4, 5, 2, 2, 6, seed=3, intercept=True)
    start = truth + 0.05 * np.random.default_rng(4).normal(size=truth.size)
    yield "factored", (X, Y, start, FactoredHeads(2, 6, 2)), {"intercept": True}
    X, Y, truth, factors = refine_planted(200, 5, 6, 3, 2, 6)
    shares = (Y.reshape(-1, 6) @ decoupling_map(factors)[0]).reshape(200, 5, 3, 2)
    Q, K, _ = FactoredHeads(3, 7, 2).factors(truth)
    start = np.concatenate([Q[1].ravel(), K[1].ravel()])
    start += 0.05 * np.random.default_rng(3).normal(size=start.size)
    fixed = np.delete(shares, 1, axis=2).reshape(200, 5, 4)
    yield (
        "fixed_columns",
        (X, shares[:, :, 1], start, LowRank(1, 7, 2)),
        {"fixed_columns": fixed},
    )
    # rotary heads (base 10 000, k = 16: three slow pairs of four), their slow
    # mixings lifted into the solver's variables
    X, y, layer = make_attention_regression(
        30, 16, 8, 2, head_rank=8, causal=True, rope=True, n_kv_heads=1,
        distribution="gaussian", random_state=0, return_layer=True,
    )  # fmt: skip
    par = LowRank(2, 8, 8, n_kv_heads=1, causal=True, rope_theta=layer.rope_theta)
    truth = np.concatenate([layer.rotary_query.ravel(), layer.rotary_key.ravel()])
    noise = np.random.default_rng(1).normal(size=truth.size)
    start = truth + 0.01 * np.sqrt(np.mean(truth**2)) * noise
    yield (
        "rotary_lifted",
        (X.reshape(30, 16, 8), y.reshape(30, 16, 8), start, par),
        {"coarse": False, "max_products": 40, "tol": 1e-13},
    )


NAMESPACE_CASES = {name: case for name, *case in _namespace_cases()}


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("case", NAMESPACE_CASES)
def test_other_namespaces_give_numpys_result(to_array, case):
    (X, Y, start, par), options = NAMESPACE_CASES[case]
    params, projection, info = varpro_least_squares(X, Y, start, par, **options)
    moved = {
        key: to_array(value) if key == "fixed_columns" else value
        for key, value in options.items()
    }
    got_params, got_projection, got_info = varpro_least_squares(
        to_array(X), to_array(Y), start, par, **moved
    )
    xp = namespace(to_array(X))
    assert namespace(got_params) is xp and namespace(got_projection) is xp
    assert got_info.keys() == info.keys()
    assert all(type(got_info[key]) is type(info[key]) for key in info)
    # whole runs (a float32 stage among them) compared by their outcome, not by
    # their iteration counts: both converge, and both fit the planted data exactly
    # (at a loss of 1e-31 whether the gradient's test or the step's holds first
    # is rounding: off numpy the 2-D trust-region step is solved on the device)
    assert got_info["converged"] and info["converged"]
    assert {got_info["stop_reason"], info["stop_reason"]} <= {"gradient", "step"}
    scale = np.linalg.norm(Y)
    assert np.sqrt(2 * got_info["loss"]) <= 1e-12 * scale
    assert np.sqrt(2 * info["loss"]) <= 1e-12 * scale
    got_params, got_projection = to_numpy(got_params), to_numpy(got_projection)
    if isinstance(par, FullRank):
        np.testing.assert_allclose(got_params, params, rtol=1e-10, atol=1e-12)
    # Q K^T (not Q, K), and with tokens [x, 1] the outputs: the identifiable parts
    # (a row shift of the logits, an output shift between heads change nothing)
    if isinstance(par, LowRank) and "fixed_columns" not in options:
        attention = par.attention(params)
        np.testing.assert_allclose(
            par.attention(got_params),
            attention,
            rtol=0,
            atol=1e-10 * abs(attention).max(),
        )
    if isinstance(par, FactoredHeads):
        attention, got_attention = par.attention(params), par.attention(got_params)
        outputs = forward(X, attention, projection)
        np.testing.assert_allclose(
            forward(X, got_attention, got_projection),
            outputs,
            rtol=0,
            atol=1e-10 * abs(outputs).max(),
        )
    else:
        np.testing.assert_allclose(
            got_projection, projection, rtol=0, atol=1e-10 * abs(projection).max()
        )


def _positional_layer(seed, n=150, d=12, k=6):
    """Issue 61's positional previous-token head (logit 10 on token l - 1, from
    the positions' features alone) beside a random head, full-rank ``W_i``."""
    rng = np.random.default_rng(seed)
    half = d // 2
    positions = np.zeros((k, d))
    positions[:, half:] = 0.8 * rng.normal(size=(k, half))
    plus = np.linalg.pinv(positions)
    attention = np.stack(
        [
            10 * plus @ np.eye(k, k=-1) @ plus.T,
            rng.normal(scale=d**-0.5, size=(d, d)),
        ]
    )
    projection = rng.normal(scale=d**-0.5, size=(2, d, d))
    words = rng.normal(size=(500, half))[rng.integers(500, size=(n, k))]
    X = np.concatenate([words, np.broadcast_to(positions[:, half:], (n, k, half))], -1)
    Y = forward(X, attention, projection)
    A, _ = whitening_map(X)  # as the random-start path polishes it
    return X @ A, Y


def test_a_sharp_heads_steps_in_the_heads_blocks():
    # the previous-token head's small weights sit at the bottom of the Gauss-Newton
    # spectrum: truncated LSMR steps miss them and the polish crawls, where the
    # steps in each head's block converge (issue 61)
    X, Y = _positional_layer(0)
    par = FullRank(2, 12)
    start = par.from_attention(random_attention(2, 12, np.random.RandomState(0)))
    runs = {
        blocks: varpro_least_squares(X, Y, start, par, max_iter=30, head_blocks=blocks)
        for blocks in (True, False)
    }
    blocked, plain = runs[True][2], runs[False][2]
    assert blocked["converged"] and blocked["loss"] <= 1e-28 * blocked["loss_start"]
    # the same start, several times the products (at the evaluations' cap or not)
    assert blocked["n_products"] < 0.5 * plain["n_products"]
    np.testing.assert_allclose(
        par.attention(runs[True][0]),
        par.attention(runs[False][0]),
        atol=1e-4 * np.abs(par.attention(runs[True][0])).max(),
    )


def test_plain_rotary_steps_stop_where_the_lift_should_take_over():
    """The rotary polish's plain steps go on while every PLAIN_WINDOW
    evaluations take the cost below PLAIN_PROGRESS of what it was, and stop
    when they do not or when the relative residual falls below LIFT_BELOW
    (then the slow mixings are lifted)."""
    from types import SimpleNamespace

    from skattn.solvers.optimizers._lm_matrix_free import (
        LIFT_BELOW,
        PLAIN_PROGRESS,
        PLAIN_WINDOW,
        _slowing,
    )

    def run(costs, target=1.0):
        check = _slowing(target)
        for nfev, cost in enumerate(costs, start=1):
            try:
                check(SimpleNamespace(cost=cost, nfev=nfev))
            except StopIteration:
                return nfev
        return None

    fast = [0.5 * 0.9**i for i in range(3 * PLAIN_WINDOW)]  # 0.66 every window
    assert PLAIN_PROGRESS > 0.9**PLAIN_WINDOW and run(fast) is None
    slow = [0.5 * 0.99**i for i in range(3 * PLAIN_WINDOW)]  # 0.96 every window
    assert PLAIN_PROGRESS < 0.99**PLAIN_WINDOW
    assert run(slow) == 1 + PLAIN_WINDOW
    near = 0.5 * (0.5 * LIFT_BELOW) ** 2  # the residual below LIFT_BELOW
    assert run([0.5, 0.1, near]) == 3


def test_plain_rotary_steps_that_spend_the_whole_budget_stop_on_it():
    # the plain steps slowed (or reached LIFT_BELOW) at the budget's last
    # evaluation: no lifted stage was left to run, and the run stops on its
    # budget (before: a TypeError on the status that no stage had set; a
    # trained Qwen2 layer at base 10^6 crashed so in the decoder's reflections)
    (X, Y, start, par), options = NAMESPACE_CASES["rotary_lifted"]
    for max_iter in (2, 3, 4):
        _, _, info = varpro_least_squares(
            X, Y, start, par, **{**options, "max_iter": max_iter}
        )
        assert info["n_evaluations"] == max_iter
        assert info["stop_reason"] == "max_iter" and not info["converged"]
