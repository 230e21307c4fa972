"""Decoder attention math: rotary positions, masks, shared key heads."""

import numpy as np
import pytest

from skattn import AttentionLayer
from skattn.layer._math import attention_patterns, forward
from skattn.layer._positions import (
    Rotary,
    key_head_index,
    layout_permutation,
    mask_logits,
    rotary_frequencies,
    rotary_tables,
    rotate,
)


def _rotation(delta, frequencies, layout):
    """R(delta omega) as an explicit r x r matrix."""
    r = 2 * len(frequencies)
    R = np.zeros((r, r))
    for p, w in enumerate(frequencies):
        i, j = (2 * p, 2 * p + 1) if layout == "interleaved" else (p, p + r // 2)
        c, s = np.cos(delta * w), np.sin(delta * w)
        R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R


def naive_decoder_forward(X, theta, W, P, K, base, layout, causal, mask):
    """The decoder layer by loops over samples, heads, query and key tokens."""
    n, k, _ = X.shape
    m, m_kv = P.shape[0], K.shape[0]
    om = rotary_frequencies(P.shape[2], base)
    out = np.full((n, k, W.shape[2]), np.nan)
    for s in range(n):
        for row in range(k):
            if not mask[s, row]:
                continue
            out[s, row] = 0.0
            for h in range(m):
                g = h // (m // m_kv)
                logits = np.full(k, -np.inf)
                for a in range(k):
                    if (causal and a > row) or not mask[s, a]:
                        continue
                    q = np.append(X[s, row], 1.0) @ P[h]
                    key = np.append(X[s, a], 1.0) @ K[g]
                    logits[a] = (
                        X[s, row] @ theta[h] @ X[s, a]
                        + q @ _rotation(a - row, om, layout) @ key
                    )
                p = np.exp(logits - logits.max())
                out[s, row] += (p / p.sum()) @ X[s] @ W[h]
    return out


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("m_kv", [1, 2, 4])
def test_forward_matches_naive_loops(layout, causal, m_kv):
    rng = np.random.default_rng(m_kv)
    n, k, d, m, r = 3, 6, 5, 4, 4
    X = rng.normal(size=(n, k, d))
    theta = 0.2 * rng.normal(size=(m, d, d))
    W = rng.normal(size=(m, d, 3))
    P, K = rng.normal(size=(m, d + 1, r)), rng.normal(size=(m_kv, d + 1, r))
    mask = np.ones((n, k), dtype=bool)
    mask[0, :2] = False  # left padding
    mask[1, -3:] = False  # right padding
    out = forward(
        X,
        theta,
        W,
        rotary=Rotary(P, K, 50.0, layout),
        causal=causal,
        key_mask=mask,
    )
    expected = naive_decoder_forward(X, theta, W, P, K, 50.0, layout, causal, mask)
    scale = np.abs(expected[mask]).max()
    assert np.abs(out[mask] - expected[mask]).max() <= 1e-13 * scale


def test_torch_namespace_gives_the_numpy_result():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2, 5, 4))
    theta, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 4))
    P, K = rng.normal(size=(2, 5, 2)), rng.normal(size=(1, 5, 2))
    mask = np.array([[True] * 5, [False, True, True, True, True]])
    kw = {"causal": True, "key_mask": mask}
    expected = forward(X, theta, W, rotary=Rotary(P, K, 100.0), **kw)
    t = {
        name: torch.as_tensor(a)
        for name, a in zip("XTWPK", (X, theta, W, P, K), strict=True)
    }
    out = forward(
        t["X"],
        t["T"],
        t["W"],
        rotary=Rotary(t["P"], t["K"], 100.0),
        causal=True,
        key_mask=torch.as_tensor(mask),
    )
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-13)


