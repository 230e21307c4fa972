"""The command line: skattn demo and skattn fit (sweep: test_experiments_config)."""

import subprocess
import sys

import numpy as np
import pytest

from skattn import make_attention_regression
from skattn.cli import main


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
            ["data.npz", "--out", "missing/layer.npz"],
            1,
            "skattn: error: --out 'missing/layer.npz': the folder 'missing' does not "
            "exist",
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
    assert not (data / "layer.npz").exists()


@pytest.mark.parametrize(
    "args, status, message",
    [
        (["fit", "nope.npy", "y.npy", "--n-tokens", "2"], 1, "does not exist"),
        (
            ["fit", "data.npz", "--n-tokens", "4", "--out", "missing/layer.npz"],
            1,
            "the folder 'missing' does not exist",
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
                "(default: layer.npz)",
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


def test_fit_help_defaults_are_the_estimators():
    from skattn import MultiHeadAttentionRegressor
    from skattn.cli import FIT_OPTIONS, _parser

    estimator = MultiHeadAttentionRegressor().get_params()
    fit = _parser()._subparsers._group_actions[0].choices["fit"]
    for action in fit._actions:
        parameter = FIT_OPTIONS.get(action.dest)
        if parameter and action.dest not in ("n_tokens", "seed"):
            assert action.default == estimator[parameter], action.dest


def test_demo_checks_the_plot_path_before_fitting(tmp_path, capsys, monkeypatch):
    from skattn import MultiHeadAttentionRegressor

    monkeypatch.setattr(MultiHeadAttentionRegressor, "fit", _no_fit)
    plot = str(tmp_path / "missing" / "p.png")
    code, err = _exit(["demo", "--quiet", "--plot", plot], capsys)
    assert code == 1
    assert err == f"skattn: error: --plot {plot!r}: the folder " + (
        f"{str(tmp_path / 'missing')!r} does not exist; create it first.\n"
    )
