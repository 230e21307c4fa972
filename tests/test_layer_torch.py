"""AttentionLayer <-> torch.nn.MultiheadAttention, and from_projections."""

import numpy as np
import pytest

from skattn import AttentionLayer
from skattn.datasets import make_attention_layer

torch = pytest.importorskip("torch")


def _mha(embed_dim, n_heads, bias, batch_first, seed):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(
        embed_dim, n_heads, bias=bias, batch_first=batch_first, dtype=torch.float64
    )
    if bias:  # torch initialises the biases to 0: make them count
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    return mha.eval()


def _torch_forward(module, X, batch_first):
    x = torch.as_tensor(X)
    x = x if batch_first else x.transpose(0, 1)
    with torch.no_grad():
        out = module(x, x, x, need_weights=False)[0]
    out = out if batch_first else out.transpose(0, 1)
    return out.numpy()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 8])
def test_from_torch_matches_torch_forward(bias, batch_first, n_heads):
    mha = _mha(24, n_heads, bias, batch_first, seed=n_heads)
    X = np.random.default_rng(n_heads).normal(size=(6, 5, 24))
    layer = AttentionLayer.from_torch(mha)
    expected = _torch_forward(mha, X, batch_first)
    got = layer.transform(X).reshape(expected.shape)
    assert np.max(np.abs(got - expected)) <= 1e-12 * max(1.0, np.abs(expected).max())
    assert (layer.key_bias is None) == (not bias)
    assert layer.n_heads == n_heads


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("n_heads", [1, 2, 4, 8])
def test_to_torch_round_trip(bias, batch_first, n_heads):
    layer = AttentionLayer.from_torch(_mha(16, n_heads, bias, True, seed=10 + n_heads))
    module = layer.to_torch(batch_first=batch_first)
    assert isinstance(module, torch.nn.MultiheadAttention)
    X = np.random.default_rng(0).normal(size=(4, 7, 16))
    out = _torch_forward(module, X, batch_first)
    np.testing.assert_allclose(
        out.reshape(4, -1), layer.transform(X), rtol=0, atol=1e-12
    )
    back = AttentionLayer.from_torch(module)
    np.testing.assert_allclose(back.transform(X), layer.transform(X), atol=1e-12)


def test_to_torch_falls_back_to_skattn_module():
    # full-rank 4 x 4 heads do not fit head_dim = 2; d_out != d neither
    for layer in (
        make_attention_layer(2, 4, random_state=0),
        make_attention_layer(2, 4, n_outputs=3, random_state=0),
    ):
        layer.key_bias = np.arange(8.0).reshape(2, 4) / 10
        layer.intercept = np.ones(layer.n_outputs)
        module = layer.to_torch()
        assert not isinstance(module, torch.nn.MultiheadAttention)
        X = np.random.default_rng(1).normal(size=(3, 5, 4))
        out = _torch_forward(module, X, True)
        np.testing.assert_allclose(out.reshape(3, -1), layer.transform(X), atol=1e-12)
        back = AttentionLayer.from_torch(module)
        np.testing.assert_allclose(back.transform(X), layer.transform(X), atol=1e-12)
    # a low-rank planted layer fits the standard module
    low = make_attention_layer(2, 4, random_state=0)
    low.attention = low.attention @ np.diag([1.0, 1.0, 0.0, 0.0])
    low.projection = np.diag([1.0, 0.0, 0.0, 0.0]) @ low.projection
    assert isinstance(low.to_torch(), torch.nn.MultiheadAttention)
    # batch_first=False for the fallback module too
    module = layer.to_torch(batch_first=False, module="skattn")
    X = np.random.default_rng(2).normal(size=(3, 5, 4))
    out = _torch_forward(module, X, False)
    np.testing.assert_allclose(out.reshape(3, -1), layer.transform(X), atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True},
        {"causal": True, "rope": True, "n_kv_heads": 2, "head_rank": 2},
        {"rope": True, "rope_layout": "interleaved", "head_rank": 4, "rope_theta": 7.0},
    ],
)
def test_decoder_layer_to_torch_is_skattn_module(kw, batch_first):
    layer = make_attention_layer(4, 6, random_state=0, **kw)
    layer.key_bias = np.arange(24.0).reshape(4, 6) / 10
    layer.intercept = np.ones(6)
    module = layer.to_torch(batch_first=batch_first)
    assert not isinstance(module, torch.nn.MultiheadAttention)
    X = np.random.default_rng(1).normal(size=(3, 5, 6))
    out = _torch_forward(module, X, batch_first)
    np.testing.assert_allclose(out.reshape(3, -1), layer.transform(X), atol=1e-12)
    back = AttentionLayer.from_torch(module)
    assert back.causal == layer.causal
    np.testing.assert_array_equal(back.transform(X), layer.transform(X))
    # the patterns, averaged over the heads, and gradients through the rotation
    x = torch.as_tensor(X if batch_first else X.transpose(1, 0, 2))
    out, weights = module(x)
    np.testing.assert_allclose(
        weights.detach().numpy(), layer.attention_patterns(X).mean(axis=1), atol=1e-12
    )
    out.sum().backward()
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None for g in grads)
    if "rope" in kw:
        assert torch.any(module.rotary_query.grad != 0)


