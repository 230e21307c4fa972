"""Decoder checkpoints: checked before any model is loaded, run by transformers.

Tiny GPT-2, Llama, Mistral and Qwen2 checkpoints are built offline in a tmp
folder (``save_random_decoder``: random init, a BPE tokenizer; a few
checkpoints briefly trained on the text); the bad ones are these with one
thing changed.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import skattn.datasets._decoder_checkpoint as loader  # noqa: E402
from skattn import AttentionLayer  # noqa: E402
from skattn.datasets._decoder_checkpoint import (  # noqa: E402
    attention_module,
    check_decoder_checkpoint,
    decoder_examples,
    rope_tables,
    save_random_decoder,
    write_decoder_layer,
)
from skattn.layer._files import read_safetensors  # noqa: E402

ARCHS = ["gpt2", "llama", "qwen2", "mistral"]
SENTENCES = [
    "Return the number of items in the list.",
    "Open the file and read every line of it into a list of strings.",
    "Raise a ValueError when the argument is negative or not a number.",
    "The cache keeps the last result so that the next call is fast.",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    return {
        arch: save_random_decoder(root / arch, arch, SENTENCES)[0] for arch in ARCHS
    }


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_check_reads_names_and_shapes_from_the_headers(checkpoints):
    llama = check_decoder_checkpoint(checkpoints["llama"], layer=1, n_tokens=8)
    assert llama["prefix"] == "model.layers.1.self_attn."
    assert llama["shapes"] == {
        "q_proj.weight": (16, 16),
        "k_proj.weight": (8, 16),
        "v_proj.weight": (8, 16),
        "o_proj.weight": (16, 16),
    }
    qwen2 = check_decoder_checkpoint(checkpoints["qwen2"], layer=0)
    assert sorted(n for n in qwen2["shapes"] if n.endswith("bias")) == [
        "k_proj.bias",
        "q_proj.bias",
        "v_proj.bias",
    ]
    gpt2 = check_decoder_checkpoint(checkpoints["gpt2"], layer=1)
    assert gpt2["prefix"] == "transformer.h.1.attn."
    assert gpt2["shapes"]["c_attn.weight"] == (16, 48)


@pytest.mark.parametrize("arch", ARCHS)
def test_examples_are_the_modules_inputs_and_outputs(checkpoints, arch):
    checkpoint = check_decoder_checkpoint(checkpoints[arch], layer=1, n_tokens=8)
    ids = np.random.default_rng(0).integers(0, 20, size=(5, 8))
    X, Y, model = decoder_examples(checkpoint, ids)
    assert X.shape == Y.shape == (5, 8, 16)
    # X: the normalized hidden states entering block 1 (the model's own pass)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
    entering = out.hidden_states[1]
    name, module = attention_module(model, checkpoint)
    block = model.get_submodule(name.rsplit(".", 1)[0])
    norm = block.ln_1 if arch == "gpt2" else block.input_layernorm
    with torch.no_grad():
        np.testing.assert_allclose(X, norm(entering).numpy(), rtol=0, atol=1e-13)
    # Y: the module on X (float64 RoPE tables), = skattn's reading of it
    kwargs = {"attention_mask": None}
    if arch != "gpt2":
        cos, sin = rope_tables(8, 8, 10000.0)
        kwargs["position_embeddings"] = (torch.as_tensor(cos), torch.as_tensor(sin))
    with torch.no_grad():
        direct = module(torch.as_tensor(X), **kwargs)[0].numpy()
    assert _rel(Y, direct) <= 1e-14
    layer = AttentionLayer.from_torch(module)
    assert _rel(layer.transform(X.reshape(5, -1)), Y.reshape(5, -1)) <= 1e-12
    # the model's own float32 tables: the same up to their rounding
    _, Y32, _ = decoder_examples(checkpoint, ids, rope="model", model=model)
    assert _rel(Y32, Y) <= (0 if arch == "gpt2" else 1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_written_layer_loads_back_into_the_model(checkpoints, arch, tmp_path):
    checkpoint = check_decoder_checkpoint(checkpoints[arch], layer=1)
    ids = np.random.default_rng(1).integers(0, 20, size=(4, 8))
    X, Y, model = decoder_examples(checkpoint, ids)
    _, module = attention_module(model, checkpoint)
    layer = AttentionLayer.from_torch(module)
    path = tmp_path / "layer.safetensors"
    tensors = write_decoder_layer(path, layer, checkpoint)
    read, metadata = read_safetensors(path)
    assert sorted(read) == sorted(tensors)
    assert all(key.startswith(checkpoint["prefix"]) for key in read)
    assert metadata["format"] == loader.DECODER_FORMAT
    # into another draw of the model: its layer-1 attention becomes this one
    other = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoints[arch]), dtype=torch.float64
    )
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1)
    result = other.load_state_dict(
        {k: torch.as_tensor(v) for k, v in read.items()}, strict=False
    )
    assert result.unexpected_keys == []
    _, back = attention_module(other, checkpoint)
    kwargs = {"attention_mask": None}
    if arch != "gpt2":
        cos, sin = rope_tables(8, 8, 10000.0)
        kwargs["position_embeddings"] = (torch.as_tensor(cos), torch.as_tensor(sin))
    with torch.no_grad():
        theirs = back(torch.as_tensor(X), **kwargs)[0].numpy()
    assert _rel(theirs, Y) <= 1e-12


def _config_edit(**changes):
    def edit(folder):
        path = folder / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config))

    return edit


def _drop_tensor(name):
    """Rewrite model.safetensors without ``name`` (a header-only change would
    do, but the file stays a valid one)."""

    def edit(folder):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        del tensors[name]
        save_file(tensors, str(folder / "model.safetensors"))

    return edit


def _reshape_tensor(name):
    def edit(folder):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        tensors[name] = tensors[name][:-1]
        save_file(tensors, str(folder / "model.safetensors"))

    return edit


def _add_tensor(name, shape):
    def edit(folder):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        tensors[name] = np.ones(shape)
        save_file(tensors, str(folder / "model.safetensors"))

    return edit


def _shard_index(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {
        "model.layers.1.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )


def _remove(name):
    return lambda folder: (folder / name).unlink()


def _garble(name):
    return lambda folder: (folder / name).write_bytes(b"\x07\x00")


# (architecture, how the folder is broken, what the message says, check kwargs)
BAD = {
    "unsupported model_type": ("llama", _config_edit(model_type="gemma2"), "gemma2"),
    "mistral sliding window": (
        "mistral",
        _config_edit(sliding_window=4096),
        "sliding_window=4096",
    ),
    "qwen2 use_sliding_window": (
        "qwen2",
        _config_edit(use_sliding_window=True),
        "use_sliding_window",
    ),
    "rope scaling": (
        "llama",
        _config_edit(
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
        ),
        "rope_type='linear'",
    ),
    "partial rotary factor": (
        "llama",
        _config_edit(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            }
        ),
        "partial_rotary_factor=0.5",
    ),
    "gpt2 cross-attention": (
        "gpt2",
        _config_edit(add_cross_attention=True),
        "cross-attention",
    ),
    "soft-capping": (
        "llama",
        _config_edit(attn_logit_softcapping=50.0),
        "soft-capping",
    ),
    "heads not dividing the width": (
        "gpt2",
        _config_edit(n_head=3),
        "does not divide",
    ),
    "kv heads not dividing": (
        "llama",
        _config_edit(num_key_value_heads=3),
        "does not divide",
    ),
    "layer out of range": ("llama", _config_edit(), "has 2 layers"),
    "window beyond the position table": (
        "qwen2",
        _config_edit(max_position_embeddings=4),
        "max_position_embeddings=4",
    ),
    "no tokenizer.json": ("llama", _remove("tokenizer.json"), "tokenizer.json"),
    "no config.json": ("llama", _remove("config.json"), "config.json"),
    "config not JSON": ("llama", _garble("config.json"), "cannot be read as JSON"),
    "no weights": ("llama", _remove("model.safetensors"), "neither"),
    "weights not safetensors": (
        "llama",
        _garble("model.safetensors"),
        "not a .safetensors file",
    ),
    "index naming a missing shard": (
        "llama",
        _shard_index,
        "model-00002-of-00002.safetensors",
    ),
    "missing tensor of the layer": (
        "llama",
        _drop_tensor("model.layers.1.self_attn.k_proj.weight"),
        "lack model.layers.1.self_attn.k_proj.weight",
    ),
    "wrong tensor shape": (
        "qwen2",
        _reshape_tensor("model.layers.1.self_attn.q_proj.bias"),
        "q_proj.bias has shape (15,)",
    ),
    "query/key norms": (
        "qwen2",
        _add_tensor("model.layers.1.self_attn.q_norm.weight", (8,)),
        "query/key norms",
    ),
    "attention sinks": (
        "llama",
        _add_tensor("model.layers.1.self_attn.sinks", (2,)),
        "attention sinks",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_one_line_errors_before_any_model_loads(
    case, checkpoints, tmp_path, monkeypatch
):
    import shutil

    arch, breaks, match = BAD[case]
    folder = tmp_path / arch
    shutil.copytree(checkpoints[arch], folder)
    breaks(folder)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loader, "_load_model", no_model)
    layer = 2 if case == "layer out of range" else 1
    with pytest.raises(ValueError) as info:
        check_decoder_checkpoint(folder, layer=layer, n_tokens=8)
    message = str(info.value)
    assert match in message
    assert "\n" not in message


def test_bad_cases_count_at_least_ten():
    assert len(BAD) >= 10


def test_module_ranks_moves_what_the_data_leave_free_into_the_intercept(
    checkpoints, tmp_path
):
    # GPT-2's LayerNorm outputs lie in a hyperplane N^T x = N^T mu: values along
    # N only add a constant, so a fit may put anything there (full-rank W_i);
    # the module (values of rank head_dim, an output bias) holds it once moved
    checkpoint = check_decoder_checkpoint(checkpoints["gpt2"], layer=1)
    ids = np.random.default_rng(2).integers(0, 20, size=(30, 8))
    X, Y, model = decoder_examples(checkpoint, ids)
    _, module = attention_module(model, checkpoint)
    teacher = AttentionLayer.from_torch(module)
    N, mu = loader._hull_normals(X)
    assert N.shape == (16, 1)
    a = np.random.default_rng(3).normal(size=(2, 1, 16))
    moved = teacher.set_params(
        projection=teacher.projection + N[None] @ a,
        intercept=teacher.intercept - np.einsum("q,mqo->o", N.T @ mu, a),
    )
    flat, target = X.reshape(len(X), -1), Y.reshape(len(X), -1)
    assert _rel(moved.transform(flat), target) <= 1e-12  # the same on the data
    assert min(np.linalg.matrix_rank(w, tol=1e-10) for w in moved.projection) == 9
    fixed = loader.module_ranks(moved, checkpoint["settings"], X)
    assert max(np.linalg.matrix_rank(w, tol=1e-10) for w in fixed.projection) == 8
    assert _rel(fixed.transform(flat), target) <= 1e-12
    write_decoder_layer(tmp_path / "layer.safetensors", fixed, checkpoint)


def test_a_sharded_checkpoint_is_read_from_its_index(checkpoints, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoints["llama"]), dtype=torch.float64
    )
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "tokenizer.json").write_bytes(
        (checkpoints["llama"] / "tokenizer.json").read_bytes()
    )
    assert not (tmp_path / "model.safetensors").exists()
    checkpoint = check_decoder_checkpoint(tmp_path, layer=1, n_tokens=8)
    assert len(checkpoint["weight_files"]) > 1
    assert checkpoint["prefix"] == "model.layers.1.self_attn."


def _stream(folder):
    """The SENTENCES as the checkpoint's tokenizer cuts them, one stream."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [i for encoding in tokenizer.encode_batch(SENTENCES) for i in encoding.ids]


