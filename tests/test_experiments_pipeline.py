"""The pipeline's shared steps, each alone: text files, device, windows' plan,
the resume record, the report's JSON values, the certificate's summary.

The pipeline end to end: tests/test_experiments_layer.py (encoders),
tests/test_experiments_decoder_layer.py (decoders), tests/test_cli_main.py.
"""

import json

import numpy as np
import pytest

import skattn.experiments._pipeline as pipeline_module
from skattn import certify
from skattn.datasets import make_attention_regression


def test_certificate_summary():
    X, y, planted = make_attention_regression(
        300, 3, 4, 2, n_outputs=10, random_state=0, return_layer=True
    )
    summary = pipeline_module._certificate_summary(certify(planted, X, y))
    assert summary["verdict"] == "exact and identifiable"
    assert summary["null_dimension"] == 0 and summary["redundant_heads"] == []
    assert summary["sharp_head_verdicts"] == ["pinned", "pinned"]
    assert summary["text"].startswith("Certificate of a fit")
    json.dumps(pipeline_module._jsonable(summary), allow_nan=False)


def test_jsonable_turns_numpy_and_non_finite_values_into_json():
    value = {
        "a": np.float64(np.inf),
        "b": np.arange(2),
        "c": (np.bool_(True), np.int32(3)),
        "d": float("nan"),
    }
    assert pipeline_module._jsonable(value) == {
        "a": None,
        "b": [0, 1],
        "c": [True, 3],
        "d": None,
    }


def test_device_refuses_scipy_array_api_set_after_import_scipy(monkeypatch):
    # set in os.environ after scipy was imported, the switch does nothing: said
    # (issue 52, point 8)
    pytest.importorskip("torch")
    monkeypatch.setenv("SCIPY_ARRAY_API", "1")
    monkeypatch.setattr(pipeline_module, "scipy_array_api_ignored", lambda: True)
    with pytest.raises(ValueError, match="but scipy was imported before"):
        pipeline_module._check_device("cpu", None)


def test_resume_record_says_what_it_counts(tmp_path):
    # stages reused from a killed run (no time recorded), then from a finished
    # one (its total counted) (issue 52, point 2)
    from types import SimpleNamespace

    def learner(reused, computed):
        memory = {"folder": "f", "reused": reused, "computed": computed}
        return SimpleNamespace(phase_report_=[SimpleNamespace(info={"memory": memory})])

    pieces = pipeline_module._Pieces(tmp_path, {"layer": 1, "out": "o"})
    record = pipeline_module._resume_record(
        learner(["search-1"], ["polish-1"]), pieces, 5
    )
    assert record["stages_reused"] == 1 and record["stages_computed"] == 1
    assert record["fit_seconds_all_pieces"] == 5
    assert "whose time is not recorded" in record["note"]
    # the same arguments but another out: the same fit
    pieces = pipeline_module._Pieces(tmp_path, {"layer": 1, "out": "elsewhere"})
    record = pipeline_module._resume_record(
        learner(["search-1", "polish-1"], []), pieces, 1
    )
    assert record["fit_seconds_all_pieces"] == 6
    assert "took 5.0 s in all" in record["note"]
    pieces.record(2.5)  # then an interrupted piece, and a run that resumes it
    record = pipeline_module._resume_record(
        learner(["search-1"], ["polish-1"]), pieces, 3
    )
    assert record["earlier_pieces_seconds"] == [2.5]
    assert record["fit_seconds_all_pieces"] == 5.5 and "note" not in record


def test_text_takes_folders_and_glob_patterns(tmp_path):
    # issue 51: a folder's text files (its tree, sorted) and a pattern's matches
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha")
    (corpus / "sub" / "b.md").write_text("beta")
    (corpus / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: skipped
    paths, contents = pipeline_module._read_texts([corpus])
    assert paths == [corpus / "a.txt", corpus / "sub" / "b.md"]
    assert contents == ["alpha", "beta"]
    paths, _ = pipeline_module._read_texts([str(corpus / "**" / "*.md")])
    assert paths == [corpus / "sub" / "b.md"]
    with pytest.raises(FileNotFoundError, match="no text file matches"):
        pipeline_module._read_texts([str(corpus / "*.rst")])


def test_window_plan_fits_what_the_count_asks_and_holds_out_the_rest():
    from skattn.experiments._pipeline import MAX_HELD_OUT, window_plan

    # plenty of text: the count's windows fitted, the rest held out up to the cap
    assert window_plan(500, None, 0.2, 100)[:2] == (500, 400)
    total, held, why = window_plan(10**6, None, 0.2, 100)
    assert (total - held, held) == (100, MAX_HELD_OUT) and why.endswith(" held out")
    # too little for the count and its held-out share: every window, as before
    assert window_plan(120, None, 0.2, 100) == (
        120,
        24,
        "all of them: fewer than the 125 that the count asks for with its margin "
        "and held-out share",
    )
    # n_windows decides
    assert window_plan(10**6, 50, 0.2, 100) == (50, 10, "n_windows")


def test_windows_to_pin_are_asked_only_where_the_count_was_left_to_decide():
    from skattn.experiments._pipeline import _windows_to_pin

    heads = [
        {"head": 0, "pinned": True, "windows_needed": 10},
        {"head": 1, "pinned": False, "windows_needed": 900},
    ]
    verdict = {"determined": False, "heads": heads}
    assert _windows_to_pin(verdict, 300, None) == 900
    assert _windows_to_pin(verdict, 300, 400) is None  # n_windows given
    assert _windows_to_pin({**verdict, "determined": True}, 300, None) is None
    heads[1]["windows_needed"] = None  # no window of this text splits it
    assert _windows_to_pin(verdict, 300, None) is None


def test_compare_outputs_measures_what_it_says():
    rng = np.random.default_rng(0)
    H = rng.normal(size=(3, 4, 5))
    logits = rng.normal(size=(3, 4, 7))
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = rng.integers(7, size=(3, 4))
    same = pipeline_module.compare_outputs(H, H, log_probs=(lp, lp), ids=ids)
    assert same["hidden_states_relative_difference"] == 0
    assert same["embedding_cosine_min"] == pytest.approx(1)
    assert same["perplexity_learned"] == same["perplexity_original"]
    # the perplexity of the next tokens: exp of their mean negative log-probability
    taken = [lp[i, t, ids[i, t + 1]] for i in range(3) for t in range(3)]
    assert same["perplexity_original"] == pytest.approx(np.exp(-np.mean(taken)))
    moved = pipeline_module.compare_outputs(H, 1.1 * H)
    assert moved["hidden_states_relative_difference"] == pytest.approx(0.1)
    assert moved["embedding_cosine_min"] == pytest.approx(1)
