"""skattn.experiments._sweep: recovery sweeps, their result files and engines."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

from _helpers import SWEEP_PLANTED as TINY  # noqa: E402
from _helpers import no_fit as _no_fit  # noqa: E402
from _helpers import sweep_learners as _learners  # noqa: E402

from skattn import GradientAttentionRegressor, MultiHeadAttentionRegressor  # noqa: E402
from skattn.experiments import (  # noqa: E402
    PhaseDiagramDisplay,
    SweepCurveDisplay,
    _sweep,
    recovery_sweep,
)


def test_rows_hold_every_setting_and_measure(tmp_path):
    results = recovery_sweep(
        _learners(),
        n_samples=[100, 200],
        planted=TINY,
        noise=[0.0, 0.01],
        seeds=[0, 1],
        n_jobs=1,
        n_test=50,
        progress=False,
    )
    assert len(results) == 2 * 2 * 2 * 2 == results.attrs["n_fitted"]
    assert results["cell_id"].is_unique
    assert set(results["status"]) == {"ok"}
    assert set(results.columns) == set(_sweep.COLUMNS)
    phased = results[(results.learner == "phased") & (results.noise == 0)]
    # One noise-free head: the phased learner recovers it exactly.
    assert phased["success"].all()
    assert (phased["attention_error"] < 1e-8).all()
    assert (phased["n_heads_fitted"] == 1).all()
    assert (results["fit_seconds"] > 0).all()
    summary = json.loads(phased["phase_summary"].iloc[0])
    assert [r["phase"] for r in summary[:2]] == ["0-start", "1-crude-projection-sum"]
    # Ten L-BFGS iterations do not converge: the warning is in the row.
    gradient = results[results.learner == "gradient"]
    assert (gradient["n_warnings"] > 0).all()
    assert "ConvergenceWarning" in json.loads(gradient["warnings"].iloc[0])[0]


def test_a_failed_fit_is_a_row_not_a_crash():
    # One output per token is fewer than the two tokens phase 2 needs.
    results = recovery_sweep(
        {"phased": MultiHeadAttentionRegressor(init="phased")},
        n_samples=50,
        planted={"n_tokens": 2, "n_features": 2, "n_outputs": 1},
        seeds=[0, 1],
        n_jobs=1,
        progress=False,
    )
    assert list(results["status"]) == ["failed", "failed"]
    assert results["error"].str.contains("n_outputs_per_token >= n_tokens").all()
    assert not results["success"].any()


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_rerun_skips_finished_cells(tmp_path, suffix):
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    output = tmp_path / f"results.{suffix}"
    kwargs = dict(planted=TINY, n_jobs=1, n_test=50, progress=False, output=output)
    first = recovery_sweep(_learners(), n_samples=[100], seeds=[0, 1], **kwargs)
    assert first.attrs["n_fitted"] == 4
    second = recovery_sweep(_learners(), n_samples=[100, 200], seeds=[0, 1], **kwargs)
    assert second.attrs["n_fitted"] == 4  # only the new n_samples
    assert len(second) == 8
    on_disk = pd.read_csv(output) if suffix == "csv" else pd.read_parquet(output)
    assert len(on_disk) == 8 and on_disk["cell_id"].is_unique
    # The resumed rows are the ones written by the first run.
    np.testing.assert_array_equal(
        second["attention_error"].to_numpy()[[0, 1]],
        first["attention_error"].to_numpy()[[0, 1]],
    )
    third = recovery_sweep(_learners(), n_samples=[100, 200], seeds=[0, 1], **kwargs)
    assert third.attrs["n_fitted"] == 0 and len(third) == 8


def test_retry_failed_reruns_only_failed_cells(tmp_path):
    output = tmp_path / "results.csv"
    bad = {"n_tokens": 2, "n_features": 2, "n_outputs": 1}
    kwargs = dict(n_samples=50, seeds=[0], n_jobs=1, progress=False, output=output)
    learners = {"phased": MultiHeadAttentionRegressor(init="phased")}
    recovery_sweep(learners, planted=bad, **kwargs)
    again = recovery_sweep(learners, planted=bad, **kwargs)
    assert again.attrs["n_fitted"] == 0
    retried = recovery_sweep(
        learners,
        planted=bad,
        retry_failed=True,
        **kwargs,
    )
    assert retried.attrs["n_fitted"] == 1 and len(retried) == 1


def test_a_cut_short_result_file_is_an_error_that_names_it(tmp_path):
    # Writes are atomic, so a partial row means the file was damaged after the
    # sweep wrote it: an error naming the file, which is left as it is.
    output = tmp_path / "results.csv"
    kwargs = dict(planted=TINY, n_jobs=1, n_test=50, progress=False, output=output)
    recovery_sweep(_learners(), n_samples=[100], seeds=[0], **kwargs)
    with output.open("a") as file:
        file.write('"{""estimator"": ""Multi')  # a row cut short
    damaged = output.read_bytes()
    with pytest.raises(ValueError, match=f"{output}.*cut short"):
        recovery_sweep(_learners(), n_samples=[100], seeds=[0, 1], **kwargs)
    assert output.read_bytes() == damaged


def test_learner_parameters_follow_the_planted_layer():
    results = recovery_sweep(
        {"phased": MultiHeadAttentionRegressor(n_heads="planted")},
        n_samples=300,
        planted={**TINY, "n_heads": [1, 2], "n_outputs": 12},
        n_jobs=1,
        n_test=50,
        progress=False,
    )
    assert list(results["n_heads_fitted"]) == [1, 2]


def test_a_sweep_plants_low_rank_heads_on_embedded_words():
    # the axes of the recovery map (benchmarks/recovery_map/recovery_map.toml):
    # the planted heads' rank, passed on to the learner, and words with positions
    results = recovery_sweep(
        {"phased": MultiHeadAttentionRegressor(n_heads="planted", head_rank="planted")},
        n_samples=300,
        planted={
            **TINY,
            "n_features": 6,
            "n_outputs": 6,
            "head_rank": [1, 2],
            "distribution": "vocabulary",
        },
        n_jobs=1,
        n_test=50,
        progress=False,
    )
    assert list(results["head_rank"]) == [1, 2]
    assert set(results["status"]) == {"ok"}, list(results["error"])
    assert list(results["distribution"]) == ["vocabulary"] * 2


@pytest.mark.parametrize(
    "seeds, expected",
    [
        (3, [0, 1, 2]),  # an int is a count, as in a TOML config
        (np.int64(2), [0, 1]),
        (range(5), [0, 1, 2, 3, 4]),
        (range(2, 4), [2, 3]),
        ([7], [7]),  # one seed
        ((4, 1), [4, 1]),
        (np.arange(2), [0, 1]),
        ((s for s in (5, 6)), [5, 6]),
    ],
)
def test_seeds_is_a_count_or_an_iterable_of_seeds(seeds, expected):
    grid = _sweep._check_grid(_learners(), TINY, [100], [0.0], seeds)
    assert grid["seed"] == expected
    cells = _sweep._expand(_learners(), grid)
    assert sorted({c["seed"] for c in cells}) == sorted(expected)
    assert all(type(c["seed"]) is int for c in cells)


def test_a_sweep_takes_a_range_of_seeds():
    results = recovery_sweep(
        {"gradient": GradientAttentionRegressor(n_heads="planted", max_iter=10)},
        n_samples=100,
        planted=TINY,
        seeds=range(1, 3),
        n_jobs=1,
        n_test=20,
        progress=False,
    )
    assert list(results["seed"]) == [1, 2] and set(results["status"]) == {"ok"}


def test_rows_record_the_precision_reached_and_why_the_fit_stopped():
    learners = {
        "phased": MultiHeadAttentionRegressor(n_heads="planted"),
        "gradient": GradientAttentionRegressor(n_heads="planted"),
        "own_tol": GradientAttentionRegressor(n_heads="planted", tol=1e-4),
        "capped": GradientAttentionRegressor(n_heads="planted", max_iter=3),
        "phases": MultiHeadAttentionRegressor(n_heads="planted", polish=False),
    }
    results = recovery_sweep(
        learners, n_samples=200, planted=TINY, n_jobs=1, n_test=50, progress=False
    ).set_index("learner")
    errors = results[["attention_error", "projection_error"]].max(axis=1)
    np.testing.assert_array_equal(results["precision"], errors)
    assert (results["success"] == (results["precision"] <= 1e-6)).all()
    assert results["stop_reason"].to_dict() == {
        "phased": "tol",  # the polish's step tolerance
        "gradient": "no_progress",  # tol=0 in a sweep: to the rounding floor
        "own_tol": "tol",
        "capped": "max_iter",
        "phases": "no_polish",
    }
    assert results["learner_tol"].to_dict() == {
        "phased": 1e-10,
        "gradient": 0.0,  # the default tol, tightened by the sweep
        "own_tol": 1e-4,  # set by the user: kept
        "capped": 0.0,
        "phases": 1e-10,
    }
    # run to its floor, the gradient baseline reaches the phased learner's precision
    assert results.loc["gradient", "precision"] < 1e-12
    assert results.loc["gradient", "success"] and results.loc["phased", "success"]
    assert results.loc["own_tol", "precision"] > 1e-6
    assert "max_iter" in results.loc["capped", "warnings"]


def test_tighten_tol_false_keeps_the_learners_defaults():
    results = recovery_sweep(
        {"gradient": GradientAttentionRegressor(n_heads="planted")},
        n_samples=200,
        planted=TINY,
        seeds=2,
        tighten_tol=False,
        n_jobs=1,
        n_test=50,
        progress=False,
    )
    assert (results["learner_tol"] == 1e-6).all()
    assert (results["stop_reason"] == "tol").all()
    # the default gradient tolerance stops near 1e-6 parameter error, far above
    # the floor the sweep's tol=0 reaches
    assert (results["precision"] > 1e-10).all()


def test_a_result_file_of_another_version_is_refused(tmp_path, monkeypatch):
    output = tmp_path / "results.csv"
    old_columns = [c for c in _sweep.COLUMNS if c != "precision"]
    row = dict.fromkeys(old_columns, 0)  # a well-formed row of the older layout
    row.update(
        cell_id=json.dumps({"learner": "phased", "seed": 0}),
        learner="phased",
        status="ok",
    )
    pd.DataFrame([row]).to_csv(output, index=False)
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    with pytest.raises(ValueError, match=r"another version of skattn.*'precision'"):
        recovery_sweep(_learners(), n_samples=100, output=output, progress=False)


# -- bad input: a clear error before any fit starts ------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"planted": {"n_head": 2}}, r"unknown key\(s\) \['n_head'\]"),
        ({"n_samples": [100, -1]}, "n_samples must hold positive ints"),
        ({"seeds": []}, "seeds is an empty list"),
        ({"seeds": 0}, r"seeds=0: an int is the number of seeds .* seeds=\[0\]"),
        ({"seeds": [0, -1]}, "seeds must hold non-negative ints, got -1"),
        ({"seeds": [1, 2, 1]}, r"seeds holds \[1\] more than once"),
        ({"seeds": "0"}, "seeds must be a number of seeds"),
        ({"seeds": 1.5}, "seeds must be a number of seeds"),
        ({"seeds": [0.5]}, "seeds must hold non-negative ints"),
        ({"noise": [-0.1]}, "noise must hold non-negative numbers"),
        ({"tighten_tol": "yes"}, "tighten_tol must be True or False"),
        (
            {"learners": {"x": MultiHeadAttentionRegressor(max_rows="planted")}},
            "max_rows='planted'",
        ),
        ({"learners": {"x": object()}}, "must be a scikit-learn estimator"),
        ({"output": "results.txt"}, r"must end in \.csv or \.parquet"),
        ({"output": "/no/such/folder/results.csv"}, "does not exist"),
        (
            {"learners": {"g": GradientAttentionRegressor(max_iter="many")}},
            r"learners\['g'\] \(in the cells of n_tokens=4\): The 'max_iter' "
            r"parameter of GradientAttentionRegressor must be an int",
        ),
        (
            {"learners": {"p": MultiHeadAttentionRegressor(polish_tol=-1.0)}},
            r"learners\['p'\] .*The 'polish_tol' parameter",
        ),
        (
            {"planted": {"distribution": "uniform"}},
            r"planted\['distribution'\]='uniform': The 'distribution' parameter of "
            r"make_attention_regression must be",
        ),
        (
            {"planted": {"attention_scale": [1.0, -1.0]}},
            r"planted\['attention_scale'\]=-1.0: The 'attention_scale' parameter",
        ),
        ({"planted": {"attention_scale": True}}, "not a boolean"),
        ({"planted": {"structure": "sparse"}}, r"planted\['structure'\]='sparse'"),
        ({"planted": {"n_heads": True}}, "must hold positive integers"),
        ({"seeds": [2**40]}, "seeds must hold ints up to 4294967295"),
        ({"n_jobs": 0}, "n_jobs must be a non-zero integer"),
        ({"retry_failed": "yes"}, "retry_failed must be True or False"),
    ],
)
def test_bad_input_is_refused_before_any_fit(monkeypatch, kwargs, match):
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    args = {"learners": _learners(), "n_samples": 100, "progress": False, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        recovery_sweep(**args)


def test_a_planted_layer_is_drawn_once_before_any_fit(monkeypatch):
    # each value is valid, the layer they make is not: a distribution of 3 features
    from skattn.datasets._distributions import BooleanTokens

    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    planted = {"n_tokens": 4, "n_features": 4, "distribution": BooleanTokens(4, 3)}
    with pytest.raises(ValueError, match=r"the planted layer \{.*\} is invalid: "):
        recovery_sweep(_learners(), n_samples=100, planted=planted, progress=False)


def test_the_learners_are_checked_in_every_planted_cell(monkeypatch):
    # a placeholder is filled in per cell before the learner validates its parameters
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    learner = MultiHeadAttentionRegressor(n_heads="planted", max_heads="planted")
    with pytest.raises(ValueError, match="max_heads='planted'"):
        recovery_sweep({"p": learner}, n_samples=100, progress=False)
    # parameters that are valid for every cell pass, and then the fits start
    with pytest.raises(AssertionError, match="a fit started"):
        recovery_sweep(
            {"p": MultiHeadAttentionRegressor(n_heads="planted", polish_tol=1e-8)},
            n_samples=100,
            planted={"n_heads": [1, 2], "n_tokens": 2},
            n_jobs=1,
            progress=False,
        )


def test_an_unreadable_output_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    output = tmp_path / "results.csv"
    output.write_text("not,a,sweep\n1,2,3\n")
    with pytest.raises(ValueError, match="not a sweep's result file"):
        recovery_sweep(_learners(), n_samples=100, output=output, progress=False)
    broken = tmp_path / "results.parquet"
    broken.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot be read as parquet"):
        recovery_sweep(_learners(), n_samples=100, output=broken, progress=False)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes anywhere"
)
def test_a_read_only_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="is not writable"):
            recovery_sweep(
                _learners(), n_samples=100, output=folder / "r.csv", progress=False
            )
    finally:
        folder.chmod(0o700)


def test_a_scheduler_that_does_not_answer_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setattr(_sweep, "_run_cell", _no_fit)
    monkeypatch.setattr(_sweep, "_SCHEDULER_TIMEOUT", 1)
    output = tmp_path / "results.csv"
    with pytest.raises(ValueError, match="did not answer within 1 s"):
        recovery_sweep(
            _learners(),
            n_samples=100,
            output=output,
            scheduler="tcp://127.0.0.1:9",
            progress=False,
        )
    assert not output.exists()


def test_missing_pandas_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"skattn\[sweep\]"):
        recovery_sweep(_learners(), n_samples=100, progress=False)


def test_missing_distributed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)
    with pytest.raises(ImportError, match=r"skattn\[dask\]"):
        recovery_sweep(
            _learners(), n_samples=100, scheduler="tcp://127.0.0.1:9", progress=False
        )


# -- the TOML config and `skattn sweep` ------------------------------------------


# -- at scale: >= 100 fits on a LocalCluster, interrupted and resumed -------------

SWEEP_SCRIPT = """
import sys
from skattn import GradientAttentionRegressor, MultiHeadAttentionRegressor
from skattn.experiments import recovery_sweep

