"""Parametrizations of the heads: full, low-rank, factored values
(``kernels/_parametrization.py``)."""

import numpy as np
import pytest
from _helpers import factored_planted

from skattn.solvers import (
    FactoredHeads,
    FullRank,
    LowRank,
    VarproProblem,
    balanced_factors,
    make_parametrization,
)
from skattn.solvers.kernels._parametrization import random_attention


def test_balanced_factors_and_parametrizations():
    rng = np.random.default_rng(6)
    M = rng.normal(size=(3, 5, 2)) @ rng.normal(size=(3, 2, 4))
    A, B = balanced_factors(M, 2)
    np.testing.assert_allclose(A @ np.swapaxes(B, 1, 2), M, atol=1e-12)
    np.testing.assert_allclose(
        np.linalg.norm(A, axis=1), np.linalg.norm(B, axis=1), rtol=1e-10
    )
    low = make_parametrization(2, 6, 3)
    theta = low.attention(low.from_attention(rng.normal(size=(2, 6, 6))))
    assert np.linalg.matrix_rank(theta[0]) == 3
    assert isinstance(make_parametrization(2, 6, 6), FullRank)


@pytest.mark.parametrize("par", [FullRank(2, 4), LowRank(2, 4, 2)])
def test_attention_vjp_is_the_gradient_of_a_linear_function_of_theta(par):
    # the gradient of p -> <G, Theta(p)> at p, against central differences
    rng = np.random.default_rng(7)
    params, G = rng.normal(size=par.size), rng.normal(size=(2, 4, 4))
    grad = par.attention_vjp(params, G)
    eps = 1e-6
    numeric = [
        (
            np.sum(G * par.attention(params + eps * e))
            - np.sum(G * par.attention(params - eps * e))
        )
        / (2 * eps)
        for e in np.eye(par.size)
    ]
    np.testing.assert_allclose(grad, numeric, rtol=1e-7, atol=1e-9)


def test_random_attention_has_the_scale_asked_for():
    small = random_attention(3, 40, random_state=0, scale=0.5)
    assert small.shape == (3, 40, 40)
    np.testing.assert_allclose(np.linalg.norm(small, axis=(1, 2)), 0.5, rtol=0.05)
    np.testing.assert_array_equal(random_attention(3, 40, random_state=0), small / 0.5)


def test_low_rank_preconditioner_is_a_change_of_variables():
    par = LowRank(3, 6, 2)
    rng = np.random.default_rng(11)
    params = rng.normal(size=par.size)
    apply, transpose, inverse = par.preconditioner(params)
    z, g = rng.normal(size=par.size), rng.normal(size=par.size)
    np.testing.assert_allclose(apply(inverse(params)), params, rtol=1e-12)
    # transpose is the adjoint of apply: <M z, g> = <z, M^T g>
    assert apply(z) @ g == pytest.approx(z @ transpose(g), rel=1e-12)
    # the same Theta_i along the new variables' path: Q K^T = Z^Q C^K (Z^K C^Q)^T
    np.testing.assert_allclose(
        par.attention(apply(inverse(params))), par.attention(params), atol=1e-12
    )
    # at params the new variables are balanced: the logits' derivative along
    # Z^Q_i is X dZ^Q_i (X K_i C^K_i)^T with K_i C^K_i orthonormal (same for Z^K)
    unit = np.zeros((3, 6, 2))
    unit[:, :2, :] = np.eye(2)
    c_k, c_q = (
        f[:, :2, :] for f in par.factors(apply(np.concatenate([unit.ravel()] * 2)))
    )
    Q, K = par.factors(params)
    for factor, c in ((K, c_k), (Q, c_q)):
        balanced = factor @ c
        np.testing.assert_allclose(
            np.swapaxes(balanced, 1, 2) @ balanced,
            np.broadcast_to(np.eye(2), (3, 2, 2)),
            atol=1e-8,
        )
    assert FullRank(2, 3).preconditioner(np.zeros(18)) is None


