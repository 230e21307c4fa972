"""skattn.experiments._plot: the displays of a sweep's results."""

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

from skattn.experiments import PhaseDiagramDisplay, SweepCurveDisplay  # noqa: E402


def _fake_results():
    rows = []
    for learner, offset in (("phased", 0.0), ("gradient", 0.5)):
        for n in (100, 1000):
            for scale in (1.0, 2.0):
                for seed in range(4):
                    rows.append(
                        {
                            "learner": learner,
                            "n_samples": n,
                            "attention_scale": scale,
                            "seed": seed,
                            "success": seed < (2 if n == 100 else 4),
                            "attention_error": offset + seed / n,
                        }
                    )
    return pd.DataFrame(rows)


def test_sweep_curve_display_draws_rate_and_error():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    results = _fake_results()
    one_scale = results[results.attention_scale == 1.0]
    display = SweepCurveDisplay.from_results(one_scale)
    np.testing.assert_allclose(display.lines_["phased"].get_ydata(), [0.5, 1.0])
    assert display.ax_.get_yscale() == "linear"
    errors = SweepCurveDisplay.from_results(one_scale, y="attention_error")
    np.testing.assert_allclose(
        errors.lines_["gradient"].get_ydata(), [0.5 + 1.5 / 100, 0.5 + 1.5 / 1000]
    )
    assert errors.ax_.get_yscale() == "log"
    with pytest.raises(ValueError, match=r"vary in \['attention_scale'\]"):
        SweepCurveDisplay.from_results(results)
    with pytest.raises(ValueError, match=r"no column\(s\) \['wall'\]"):
        SweepCurveDisplay.from_results(one_scale, y="wall")


def test_phase_diagram_display_averages_over_seeds():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    results = _fake_results()
    display = PhaseDiagramDisplay.from_results(
        results, y="attention_scale", learner="phased"
    )
    np.testing.assert_allclose(display.table, [[0.5, 1.0], [0.5, 1.0]])
    assert display.x_values == [100, 1000] and display.y_values == [1.0, 2.0]
    with pytest.raises(ValueError, match="pass learner="):
        PhaseDiagramDisplay.from_results(results, y="attention_scale")
    with pytest.raises(ValueError, match="learner='adam' is not in the results"):
        PhaseDiagramDisplay.from_results(results, y="attention_scale", learner="adam")
