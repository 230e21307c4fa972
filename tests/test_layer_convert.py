"""Maps between skattn's parameters and the weights of real attention layers
(``layer/_convert.py``)."""

import numpy as np
import pytest

from skattn.layer._convert import (
    check_projection_weights,
    parameters_to_projections,
    projections_to_parameters,
)
from skattn.layer._math import forward, softmax


def _multi_head_attention(X, query, key, value, output, n_heads, biases):
    """A real multi-head attention sub-layer, written out (PyTorch's convention)."""
    d_h = query.shape[0] // n_heads
    q = (X @ query.T + biases["query"]).reshape(*X.shape[:2], n_heads, d_h)
    k = (X @ key.T + biases["key"]).reshape(*X.shape[:2], n_heads, d_h)
    v = (X @ value.T + biases["value"]).reshape(*X.shape[:2], n_heads, -1)
    logits = np.einsum("nlhe,nahe->nhla", q, k) / np.sqrt(d_h)
    heads = np.einsum("nhla,nahe->nlhe", softmax(logits, axis=-1), v)
    return heads.reshape(*X.shape[:2], -1) @ output.T + biases["output"]


def test_parameters_reproduce_a_real_layer_with_biases():
    rng = np.random.default_rng(0)
    n_heads, d, d_out = 2, 5, 3
    query, key = rng.normal(size=(2, 4, d))
    value, output = rng.normal(size=(6, d)), rng.normal(size=(d_out, 6))
    biases = {
        "query": rng.normal(size=4),
        "key": rng.normal(size=4),
        "value": rng.normal(size=6),
        "output": rng.normal(size=d_out),
    }
    X = rng.normal(size=(7, 4, d))
    attention, projection, key_bias, intercept = projections_to_parameters(
        query, key, value, output, n_heads, biases
    )
    assert attention.shape == (2, d, d) and projection.shape == (2, d, d_out)
    np.testing.assert_allclose(
        forward(X, attention, projection, key_bias=key_bias, intercept=intercept),
        _multi_head_attention(X, query, key, value, output, n_heads, biases),
        atol=1e-12,
    )


def test_parameters_to_projections_is_a_right_inverse():
    # Theta_i of rank 1 and a key bias: [Theta_i^T, u_i] of rank 2 = head_dim
    rng = np.random.default_rng(1)
    m, d = 2, 4
    attention = rng.normal(size=(m, d, 1)) @ rng.normal(size=(m, 1, d))
    key_bias = rng.normal(size=(m, d))
    projection = rng.normal(size=(m, d, 2)) @ rng.normal(size=(m, 2, d))
    intercept = rng.normal(size=d)
    weights, reason = parameters_to_projections(
        attention, projection, key_bias, intercept, m
    )
    assert reason == ""
    biases = {name: weights[f"{name}_bias"] for name in ("query", "key", "value")}
    biases["output"] = weights["output_bias"]
    again = projections_to_parameters(
        weights["query"], weights["key"], weights["value"], weights["output"], m, biases
    )
    for got, expected in zip(
        again, (attention, projection, key_bias, intercept), strict=True
    ):
        np.testing.assert_allclose(got, expected, atol=1e-12)


@pytest.mark.parametrize("scale", [None, 0.3, 1.0])
def test_parameters_to_projections_with_a_given_scale(scale):
    rng = np.random.default_rng(3)
    m, d = 2, 4
    attention = rng.normal(size=(m, d, 1)) @ rng.normal(size=(m, 1, d))
    projection = rng.normal(size=(m, d, 2)) @ rng.normal(size=(m, 2, d))
    zeros = (np.zeros((m, d)), np.zeros(d))
    weights, _ = parameters_to_projections(attention, projection, *zeros, m, scale)
    again = projections_to_parameters(
        weights["query"],
        weights["key"],
        weights["value"],
        weights["output"],
        m,
        scale=scale,
    )
    np.testing.assert_allclose(again[0], attention, rtol=0, atol=1e-12)
    np.testing.assert_allclose(again[1], projection, rtol=0, atol=1e-12)


def test_parameters_that_do_not_fit_standard_heads_say_why():
    rng = np.random.default_rng(2)
    theta, u = rng.normal(size=(2, 4, 4)), np.zeros((2, 4))
    W = rng.normal(size=(2, 4, 4))
    assert parameters_to_projections(theta, W[..., :3], u, np.zeros(3), 2) == (
        None,
        "n_outputs=3 differs from n_features=4",
    )
    three = (theta[[0, 0, 1]], W[[0, 0, 1]], u[[0, 0, 1]], np.zeros(4), 3)
    assert parameters_to_projections(*three) == (
        None,
        "n_heads=3 does not divide n_features=4",
    )
    weights, reason = parameters_to_projections(theta, W, u, np.zeros(4), 2)
    assert weights is None and reason == "head 0 has rank [Theta_i^T, u_i] > head_dim=2"


def test_check_projection_weights_rejects_bad_weights():
    eye = np.eye(4, dtype=int)
    *weights, biases = check_projection_weights(eye, eye, eye, eye, 2)
    assert all(w.dtype == np.float64 for w in weights)
    assert all(np.array_equal(b, np.zeros(4)) for b in biases.values())
    bad = np.eye(4)
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="key contains 1 NaN"):
        check_projection_weights(eye, bad, eye, eye, 2)
    with pytest.raises(ValueError, match="does not divide the width of query"):
        check_projection_weights(eye, eye, eye, eye, 3)
    with pytest.raises(ValueError, match="unknown key"):
        check_projection_weights(eye, eye, eye, eye, 2, biases={"bias": np.ones(4)})
    with pytest.raises(ValueError, match=r"biases\['query'\] must have shape \(4,\)"):
        check_projection_weights(eye, eye, eye, eye, 2, biases={"query": np.ones(3)})
    with pytest.raises(ValueError, match="n_heads must be a positive integer"):
        check_projection_weights(eye, eye, eye, eye, True)


@pytest.mark.parametrize("n_heads", ["two", "2", 2.0, 0, None])
def test_n_heads_of_a_checkpoint_must_be_a_positive_int(n_heads):
    # e.g. a config.json's num_attention_heads passed on as it was read
    eye = np.eye(4)
    with pytest.raises(ValueError, match=r"n_heads must be a positive integer, got "):
        check_projection_weights(eye, eye, eye, eye, n_heads)
