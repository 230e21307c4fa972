"""Matrix-free Levenberg-Marquardt on the reduced problem
(``optimizers/_lm_matrix_free.py``)."""

import numpy as np
import pytest
from _helpers import planted, refine_planted

from skattn.layer._math import forward
from skattn.solvers import (
    FactoredHeads,
    FullRank,
    LowRank,
    VarproProblem,
    varpro_least_squares,
)
from skattn.solvers.kernels._decoupling import decoupling_map


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
