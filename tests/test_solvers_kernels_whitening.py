"""Whitening the tokens and mapping a layer back (``kernels/_whitening.py``)."""

import numpy as np


def test_whitening_map_is_exact_and_whitens():
    from skattn.layer._math import forward
    from skattn.solvers import whitening_map
    from skattn.solvers.kernels._whitening import _unwhiten

    rng = np.random.default_rng(0)
    scales = np.array([5.0, 1.0, 0.2, 0.05])
    X = rng.normal(size=(400, 3, 4)) * scales + [1.0, 0.0, 0.0, 0.0]
    A, condition = whitening_map(X)
    Z = (X @ A).reshape(-1, A.shape[1])
    np.testing.assert_allclose(Z.T @ Z / len(Z), np.eye(4), atol=1e-10)
    assert condition > 1e3
    # a layer on the whitened tokens, mapped back, has the same outputs
    theta, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 3))
    back_theta, back_W = _unwhiten(theta, W, A)
    np.testing.assert_allclose(
        forward(X, back_theta, back_W), forward(X @ A, theta, W), atol=1e-10
    )


def test_whitening_drops_the_directions_tokens_do_not_reach():
    from skattn.solvers import whitening_map

    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 3, 5))
    X -= X.mean(axis=2, keepdims=True)  # a LayerNorm's hyperplane
    A, _ = whitening_map(X)
    assert A.shape == (5, 4)
