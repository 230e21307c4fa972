"""The random-start path of decoder heads (``solvers/_decoder.py``)."""

import numpy as np
import pytest

from skattn.datasets import make_attention_regression
from skattn.layer._math import forward
from skattn.layer._positions import Rotary
from skattn.solvers._decoder import fit_decoder_from_random_starts, random_decoder_start
from skattn.solvers.kernels._parametrization import FactoredHeads, LowRank


def test_random_decoder_start_has_the_scale_of_random_attention():
    par = FactoredHeads(4, 40, 8, n_kv_heads=2)
    Q, K, V = par.factors(random_decoder_start(par, 0))
    theta = Q @ np.swapaxes(K[[0, 0, 1, 1]], 1, 2)
    np.testing.assert_allclose(np.linalg.norm(theta, axis=(1, 2)), 1.0, rtol=0.3)
    np.testing.assert_allclose(
        np.swapaxes(V, 1, 2) @ V, np.eye(8)[None].repeat(4, 0), atol=1e-12
    )
    assert random_decoder_start(LowRank(4, 40, 8), 0).shape == (2 * 4 * 40 * 8,)


@pytest.mark.parametrize(
    "decoder",
    [
        {"causal": True, "rope": True, "n_kv_heads": 2},
        {"causal": True, "n_kv_heads": 1},
    ],
)
def test_planted_grouped_decoder_is_learned_to_rounding(decoder):
    m, k, d, r = 4, 5, 8, 2
    X, y, layer = make_attention_regression(
        1500,
        k,
        d,
        m,
        head_rank=r,
        rope_theta=100.0,
        random_state=1,
        return_layer=True,
        **decoder,
    )
    X, Y = X.reshape(-1, k, d), y.reshape(-1, k, d)
    rope_theta = 100.0 if decoder.get("rope") else None
    Q, K, W, info = fit_decoder_from_random_starts(
        X[:1200],
        Y[:1200],
        m,
        r,
        causal=True,
        rope_theta=rope_theta,
        n_kv_heads=decoder["n_kv_heads"],
        random_state=0,
    )
    assert K.shape == (decoder["n_kv_heads"], d, r)
    assert info["relative_residual"] <= 1e-10
    assert info["decoupled"] is None and "jointly" in info["decoupled_note"]
    group = np.arange(m) // (m // decoder["n_kv_heads"])
    if rope_theta is None:
        attention, rotary = Q @ np.swapaxes(K[group], 1, 2), None
    else:
        attention, rotary = np.zeros((m, d, d)), Rotary(Q, K, rope_theta)
    held = forward(X[1200:], attention, W, causal=True, rotary=rotary)
    error = np.linalg.norm(held - Y[1200:]) / np.linalg.norm(Y[1200:])
    assert error <= 1e-8