def test_regauge_balances_the_values_and_keeps_the_model():
    X, Y, truth = factored_planted(40, 3, 4, 2, 2, 6, intercept=True)
    par = FactoredHeads(2, 5, 2)
    params = truth + 0.2 * np.random.default_rng(6).normal(size=par.size)
    problem = VarproProblem(X, Y, None, par, intercept=True)
    residual, projection = problem.residual(params).copy(), problem.projection
    balanced = par.regauge(params, problem.output_factors)
    np.testing.assert_allclose(problem.residual(balanced), residual, atol=1e-12)
    np.testing.assert_allclose(problem.projection, projection, atol=1e-10)
    grams = problem.output_factors @ np.swapaxes(problem.output_factors, 1, 2)
    np.testing.assert_allclose(
        grams, np.broadcast_to(np.eye(2), grams.shape), atol=1e-8
    )
    np.testing.assert_allclose(par.attention(balanced), par.attention(params))


# decoder heads: causal mask, rotary positions, grouped key heads
_DECODERS = [
    {"causal": True},
    {"rope_theta": 100.0},
    {"rope_theta": 10.0, "rope_layout": "interleaved", "causal": True},
    {"n_kv_heads": 2},
    {"causal": True, "rope_theta": 50.0, "n_kv_heads": 1},
]


def _decoder_case(kind, decoder, seed=0):
    rng = np.random.default_rng(seed)
    par = kind(4, 5, 2, **decoder)
    X = rng.normal(size=(3, 6, 5))
    return par, X, rng.normal(size=par.size) / 2