def _next_token_loss(model, ids, window):
    """The mean next-token loss over every window of ``window`` tokens."""
    stream = torch.as_tensor(ids)
    windows = stream.unfold(0, window, 1)
    with torch.no_grad():
        return float(model(input_ids=windows, labels=windows).loss)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_briefly_trained_checkpoint_predicts_its_text_better(
    checkpoints, arch, tmp_path
):
    folder, trained = save_random_decoder(
        tmp_path / arch, arch, SENTENCES, train_steps=20, train_tokens=8
    )
    assert trained.dtype == torch.float64 and not trained.training
    untrained = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoints[arch]), dtype=torch.float64
    ).eval()
    ids = _stream(folder)
    assert ids == _stream(checkpoints[arch])  # the same tokenizer
    before = _next_token_loss(untrained, ids, 8)
    after = _next_token_loss(trained, ids, 8)
    assert after < before - 0.5, (before, after)
    # what was saved is the model returned, in float64
    saved, _ = read_safetensors(folder / "model.safetensors")
    state = trained.state_dict()
    assert all(value.dtype == np.float64 for value in saved.values())
    assert all(np.array_equal(v, state[k].numpy()) for k, v in saved.items())
    if arch != "llama":
        return
    # the same arguments, the same checkpoint
    again = save_random_decoder(
        tmp_path / "again", arch, SENTENCES, train_steps=20, train_tokens=8
    )[0]
    assert (again / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_no_training_saves_the_random_draw_bit_for_bit(checkpoints, arch, tmp_path):
    folder, _ = save_random_decoder(
        tmp_path / arch, arch, SENTENCES, train_steps=0, rope_theta=None
    )
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (folder / name).read_bytes() == (checkpoints[arch] / name).read_bytes()
    # and that is the seed's draw from the config (attention biases redrawn)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(0)
    drawn = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    drawn = drawn.double()  # drawn in float32, as save_random_decoder does
    saved, _ = read_safetensors(folder / "model.safetensors")
    state = drawn.state_dict()
    weights = [k for k in saved if not ("attn." in k and k.endswith("bias"))]
    assert len(weights) > 10
    assert all(np.array_equal(saved[k], state[k].numpy()) for k in weights)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_rope_theta_lands_in_the_config(arch, tmp_path):
    folder, model = save_random_decoder(tmp_path, arch, SENTENCES, rope_theta=5e5)
    checkpoint = check_decoder_checkpoint(folder, layer=1)
    assert checkpoint["settings"]["rope_theta"] == 5e5
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    assert loaded.config.rope_parameters["rope_theta"] == 5e5


@pytest.mark.parametrize(
    "arch, kwargs, match",
    [
        ("gpt2", {"rope_theta": 5e5}, "has learned positions and no rotary base"),
        ("llama", {"rope_theta": -1.0}, "rope_theta must be a positive finite"),
        ("llama", {"rope_theta": "5e5"}, "rope_theta must be a positive finite"),
        ("llama", {"train_steps": -1}, "train_steps must be a non-negative integer"),
        ("llama", {"train_steps": 2.5}, "train_steps must be a non-negative integer"),
        ("llama", {"train_steps": True}, "train_steps must be a non-negative integer"),
        ("llama", {"train_tokens": 1}, "train_tokens must be None"),
        ("llama", {"train_tokens": 65}, "to max_positions=64, got 65"),
        ("llama", {"train_steps": 1}, "pass more text or a smaller train_tokens"),
        ("falcon", {}, "architecture='falcon' is not supported"),
    ],
)
def test_bad_arguments_of_save_random_decoder(arch, kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match) as info:
        save_random_decoder(tmp_path, arch, SENTENCES, **kwargs)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "model.safetensors").exists()