recovery_sweep(
    {{
        "phased": MultiHeadAttentionRegressor(n_heads="planted"),
        "gradient": GradientAttentionRegressor(n_heads="planted", max_iter=10),
    }},
    n_samples={n_samples},
    planted={planted},
    seeds={seeds},
    output=sys.argv[1],
    n_jobs=1,
    n_test=50,
    progress=False,
)
"""


def _rows_in(path):
    if not path.exists():
        return 0
    return max(path.read_bytes().count(b"\n") - 1, 0)


def test_sweep_on_a_local_cluster_resumes_after_a_kill(tmp_path):
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    n_samples, seeds = [100, 200, 400], list(range(10))
    planted = {**TINY, "attention_scale": [1.0, 2.0]}
    n_cells = 2 * 3 * 2 * len(seeds)  # learners x n_samples x scales x seeds = 120
    output = tmp_path / "results.csv"
    script = tmp_path / "sweep.py"
    script.write_text(
        textwrap.dedent(
            SWEEP_SCRIPT.format(n_samples=n_samples, planted=planted, seeds=seeds)
        )
    )
    # A real interruption: the sweep runs in another process, killed mid-way.
    process = subprocess.Popen([sys.executable, str(script), str(output)])
    try:
        deadline = time.monotonic() + 120
        while _rows_in(output) < 10 and time.monotonic() < deadline:
            assert process.poll() is None, "the sweep ended before it was killed"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    before = _sweep._ResultFile(output).frame  # every row written before the kill
    n_done = len(before)
    assert 10 <= n_done < n_cells

    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, dashboard_address=None
    ) as cluster:
        results = recovery_sweep(
            {
                "phased": MultiHeadAttentionRegressor(n_heads="planted"),
                "gradient": GradientAttentionRegressor(n_heads="planted", max_iter=10),
            },
            n_samples=n_samples,
            planted=planted,
            seeds=seeds,
            output=output,
            scheduler=cluster.scheduler_address,
            n_test=50,
            progress=False,
        )
    assert len(results) == n_cells and results["cell_id"].is_unique
    assert results.attrs["n_fitted"] == n_cells - n_done  # no fit done twice
    on_disk = pd.read_csv(output)
    assert len(on_disk) == n_cells and on_disk["cell_id"].is_unique
    assert set(before["cell_id"]) <= set(on_disk["cell_id"])
    assert set(results["status"]) == {"ok"}
    curves = SweepCurveDisplay.from_results(results[results.attention_scale == 2.0])
    assert sorted(curves.lines_) == ["gradient", "phased"]
    diagram = PhaseDiagramDisplay.from_results(
        results, y="attention_scale", learner="phased"
    )
    assert diagram.table.shape == (2, 3) and np.all(np.isfinite(diagram.table))
