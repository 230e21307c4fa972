"""What each phase reports, and the table of reports (``phased/_report.py``)."""

import numpy as np
import pytest

from skattn.phased import PhaseReport, format_reports


def test_a_report_reads_its_findings_by_key():
    report = PhaseReport("2-hull", 1, 0.5, {"n_rows": 120, "gap_ratio": 7.0})
    assert report["n_rows"] == 120 and report["gap_ratio"] == 7.0
    with pytest.raises(KeyError):
        report["rank"]
    assert PhaseReport("5-span", 0, 0.0).info == {}


def test_summary_shows_scalars_only_and_rounds_floats():
    info = {
        "rank": 2,
        "residual": 1.23456789e-5,
        "spectrum": np.arange(4.0),  # an array: left out
        "hull": {"point": 1},  # a dict: left out
        "solver": "dense",
        "gap": np.float64(12.3456),
    }
    line = PhaseReport("4-hull", 3, 1.23456, info).summary()
    assert line == (
        "4-hull  round 3  1.235 s  rank=2  residual=1.23e-05  solver=dense  gap=12.3"
    )
    assert str(PhaseReport("4-hull", 3, 1.23456, info)) == line
    short = PhaseReport("4-hull", 3, 1.23456, info).summary(max_items=1)
    assert short == "4-hull  round 3  1.235 s  rank=2"
    assert PhaseReport("0-start", 0, 0.0).summary() == "0-start  round 0  0.000 s"


def test_format_reports_is_one_line_per_report():
    reports = [
        PhaseReport("1-crude-projection-sum", 0, 0.25, {"n_samples": 1000}),
        PhaseReport("5-span", 0, 0.001, {"rank": 2}),
    ]
    table = format_reports(reports)
    assert table.splitlines() == [r.summary() for r in reports]
    assert format_reports([]) == ""
