"""Tests of skattn.diagnostics' conditions: the non-degeneracy report of a layer."""

import numpy as np
import pytest

from skattn import AttentionLayer
from skattn.datasets import make_attention_layer
from skattn.diagnostics import (
    THRESHOLDS,
    Condition,
    ConditionReport,
    check_conditions,
    column_shares,
    cosine_matrix,
    diagonal_weights,
    stable_ranks,
)

ALL_NAMES = [
    *THRESHOLDS,
    "pattern_solvable",
    "identifiability",
]


@pytest.mark.parametrize(
    "m, d, d_out, k",
    [(1, 4, 8, 4), (2, 8, 16, 4), (3, 8, 16, 5), (2, 6, 12, 5), (3, 16, 32, 8)],
)
@pytest.mark.parametrize("seed", range(5))
def test_random_planted_layer_passes_when_identifiable(m, d, d_out, k, seed):
    assert d_out > m * k
    layer = make_attention_layer(m, d, n_outputs=d_out, random_state=seed)
    report = check_conditions(layer, n_tokens=k)
    assert report.passed, str(report)
    assert report.failed == []
    assert report.names == ALL_NAMES


@pytest.mark.parametrize("m, k, d_out", [(2, 4, 8), (2, 4, 6), (3, 3, 9), (1, 5, 5)])
def test_identifiability_fails_when_d_out_at_most_mk(m, k, d_out):
    layer = make_attention_layer(m, 8, n_outputs=d_out, random_state=0)
    report = check_conditions(layer, n_tokens=k)
    assert not report.passed
    assert "identifiability" in report.failed
    line = report["identifiability"]
    assert line.value == d_out and line.threshold == m * k and line.relation == ">"
    assert report["pattern_solvable"].passed == (d_out >= k)


def test_pattern_solvable_fails_when_d_out_below_k():
    layer = make_attention_layer(1, 8, n_outputs=3, random_state=0)
    report = check_conditions(layer, n_tokens=4)
    assert {"pattern_solvable", "identifiability"} <= set(report.failed)
    # W_sum is 8 x 3: its 4th singular value does not exist
    assert report["projection_sum_conditioning"].value == 0.0


def test_identical_heads_are_flagged():
    layer = make_attention_layer(2, 6, n_outputs=16, random_state=0)
    th = np.stack([layer.attention[0], layer.attention[0]])
    W = np.stack([layer.projection[0], layer.projection[0]])
    report = check_conditions(AttentionLayer(th, W), n_tokens=3)
    assert not report.passed
    for name in [
        "attention_incoherence",
        "attention_independence",
        "attention_separation",
        "projection_incoherence",
    ]:
        assert name in report.failed
    assert report["attention_incoherence"].value == pytest.approx(1.0)
    assert report["attention_separation"].value == 0.0
    # parallel but of different norms: incoherent, yet separated
    scaled = AttentionLayer(
        np.stack([th[0], 3 * th[0]]), np.stack([W[0], layer.projection[1]])
    )
    report = check_conditions(scaled, n_tokens=3)
    assert "attention_incoherence" in report.failed
    assert report["attention_separation"].passed


def test_degenerate_structures_are_flagged():
    d = 8
    rng = np.random.default_rng(0)
    W = rng.standard_normal((2, d, 20)) / np.sqrt(d)
    u, v = rng.standard_normal((2, d))
    rank_one = AttentionLayer(np.stack([np.outer(u, v), 2 * np.eye(d)]), W)
    report = check_conditions(rank_one, n_tokens=3)
    assert report["attention_stable_rank"].value == pytest.approx(1.0)
    assert report["diagonal_weight"].value == pytest.approx(d)
    assert {"attention_stable_rank", "diagonal_weight"} <= set(report.failed)
    np.testing.assert_allclose(
        report["attention_stable_rank"].per_head, [1.0, d], rtol=1e-10
    )
    one_column = W.copy()
    one_column[1, :, 1:] = 0.0
    weak = W.copy()
    weak[0] *= 0.01
    th = rng.standard_normal((2, d, d))
    report = check_conditions(AttentionLayer(th, one_column), n_tokens=3)
    assert report["projection_column_share"].value == 1.0
    assert "projection_column_share" in report.failed
    assert "projection_stable_rank" in report.failed
    report = check_conditions(AttentionLayer(th, weak), n_tokens=3)
    assert report.failed == ["projection_norm_ratio"]
    assert report["projection_norm_ratio"].value == pytest.approx(
        np.linalg.norm(W[1]) / np.linalg.norm(weak[0])
    )


