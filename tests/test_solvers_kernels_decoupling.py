"""The decoupling map: each head's share of the outputs (``kernels/_decoupling.py``)."""

import numpy as np

from skattn.solvers.kernels._decoupling import decoupling_map


def test_decoupling_map_is_a_right_inverse_also_when_outputs_are_wider():
    factors = np.random.default_rng(0).normal(size=(3, 2, 9))
    D, condition = decoupling_map(factors)
    np.testing.assert_allclose(factors.reshape(6, 9) @ D, np.eye(6), atol=1e-12)
    assert 1 <= condition < 1e3
