"""MultiHeadAttentionRegressor: where the polish starts, low-rank heads, solvers."""

import warnings

import numpy as np
import pytest

from skattn import (
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
)
from skattn.phased import CertificationError, CertificationWarning


def _data(n=3000, k=4, d=6, m=2, head_rank=None, distribution="boolean", seed=0):
    return make_attention_regression(
        n,
        k,
        d,
        m,
        n_outputs=2 * d,
        distribution=distribution,
        head_rank=head_rank,
        random_state=seed,
        return_layer=True,
    )


def _starts(est):
    return [r for r in est.phase_report_ if r.phase == "0-start"]


def test_fallback_when_phases_cannot_certify():
    # a certification tolerance no row can meet: phases 2-4 fail
    X, y, layer = _data()
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, certify_tol=1e-9, certify_tol_final=1e-9, random_state=0
    )
    with pytest.warns(CertificationWarning, match="random starts instead"):
        est.fit(X, y)
    starts = _starts(est)
    assert [s["init"] for s in starts] == ["phased", "random"]
    assert "phases 2-4 failed" in starts[-1]["reason"]
    polish = est.phase_report_[-1]
    assert polish.phase == "6-polish" and polish["n_starts_run"] >= 1
    errors = parameter_error(layer, est)
    assert errors.attention_error < 1e-8 and errors.projection_error < 1e-8
    assert est.hull_point_ is None and est.n_iter_ == 0


def test_init_phased_keeps_raising():
    X, y, _ = _data()
    est = MultiHeadAttentionRegressor(
        n_heads=2,
        n_tokens=4,
        certify_tol=1e-9,
        certify_tol_final=1e-9,
        init="phased",
        random_state=0,
    )
    with pytest.raises(CertificationError, match="certify_tol"):
        est.fit(X, y)


def test_init_random_skips_the_phases():
    X, y, layer = _data(distribution="gaussian")
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, init="random", random_state=0
    ).fit(X, y)
    assert [r.phase for r in est.phase_report_] == ["0-start", "6-polish"]
    assert parameter_error(layer, est).attention_error < 1e-8


def test_init_random_needs_the_polish():
    X, y, _ = _data(n=200)
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, init="random", polish=False
    )
    with pytest.raises(ValueError, match="init='random' needs polish=True"):
        est.fit(X, y)


def test_auto_init_skips_phases_when_d_out_is_below_k():
    X, y, layer = make_attention_regression(
        2000, 6, 4, 1, n_outputs=4, random_state=0, return_layer=True
    )
    est = MultiHeadAttentionRegressor(n_heads=1, n_tokens=6, random_state=0)
    with pytest.warns(UserWarning, match="Phases 1-5 of Chen & Li were skipped"):
        est.fit(X, y)
    assert _starts(est)[0]["init"] == "random"
    assert "n_outputs_per_token >= n_tokens" in _starts(est)[0]["reason"]
    assert parameter_error(layer, est).attention_error < 1e-8


def test_low_rank_heads_recovered_with_factors():
    X, y, layer = _data(n=3000, d=8, m=2, head_rank=2, distribution="gaussian")
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, head_rank=2, random_state=0
    ).fit(X, y)
    errors = parameter_error(layer, est)
    assert errors.attention_error < 1e-8 and errors.projection_error < 1e-8
    query, key, value, output = est.factors_
    assert query.shape == key.shape == value.shape == (2, 8, 2)
    assert output.shape == (2, 2, 16)
    theta = query @ np.swapaxes(key, 1, 2)
    np.testing.assert_allclose(theta, est.attention_, atol=1e-12)
    np.testing.assert_allclose(value @ output, est.projection_, atol=1e-8)
    polish = [r for r in est.phase_report_ if r.phase == "6-polish"][-1]
    assert polish["solver"] == "matrix-free" and polish["n_products"] > 0


def test_head_rank_needs_integer_n_heads():
    X, y, _ = _data(n=300)
    est = MultiHeadAttentionRegressor(n_heads="auto", n_tokens=4, head_rank=2)
    with pytest.raises(ValueError, match="head_rank needs an integer n_heads"):
        est.fit(X, y)


@pytest.mark.parametrize("solver", ["dense", "matrix-free"])
def test_polish_solver_is_used_and_reported(solver):
    X, y, layer = _data(n=2000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        est = MultiHeadAttentionRegressor(
            n_heads=2, n_tokens=4, polish_solver=solver, random_state=0
        ).fit(X, y)
    polish = est.phase_report_[-1]
    assert polish.phase == "6-polish" and polish["solver"] == solver
    assert parameter_error(layer, est).attention_error < 1e-8


def test_whitening_map_is_exact_and_whitens():
    from skattn.layer._math import forward
    from skattn.solvers import whitening_map
    from skattn.solvers._polish import _unwhiten

    rng = np.random.default_rng(0)
    scales = np.array([5.0, 1.0, 0.2, 0.05])
    X = rng.normal(size=(400, 3, 4)) * scales + [1.0, 0.0, 0.0, 0.0]
    A, condition = whitening_map(X)
    Z = (X @ A).reshape(-1, A.shape[1])
    np.testing.assert_allclose(Z.T @ Z / len(Z), np.eye(4), atol=1e-10)
    assert condition > 1e3
    # a layer on the whitened tokens, mapped back, has the same outputs
    theta, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 3))
    back_theta, back_W = _unwhiten(theta, W, A)
    np.testing.assert_allclose(
        forward(X, back_theta, back_W), forward(X @ A, theta, W), atol=1e-10
    )


def test_whitening_drops_the_directions_tokens_do_not_reach():
    from skattn.solvers import whitening_map

    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 3, 5))
    X -= X.mean(axis=2, keepdims=True)  # a LayerNorm's hyperplane
    A, _ = whitening_map(X)
    assert A.shape == (5, 4)


def _anisotropic_data(seed=0):
    # Gaussian tokens stretched along coordinates (condition number ~ 1e3) and
    # offset from the origin: the polish is slow on them unless whitened
    rng = np.random.default_rng(seed)
    X, y, layer = make_attention_regression(
        3000,
        4,
        6,
        2,
        n_outputs=12,
        distribution="gaussian",
        random_state=seed,
        return_layer=True,
    )
    T = np.diag([4.0, 2.0, 1.0, 0.5, 0.25, 0.12]) + 0.3 * rng.normal(size=(6, 6))
    X = (X.reshape(-1, 4, 6) @ T + 0.5).reshape(len(X), -1)
    return X, layer.transform(X), layer


@pytest.mark.parametrize("whiten", ["auto", True, False])
def test_whiten_is_recorded_and_recovers(whiten):
    X, y, layer = _anisotropic_data()
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, init="random", whiten=whiten, random_state=0
    ).fit(X, y)
    record = [r for r in est.phase_report_ if r.phase == "6-polish"][-1]
    assert record["whitening"]["applied"] is (whiten is not False)
    if whiten is not False:
        assert record["whitening"]["condition"] > 10
    err = parameter_error(layer, est)
    assert max(err.attention_error, err.projection_error) < 1e-8


def test_whiten_auto_leaves_boolean_tokens_alone():
    X, y, layer = _data()
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, init="random", random_state=0
    ).fit(X, y)
    record = [r for r in est.phase_report_ if r.phase == "6-polish"][-1]
    assert record["whitening"]["applied"] is False
    assert record["whitening"]["condition"] < 10


def test_whiten_rejects_unknown_values():
    X, y, _ = _data(n=200)
    with pytest.raises(ValueError, match="whiten"):
        MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, whiten="yes").fit(X, y)
