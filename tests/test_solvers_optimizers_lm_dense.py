"""Dense Levenberg-Marquardt: its Gauss-Newton blocks (``optimizers/_lm_dense.py``)."""

import numpy as np
import pytest
from _helpers import array_namespaces, planted

from skattn.layer._math import forward, squared_loss_gradient
from skattn.solvers.optimizers._lm_dense import (
    _gauss_newton_system,
    _varpro_levenberg_marquardt,
)
from skattn.utils._array_api import namespace, to_numpy


def test_gauss_newton_blocks_match_numeric_jacobian():
    rng = np.random.default_rng(0)
    n, k, d, m, o = 6, 3, 3, 2, 2
    X = rng.choice([-1.0, 1.0], size=(n, k, d))
    attention = rng.normal(size=(m, d, d))
    projection = rng.normal(size=(m, d, o))
    Y = rng.normal(size=(n, k, o))
    weight = rng.uniform(0.5, 2.0, size=n)
    loss, g_t, g_w, h_tt, h_tw, gram = _gauss_newton_system(
        X, Y, attention, projection, weight, 0.0
    )
    ref_loss, ref_gt, ref_gw = squared_loss_gradient(
        X, Y, attention, projection, weight
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    np.testing.assert_allclose(g_t, ref_gt.ravel(), atol=1e-12)
    np.testing.assert_allclose(g_w, ref_gw.reshape(m * d, o), atol=1e-12)
    scale = np.sqrt(weight / weight.sum())[:, None, None]

    def residual(x):
        th = x[: m * d * d].reshape(m, d, d)
        W = x[m * d * d :].reshape(m, d, o)
        return ((forward(X, th, W) - Y) * scale).ravel()

    x0 = np.concatenate([attention.ravel(), projection.ravel()])
    jac = np.empty((residual(x0).size, x0.size))
    for j in range(x0.size):
        e = np.zeros_like(x0)
        e[j] = 1e-6
        jac[:, j] = (residual(x0 + e) - residual(x0 - e)) / 2e-6
    H = jac.T @ jac
    p = m * d * d
    np.testing.assert_allclose(h_tt, H[:p, :p], atol=1e-8)
    np.testing.assert_allclose(h_tw.reshape(p, -1), H[:p, p:], atol=1e-8)
    np.testing.assert_allclose(np.kron(gram, np.eye(o)), H[p:, p:], atol=1e-8)


def _lm_case(case):
    """``(X, Y, start, weight, alpha, hull)`` of the namespace comparisons."""
    rng = np.random.default_rng(4)
    hull, weight, alpha = None, None, 0.0
    if case == "via_covariance":  # d_out > d
        X, Y, attention, _ = planted(200, 3, 3, 2, 7, seed=2)
    else:
        X, Y, attention, _ = planted(200, 4, 4, 2, 4, seed=1)
        weight, alpha = rng.uniform(0.5, 2.0, 200), 1e-3
    if case == "hull":
        directions = np.linalg.qr(rng.normal(size=(16, 1)))[0].T.reshape(1, 4, 4)
        hull = (rng.normal(size=(4, 4)), directions)
    start = attention + 0.1 * rng.normal(size=attention.shape)
    return X, Y, start, weight, alpha, hull


LM_CASES = ["plain", "via_covariance", "hull"]


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("case", LM_CASES)
def test_one_levenberg_marquardt_step_in_other_namespaces_is_numpys(to_array, case):
    # one Jacobian, one damped step from the same point: rounding apart, the same
    # arithmetic, so the same step to 1e-10 on any BLAS
    X, Y, start, weight, alpha, hull = _lm_case(case)
    args = (start, weight, alpha, hull, 2, 1e-10)  # 2 evaluations: one step
    expected = _varpro_levenberg_marquardt(X, Y, *args)
    theta, projection, info = _varpro_levenberg_marquardt(
        to_array(X), to_array(Y), *args
    )
    xp = namespace(to_array(X))
    assert namespace(theta) is xp and namespace(projection) is xp
    assert info["n_iter"] == expected[2]["n_iter"] == 1
    for got, want in zip((theta, projection), expected[:2], strict=True):
        np.testing.assert_allclose(
            to_numpy(got), want, rtol=0, atol=1e-10 * abs(want).max()
        )
    assert info["loss"] == pytest.approx(expected[2]["loss"], rel=1e-10)
    assert type(info["loss"]) is float


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("case", LM_CASES)
def test_levenberg_marquardt_runs_in_other_namespaces_end_where_numpys_does(
    to_array, case
):
    # whole runs compared by their outcome, not step by step: both stop on a small
    # step at the same minimum (the same loss; the same point but for the flat
    # directions of the minimum, along which rounding moves each run its own way:
    # on the hull about 1e-8, iteration counts differing on another BLAS)
    X, Y, start, weight, alpha, hull = _lm_case(case)
    args = (start, weight, alpha, hull, 300, 1e-10)
    expected = _varpro_levenberg_marquardt(X, Y, *args)
    theta, projection, info = _varpro_levenberg_marquardt(
        to_array(X), to_array(Y), *args
    )
    assert info["stop_reason"] == expected[2]["stop_reason"] == "step"
    assert info["loss"] == pytest.approx(expected[2]["loss"], rel=1e-9, abs=1e-25)
    for got, want in zip((theta, projection), expected[:2], strict=True):
        np.testing.assert_allclose(
            to_numpy(got), want, rtol=0, atol=1e-6 * abs(want).max()
        )
    if case == "via_covariance":  # exact data: both end at the planted layer
        assert expected[2]["loss"] < 1e-20 and info["loss"] < 1e-20


@pytest.mark.parametrize("to_array", array_namespaces())
def test_gauss_newton_blocks_in_other_namespaces_are_numpys(to_array):
    rng = np.random.default_rng(0)
    X = rng.choice([-1.0, 1.0], size=(6, 3, 3))
    attention, projection = rng.normal(size=(2, 3, 3)), rng.normal(size=(2, 3, 2))
    Y, weight = rng.normal(size=(6, 3, 2)), rng.uniform(0.5, 2.0, size=6)
    expected = _gauss_newton_system(X, Y, attention, projection, weight, 0.1)
    got = _gauss_newton_system(
        *(to_array(a) for a in (X, Y, attention, projection)), weight, 0.1
    )
    assert type(got[0]) is float and got[0] == pytest.approx(expected[0], rel=1e-12)
    for block, want in zip(got[1:], expected[1:], strict=True):
        assert namespace(block) is namespace(to_array(X))
        np.testing.assert_allclose(to_numpy(block), want, rtol=1e-10, atol=1e-13)
