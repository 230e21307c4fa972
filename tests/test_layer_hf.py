"""transformers' decoder attention (GPT-2, Llama, Mistral, Qwen2) and skattn's layer.

The teachers are transformers' own modules, random init in float64 with the SDPA
attention (the eager one computes the softmax in float32).  transformers builds
the RoPE tables in float32 even in a float64 model (``LlamaRotaryEmbedding``
casts the frequencies and angles to float); the exact comparisons hand the
attention module the same tables in float64 (``emb = cat(freqs, freqs)``,
``cos``, ``sin``, as ``LlamaRotaryEmbedding.forward`` builds them), and the
model's own float32 tables are checked to agree to float32 rounding.
"""

import numpy as np
import pytest

from skattn import AttentionLayer
from skattn.datasets import make_attention_layer
from skattn.layer._hf import decoder_parameters, decoder_settings, decoder_weights
from skattn.layer._math import forward

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
ARCHS = ["gpt2", "llama", "qwen2", "mistral"]


def _config(arch, **kw):
    common = {"vocab_size": 97, "attn_implementation": "sdpa"}
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=D, n_head=HEADS, n_layer=2, n_positions=64, **common, **kw
        )
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    extra = {"sliding_window": None} if arch == "mistral" else {}
    return cls(
        hidden_size=D,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=2,
        intermediate_size=32,
        **common,
        **{**extra, **kw},
    )


def _model(arch, seed=0, **kw):
    """A tiny random float64 model and its layer-1 attention module (all its
    weights and biases drawn with std 0.2)."""
    torch.manual_seed(seed)
    config = _config(arch, **kw)
    cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[arch]
    model = cls(config).double().eval()
    attn = (
        model.transformer.h[1].attn
        if arch == "gpt2"
        else model.model.layers[1].self_attn
    )
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.2)
    return model, attn