def test_layouts_differ_by_a_permutation_of_the_factor_columns():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(2, 7, 3))
    P, K = rng.normal(size=(2, 3, 6)), rng.normal(size=(2, 3, 6))
    theta, W = np.zeros((2, 3, 3)), rng.normal(size=(2, 3, 3))
    perm = layout_permutation(6, "interleaved", "half")
    half = forward(X, theta, W, rotary=Rotary(P[..., perm], K[..., perm], 10.0))
    inter = forward(X, theta, W, rotary=Rotary(P, K, 10.0, "interleaved"))
    np.testing.assert_allclose(half, inter, rtol=0, atol=1e-13)
    back = layout_permutation(6, "half", "interleaved")
    np.testing.assert_array_equal(perm[back], np.arange(6))


def test_rotation_depends_on_relative_positions_only():
    # shifting every token by one position leaves q(l)^T R k(a) unchanged:
    # rotate the same vectors at positions 1..k instead of 0..k-1
    rng = np.random.default_rng(3)
    q, key = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    cos, sin = rotary_tables(6, 4, 10000.0)
    a = rotate(q, cos[:5], sin[:5]) @ rotate(key, cos[:5], sin[:5]).T
    b = rotate(q, cos[1:], sin[1:]) @ rotate(key, cos[1:], sin[1:]).T
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_causal_patterns_are_lower_triangular_and_stochastic():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(3, 5, 4))
    S = attention_patterns(X, rng.normal(size=(2, 4, 4)), causal=True)
    assert np.all(np.triu(S, 1) == 0)
    np.testing.assert_allclose(S.sum(-1), 1.0, rtol=0, atol=1e-14)
    assert S[0, 0, 0, 0] == 1.0  # the first token sees itself only


def test_mask_logits_keeps_unmasked_logits_and_a_fully_masked_row_finite():
    logits = np.arange(8.0).reshape(1, 2, 2, 2)
    assert mask_logits(logits) is logits
    out = mask_logits(logits, key_mask=np.array([[False, True]]))
    np.testing.assert_array_equal(out[..., 1], logits[..., 1])
    assert np.all(out[..., 0] == np.finfo(float).min)
    row = mask_logits(logits, causal=True, key_mask=np.array([[False, True]]))
    assert np.all(np.isfinite(row))


def test_key_head_index_groups_consecutive_query_heads():
    np.testing.assert_array_equal(key_head_index(6, 3), [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(key_head_index(3, 1), [0, 0, 0])
    np.testing.assert_array_equal(key_head_index(3, 3), [0, 1, 2])


def test_frequencies_are_rope_s():
    np.testing.assert_allclose(
        rotary_frequencies(8, 10000.0),
        [1.0, 10000.0**-0.25, 10000.0**-0.5, 10000.0**-0.75],
        rtol=1e-15,
    )


def _layer(**kw):
    rng = np.random.default_rng(5)
    params = {
        "rotary_query": rng.normal(size=(4, 3, 2)),
        "rotary_key": rng.normal(size=(2, 3, 2)),
    }
    params.update(kw)
    return AttentionLayer(np.zeros((4, 3, 3)), rng.normal(size=(4, 3, 3)), **params)


def test_layer_transform_is_the_decoder_forward():
    layer = _layer(causal=True, rope_theta=30.0, rope_layout="interleaved")
    X = np.random.default_rng(6).normal(size=(2, 4, 3))
    P = np.concatenate([layer.rotary_query, np.zeros((4, 1, 2))], axis=1)
    K = np.concatenate([layer.rotary_key, np.zeros((2, 1, 2))], axis=1)
    expected = naive_decoder_forward(
        X,
        layer.attention,
        layer.projection,
        P,
        K,
        30.0,
        "interleaved",
        True,
        np.ones((2, 4), dtype=bool),
    )
    np.testing.assert_allclose(
        layer.transform(X), expected.reshape(2, -1), rtol=0, atol=1e-13
    )
    S = layer.attention_patterns(X)
    assert np.all(np.triu(S, 1) == 0)


def test_default_layer_is_the_position_free_layer():
    rng = np.random.default_rng(7)
    theta, W = rng.normal(size=(2, 3, 3)), rng.normal(size=(2, 3, 3))
    X = rng.normal(size=(4, 5, 3))
    np.testing.assert_array_equal(
        AttentionLayer(theta, W).transform(X), forward(X, theta, W).reshape(4, -1)
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"rotary_key": None}, "rotary_query is given without rotary_key"),
        ({"rotary_query": np.ones((4, 3, 3)), "rotary_key": np.ones((2, 3, 3))}, "odd"),
        ({"rotary_query": np.ones((3, 3, 2))}, "rotary_query has 3 heads"),
        ({"rotary_key": np.ones((3, 3, 2))}, "does not divide n_heads=4"),
        ({"rotary_key": np.ones((2, 3, 4))}, "rotary dimension 4"),
        ({"rotary_query": np.ones((4, 5, 2))}, "rotary_query must have shape"),
        ({"rotary_key": np.full((2, 3, 2), np.nan)}, "rotary_key"),
        ({"n_kv_heads": 4}, "rotary_key has 2 heads but n_kv_heads=4"),
        ({"rotary_query": None, "rotary_key": None, "n_kv_heads": 3}, "divide"),
        ({"rope_layout": "gptj"}, "rope_layout"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"causal": "yes"}, "causal"),
    ],
)
def test_bad_decoder_parameters_give_one_line_errors(kw, match):
    layer = _layer(**kw)
    with pytest.raises(ValueError, match=match) as info:
        layer.fit(np.zeros((1, 2, 3)))
    assert "\n" not in str(info.value)


