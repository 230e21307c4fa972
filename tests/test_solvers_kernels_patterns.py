"""A head's patterns read off its outputs: simplex projection and least squares."""

import numpy as np
import pytest
from _helpers import array_namespaces
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import skattn.solvers.kernels._patterns as patterns_module
from skattn.layer._math import forward, softmax
from skattn.solvers import FactoredHeads, invert_patterns
from skattn.solvers.kernels._patterns import (
    _projected_gradient,
    project_simplex,
    simplex_least_squares,
)
from skattn.utils._array_api import namespace, to_numpy


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
    found = simplex_least_squares(P @ Z, Z, np.full(P.shape, 1.0 / k))
    np.testing.assert_allclose(found, P, rtol=0, atol=1e-12)


def assert_simplex_optimal(P, targets, images, tol=1e-9):
    """KKT of ``min ||u - p Z||^2`` over the simplex, every row: the gradient
    ``p G - b`` equal on the support and no smaller off it."""
    assert np.all(P >= 0)
    np.testing.assert_allclose(P.sum(-1), 1.0, rtol=0, atol=1e-12)
    gram = images @ np.swapaxes(images, 1, 2)
    gradient = P @ gram - targets @ np.swapaxes(images, 1, 2)
    scale = 1.0 + np.abs(gradient).max()
    for g, p in zip(
        gradient.reshape(-1, P.shape[-1]), P.reshape(-1, P.shape[-1]), strict=True
    ):
        support = p > 0
        level = g[support].mean()
        np.testing.assert_allclose(g[support], level, rtol=0, atol=tol * scale)
        assert np.all(g[~support] >= level - tol * scale)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 9),
    st.integers(1, 12),
    st.integers(0, 2**32 - 1),
)
def test_simplex_least_squares_is_optimal(n, k, r, seed):
    """Any targets (not only mixtures), any start on the simplex, also fewer
    features than tokens (several optima) and repeated tokens: the rows found
    satisfy the optimality conditions, and no row is worse than FISTA's."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, k, r))
    if k > 1:
        images[:, -1] = images[:, 0]  # a repeated token
    targets = rng.normal(size=(n, 3, r))
    start = project_simplex(rng.normal(size=(n, 3, k)))
    found = simplex_least_squares(targets, images, start)
    assert_simplex_optimal(found, targets, images)
    gram = images @ np.swapaxes(images, 1, 2)
    linear = targets @ np.swapaxes(images, 1, 2)
    fista = _projected_gradient(linear, gram, start, max_iter=5000)

    def cost(P):
        return 0.5 * np.einsum("nqi,nij,nqj->nq", P, gram, P) - (P * linear).sum(-1)

    assert np.all(cost(found) <= cost(fista) + 1e-10 * (1 + np.abs(cost(fista))))


def test_simplex_least_squares_rows_left_are_finished_by_fista():
    """With no active-set iteration allowed every row goes to projected gradient
    (1000 FISTA iterations), which comes near the same rows."""
    rng = np.random.default_rng(2)
    Z = rng.normal(size=(6, 5, 8))
    P = softmax(4.0 * rng.normal(size=(6, 4, 5)), axis=-1)
    uniform = np.full(P.shape, 0.2)
    exact = simplex_least_squares(P @ Z, Z, uniform)
    fallback = simplex_least_squares(P @ Z, Z, uniform, max_iter=0)
    np.testing.assert_allclose(exact, P, rtol=0, atol=1e-12)
    gram = Z @ np.swapaxes(Z, 1, 2)
    fista = _projected_gradient((P @ Z) @ np.swapaxes(Z, 1, 2), gram, uniform)
    np.testing.assert_allclose(fallback, fista, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fallback, P, rtol=0, atol=1e-4)


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


def test_invert_patterns_stops_once_a_round_gains_little():
    """Outputs with noise: the rounds' residual reaches a floor, where a round
    lowering it by less than ``stall`` of it ends the reading early; without
    ``stall`` every round runs."""
    rng = np.random.default_rng(3)
    par = FactoredHeads(1, 6, 6)
    truth = rng.normal(size=par.size)
    X = rng.normal(size=(200, 4, 6))
    Y = forward(X, par.attention(truth), par.factors(truth)[2])
    Y += 1e-3 * np.abs(Y).mean() * rng.normal(size=Y.shape)
    _, every = invert_patterns(X, Y, truth, par, 0, n_rounds=60)
    _, early = invert_patterns(X, Y, truth, par, 0, n_rounds=60, stall=0.01)
    assert len(every["residuals"]) == 61
    residuals = early["residuals"]
    assert 2 < len(residuals) < 61
    assert residuals[-1] > 0.99 * residuals[-2]
    gains = zip(residuals[:-2], residuals[1:-1], strict=True)
    assert all(b <= 0.99 * a for a, b in gains)
    assert residuals[-1] < 1.05 * every["residuals"][-1]  # near the floor


def assert_numpys(out, expected, to_array, rtol=1e-12):
    """``out`` is in ``to_array``'s namespace and is ``expected`` to ``rtol``."""
    assert namespace(out) is namespace(to_array(np.ones(1)))
    got = to_numpy(out)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= rtol * max(np.abs(expected).max(), 1.0)


