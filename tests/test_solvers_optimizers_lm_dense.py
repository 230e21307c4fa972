"""Dense Levenberg-Marquardt: its Gauss-Newton blocks (``optimizers/_lm_dense.py``)."""

import numpy as np

from skattn.layer._math import forward, squared_loss_gradient
from skattn.solvers.optimizers._lm_dense import _gauss_newton_system


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
