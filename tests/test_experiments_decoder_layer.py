"""learn_layer (and skattn layer) on decoder checkpoints: GPT-2, Llama, Qwen2.

Tiny checkpoints made offline (hidden 16, 2 query heads, 1 key/value head,
weights with std 0.2, a BPE tokenizer trained on the text); the fits are tiny
(windows of 8 tokens).  GPT-2's layer is learned exactly by the default learner
in seconds; the rotary ones are fitted by a learner capped at a few iterations:
those tests check the plumbing (examples, report, writing, loading back), the
benchmark ``bench_decoder_checkpoints.py`` what the default learner reaches.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _helpers import word_text  # noqa: E402

import skattn.datasets._decoder_checkpoint as loader  # noqa: E402
from skattn.cli import main  # noqa: E402
from skattn.datasets._decoder_checkpoint import save_random_decoder  # noqa: E402
from skattn.experiments import learn_layer  # noqa: E402
from skattn.experiments._decoder_layer import (  # noqa: E402
    decoder_learner,
    decoder_verdict,
)
from skattn.experiments._layer import UnidentifiableDataError  # noqa: E402
from skattn.layer._files import read_safetensors  # noqa: E402
from skattn.layer._hf import decoder_settings  # noqa: E402


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return word_text(tmp_path_factory.mktemp("text") / "text.txt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, text):
    root = tmp_path_factory.mktemp("decoders")
    texts = [text.read_text()]
    return {
        arch: save_random_decoder(root / arch, arch, texts)[0]
        for arch in ("gpt2", "llama", "qwen2")
    }


def _capped(folder, n_tokens=8):
    """The default decoder learner, stopped after two polish iterations."""
    config = json.loads((folder / "config.json").read_text())
    return decoder_learner(decoder_settings(config, 1), n_tokens).set_params(
        polish_max_iter=2, n_restarts=1, start_search="none"
    )


def test_gpt2_layer_is_learned_written_and_loaded_back(checkpoints, text, tmp_path):
    result = learn_layer(
        checkpoints["gpt2"],
        layer=1,
        texts=text,
        n_tokens=8,
        n_windows=60,
        out=tmp_path / "out",
    )
    report = result.report
    assert report["held_out_relative_error"] <= 1e-8
    assert report["teacher_agreement"] <= 1e-12
    assert report["loaded_back_held_out_relative_error"] <= 1e-8
    assert report["written_held_out_relative_error"] <= 1e-8
    assert report["verdict"]["summary"] == "2 exact (the layer as a whole)"
    assert report["checkpoint"]["module"] == "transformer.h.1.attn"
    assert json.loads(result.files["report"].read_text()) == report
    tensors, _ = read_safetensors(result.files["layer"])
    assert sorted(tensors) == [
        f"transformer.h.1.attn.{name}"
        for name in ("c_attn.bias", "c_attn.weight", "c_proj.bias", "c_proj.weight")
    ]
    # into a fresh copy of the model: layer 1's attention reproduces the learned one
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoints["gpt2"]), dtype=torch.float64
    )
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, False)
    X = result.X_held_out.reshape(-1, 8, 16)
    with torch.no_grad():
        theirs = model.transformer.h[1].attn(torch.as_tensor(X))[0].numpy()
    ours = result.learned.transform(result.X_held_out)
    scale = np.abs(result.y_held_out).max()
    assert np.abs(theirs.reshape(len(X), -1) - ours).max() <= 1e-10 * scale


@pytest.mark.filterwarnings("ignore:The decoder layer's polish stopped")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotary_layers_are_written_in_the_models_own_names(
    checkpoints, text, tmp_path, arch, capsys
):
    folder = checkpoints[arch]
    result = learn_layer(
        folder,
        layer=1,
        texts=text,
        n_tokens=8,
        n_windows=40,
        estimator=_capped(folder),
        out=tmp_path / "out",
        verbose=1,
    )
    report = result.report
    # the slow rotary pairs' mixings, weakly pinned: said before the fit, recorded
    slow = report["verdict"]["slow_mixings"]
    assert slow["pinned"] and 0 < slow["pinned_to"] < 1e-6
    said = capsys.readouterr().err
    assert f"layer 1: {slow['slow_pairs']} of each head's " in said
    assert "their mixings are pinned only to about" in said
    assert report["teacher_agreement"] <= 1e-12
    assert report["rope_tables"]["teacher"] == "float64"
    assert report["rope_tables"]["model_float32_tables_relative_difference"] < 1e-6
    held = report["held_out_relative_error"]
    assert 0 < held < 1  # two iterations: the plumbing, not the accuracy
    # the written layer (values cut to the module's head_dim directions per
    # key/value group), loaded back into the model, computes what was written
    written = report["written_held_out_relative_error"]
    assert report["loaded_back_held_out_relative_error"] == pytest.approx(
        written, rel=1e-8
    )
    tensors, metadata = read_safetensors(result.files["layer"])
    names = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
    if arch == "qwen2":
        names |= {"q_proj.bias", "k_proj.bias", "v_proj.bias"}
    assert set(tensors) == {f"model.layers.1.self_attn.{n}" for n in names}
    assert metadata["architecture"] == arch and metadata["layer"] == "1"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float64
    )
    state = model.state_dict()
    for key, value in tensors.items():
        assert tuple(state[key].shape) == value.shape


def test_too_few_windows_stop_before_the_model_loads(checkpoints, text, monkeypatch):
    monkeypatch.setattr(loader, "_load_model", _no_model)
    with pytest.raises(UnidentifiableDataError, match="cannot determine") as info:
        learn_layer(checkpoints["llama"], layer=1, texts=text, n_tokens=8, n_windows=4)
    assert "\n" not in str(info.value)


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_heads": 1}, "learned whole"),
        ({"plot": True, "out": "x"}, "plot=True"),
        ({"layer": 5}, "has 2 layers"),
        ({"n_tokens": 100}, "position table"),
        ({"n_windows": 10**5}, "text is too short"),
    ],
)
def test_bad_input_is_one_line_before_the_model_loads(
    checkpoints, text, monkeypatch, tmp_path, kwargs, match
):
    monkeypatch.setattr(loader, "_load_model", _no_model)
    if "out" in kwargs:
        kwargs = {**kwargs, "out": tmp_path / kwargs["out"]}
    arguments = {"layer": 1, "texts": text, "n_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=match) as info:
        learn_layer(checkpoints["qwen2"], **arguments)
    assert "\n" not in str(info.value)


def test_the_command_line_names_an_unsupported_variant_in_one_line(
    checkpoints, text, tmp_path, monkeypatch, capsys
):
    import shutil

    folder = tmp_path / "qwen2"
    shutil.copytree(checkpoints["qwen2"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["use_sliding_window"] = True
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(loader, "_load_model", _no_model)
    with pytest.raises(SystemExit) as info:
        main(["layer", str(folder), "--layer", "1", "--text", str(text)])
    message = str(info.value)
    assert message.startswith("skattn: error: ") and "use_sliding_window" in message
    assert "\n" not in message


def test_a_fit_the_machine_cannot_hold_is_refused_before_the_model_loads(
    checkpoints, text, monkeypatch
):
    import skattn.experiments._decoder_layer as decoder_layer

    monkeypatch.setattr(loader, "_load_model", _no_model)
    monkeypatch.setattr(decoder_layer, "available_memory", lambda: 2**20)
    argv = ["layer", str(checkpoints["llama"]), "--layer", "1", "--text", str(text)]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--n-tokens", "8"])
    message = str(info.value)
    assert message.startswith("skattn: error: The fit of ")
    assert "of memory at the peak" in message and "has 1 MiB available" in message
    assert "--n-windows" in message and "\n" not in message


def test_the_learner_and_the_count_follow_the_config():
    llama = decoder_settings(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 500000.0,
        }
    )
    est = decoder_learner(llama, 32)
    assert (est.causal, est.rope, est.rope_theta, est.rope_layout) == (
        True,
        True,
        500000.0,
        "half",
    )
    assert (est.n_heads, est.n_kv_heads, est.head_rank, est.fit_intercept) == (
        4,
        2,
        16,
        False,
    )
    gpt2 = decoder_settings({"model_type": "gpt2", "n_embd": 64, "n_head": 4})
    est = decoder_learner(gpt2, 32)
    assert (est.rope, est.n_kv_heads, est.fit_intercept) == (False, None, True)
    # the count: equations n k d against the unknowns, less each group's gauge
    verdict = decoder_verdict(6, 32, llama, intercept=False)
    unknowns = (4 + 2 * 2) * 64 * 16 + 4 * 16 * 64 - 2 * (16 + 16 * 16)
    assert verdict["count"]["unknowns"] == unknowns
    assert verdict["determined"] == (6 * 32 * 64 >= unknowns)
    assert not decoder_verdict(5, 32, llama, intercept=False)["determined"]
    # causal rows counted as they are: row l gives l logit differences, a window
    # of 4 tokens 6 where 4 unmasked rows give 12; a head of rank 16 at d = 64
    # has 1792 logit unknowns: 598 rows of 3 differences, 299 windows, not 150
    count = decoder_verdict(299, 4, llama, intercept=False)["count"]
    assert count["rows_needed"] == 598 and count["rows"] == 598
    assert count["samples_needed"] == 299 and count["determined"]
    assert not decoder_verdict(298, 4, llama, intercept=False)["determined"]
    # the slow rotary pairs' mixings: weakly pinned, said in a line; at a base no
    # model uses, too weakly for a 32-token window: no head pinned, the window
    # length that would pin them said (more windows would not: none counted)
    verdict = decoder_verdict(400, 32, llama, intercept=False)
    assert verdict["determined"] and verdict["slow_mixings"]["pinned"]
    assert "6 of each head's 8 rotary pairs" in verdict["note"]
    assert "pinned only to about 3e-12" in verdict["note"]
    far = decoder_verdict(400, 32, {**llama, "rope_theta": 1e14}, intercept=False)
    assert not far["determined"] and far["count"]["samples_needed"] <= 400
    assert not any(head["pinned"] for head in far["heads"])
    assert all(head["windows_needed"] is None for head in far["heads"])
    tokens = far["slow_mixings"]["tokens_needed"]
    assert f"windows of at least {tokens} tokens would pin them" in far["message"]
    assert decoder_verdict(400, 32, gpt2, intercept=True)["slow_mixings"] is None


def test_an_interrupted_decoder_layer_run_resumes(checkpoints, text, tmp_path, capsys):
    # skattn layer on GPT-2's layer 1, stopped by Ctrl-C once its first stage is
    # kept: the message says how to resume; run again, the kept stage is read back
    # and the rest computed; once more, every stage is read back and said so
    from pathlib import Path

    import skattn.experiments._pipeline as pipeline_module
    import skattn.solvers._decoder as decoder_module

    out = tmp_path / "o"
    argv = ["layer", str(checkpoints["gpt2"]), "--layer", "1", "--text", str(text)]
    argv += ["--n-tokens", "8", "--n-windows", "60", "--out", str(out), "--quiet"]
    search = decoder_module.minibatch_search

    def stopped(*args, **kwargs):  # after the search, before it is kept
        search(*args, **kwargs)
        raise KeyboardInterrupt

    decoder_module.minibatch_search = stopped
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
    finally:
        decoder_module.minibatch_search = search
    assert exit_info.value.code == 130
    # one line (transformers' own bar of the weights it loads is not shown)
    assert capsys.readouterr().err == (
        f"skattn: interrupted; run the same command again to resume from "
        f"{out / 'cache'}\n"
    )
    assert main(argv) == 0
    report = json.loads(Path(out, "report.json").read_text())
    assert report["held_out_relative_error"] <= 1e-8
    resume = report["resume"]
    assert resume["stages_computed"] > 0 and len(resume["earlier_pieces_seconds"]) == 1
    assert main(argv) == 0
    printed = capsys.readouterr().out
    again = json.loads(Path(out, "report.json").read_text())
    assert again["resume"]["stages_reused"] > 0
    assert again["resume"]["stages_computed"] == 0
    assert again["held_out_relative_error"] == report["held_out_relative_error"]
    assert f"resumed: {again['resume']['stages_reused']} stages reused" in printed
    assert pipeline_module._Pieces.FILE in {p.name for p in (out / "cache").iterdir()}


def test_more_text_than_the_count_asks_for_is_held_out_not_fitted(
    checkpoints, text, tmp_path, capsys
):
    # no n_windows: the fit takes the windows the count asks for with the search's
    # margin, the rest of the text is held out; the first line says so
    from skattn.experiments._pipeline import MAX_HELD_OUT

    folder = checkpoints["gpt2"]
    config = json.loads((folder / "config.json").read_text())
    settings = decoder_settings(config, 1)
    count = decoder_verdict(1, 8, settings, intercept=True)["count"]
    wanted = count["search_samples_needed"]
    result = learn_layer(folder, layer=1, texts=text, n_tokens=8, verbose=1)
    report = result.report
    available = report["text"]["n_windows_available"]
    assert wanted + 2 <= available <= wanted + MAX_HELD_OUT  # more than asked for
    assert report["n_windows_fit"] == wanted
    assert report["n_windows_held_out"] == available - wanted
    assert report["held_out_relative_error"] <= 1e-8
    first = capsys.readouterr().err
    assert (
        f"to fit on {wanted} windows of 8 tokens ({available - wanted} held out) of "
        f"the {available} of 1 text file(s): the count asks for {wanted} with its "
        f"margin; the rest held out; about " in first
    )
    assert "MiB of memory at the peak (the polish " in first