def test_three_heads_in_a_plane_fail_independence():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 6, 6))
    th = np.stack([a, b, a + b])
    W = rng.standard_normal((3, 6, 40))
    report = check_conditions(AttentionLayer(th, W), n_tokens=3)
    # pairwise cosines stay moderate, yet the three heads span only a plane
    assert report["attention_incoherence"].value < 0.8
    assert report["attention_independence"].value < 1e-6
    assert report.failed == ["attention_independence"]


def test_report_access_and_display():
    layer = make_attention_layer(2, 8, n_outputs=16, random_state=0)
    report = check_conditions(layer, n_tokens=4)
    assert isinstance(report, ConditionReport)
    assert len(report) == len(ALL_NAMES)
    assert all(isinstance(c, Condition) for c in report)
    assert report.identifiability is report["identifiability"]
    with pytest.raises(KeyError, match="no condition named 'nope'"):
        report["nope"]
    with pytest.raises(AttributeError, match="nope"):
        _ = report.nope
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith("Conditions for m=2 heads, d=8, d_out=16, k=4")
    assert lines[-1].startswith("overall: PASS (13/13 passed")
    # aligned: the status column starts at the same offset on every row
    offsets = {line.index("pass") for line in lines[2:-1]}
    assert len(offsets) == 1
    assert "identifiability" in text and "> 8" in text
    frame = report.to_frame()
    assert list(frame.index) == ALL_NAMES
    assert frame.loc["identifiability", "passed"]
    assert "FAIL" in str(check_conditions(layer, n_tokens=8))


def test_n_tokens_from_layer_and_errors():
    layer = make_attention_layer(2, 4, n_outputs=12, random_state=0)
    with_k = AttentionLayer(layer.attention, layer.projection, n_tokens=3)
    assert check_conditions(with_k).n_tokens == 3
    with pytest.raises(ValueError, match="n_tokens is None"):
        check_conditions(layer)
    with pytest.raises(ValueError, match="n_tokens must be a positive integer, got 0"):
        check_conditions(layer, 0)
    with pytest.raises(TypeError, match="layer must be an AttentionLayer"):
        check_conditions(np.zeros((2, 4, 4)), 3)
    bad = layer.attention.copy()
    bad[1, 2, 3] = np.inf
    with pytest.raises(ValueError, match="attention contains 1 NaN or infinite"):
        check_conditions(AttentionLayer(bad, layer.projection), 3)


def test_quantities():
    np.testing.assert_allclose(
        stable_ranks(np.stack([np.eye(3), np.ones((3, 3))])), [3, 1]
    )
    np.testing.assert_allclose(stable_ranks(np.zeros((1, 2, 2))), [0])
    np.testing.assert_allclose(
        diagonal_weights(np.stack([np.eye(3), np.diag([1.0, -1.0, 0.0])])), [3, 0]
    )
    np.testing.assert_allclose(column_shares(np.ones((2, 3, 4))), 0.25)
    cos = cosine_matrix(np.stack([np.eye(2), -np.eye(2), np.zeros((2, 2))]))
    np.testing.assert_allclose(cos, [[1, -1, 0], [-1, 1, 0], [0, 0, 1]])


def test_single_output_column_share_is_vacuous():
    layer = make_attention_layer(1, 4, n_outputs=1, random_state=0)
    report = check_conditions(layer, n_tokens=1)
    assert report["projection_column_share"].value == 1.0
    assert report["projection_column_share"].passed
