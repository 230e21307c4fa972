"""Sharp heads restarted from their patterns, fitted in logit space
(``stages/_sharp_heads.py``), and that restart inside the refinement."""

import numpy as np
import pytest
from _helpers import sharp_layer, too_sharp_start

from skattn.metrics import sharpness_profile
from skattn.solvers import decoupled_refine
from skattn.solvers.stages._sharp_heads import can_read_patterns, logit_start


def relative_attention_error(par, params, truth, head):
    a, b = par.attention(params)[head], par.attention(truth)[head]
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_can_read_patterns():
    assert can_read_patterns(32, 16) and can_read_patterns(16, 16)
    assert not can_read_patterns(8, 16) and not can_read_patterns(None, 4)


def test_a_sharp_head_three_times_too_sharp_is_recovered_exactly():
    # head 0 is sharp (median largest weight above 0.99); it starts three times
    # too sharp, its small weights too small by e^2 and more: read off the outputs
    # and fitted in logit space it is near, and its one-head problem then exact
    X, Y, truth, par = sharp_layer()
    assert sharpness_profile(par.attention(truth), X).median_largest_weight[0] > 0.99
    start = too_sharp_start(par, truth)
    found, info = logit_start(X, Y, start, par, 0, n_rounds=15)
    before = relative_attention_error(par, start, truth, 0)
    after = relative_attention_error(par, found, truth, 0)
    assert before > 1.0 and after < 1e-3
    assert info["logit_cost"] < 1e-3 * info["logit_cost_start"]
    assert info["pattern_residuals"][-1] < 1e-6
    # only head 0's Q, K moved
    for one, other in zip(par.factors(start), par.factors(found), strict=True):
        np.testing.assert_array_equal(one[1], other[1])
    np.testing.assert_array_equal(par.factors(start)[2], par.factors(found)[2])
    refined, again = decoupled_refine(X, Y, found, par, heads=[0])
    assert again["heads"][0]["converged"] and again["residual"] < 1e-10
    assert relative_attention_error(par, refined, truth, 0) < 1e-8


def test_the_restart_on_torch_stays_on_torch_and_ends_where_numpys_does():
    # the pattern reading and the logit fit run on the arrays' namespace: the
    # parameters come back as torch tensors, the patterns split the same rows,
    # and the head is as near as numpy's (the runs compared by their outcome:
    # 20 trust-region steps of an ill-conditioned fit from the same start)
    torch = pytest.importorskip("torch")
    X, Y, truth, par = sharp_layer()
    start = too_sharp_start(par, truth)
    Q, _, V = par.factors(start)
    expected, info = logit_start(X, Y, start, par, 0, n_rounds=15)
    found, got = logit_start(*map(torch.asarray, (X, Y, start)), par, 0, n_rounds=15)
    assert isinstance(found, torch.Tensor) and found.dtype == torch.float64
    assert got["n_split_rows"] == info["n_split_rows"]
    np.testing.assert_allclose(
        got["pattern_residuals"], info["pattern_residuals"], rtol=1e-6
    )
    assert got["logit_cost_start"] == pytest.approx(info["logit_cost_start"], rel=1e-10)
    assert got["logit_cost"] < 1e-3 * got["logit_cost_start"]
    found = found.numpy()
    assert relative_attention_error(par, found, truth, 0) < 1e-3
    # only head 0's Q, K moved
    np.testing.assert_array_equal(par.factors(found)[2], V)
    np.testing.assert_array_equal(par.factors(found)[0][1], Q[1])
