"""Phases 2 and 4 on planted layers: the constraints, the affine hull and the
rounds of ``sculpt_hull`` (``phased/_affine_hull.py``)."""

import warnings

import numpy as np
import pytest
from _helpers import phased_planted as _plant
from _helpers import relative as _rel

from skattn import MultiHeadAttentionRegressor
from skattn.phased import (
    crude_projection_sum,
    hull_span,
    refine_projection_sum,
    sculpt_hull,
)
from skattn.phased._affine_hull import (
    _DENSE_HULL_MAX_FEATURES,
    _reweighted_stats,
    fit_affine_hull,
    hull_constraints,
    hull_distance,
)


def test_single_head_hull_is_exact():
    X, Y, theta, W = _plant(2000, 3, 5, 1, d_out=6, distribution="gaussian")
    stats, info = hull_constraints(X, Y, W[0], tol=1e-6)
    (point, directions), hinfo = fit_affine_hull(stats, 1)
    assert directions.shape == (0, 5, 5)
    np.testing.assert_allclose(point, theta[0], atol=1e-8)
    assert hinfo["rms_residual"] < 1e-8
    assert hinfo["augmented_gap_ratio"] > 1e6


@pytest.mark.parametrize(
    "distribution, k, bound",
    [("boolean", 4, 0.12), ("gaussian", 2, 0.05)],
)
def test_hull_given_exact_projection_sum(distribution, k, bound):
    # Measured over 3 seeds: 0.065-0.068 (Boolean, k=4), 0.009-0.012 (Gaussian, k=2).
    X, Y, theta, W = _plant(20000, k, 8, 2, d_out=16, distribution=distribution)
    stats, info = hull_constraints(X, Y, W.sum(0), tol=0.03)
    (point, directions), hinfo = fit_affine_hull(stats, 2)
    assert directions.shape == (1, 8, 8)
    np.testing.assert_allclose(
        np.einsum("iab,jab->ij", directions, directions), np.eye(1), atol=1e-10
    )
    assert np.max(hull_distance(theta, point, directions)) < bound
    assert hinfo["gap_ratio"] > 3
    assert info["n_rows_used"] == stats["n_rows"] <= 20000
    # Phase 5: the span of the hull holds both heads.
    basis, sinfo = hull_span(point, directions)
    assert sinfo["rank"] == 2
    flat = basis.reshape(2, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(2), atol=1e-10)
    resid = theta.reshape(2, -1) - (theta.reshape(2, -1) @ flat.T) @ flat
    assert np.max(np.linalg.norm(resid, axis=1) / np.linalg.norm(theta[0])) < bound


