"""Each head's Gauss-Newton block and its preconditioner
(``solvers/kernels/_head_gram.py``)."""

import numpy as np
import pytest
from _helpers import array_namespaces

from skattn.layer._math import forward
from skattn.solvers.kernels._head_gram import (
    block_preconditioner,
    full_rank_head_grams,
    gram_sequences,
)
from skattn.utils._array_api import to_numpy


def _numeric_jacobian(X, attention, projection, head, root):
    """The outputs' Jacobian in ``vec(Theta_head)`` by central differences, the
    rows scaled by ``root``."""
    d = X.shape[2]
    columns = []
    for e in np.eye(d * d):
        step = np.zeros_like(attention)
        step[head] = 1e-6 * e.reshape(d, d)
        change = forward(X, attention + step, projection) - forward(
            X, attention - step, projection
        )
        columns.append((change * root[:, None, None]).ravel() / 2e-6)
    return np.stack(columns, axis=1)


def test_each_block_is_the_gram_of_its_heads_jacobian():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(7, 4, 3))
    attention, projection = rng.normal(size=(2, 3, 3)), rng.normal(size=(2, 3, 5))
    weights = rng.uniform(0.5, 2.0, size=7)
    grams = full_rank_head_grams(X, attention, projection, weights)
    assert grams.shape == (2, 9, 9)
    for head in range(2):
        J = _numeric_jacobian(X, attention, projection, head, np.sqrt(weights))
        np.testing.assert_allclose(grams[head], J.T @ J, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("to_array", array_namespaces())
def test_other_namespaces_give_numpys_blocks(to_array):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(6, 5, 4))
    attention, projection = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 3))
    expected = full_rank_head_grams(X, attention, projection)
    got = full_rank_head_grams(to_array(X), to_array(attention), to_array(projection))
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-12, atol=1e-12)


def test_the_preconditioner_whitens_each_block_and_damps_its_null_directions():
    rng = np.random.default_rng(2)
    A = rng.normal(size=(2, 4, 4))
    grams = A @ A.transpose(0, 2, 1)
    grams[1] = np.outer(A[1, 0], A[1, 0])  # rank one: three null directions
    apply, transpose, inverse = block_preconditioner(grams, ridge=1e-6)
    M = np.stack([apply(e) for e in np.eye(8)], axis=1)
    whitened = M[:4, :4].T @ grams[0] @ M[:4, :4]
    np.testing.assert_allclose(whitened, np.eye(4), atol=1e-4)  # but for the ridge
    assert np.all(M[:4, 4:] == 0) and np.all(M[4:, :4] == 0)
    # the null directions scaled by the ridge, not by the inverse of a rounding
    assert np.abs(M[4:, 4:]).max() <= 1.01 / np.sqrt(1e-6 * grams[1].diagonal().max())
    z = rng.normal(size=8)
    np.testing.assert_allclose(inverse(apply(z)), z, atol=1e-10)
    np.testing.assert_allclose(transpose(z), M.T @ z, atol=1e-12)
    with pytest.raises(np.linalg.LinAlgError):
        block_preconditioner(np.full((1, 2, 2), np.nan))


def test_the_blocks_are_summed_over_evenly_spread_sequences():
    rows = gram_sequences(5000, 16, 32)  # 3 * 32**2 / 16 = 192 sequences
    assert len(rows) == 192 and rows[0] == 0 and rows[-1] < 5000
    assert np.all(np.diff(rows) >= 26)
    np.testing.assert_array_equal(gram_sequences(100, 16, 32), np.arange(100))
