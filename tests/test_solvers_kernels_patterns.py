"""A head's patterns read off its outputs: simplex projection and least squares."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from skattn.layer._math import forward, softmax
from skattn.solvers import FactoredHeads, invert_patterns
from skattn.solvers.kernels._patterns import project_simplex, simplex_least_squares


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        np.float64,
        st.tuples(st.integers(1, 4), st.integers(1, 7)),
        elements=st.floats(-1e3, 1e3),
    )
)
def test_project_simplex_is_the_euclidean_projection(V):
    P = project_simplex(V)
    assert np.all(P >= 0)
    np.testing.assert_allclose(P.sum(-1), 1.0, rtol=0, atol=1e-9)
    # optimality (KKT): P = max(V - theta, 0) with one theta per row, so V - P
    # equals theta on the support and is at least theta off it
    gap = V - P
    for g, p in zip(gap, P, strict=True):
        support = p > 0
        theta = g[support].mean()
        np.testing.assert_allclose(g[support], theta, atol=1e-9 * (1 + abs(theta)))
        assert np.all(g[~support] <= theta + 1e-9 * (1 + abs(theta)))
    # points of the simplex are their own projection
    np.testing.assert_allclose(project_simplex(P), P, atol=1e-12)


def test_simplex_least_squares_recovers_planted_rows():
    """With at least as many features as tokens the rows are determined: found
    from the uniform start, nearly one-hot rows included."""
    rng = np.random.default_rng(1)
    n, k, r = 20, 5, 8
    Z = rng.normal(size=(n, k, r))
    P = softmax(6.0 * rng.normal(size=(n, 7, k)), axis=-1)
    found = simplex_least_squares(P @ Z, Z, np.full(P.shape, 1.0 / k), max_iter=3000)
    np.testing.assert_allclose(found, P, rtol=0, atol=1e-9)


def test_invert_patterns_reads_the_small_weights_of_a_too_sharp_head():
    """Head 0 of two, learned with its largest weights in the right places but its
    logits three times too sharp (the MiniLM layer-0 failure: its small weights
    wrong by nats): the patterns read off the outputs are the real ones, small
    weights included, the other head's error notwithstanding."""
    rng = np.random.default_rng(0)
    m, d, r, k, d_out = 2, 6, 6, 4, 12
    par = FactoredHeads(m, d, r)
    truth = rng.normal(size=par.size)
    Q, K, V = par.factors(truth)
    X = rng.normal(size=(400, k, d))
    Y = forward(X, Q @ np.swapaxes(K, 1, 2), V @ rng.normal(size=(m, r, d_out)))
    sharp, other = Q.copy(), K.copy()
    sharp[0] *= 3.0
    other[1] = rng.normal(size=(d, r))  # head 1 wrong too
    start = np.concatenate([sharp.ravel(), other.ravel(), V.ravel()])
    real = softmax(par.logits(X, truth), axis=-1)[:, 0]
    before = softmax(par.logits(X, start), axis=-1)[:, 0]
    assert np.array_equal(before.argmax(-1), real.argmax(-1))
    visible = real > 1e-6
    assert np.abs(np.log(before[visible]) - np.log(real[visible])).max() > 1.0

    found, info = invert_patterns(X, Y, start, par, 0, n_rounds=40)

    np.testing.assert_allclose(found, real, rtol=0, atol=1e-6)
    assert np.abs(np.log(found[visible]) - np.log(real[visible])).max() < 0.1
    residuals = info["residuals"]
    assert len(residuals) == 41
    assert residuals[-1] < 1e-7 < 1e-1 < residuals[0]
