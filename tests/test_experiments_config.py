"""skattn.experiments._config: the TOML config of a sweep and `skattn sweep`."""

import textwrap

import pytest

pd = pytest.importorskip("pandas")

from _helpers import SWEEP_PLANTED as TINY  # noqa: E402
from _helpers import no_fit as _no_fit  # noqa: E402
from _helpers import sweep_learners as _learners  # noqa: E402

from skattn.cli import main  # noqa: E402
from skattn.experiments import _sweep, load_sweep_config  # noqa: E402

CONFIG = """
output = "results.csv"
n_jobs = 1
n_test = 50

[planted]
n_heads = 1
n_tokens = 2
n_features = 4
n_outputs = 8

[grid]
n_samples = [100, 200]
seeds = 2

[learners.phased]
estimator = "MultiHeadAttentionRegressor"
n_heads = "planted"
"""


def test_seeds_mean_the_same_in_python_and_in_a_config(tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text(CONFIG.replace("seeds = 2", "seeds = 3"))
    assert (
        load_sweep_config(config)["seeds"]
        == _sweep._check_grid(_learners(), TINY, [100], [0.0], 3)["seed"]
        == [0, 1, 2]
    )
    config.write_text(CONFIG.replace("seeds = 2", "seeds = 0"))
    with pytest.raises(ValueError, match=r"\[grid\] seeds=0: an int is the number"):
        load_sweep_config(config)


def test_cli_sweep_runs_and_resumes(tmp_path, capsys):
    config = tmp_path / "sweep.toml"
    config.write_text(CONFIG)
    assert main(["sweep", str(config), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "4 cells (4 fitted now, 0 from" in out
    assert "success rate 1.00 over 4 fits; median precision" in out
    assert "stopped: tol 4" in out
    assert len(pd.read_csv(tmp_path / "results.csv")) == 4
    assert main(["sweep", str(config), "--quiet"]) == 0
    assert "(0 fitted now, 4 from" in capsys.readouterr().out


@pytest.mark.parametrize(
    "edit, match",
    [
        (("n_test = 50", "n_test = 50\nn_fits = 3"), r"unknown key\(s\) \['n_fits'\]"),
        (
            ("[grid]", "[grid]\nn_sample = 3"),
            r"unknown key\(s\) \['n_sample'\] in \[grid\]",
        ),
        (
            ('"MultiHeadAttentionRegressor"', '"TransformerRegressor"'),
            "estimator='TransformerRegressor', which is not a skattn regressor",
        ),
        (
            ('n_heads = "planted"\n', 'n_heads = "planted"\nlearning_rate = 2\n'),
            r"unknown parameter\(s\) \['learning_rate'\]",
        ),
        (
            (
                "[learners.phased]",
                '[learners.gradient]\nestimator = "GradientAttentionRegressor"\n'
                'solver = "adam"\n\n[learners.phased]',
            ),
            r"\[learners.gradient\] sets 'solver', which GradientAttentionRegressor "
            r"now calls 'optimizer'",
        ),
        (("[learners.phased]", "[learners.phased"), "not valid TOML"),
        (
            ('output = "results.csv"', 'output = "missing/results.csv"'),
            "does not exist",
        ),
        (
            (
                'n_heads = "planted"\n',
                'n_heads = "planted"\npolish_max_iter = "many"\n',
            ),
            r"learners\['phased'\] \(in the cells of n_heads=1, n_tokens=2\): The "
            r"'polish_max_iter' parameter of MultiHeadAttentionRegressor must be an "
            r"int",
        ),
        (
            ('n_heads = "planted"\n', 'n_heads = "planted"\ninit = "zeros"\n'),
            "The 'init' parameter of MultiHeadAttentionRegressor",
        ),
        (
            ("n_outputs = 8", 'n_outputs = 8\ndistribution = "uniform"'),
            r"planted\['distribution'\]='uniform': The 'distribution' parameter of "
            r"make_attention_regression must be a str among",
        ),
        (
            ("n_outputs = 8", "n_outputs = 8\nattention_scale = -2.0"),
            r"planted\['attention_scale'\]=-2.0",
        ),
        (("n_outputs = 8", "n_outputs = [8, 0]"), "n_outputs'] must hold positive"),
        (("seeds = 2", "seeds = [4294967296]"), "seeds must hold ints up to"),
        (
            ("n_jobs = 1", "n_jobs = 0"),
            r"n_jobs must be a non-zero integer \(-1: all .*got 0",
        ),
        (("n_test = 50", 'n_test = "50"'), "n_test must be a positive integer"),
        (('output = "results.csv"', "output = 3"), "output must be a file name"),
        (("n_test = 50", "n_test = 50\nretry_failed = 1"), "retry_failed must be true"),
    ],
)
def test_cli_sweep_refuses_a_bad_config(tmp_path, monkeypatch, capsys, edit, match):
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    config = tmp_path / "sweep.toml"
    config.write_text(CONFIG.replace(*edit))
    with pytest.raises(SystemExit, match=match) as info:
        main(["sweep", str(config), "--quiet"])
    message = info.value.code  # printed by the interpreter, with exit status 1
    assert message.startswith("skattn: error: ") and "\n" not in message
    assert not (tmp_path / "results.csv").exists()
    assert "Traceback" not in capsys.readouterr().err


def test_cli_sweep_with_failed_cells_exits_1_naming_each(tmp_path, capsys):
    # 3 examples are too few for phases 2-4 to certify: init="phased" fails there
    config = tmp_path / "sweep.toml"
    config.write_text(
        CONFIG.replace("n_samples = [100, 200]", "n_samples = [3, 100]").replace(
            'n_heads = "planted"\n', 'n_heads = "planted"\ninit = "phased"\n'
        )
    )
    assert main(["sweep", str(config), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "4 cells (4 fitted now, 0 from" in captured.out
    assert "2 failed." in captured.out
    err = captured.err.splitlines()
    assert err[0] == "skattn: error: 2 of 4 cells failed:"
    for line, seed in zip(err[1:3], (0, 1), strict=True):
        assert line.startswith("  learner=phased estimator=MultiHeadAttentionRegressor")
        assert f"n_samples=3 noise=0.0 seed={seed}: CertificationError: " in line
    assert "retry_failed = true" in err[3]
    assert "Traceback" not in captured.err
    # the failed cells stay failed on a rerun that does not retry them: still 1
    assert main(["sweep", str(config), "--quiet"]) == 1
    assert "(0 fitted now, 4 from" in capsys.readouterr().out


def test_the_config_example_of_the_docs_loads(tmp_path):
    # the TOML shown in skattn.experiments._config's docstring is a valid config
    from skattn.experiments import _config

    after = _config.__doc__.split("::\n", 1)[1].splitlines()
    block = []
    for line in after:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    example = textwrap.dedent("\n".join(block))
    config = tmp_path / "sweep.toml"
    config.write_text(example)
    kwargs = load_sweep_config(config)
    assert kwargs["seeds"] == [0, 1, 2] and kwargs["tighten_tol"] is True
    assert kwargs["learners"]["phased"].n_heads == "planted"
    assert kwargs["planted"]["n_heads"] == [1, 2]


def test_config_paths_are_relative_to_the_config(tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text(CONFIG)
    kwargs = load_sweep_config(config)
    assert kwargs["output"] == str(tmp_path / "results.csv")
    assert kwargs["seeds"] == [0, 1] and kwargs["n_samples"] == [100, 200]
    with pytest.raises(ValueError, match="cannot read the sweep config"):
        load_sweep_config(tmp_path / "absent.toml")