def _tables64(n_tokens, theta=10000.0, dim=HEAD_DIM):
    """LlamaRotaryEmbedding.forward's cos, sin, in float64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = torch.arange(n_tokens, dtype=torch.float64)[None, :, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


PADDINGS = {
    "none": [],
    "left": [(0, slice(0, 3)), (2, slice(0, 1))],
    "right": [(1, slice(-4, None)), (2, slice(-2, None))],
}


def _run(model, attn, padding, k=12):
    """transformers' own pass: the attention module's input hidden states and
    keyword arguments, its output, and the attention mask of the batch."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, k), generator=gen)
    mask = torch.ones(3, k, dtype=torch.long)
    for row, cols in PADDINGS[padding]:
        mask[row, cols] = 0
    captured = {}

    def pre(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, dict(kwargs)

    def post(module, args, kwargs, out):
        captured["out"] = out[0]

    hooks = [
        attn.register_forward_pre_hook(pre, with_kwargs=True),
        attn.register_forward_hook(post, with_kwargs=True),
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for hook in hooks:
        hook.remove()
    args, kwargs = captured["args"], captured["kwargs"]
    hidden = args[0] if args else kwargs.pop("hidden_states")
    return hidden, args[1:], kwargs, captured["out"], mask.numpy().astype(bool)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_equals_transformers_attention(arch, padding):
    model, attn = _model(arch)
    hidden, args, kwargs, out, mask = _run(model, attn, padding)
    if arch != "gpt2":
        own_cos, own_sin = kwargs["position_embeddings"]
        cos, sin = _tables64(hidden.shape[1])
        # the model's own tables: the same up to float32 rounding
        assert torch.abs(own_cos - cos).max() < 1e-6
        assert torch.abs(own_sin - sin).max() < 1e-6
        kwargs["position_embeddings"] = (cos, sin)
        with torch.no_grad():
            float32_tables_out = out.numpy()
            out = attn(hidden, *args, **kwargs)[0]
    X, Y = hidden.numpy(), out.numpy()
    layer = AttentionLayer.from_torch(attn)
    for s in range(X.shape[0]):  # each sequence alone: its real tokens
        real = mask[s]
        ours = layer.transform(X[s : s + 1, real]).reshape(-1, D)
        assert _rel(ours, Y[s, real]) <= 1e-12
        if arch != "gpt2":  # against the model's float32 RoPE tables
            assert _rel(ours, float32_tables_out[s, real]) <= 1e-6
    # the padded batch at once, padded keys masked out
    params = {
        "causal": True,
        "key_mask": mask,
        "key_bias": layer.key_bias,
        "intercept": layer.intercept,
    }
    if arch != "gpt2":
        params["rotary"] = layer._decoder()["rotary"]
    batch = forward(X, layer.attention, layer.projection, **params)
    assert _rel(batch[mask], Y[mask]) <= 1e-12


@pytest.mark.parametrize("arch", ARCHS)
def test_to_torch_writes_a_module_that_reproduces_the_layer(arch):
    _, attn = _model(arch)
    layer = AttentionLayer.from_torch(attn)
    _, other = _model(arch, seed=3)  # another draw of the same architecture
    assert layer.to_torch(module=other) is other
    back = AttentionLayer.from_torch(other)
    for name in ("attention", "projection", "rotary_query", "rotary_key"):
        ours, theirs = getattr(layer, name), getattr(back, name)
        if ours is None:
            assert theirs is None
        else:
            assert np.abs(ours - theirs).max() <= 1e-12 * max(np.abs(ours).max(), 1)
    for name in ("key_bias", "intercept"):
        ours, theirs = getattr(layer, name), getattr(back, name)
        if ours is not None:
            assert np.abs(ours - theirs).max() <= 1e-12 * np.abs(ours).max()
    X = np.random.default_rng(0).normal(size=(2, 9, D))
    x = torch.as_tensor(X)
    kwargs = {"attention_mask": None}
    if arch != "gpt2":
        kwargs["position_embeddings"] = _tables64(9)
    with torch.no_grad():
        theirs = other(x, **kwargs)[0].numpy().reshape(2, -1)
    assert _rel(layer.transform(X), theirs) <= 1e-12


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_planted_gqa_rope_layer_loads_into_llama(layout):
    layer = make_attention_layer(
        HEADS,
        D,
        head_rank=HEAD_DIM,
        causal=True,
        rope=True,
        rope_layout=layout,
        n_kv_heads=KV_HEADS,
        random_state=0,
    )
    _, attn = _model("llama")
    layer.to_torch(module=attn)
    X = np.random.default_rng(1).normal(size=(3, 7, D))
    with torch.no_grad():
        theirs = attn(
            torch.as_tensor(X), position_embeddings=_tables64(7), attention_mask=None
        )[0]
    assert _rel(layer.transform(X), theirs.numpy().reshape(3, -1)) <= 1e-12


def test_gpt2_scale_by_inverse_layer_index_is_read_from_the_module():
    model, attn = _model("gpt2", scale_attn_by_inverse_layer_idx=True)
    hidden, args, kwargs, out, mask = _run(model, attn, "none")
    layer = AttentionLayer.from_torch(attn)
    ours = layer.transform(hidden.numpy())
    assert _rel(ours, out.numpy().reshape(3, -1)) <= 1e-12
    # written back with that scale (1 / (2 sqrt(head_dim)) in layer 1)
    assert attn.scaling == pytest.approx(0.5 / HEAD_DIM**0.5)
    _, other = _model("gpt2", seed=5, scale_attn_by_inverse_layer_idx=True)
    layer.to_torch(module=other)
    with torch.no_grad():
        theirs = other(hidden, attention_mask=None)[0].numpy().reshape(3, -1)
    assert _rel(ours, theirs) <= 1e-12


def _settings_error(config):
    with pytest.raises(ValueError) as info:
        decoder_settings(config, layer_idx=1)
    message = str(info.value)
    assert "\n" not in message
    return message


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}

BAD_CONFIGS = {
    "mistral sliding window": (
        {**LLAMA, "model_type": "mistral", "sliding_window": 4096},
        "sliding_window=4096",
    ),
    "qwen2 sliding window": (
        {**LLAMA, "model_type": "qwen2", "use_sliding_window": True},
        "use_sliding_window",
    ),
    "sliding layer type": (
        {**LLAMA, "layer_types": ["full_attention", "sliding_attention"]},
        "sliding_attention",
    ),
    "rope yarn": (
        {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
        "rope_type='yarn'",
    ),
    "rope_scaling linear (transformers 4)": (
        {**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "rope_type='linear'",
    ),
    "partial rotary": (
        {**LLAMA, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor=0.5",
    ),
    "soft-capping": ({**LLAMA, "attn_logit_softcapping": 50.0}, "soft-capping"),
    "cross-attention": (
        {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "add_cross_attention": True},
        "cross-attention",
    ),
    "kv heads not dividing": ({**LLAMA, "num_key_value_heads": 3}, "does not divide"),
    "odd rotary dim": ({**LLAMA, "head_dim": 15}, "odd"),
    "gpt2 heads not dividing": (
        {"model_type": "gpt2", "n_embd": 64, "n_head": 5},
        "does not divide n_embd",
    ),
    "unsupported architecture": ({**LLAMA, "model_type": "gemma2"}, "gemma2"),
    "no hidden size": (
        {"model_type": "qwen2", "num_attention_heads": 4},
        "hidden_size",
    ),
    "negative rope_theta": (
        {**LLAMA, "rope_parameters": {"rope_theta": -1.0}},
        "rope_theta=-1.0",
    ),
    "per-layer-type rope": (
        {**LLAMA, "rope_parameters": {"full_attention": {"rope_theta": 1e4}}},
        "per layer type",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_unsupported_configs_give_one_line_errors(name):
    config, match = BAD_CONFIGS[name]
    assert match in _settings_error(config)


def test_unsupported_modules_give_one_line_errors():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cross = GPT2Attention(_config("gpt2"), is_cross_attention=True, layer_idx=0)
    with pytest.raises(ValueError, match="cross-attention") as info:
        AttentionLayer.from_torch(cross)
    assert "\n" not in str(info.value)
    _, attn = _model("qwen2")
    attn.sliding_window = 8  # what a sliding layer of Qwen2 has
    with pytest.raises(ValueError, match="sliding_window=8"):
        AttentionLayer.from_torch(attn)
    _, llama = _model("llama")
    llama.config.attn_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-capping"):
        AttentionLayer.from_torch(llama)


def test_malformed_weights_give_one_line_errors():
    settings = decoder_settings({**LLAMA, "num_key_value_heads": 2})
    good = {
        "q_proj.weight": np.ones((64, 64)),
        "k_proj.weight": np.ones((32, 64)),
        "v_proj.weight": np.ones((32, 64)),
        "o_proj.weight": np.ones((64, 64)),
    }
    decoder_parameters(good, settings)
    for name, value, match in [
        ("k_proj.weight", np.ones((64, 64)), r"k_proj.weight has shape \(64, 64\)"),
        ("q_proj.weight", np.full((64, 64), np.nan), "NaN"),
        ("q_proj.bias", np.ones(3), r"q_proj.bias has shape \(3,\)"),
    ]:
        with pytest.raises(ValueError, match=match) as info:
            decoder_parameters({**good, name: value}, settings)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="lack 'v_proj.weight'"):
        decoder_parameters({k: v for k, v in good.items() if k[0] != "v"}, settings)


def test_layers_a_module_cannot_hold_are_refused():
    llama = decoder_settings({**LLAMA, "num_key_value_heads": 2})
    names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    planted = {
        "causal": True,
        "rope": True,
        "n_kv_heads": 2,
        "head_rank": 16,
        "random_state": 0,
    }
    cases = [
        (make_attention_layer(4, 64, **{**planted, "causal": False}), "layer is not"),
        (make_attention_layer(4, 64, **{**planted, "rope": False}), "no rotary"),
        (make_attention_layer(4, 64, **{**planted, "n_kv_heads": 4}), "4 key heads"),
        (make_attention_layer(4, 64, **{**planted, "head_rank": 8}), "rotary dim"),
        (
            make_attention_layer(4, 64, **planted).set_params(
                projection=np.random.default_rng(0).normal(size=(4, 64, 64))
            ),
            "span more than head_dim=16",
        ),
        (
            make_attention_layer(4, 64, **planted).set_params(intercept=np.ones(64)),
            "intercept",
        ),
        (make_attention_layer(4, 64, **planted).set_params(rope_theta=5.0), "5.0"),
    ]
    for layer, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            decoder_weights(layer, llama, names)
        assert "\n" not in str(info.value)
    gpt2 = decoder_settings({"model_type": "gpt2", "n_embd": 64, "n_head": 4})
    with pytest.raises(ValueError, match="rotary positions"):
        decoder_weights(make_attention_layer(4, 64, **planted), gpt2, names)
