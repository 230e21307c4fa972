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
    ],
)
def test_cli_sweep_refuses_a_bad_config(tmp_path, monkeypatch, edit, match):
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    config = tmp_path / "sweep.toml"
    config.write_text(CONFIG.replace(*edit))
    with pytest.raises(SystemExit, match=match):
        main(["sweep", str(config), "--quiet"])


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
