"""The command line: skattn demo and skattn fit."""

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
    with pytest.raises(SystemExit, match="lacks"):
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
