"""The batched one-head problems (HeadBatch) against the one-head problems solved
one at a time (VarproProblem with one LowRank head and fixed columns): the same
residual, coefficients and products, head by head, in every namespace."""

import numpy as np
import pytest
from _helpers import array_namespaces

from skattn.layer._math import forward
from skattn.solvers.kernels._head_batch import HeadBatch, head_layout, lowrank_layout
from skattn.solvers.kernels._parametrization import LowRank
from skattn.solvers.kernels._varpro import VarproProblem


def _problem(n=60, k=5, d=6, r=2, h=3, f=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, k, d))
    targets = rng.normal(size=(n, k, h, r))
    fixed = None if f == 0 else rng.normal(size=(n, k, h, f))
    weights = rng.uniform(0.5, 2.0, size=n)
    params = 0.5 * rng.normal(size=(h, 2 * d * r))
    return X, targets, fixed, weights, params, rng


def _relative(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("f", [0, 4])
def test_each_head_is_its_one_head_problem(f):
    X, targets, fixed, weights, params, rng = _problem(f=f)
    h, d, r = params.shape[0], X.shape[2], targets.shape[3]
    batch = HeadBatch(X, targets, fixed, weights)
    residual = batch.residual(params)
    direction = rng.normal(size=params.shape)
    jv = batch.matvec(direction)
    jtu = batch.rmatvec(residual)
    for i in range(h):
        one = VarproProblem(
            X,
            targets[:, :, i, :],
            weights,
            LowRank(1, d, r),
            fixed_columns=None if fixed is None else fixed[:, :, i, :],
        )
        own = one.residual(params[i])
        assert _relative(residual[i], own) < 1e-12
        assert _relative(batch.coefficients[i, :d, :], one.projection[0]) < 1e-10
        assert _relative(jv[i], one.matvec(params[i], direction[i])) < 1e-12
        assert _relative(jtu[i], one.rmatvec(params[i], own, orthogonal=True)) < 1e-12
    assert batch.n_products == 2 and batch.head_products == [2] * h
    batch.select([0])  # the others leave: only head 0 counts on
    batch.matvec(direction[:1])
    assert batch.n_products == 3 and batch.head_products == [3] + [2] * (h - 1)


def test_single_precision_products_stay_close_and_residuals_double():
    X, targets, fixed, weights, params, rng = _problem()
    exact = HeadBatch(X, targets, fixed, weights)
    low = HeadBatch(X, targets, fixed, weights, dtype=np.float32)
    # the residuals and coefficients are double precision in both
    assert _relative(low.residual(params), exact.residual(params)) < 1e-12
    direction = rng.normal(size=params.shape)
    assert _relative(low.matvec(direction), exact.matvec(direction)) < 1e-5
    assert low.matvec(direction).dtype == np.float64


def test_select_keeps_the_heads_problems_at_their_point():
    X, targets, fixed, weights, params, rng = _problem(h=4)
    full = HeadBatch(X, targets, fixed, weights)
    residual = full.residual(params)
    direction = rng.normal(size=params.shape)
    jv = full.matvec(direction)
    part = HeadBatch(X, targets, fixed, weights)
    part.evaluate(params)
    part.select([3, 1])
    assert part.n_heads == 2
    assert _relative(part.residual(), residual[[3, 1]]) < 1e-15
    assert _relative(part.matvec(direction[[3, 1]]), jv[[3, 1]]) < 1e-12
    assert _relative(part.target_norms, full.target_norms[[3, 1]]) < 1e-15


def test_a_singular_design_gets_the_fitted_values_of_least_squares():
    # tokens in a proper subspace (a constant coordinate and a repeated one):
    # the Gram of S_i X is singular
    X, targets, fixed, weights, params, _ = _problem(f=0)
    X[..., -1] = 1.0
    X[..., -2] = X[..., 0]
    batch = HeadBatch(X, targets, None, weights)
    residual = batch.residual(params)
    h, d, r = params.shape[0], X.shape[2], targets.shape[3]
    for i in range(h):
        one = VarproProblem(X, targets[:, :, i, :], weights, LowRank(1, d, r))
        assert _relative(residual[i], one.residual(params[i])) < 1e-8


def test_exact_heads_have_zero_residual():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(80, 4, 5))
    Q, K = rng.normal(size=(2, 3, 5, 2))
    W = rng.normal(size=(3, 5, 2))
    targets = np.stack(
        [
            forward(X, Q[i : i + 1] @ K[i : i + 1].transpose(0, 2, 1), W[i : i + 1])
            for i in range(3)
        ],
        axis=2,
    )
    params = np.concatenate([Q.reshape(3, -1), K.reshape(3, -1)], axis=1)
    batch = HeadBatch(X, targets, None, None)
    assert np.abs(batch.residual(params)).max() < 1e-12
    assert _relative(batch.coefficients, W) < 1e-10


def test_layouts_are_inverse():
    p = np.arange(24.0)
    rows = head_layout(np, p, 3)
    assert rows.shape == (3, 8)
    assert (lowrank_layout(np, rows) == p).all()
    Q, K = LowRank(3, 2, 2).factors(p)
    assert (rows[1] == np.concatenate([Q[1].ravel(), K[1].ravel()])).all()


@pytest.mark.parametrize("to", array_namespaces())
def test_other_namespaces_give_numpys_kernels(to):
    X, targets, fixed, weights, params, rng = _problem()
    direction = rng.normal(size=params.shape)
    reference = HeadBatch(X, targets, fixed, weights)
    res = reference.residual(params)
    jv, jtu = reference.matvec(direction), reference.rmatvec(res)
    other = HeadBatch(to(X), to(targets), to(fixed), to(weights))
    res_other = other.residual(to(params))
    assert _relative(_numpy(res_other), res) < 1e-12
    assert _relative(_numpy(other.matvec(to(direction))), jv) < 1e-12
    assert _relative(_numpy(other.rmatvec(res_other)), jtu) < 1e-12


def _numpy(a):
    from skattn.utils._array_api import to_numpy

    return to_numpy(a)