def _simplex_rows(seed=4, n=40, k=5, r=8):
    """Targets of rows on the simplex plus noise, their images and a start."""
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(n, k, r))
    P = softmax(5.0 * rng.normal(size=(n, 3, k)), axis=-1)
    targets = P @ Z + 0.05 * rng.normal(size=(n, 3, r))
    return targets, Z, np.full(P.shape, 1.0 / k)


@pytest.mark.parametrize("to_array", array_namespaces())
def test_the_kernels_in_other_namespaces_are_numpys(to_array):
    # one evaluation of each, on the inputs' namespace: the projection, one
    # simplex least-squares solve (rows ending at different iterations, some
    # left to FISTA with max_iter=2) and one round of the pattern reading
    V = 3.0 * np.random.default_rng(0).normal(size=(30, 6))
    assert_numpys(project_simplex(to_array(V)), project_simplex(V), to_array)
    targets, Z, start = _simplex_rows()
    for max_iter in (None, 2):
        expected = simplex_least_squares(targets, Z, start, max_iter)
        out = simplex_least_squares(*map(to_array, (targets, Z, start)), max_iter)
        assert_numpys(out, expected, to_array)
    rng = np.random.default_rng(1)
    par = FactoredHeads(2, 6, 4)
    truth = rng.normal(size=par.size)
    X = rng.normal(size=(120, 4, 6))
    Y = forward(
        X, par.attention(truth), par.factors(truth)[2] @ rng.normal(size=(2, 4, 9))
    )
    weights = rng.uniform(0.5, 2.0, size=120)
    expected, info = invert_patterns(
        X, Y, truth, par, 1, sample_weight=weights, n_rounds=1
    )
    out, found = invert_patterns(
        *map(to_array, (X, Y, truth)),
        par,
        1,
        sample_weight=to_array(weights),
        n_rounds=1,
    )
    assert_numpys(out, expected, to_array)
    np.testing.assert_allclose(found["residuals"], info["residuals"], rtol=1e-10)


def test_rows_done_between_host_reads_are_frozen(monkeypatch):
    # off numpy the host reads which rows go on every _READ_EVERY iterations
    # (of the active set, and of FISTA): the rows and FISTA's iterate are the
    # same whether it reads every iteration or once at the end
    torch = pytest.importorskip("torch")
    targets, Z, start = _simplex_rows(seed=6, n=60)
    arrays = [torch.asarray(a) for a in (targets, Z, start)]
    runs = []
    for every in (1, 3, 10_000):
        monkeypatch.setattr(patterns_module, "_READ_EVERY", every)
        runs.append(
            [
                to_numpy(simplex_least_squares(*arrays, max_iter))
                for max_iter in (None, 3)
            ]
        )
    for other in runs[1:]:
        for one, two in zip(runs[0], other, strict=True):
            np.testing.assert_allclose(two, one, rtol=0, atol=1e-15)
