"""A head's logits fitted to its patterns in logit space (``kernels/_logits.py``)."""

import numpy as np
import pytest
from _helpers import array_namespaces

from skattn.layer._math import softmax
from skattn.solvers.kernels._logits import (
    logit_jacobian,
    logit_residual,
    logit_targets,
    split_rows,
)
from skattn.solvers.optimizers._trf import trf
from skattn.utils._array_api import namespace, to_numpy


def sharp_head(n=200, k=5, d=6, r=3, scale=8.0, seed=0):
    """Tokens, ``Q, K`` of a sharp head and its patterns."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, k, d))
    Q, K = scale * rng.normal(size=(d, r)) / d**0.5, rng.normal(size=(d, r)) / d**0.5
    P = softmax((X @ Q) @ np.swapaxes(X @ K, 1, 2), axis=-1)
    return X, Q, K, P


def test_targets_and_weights():
    P = np.array([[0.7, 0.3 - 2e-5 - 1e-6, 2e-5, 1e-6]])
    targets, weights = logit_targets(P, floor=1e-5, full=1e-4)
    np.testing.assert_allclose(targets[0, :3], np.log(P[0, :3]))
    assert targets[0, 3] == np.log(1e-5)  # not known: at the floor ...
    np.testing.assert_allclose(weights, [[1.0, 1.0, 0.2, 0.0]])  # ... weight 0
    # floor 0: every weight trusted, their logarithms as they are
    targets, weights = logit_targets(P, floor=0.0, full=1e-4)
    np.testing.assert_allclose(targets, np.log(P))
    assert weights[0, 3] == pytest.approx(0.01)


def test_the_residual_vanishes_at_the_head_whatever_the_row_constants():
    X, Q, K, P = sharp_head()
    targets, weights = logit_targets(P, floor=0.0)
    params = np.concatenate([Q.ravel(), K.ravel()])
    assert np.abs(logit_residual(X, targets, weights, params, 3)).max() < 1e-10
    # a constant per row (the softmax's normaliser) is eliminated
    shifted = (
        targets + np.random.default_rng(1).normal(size=targets.shape[:2])[..., None]
    )
    assert np.abs(logit_residual(X, shifted, weights, params, 3)).max() < 1e-10
    # another head does not fit
    assert np.abs(logit_residual(X, targets, weights, 1.1 * params, 3)).max() > 1e-2


def test_jacobian_products_are_the_derivative_and_its_transpose():
    X, Q, K, P = sharp_head(n=20)
    rng = np.random.default_rng(2)
    targets, weights = logit_targets(P)
    params, step = rng.normal(size=36), rng.normal(size=36)
    matvec, rmatvec = logit_jacobian(X, weights, params, 3)
    h = 1e-6
    numeric = (
        logit_residual(X, targets, weights, params + h * step, 3)
        - logit_residual(X, targets, weights, params - h * step, 3)
    ) / (2 * h)
    np.testing.assert_allclose(matvec(step), numeric, rtol=1e-6, atol=1e-8)
    u = rng.normal(size=numeric.size)
    assert u @ matvec(step) == pytest.approx(rmatvec(u) @ step, rel=1e-10)


def test_the_fit_recovers_a_sharp_head_where_its_weights_are_known():
    # a head whose median largest weight is above 0.95, from a start twice too sharp
    # and off: its Theta = Q K^T from the logarithms of the weights above the floor
    X, Q, K, P = sharp_head()
    assert np.median(P.max(-1)) > 0.95
    targets, weights = logit_targets(P)
    rng = np.random.default_rng(3)
    start = np.concatenate(
        [(2 * Q + 0.1 * rng.normal(size=Q.shape)).ravel(), K.ravel()]
    )
    result = trf(
        np,
        lambda p: logit_residual(X, targets, weights, p, 3),
        lambda p: logit_jacobian(X, weights, p, 3),
        start,
        ftol=1e-15,
        xtol=1e-15,
        gtol=1e-15,
        max_nfev=100,
    )
    found = result.x[:18].reshape(6, 3) @ result.x[18:].reshape(6, 3).T
    truth = Q @ K.T
    assert np.linalg.norm(found - truth) < 1e-8 * np.linalg.norm(truth)


@pytest.mark.parametrize("to_array", array_namespaces())
def test_the_kernels_in_other_namespaces_are_numpys(to_array):
    # one evaluation each, in the inputs' namespace: targets and weights, the
    # residual, both Jacobian products, the split rows
    X, Q, K, P = sharp_head(n=30)
    rng = np.random.default_rng(4)
    params, v = rng.normal(size=(2, 36))
    targets, weights = logit_targets(P)
    residual = logit_residual(X, targets, weights, params, 3)
    u = rng.normal(size=residual.size)
    matvec, rmatvec = logit_jacobian(X, weights, params, 3)
    expected = [targets, weights, residual, matvec(v), rmatvec(u)]
    Xa, va, ua = map(to_array, (X, v, u))
    t, w = logit_targets(to_array(P))
    matvec, rmatvec = logit_jacobian(Xa, w, to_array(params), 3)
    out = [t, w, logit_residual(Xa, t, w, to_array(params), 3), matvec(va), rmatvec(ua)]
    for got, want in zip(out, expected, strict=True):
        assert namespace(got) is namespace(Xa)
        scale = np.abs(want).max()
        assert np.abs(to_numpy(got) - want).max() <= 1e-12 * scale
    assert split_rows(Xa, to_array(Q), to_array(K)) == split_rows(X, Q, K) > 0