@pytest.mark.parametrize("decoder", _DECODERS)
@pytest.mark.parametrize("kind", [LowRank, FactoredHeads])
def test_decoder_logits_and_outputs_are_the_layers(kind, decoder):
    from skattn.layer._math import attention_logits, forward, softmax
    from skattn.layer._positions import Rotary

    par, X, params = _decoder_case(kind, decoder)
    Q, K = par.factors(params)[:2]
    m, d = par.n_heads, par.n_features
    if "rope_theta" in decoder:  # all of the logits rotary, Theta zero
        rotary = Rotary(Q, K, decoder["rope_theta"], decoder.get("rope_layout", "half"))
        expected = attention_logits(
            X, np.zeros((m, d, d)), causal=par.causal, rotary=rotary
        )
    else:
        rotary = None
        expected = attention_logits(X, par.attention(params), causal=par.causal)
    logits = par.logits(X, params)
    assert logits.shape == (3, m, 6, 6)
    np.testing.assert_array_equal(logits == np.finfo(float).min, expected < -1e300)
    real = expected > -1e300
    np.testing.assert_allclose(logits[real], expected[real], rtol=1e-12, atol=1e-12)
    # the outputs through the patterns: the layer's forward
    W = np.random.default_rng(1).normal(size=(m, d, 3))
    ours = np.einsum("nmkl,nld,mdo->nko", softmax(logits), X, W)
    theirs = forward(
        X,
        np.zeros((m, d, d)) if rotary is not None else par.attention(params),
        W,
        causal=par.causal,
        rotary=rotary,
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    if par.causal:  # masked keys get no attention at all
        upper = np.triu(np.ones((6, 6), dtype=bool), 1)
        assert np.all(softmax(logits)[..., upper] == 0.0)


def _products(par, X, params, direction, cotangent):
    """The logits' (and values') jvp and the vjp of the cotangents."""
    if isinstance(par, FactoredHeads):
        d_logits, d_values = par.jvp(X, params, direction)
        g_logits, g_values = cotangent
        return (d_logits, d_values), par.vjp(X, params, g_logits, g_values)
    return (par.logits_jvp(X, params, direction),), par.logits_vjp(
        X, params, cotangent[0]
    )


@pytest.mark.parametrize("decoder", _DECODERS)
@pytest.mark.parametrize("kind", [LowRank, FactoredHeads])
def test_decoder_products_match_finite_differences_and_each_other(kind, decoder):
    par, X, params = _decoder_case(kind, decoder, seed=3)
    rng = np.random.default_rng(4)
    direction = rng.normal(size=par.size)
    cotangent = (rng.normal(size=(3, 4, 6, 6)), rng.normal(size=(3, 4, 6, 2)))
    jvp, vjp = _products(par, X, params, direction, cotangent)

    def outputs(p):  # the logits (masked ones at 0: they do not move) and values
        logits = par.logits(X, p)
        logits = np.where(logits == np.finfo(float).min, 0.0, logits)
        if isinstance(par, FactoredHeads):
            return logits, par.values(X, p)
        return (logits,)

    eps = 1e-6
    plus, minus = outputs(params + eps * direction), outputs(params - eps * direction)
    for exact, hi, lo in zip(jvp, plus, minus, strict=True):
        np.testing.assert_allclose(exact, (hi - lo) / (2 * eps), rtol=1e-7, atol=1e-8)
    if par.causal:  # the jvp vanishes above the diagonal
        upper = np.triu(np.ones((6, 6), dtype=bool), 1)
        assert np.all(jvp[0][..., upper] == 0.0)
    # the vjp is the jvp's adjoint: <G, J v> = <J^T G, v>
    left = sum(np.sum(g * j) for g, j in zip(cotangent, jvp, strict=False))
    np.testing.assert_allclose(left, vjp @ direction, rtol=1e-11)
    assert vjp.shape == (par.size,)


@pytest.mark.parametrize("kind", [LowRank, FactoredHeads])
def test_grouped_preconditioner_is_a_change_of_variables(kind):
    par = kind(4, 6, 2, n_kv_heads=2, rope_theta=10.0)
    p = np.random.default_rng(5).normal(size=par.size)
    apply, transpose, inverse = par.preconditioner(p)
    np.testing.assert_allclose(apply(inverse(p)), p, rtol=1e-10)
    z = np.random.default_rng(6).normal(size=par.size)
    w = np.random.default_rng(7).normal(size=par.size)
    np.testing.assert_allclose(apply(z) @ w, z @ transpose(w), rtol=1e-10)


@pytest.mark.parametrize(
    ("decoder", "message"),
    [
        ({"n_kv_heads": 3}, "must divide n_heads=4"),
        ({"rope_layout": "spiral"}, "rope_layout must be one of"),
        ({"rope_theta": 0.0}, "must be even and rope_theta=0.0 positive"),
    ],
)
def test_decoder_settings_are_checked(decoder, message):
    with pytest.raises(ValueError, match=message):
        LowRank(4, 6, 2, **decoder)
    with pytest.raises(ValueError, match="must be even"):
        FactoredHeads(4, 6, 3, rope_theta=10.0)
    with pytest.raises(ValueError, match="start from factors"):
        LowRank(4, 6, 2, n_kv_heads=2).from_attention(np.zeros((4, 6, 6)))


@pytest.mark.parametrize("decoder", _DECODERS[:3])
def test_varpro_problem_of_a_planted_decoder_fits_it(decoder):
    # the reduced problem at the planted factors fits the layer's outputs exactly
    from skattn.layer._math import forward
    from skattn.layer._positions import Rotary

    par, X, params = _decoder_case(FactoredHeads, decoder, seed=8)
    X = np.random.default_rng(9).normal(size=(40, 6, 5))
    Q, K, V = par.factors(params)
    output = np.random.default_rng(10).normal(size=(4, 2, 3))
    rotary = None
    attention = par.attention(params)
    if par.rope_theta is not None:
        rotary = Rotary(Q, K, par.rope_theta, par.rope_layout)
        attention = np.zeros_like(attention)
    Y = forward(X, attention, V @ output, causal=par.causal, rotary=rotary)
    problem = VarproProblem(X, Y, None, par)
    assert np.max(np.abs(problem.residual(params))) < 1e-12
    np.testing.assert_allclose(problem.projection, V @ output, atol=1e-10)
