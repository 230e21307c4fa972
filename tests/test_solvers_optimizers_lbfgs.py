"""L-BFGS-B on all parameters of a layer or on the reduced objective
(``optimizers/_lbfgs.py``)."""

import numpy as np
from _helpers import planted

from skattn.layer._math import forward
from skattn.solvers import STOP_REASONS, solve_projections
from skattn.solvers.optimizers._lbfgs import lbfgs_layer, lbfgs_reduced


def test_lbfgs_layer_reaches_the_loss_floor_of_a_planted_layer():
    X, Y, attention, projection = planted(200, 3, 4, 2, 4, seed=0)
    rng = np.random.default_rng(0)
    start = attention + 0.05 * rng.normal(size=attention.shape)
    th, W, info = lbfgs_layer(
        X, Y, start, solve_projections(X, Y, start), None, 0.0, 500, 1e-12
    )
    assert info["stop_reason"] in STOP_REASONS and info["converged"]
    assert info["loss"] < 1e-20 * info["loss_start"]
    np.testing.assert_allclose(th, attention, atol=1e-9)
    np.testing.assert_allclose(W, projection, atol=1e-9)


def test_lbfgs_layer_stops_on_its_iteration_budget():
    X, Y, attention, _ = planted(200, 3, 4, 2, 4, seed=0)
    start = attention + 0.05 * np.random.default_rng(0).normal(size=attention.shape)
    W0 = solve_projections(X, Y, start)
    _, _, info = lbfgs_layer(X, Y, start, W0, None, 0.0, 1, 1e-12)
    assert info["stop_reason"] == "max_iter" and not info["converged"]
    assert info["n_iter"] == 1 and info["loss"] < info["loss_start"]


def test_lbfgs_layer_with_low_rank_heads_keeps_their_rank():
    # Q_i K_i^T and V_i O_i of rank 2: the factors are the unknowns
    rng = np.random.default_rng(3)
    m, d, r, d_out = 2, 5, 2, 6
    Q, K, V = (rng.normal(size=(m, d, r)) / np.sqrt(d) for _ in range(3))
    attention = 2 * Q @ np.swapaxes(K, 1, 2)
    projection = V @ rng.normal(size=(m, r, d_out))
    X = rng.choice([-1.0, 1.0], size=(300, 3, d))
    Y = forward(X, attention, projection)
    th, W, info = lbfgs_layer(
        X,
        Y,
        attention + 0.02 * rng.normal(size=attention.shape),
        projection + 0.02 * rng.normal(size=projection.shape),
        None,
        0.0,
        1000,
        1e-12,
        head_rank=r,
    )
    assert info["stop_reason"] in STOP_REASONS
    assert info["loss"] < 1e-20 * info["loss_start"]
    for head in (*th, *W):
        assert np.linalg.matrix_rank(head, tol=1e-10) == r
    np.testing.assert_allclose(forward(X, th, W), Y, atol=1e-9)


def test_lbfgs_reduced_in_a_hull_stays_in_it_and_eliminates_the_projections():
    X, Y, attention, _ = planted(200, 3, 4, 2, 4, seed=0)
    diff = attention[1] - attention[0]
    directions = (diff / np.linalg.norm(diff))[None]
    point = attention[0] + 0.3 * directions[0]
    start = attention + 0.2 * directions[0] * np.array([1.0, -1.0])[:, None, None]
    th, W, info = lbfgs_reduced(X, Y, start, None, 0.0, (point, directions), 300, 1e-12)
    assert info["stop_reason"] in STOP_REASONS and info["converged"]
    coords = np.einsum("mde,rde->mr", th - point, directions)
    off_hull = th - point - np.einsum("mr,rde->mde", coords, directions)
    assert np.abs(off_hull).max() < 1e-12
    np.testing.assert_allclose(th, attention, atol=1e-9)
    np.testing.assert_array_equal(W, solve_projections(X, Y, th))