def test_constraint_statistics_do_not_depend_on_batch_size():
    X, Y, _, W = _plant(3000, 4, 6, 2, d_out=12)
    a, _ = hull_constraints(X, Y, W.sum(0), tol=0.1, batch_size=3000)
    b, _ = hull_constraints(X, Y, W.sum(0), tol=0.1, batch_size=700)
    np.testing.assert_allclose(a["normal"], b["normal"], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(a["rhs"], b["rhs"], rtol=1e-10, atol=1e-10)
    assert a["n_equations"] == b["n_equations"]


def test_max_rows_bounds_the_rows_used():
    X, Y, _, W = _plant(2000, 3, 5, 1, d_out=6, distribution="gaussian")
    stats, info = hull_constraints(X, Y, W[0], tol=1e-6, max_rows=500)
    assert info["n_certified"] == 6000
    assert info["n_rows_used"] == stats["n_rows"] == 500


def test_huber_point_matches_least_squares_on_clean_rows():
    X, Y, theta, W = _plant(1500, 3, 4, 1, d_out=6, distribution="gaussian")
    stats, _ = hull_constraints(X, Y, W[0], tol=1e-6)
    (point, _), info = fit_affine_hull(stats, 1, method="huber")
    assert info["method"] == "huber"
    np.testing.assert_allclose(point, theta[0], atol=1e-4)


@pytest.mark.parametrize(
    "distribution, k, base_min, conf_max, reweight_max",
    [("boolean", 2, 0.04, 0.025, 0.015), ("boolean", 4, 0.15, 0.15, 0.1)],
)
def test_confidence_weights_and_reweighting_sharpen_the_hull(
    distribution, k, base_min, conf_max, reweight_max
):
    # Measured over 3 seeds (exact W_sum, tol=0.1): k=2 base 0.066-0.099, with
    # confidence_floor=0.03 0.008-0.012, plus reweight_iter=3 0.007-0.008; k=4
    # base 0.18-0.20, 0.11-0.13, 0.073-0.080.  The gap ratio grows with each.
    X, Y, theta, W = _plant(10000, k, 8, 2, d_out=16, distribution=distribution)
    errors, gaps = [], []
    for floor, n_iter in ((None, 0), (0.03, 0), (0.03, 3)):
        stats, _ = hull_constraints(
            X, Y, W.sum(0), tol=0.1, confidence_floor=floor, keep_rows=n_iter > 0
        )
        (point, directions), hinfo = fit_affine_hull(stats, 2, reweight_iter=n_iter)
        errors.append(np.max(hull_distance(theta, point, directions)))
        gaps.append(hinfo["augmented_gap_ratio"])
        assert hinfo["reweight_iter"] == n_iter
    assert errors[0] > base_min
    assert errors[1] < conf_max
    assert errors[2] < reweight_max
    assert gaps[0] < gaps[1] < gaps[2]


def test_kept_rows_rebuild_the_statistics():
    X, Y, _, W = _plant(3000, 4, 6, 2, d_out=12)
    plain, _ = hull_constraints(X, Y, W.sum(0), tol=0.1)
    stats, _ = hull_constraints(X, Y, W.sum(0), tol=0.1, keep_rows=True)
    np.testing.assert_array_equal(stats["normal"], plain["normal"])
    rows = stats["rows"]
    L = rows["p"].shape[0]
    assert 0 < L <= stats["n_rows"]
    assert rows["tokens"].shape == (L, 4, 6) and rows["x_row"].shape == (L, 6)
    assert rows["omega"].shape == (L, 4)
    np.testing.assert_array_equal(rows["row_weight"], 1.0)
    assert np.all((rows["omega"] > 0).sum(axis=1) >= 2)  # rows that give equations
    # The kept rows alone give the same normal matrix (rows without equations
    # contribute nothing), so reweighting starts from the same hull.
    again = _reweighted_stats(stats, np.ones(L))
    np.testing.assert_allclose(again["normal"], plain["normal"], rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(again["rhs"], plain["rhs"], rtol=1e-10, atol=1e-9)
    (p0, d0), _ = fit_affine_hull(plain, 2)
    (p1, d1), _ = fit_affine_hull(stats, 2, reweight_iter=0)
    np.testing.assert_array_equal(p0, p1)


def test_sculpt_hull_with_confidence_weights():
    # Measured over 3 seeds (n=1e4, k=2, m=2): default 0.011-0.014,
    # confidence_floor=0.03 0.006-0.008 with a 2.5-3.5x larger gap ratio.
    X, Y, theta, _ = _plant(10000, 2, 8, 2, d_out=16)
    results = [
        sculpt_hull(X, Y, 2, random_state=0, confidence_floor=floor)
        for floor in (None, 0.03)
    ]
    errors = [np.max(hull_distance(theta, r[1], r[2])) for r in results]
    assert errors[1] < 0.01
    assert errors[1] < 0.75 * errors[0]
    assert results[1][3]["augmented_gap_ratio"] > results[0][3]["augmented_gap_ratio"]


def test_single_head_stays_exact_with_confidence_and_reweighting():
    X, Y, theta, W = _plant(2000, 3, 5, 1, d_out=6, distribution="gaussian")
    stats, _ = hull_constraints(
        X, Y, W[0], tol=1e-6, confidence_floor=0.03, keep_rows=True
    )
    (point, _), _ = fit_affine_hull(stats, 1, reweight_iter=2)
    np.testing.assert_allclose(point, theta[0], atol=1e-8)


def test_confidence_options_are_validated():
    X, Y, _, W = _plant(500, 3, 4, 1, d_out=6)
    with pytest.raises(ValueError, match="confidence_floor must be"):
        hull_constraints(X, Y, W[0], tol=0.1, confidence_floor=0.0)
    stats, _ = hull_constraints(X, Y, W[0], tol=0.1)
    with pytest.raises(ValueError, match="keep_rows=True"):
        fit_affine_hull(stats, 1, reweight_iter=1)
    with pytest.raises(ValueError, match="reweight_iter must be"):
        fit_affine_hull(stats, 1, reweight_iter=-1)


def test_sculpt_hull_does_not_depend_on_batch_size():
    X, Y, _, _ = _plant(10000, 4, 8, 2, d_out=16)
    W_a, point_a, dirs_a, _ = sculpt_hull(X, Y, 2, batch_size=4096)
    W_b, point_b, dirs_b, _ = sculpt_hull(X, Y, 2, batch_size=1000)
    np.testing.assert_allclose(W_b, W_a, rtol=0, atol=1e-12)
    np.testing.assert_allclose(point_b, point_a, rtol=0, atol=1e-12)
    # the hull directions are defined up to sign: compare their projectors
    flat_a, flat_b = dirs_a.reshape(len(dirs_a), -1), dirs_b.reshape(len(dirs_b), -1)
    np.testing.assert_allclose(flat_b.T @ flat_b, flat_a.T @ flat_a, atol=1e-12)


@pytest.mark.parametrize("solver", ["dense", "matrix-free"])
def test_sculpt_hull_rounds_are_the_public_phases_with_a_pass_fewer(
    monkeypatch, solver
):
    # Each round is refine_projection_sum then hull_constraints and
    # fit_affine_hull; sculpt_hull makes a round's first phase-3 pass from the
    # previous round's phase-2 scan (the same W_sum): the same numbers, one
    # certification pass over the samples fewer per round after the first.
    from skattn.phased import _affine_hull, _projection_sum

    X, Y, _, _ = _plant(6000, 4, 8, 2, d_out=16)
    W0, _ = crude_projection_sum(X, Y)
    certified = []
    for module in (_affine_hull, _projection_sum):
        original = module._certify_batch

        def spy(X, *args, original=original):
            certified.append(len(X))
            return original(X, *args)

        monkeypatch.setattr(module, "_certify_batch", spy)
    options = dict(solver=solver, random_state=0)
    W_sum, point, dirs, info = sculpt_hull(
        X,
        Y,
        2,
        W_sum=W0,
        tol=0.3,
        tol_final=0.12,
        n_rounds=3,
        refine_iter=3,
        **options,
    )
    tols = [round_info["tol"] for round_info in info["rounds"]]
    assert len(tols) == 3
    fused = sum(certified)
    certified.clear()
    W, start = W0, None
    for r, tol in enumerate(tols):
        W, _ = refine_projection_sum(X, Y, W, tol=tol, max_iter=3)
        stats, _ = hull_constraints(X, Y, W, tol=tol, **options)
        (p, D), hinfo = fit_affine_hull(stats, 2, start=start)
        start = np.concatenate([p[None], D])
        round_info = info["rounds"][r]
        assert round_info["augmented_gap_ratio"] == hinfo["augmented_gap_ratio"]
        assert round_info["n_equations"] == hinfo["n_equations"]
        if r == info["best_round"]:
            np.testing.assert_array_equal(point, p)
            np.testing.assert_array_equal(dirs, D)
    np.testing.assert_array_equal(W_sum, W)
    assert fused == sum(certified) - (len(tols) - 1) * len(X)


def test_sculpt_hull_two_heads():
    X, Y, theta, W = _plant(20000, 4, 8, 2, d_out=16)
    W_sum, point, directions, info = sculpt_hull(X, Y, 2)
    # Measured over 3 seeds: W_sum 0.007-0.022, hull 0.07-0.12.
    assert _rel(W_sum, W.sum(0)) < 0.05
    assert np.max(hull_distance(theta, point, directions)) < 0.2
    assert info["n_heads"] == 2 and info["n_rounds"] == len(info["rounds"]) == 5
    tols = [r["tol"] for r in info["rounds"]]
    assert tols[0] == pytest.approx(0.3) and tols[-1] == pytest.approx(0.02)


@pytest.mark.parametrize("m", [1, 2])
def test_sculpt_hull_auto_counts_heads(m):
    X, Y, theta, W = _plant(20000, 2, 8, m, d_out=16, distribution="gaussian")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, point, directions, info = sculpt_hull(X, Y, "auto")
    assert info["n_heads"] == m
    assert directions.shape == (m - 1, 8, 8)
    assert np.max(hull_distance(theta, point, directions)) < 0.05


def test_too_few_certified_rows_names_the_tolerance():
    X, Y, _, W = _plant(2000, 4, 8, 2, d_out=16)
    with pytest.raises(ValueError, match=r"tol=1e-06.*or pass about \d+ samples"):
        stats, _ = hull_constraints(X, Y, W.sum(0), tol=1e-6)
        fit_affine_hull(stats, 2)
    with pytest.raises(ValueError, match="relax tol"):
        refine_projection_sum(X, Y, W.sum(0), tol=1e-6)


def test_sculpt_hull_stops_early_with_a_warning():
    X, Y, _, W = _plant(4000, 4, 8, 2, d_out=16)
    with pytest.warns(UserWarning, match="set tol_final"):
        W_sum, _, _, info = sculpt_hull(X, Y, 2, tol=0.3, tol_final=1e-4)
    assert info["stopped_early"]
    assert info["n_rounds"] < 5


def test_auto_solver_follows_the_crossover():
    d_big = _DENSE_HULL_MAX_FEATURES + 1
    for d, dense in ((_DENSE_HULL_MAX_FEATURES, True), (d_big, False)):
        X, Y, _, W = _plant(300, 3, d, 1, distribution="gaussian")
        stats, _ = hull_constraints(X, Y, W[0], tol=1e-6)
        assert (stats["normal"] is not None) == dense
        assert ("constraints" in stats) != dense


def test_solver_is_validated():
    X, Y, _, W = _plant(300, 3, 4, 1, d_out=6)
    with pytest.raises(ValueError, match="solver must be"):
        hull_constraints(X, Y, W[0], tol=0.1, solver="sparse")
    est = MultiHeadAttentionRegressor(n_heads=1, n_tokens=3, hull_solver="sparse")
    with pytest.raises(ValueError, match="hull_solver"):
        est.fit(X.reshape(300, -1), Y.reshape(300, -1))


def test_skattn_imports_and_fits_without_cvxpy():
    # GPU machines often lack cvxpy: only hull_method="huber" needs it
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        sys.modules["cvxpy"] = None  # import cvxpy raises ImportError
        from skattn import MultiHeadAttentionRegressor, make_attention_regression
        X, y = make_attention_regression(2000, 3, 4, 1, n_outputs=6, random_state=0)
        for init in ("random", "phased"):
            est = MultiHeadAttentionRegressor(n_tokens=3, init=init, random_state=0)
            assert est.fit(X, y).score(X, y) > 1 - 1e-12, init
        huber = MultiHeadAttentionRegressor(
            n_tokens=3, init="phased", hull_method="huber", random_state=0
        )
        try:
            huber.fit(X, y)
        except ImportError as exc:
            assert "pip install cvxpy" in str(exc), exc
        else:
            raise AssertionError("hull_method='huber' ran without cvxpy")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