def test_metrics_refuse_decoder_layers():
    with pytest.raises(ValueError, match="decoder layer"):
        _layer(causal=True)._arrays()
    _layer(rotary_query=None, rotary_key=None, n_kv_heads=2)._arrays()  # no positions


def test_chunked_forward_cuts_the_key_mask_with_the_samples(monkeypatch):
    import skattn.layer._math as math

    rng = np.random.default_rng(8)
    X = rng.normal(size=(7, 4, 3))
    theta, W = rng.normal(size=(2, 3, 3)), rng.normal(size=(2, 3, 2))
    rotary = Rotary(rng.normal(size=(2, 4, 2)), rng.normal(size=(1, 4, 2)), 10.0)
    mask = rng.random((7, 4)) > 0.3
    mask[:, -1] = True
    whole = forward(X, theta, W, rotary=rotary, causal=True, key_mask=mask)
    monkeypatch.setattr(math, "_FORWARD_CHUNK_FLOATS", 2 * 4 * 4 * 2)  # 2 samples
    chunked = forward(X, theta, W, rotary=rotary, causal=True, key_mask=mask)
    np.testing.assert_array_equal(chunked, whole)
    per_sample = [
        forward(
            X[s : s + 1], theta, W, rotary=rotary, causal=True, key_mask=mask[s : s + 1]
        )
        for s in range(7)
    ]
    np.testing.assert_allclose(np.concatenate(per_sample), whole, rtol=0, atol=1e-14)


def test_array_api_strict_namespace_gives_the_numpy_result():
    xp = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(9)
    X, theta, W = (rng.normal(size=s) for s in ((2, 5, 4), (2, 4, 4), (2, 4, 3)))
    P, K = rng.normal(size=(2, 5, 2)), rng.normal(size=(1, 5, 2))
    mask = np.ones((2, 5), dtype=bool)
    mask[0, 0] = False
    kw = {"causal": True, "key_mask": mask}
    expected = forward(X, theta, W, rotary=Rotary(P, K, 10.0, "interleaved"), **kw)
    a = xp.asarray
    out = forward(
        a(X),
        a(theta),
        a(W),
        rotary=Rotary(a(P), a(K), 10.0, "interleaved"),
        causal=True,
        key_mask=a(mask),
    )
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-14)
