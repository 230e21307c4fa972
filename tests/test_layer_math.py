import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skattn.layer._math import (
    attention_patterns,
    forward,
    head_features,
    min_separation,
    softmax,
    squared_loss_gradient,
)


def naive_forward(X, attention, projection):
    """F(X) by explicit loops over samples, heads, rows and tokens."""
    n, k, _ = X.shape
    out = np.zeros((n, k, projection.shape[2]))
    for s in range(n):
        for i in range(attention.shape[0]):
            logits = X[s] @ attention[i] @ X[s].T
            for row in range(k):
                p = np.exp(logits[row] - logits[row].max())
                p /= p.sum()
                out[s, row] += sum(p[a] * X[s, a] for a in range(k)) @ projection[i]
    return out


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 4),
    k=st.integers(1, 5),
    d=st.integers(1, 4),
    m=st.integers(1, 3),
    d_out=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_forward_matches_naive_loop(n, k, d, m, d_out, seed):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, k, d))
    attention = rng.normal(size=(m, d, d))
    projection = rng.normal(size=(m, d, d_out))
    np.testing.assert_allclose(
        forward(X, attention, projection),
        naive_forward(X, attention, projection),
        rtol=1e-10,
        atol=1e-10,
    )


def test_softmax_finite_for_huge_logits():
    logits = np.array([[1000.0, -1000.0, 999.0], [-1000.0, -1000.0, -1000.0]])
    p = softmax(logits)
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    np.testing.assert_allclose(p[1], 1 / 3)
    np.testing.assert_allclose(p[0, 0] / p[0, 2], np.e)


def test_patterns_finite_with_huge_attention():
    rng = np.random.default_rng(0)
    X = rng.choice([-1.0, 1.0], size=(3, 4, 5))
    patterns = attention_patterns(X, 1e3 * rng.normal(size=(2, 5, 5)))
    assert np.all(np.isfinite(patterns))
    np.testing.assert_allclose(patterns.sum(-1), 1.0)


def test_forward_equivariant_under_token_permutation():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(6, 5, 3))
    attention = rng.normal(size=(2, 3, 3))
    projection = rng.normal(size=(2, 3, 4))
    perm = rng.permutation(5)
    np.testing.assert_allclose(
        forward(X[:, perm], attention, projection),
        forward(X, attention, projection)[:, perm],
        rtol=1e-12,
        atol=1e-12,
    )


def test_head_features_make_forward_linear_in_projection():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(4, 3, 2))
    attention = rng.normal(size=(2, 2, 2))
    W1, W2 = rng.normal(size=(2, 2, 2, 3))
    feats = head_features(X, attention)
    np.testing.assert_allclose(
        forward(X, attention, W1 + 2 * W2),
        forward(X, attention, W1, feats) + 2 * forward(X, attention, W2, feats),
    )


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    X = rng.choice([-1.0, 1.0], size=(5, 4, 3))
    Y = rng.normal(size=(5, 4, 2))
    attention = rng.normal(size=(2, 3, 3))
    projection = rng.normal(size=(2, 3, 2))
    weights = rng.uniform(0.5, 2.0, size=5)
    _, g_att, g_proj = squared_loss_gradient(X, Y, attention, projection, weights)
    eps = 1e-6
    for param, grad, which in ((attention, g_att, 0), (projection, g_proj, 1)):
        numeric = np.zeros_like(param)
        for idx in np.ndindex(param.shape):
            step = np.zeros_like(param)
            step[idx] = eps
            args_p = [attention, projection]
            args_m = [attention, projection]
            args_p[which] = param + step
            args_m[which] = param - step
            numeric[idx] = (
                squared_loss_gradient(X, Y, *args_p, weights)[0]
                - squared_loss_gradient(X, Y, *args_m, weights)[0]
            ) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_forward_in_chunks_equals_one_pass(monkeypatch):
    import skattn.layer._math as layer_module

    rng = np.random.default_rng(5)
    X = rng.normal(size=(37, 3, 4))
    attention, projection = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 5))
    key_bias, intercept = rng.normal(size=(2, 4)), rng.normal(size=5)
    whole = layer_module.forward(
        X, attention, projection, key_bias=key_bias, intercept=intercept
    )
    monkeypatch.setattr(layer_module, "_FORWARD_CHUNK_FLOATS", 2 * 3 * 4 * 5)  # 5 rows
    chunked = layer_module.forward(
        X, attention, projection, key_bias=key_bias, intercept=intercept
    )
    np.testing.assert_allclose(chunked, whole, rtol=1e-13, atol=1e-13)


def test_min_separation():
    eye = np.eye(3)
    assert min_separation(eye[None]) == np.inf  # one head
    assert min_separation(np.stack([eye, -eye, 3 * eye])) == pytest.approx(2 / 3)
    assert min_separation(np.zeros((2, 3, 3))) == 0.0  # two zero heads
    assert min_separation(np.stack([eye, eye])) == 0.0


def test_min_separation_is_the_public_condition():
    import skattn.conditions
    import skattn.diagnostics

    assert skattn.diagnostics.min_separation is min_separation
    assert skattn.conditions.min_separation is min_separation
