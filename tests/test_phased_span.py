"""Phase 5: the span of the hull and the number of heads (``phased/_span.py``)."""

import numpy as np
import pytest
from _helpers import phased_planted as _plant

from skattn.phased import hull_span
from skattn.phased._affine_hull import fit_affine_hull, hull_constraints
from skattn.phased._span import estimate_n_heads


@pytest.mark.parametrize("m", [1, 2, 3])
def test_estimate_n_heads_on_planted_layers(m):
    # d_out = 16 > m * k for k = 2.
    X, Y, theta, W = _plant(20000, 2, 8, m, d_out=16, distribution="gaussian")
    stats, _ = hull_constraints(X, Y, W.sum(0), tol=0.03)
    _, hinfo = fit_affine_hull(stats, 1)
    n_heads, info = estimate_n_heads(hinfo["augmented_spectrum"])
    assert n_heads == m
    assert info["gap_ratio"] >= 5
    assert info["ratios"][m:].max() < 3  # the bulk beyond the gap is flat


def test_estimate_n_heads_warns_without_a_gap():
    with pytest.warns(UserWarning, match="Weak evidence"):
        n_heads, info = estimate_n_heads(np.linspace(1.0, 2.0, 10))
    assert info["gap_ratio"] < 5


def test_estimate_n_heads_validates_spectrum():
    with pytest.raises(ValueError, match="ascending"):
        estimate_n_heads([3.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="1-D"):
        estimate_n_heads([1.0])


def test_hull_span_through_origin_drops_a_dimension():
    rng = np.random.default_rng(0)
    direction = rng.normal(size=(3, 3))
    direction /= np.linalg.norm(direction)
    basis, info = hull_span(np.zeros((3, 3)), direction[None])
    assert info["rank"] == 1 and info["offset"] == 0.0
    np.testing.assert_allclose(np.abs(basis[0]), np.abs(direction))