def test_to_torch_into_an_unsupported_module_is_refused():
    layer = make_attention_layer(2, 4, random_state=0)
    with pytest.raises(TypeError, match="Linear"):
        layer.to_torch(module=torch.nn.Linear(4, 4))


def test_from_torch_names_unsupported_transformers_modules():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = transformers.BertConfig(hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="unsupported transformers module Bert") as e:
        AttentionLayer.from_torch(BertSelfAttention(config))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"add_bias_kv": True}, "add_bias_kv"),
        ({"add_zero_attn": True}, "add_zero_attn"),
        ({"kdim": 6}, "kdim"),
        ({"vdim": 6}, "vdim"),
    ],
)
def test_from_torch_unsupported_options(kwargs, match):
    mha = torch.nn.MultiheadAttention(8, 2, **kwargs)
    with pytest.raises(ValueError, match=match):
        AttentionLayer.from_torch(mha)


def test_from_torch_rejects_other_modules_and_masks():
    with pytest.raises(TypeError, match="MultiheadAttention"):
        AttentionLayer.from_torch(torch.nn.Linear(4, 4))
    module = make_attention_layer(2, 4, random_state=0).to_torch(module="skattn")
    x = torch.zeros(1, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="attn_mask"):
        module(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        module(x, x, x, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match='"auto" or "skattn"'):
        make_attention_layer(1, 4, random_state=0).to_torch(module="torch")


def _naive_real_attention(X, q, k, v, o, b, n_heads, scale):
    """Per head softmax(s (X Wq^T + bq)(X Wk^T + bk)^T)(X Wv^T + bv), concat, Wo."""
    h = q.shape[0] // n_heads
    heads = []
    for i in range(n_heads):
        rows = slice(i * h, (i + 1) * h)
        Q = X @ q[rows].T + b["query"][rows]
        K = X @ k[rows].T + b["key"][rows]
        V = X @ v[rows].T + b["value"][rows]
        logits = scale * Q @ np.swapaxes(K, 1, 2)
        P = np.exp(logits - logits.max(axis=-1, keepdims=True))
        heads.append((P / P.sum(axis=-1, keepdims=True)) @ V)
    return np.concatenate(heads, axis=-1) @ o.T + b["output"]


@pytest.mark.parametrize("n_heads", [1, 2, 3])
def test_from_projections_matches_naive_attention(n_heads):
    rng = np.random.default_rng(n_heads)
    d, h, d_out = 5, 4, 7
    q, k, v = rng.normal(size=(3, n_heads * h, d))
    o = rng.normal(size=(d_out, n_heads * h))
    b = {
        "query": rng.normal(size=n_heads * h),
        "key": rng.normal(size=n_heads * h),
        "value": rng.normal(size=n_heads * h),
        "output": rng.normal(size=d_out),
    }
    X = rng.normal(size=(8, 6, d))
    layer = AttentionLayer.from_projections(q, k, v, o, n_heads, biases=b, scale=0.3)
    expected = _naive_real_attention(X, q, k, v, o, b, n_heads, 0.3)
    np.testing.assert_allclose(layer.transform(X), expected.reshape(8, -1), atol=1e-12)
    # without biases: no key_bias, no intercept
    plain = AttentionLayer.from_projections(q, k, v, o, n_heads)
    assert plain.key_bias is None and plain.intercept is None
    zero = {name: np.zeros_like(vec) for name, vec in b.items()}
    expected = _naive_real_attention(X, q, k, v, o, zero, n_heads, 1 / np.sqrt(h))
    np.testing.assert_allclose(plain.transform(X), expected.reshape(8, -1), atol=1e-12)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_heads": 3}, "n_heads=3 does not divide"),
        ({"n_heads": 0}, "n_heads must be a positive integer"),
        ({"key": np.ones((8, 5))}, "key has 5 input features"),
        ({"output": np.ones((4, 6))}, "output has 6 input features"),
        ({"query": np.ones(8)}, "query must be a 2-D weight matrix"),
        ({"value": np.full((8, 4), np.nan)}, "value contains 32 NaN"),
        ({"biases": {"query": np.ones(3)}}, r"biases\['query'\] must have shape"),
        ({"biases": {"key": np.full(8, np.inf)}}, r"biases\['key'\] contains"),
        ({"biases": {"gate": np.ones(8)}}, "unknown key"),
    ],
)
def test_from_projections_bad_input(change, match):
    args = {
        "query": np.ones((8, 4)),
        "key": np.ones((8, 4)),
        "value": np.ones((8, 4)),
        "output": np.ones((4, 8)),
        "n_heads": 2,
    }
    args.update(change)
    with pytest.raises(ValueError, match=match):
        AttentionLayer.from_projections(**args)
