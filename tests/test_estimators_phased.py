"""MultiHeadAttentionRegressor: end-to-end recovery, the phases alone, errors."""

import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from skattn import (
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
    prediction_error,
)
from skattn.datasets import sample_inputs


def _planted(m, d=8, k=4, d_out=16, n=20000, distribution="boolean", seed=0, **kw):
    return make_attention_regression(
        n,
        k,
        d,
        m,
        n_outputs=d_out,
        distribution=distribution,
        random_state=seed,
        return_layer=True,
        **kw,
    )


@pytest.mark.parametrize("distribution", ["boolean", "gaussian"])
@pytest.mark.parametrize("m", [1, 2])
def test_exact_recovery_of_planted_layer(m, distribution):
    X, y, layer = _planted(m, distribution=distribution)
    est = MultiHeadAttentionRegressor(
        n_heads=m, n_tokens=4, input_distribution=distribution, random_state=0
    ).fit(X, y)
    errors = parameter_error(layer, est)
    assert errors.attention_error <= 1e-6
    assert errors.projection_error <= 1e-6
    assert est.attention_.shape == (m, 8, 8)
    assert est.projection_.shape == (m, 8, 16)


def test_phases_alone_locate_two_heads():
    """polish=False: the pure phased estimate (net over the sculpted hull)."""
    X, y, layer = _planted(2, n=30000)
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, polish=False, random_state=0
    ).fit(X, y)
    errors = parameter_error(layer, est)
    X_test = sample_inputs("boolean", 2000, 4, 8, random_state=1)
    # measured 0.050 / 0.013 / ~0.01 on this instance
    assert errors.attention_error < 0.15
    assert errors.projection_error < 0.05
    assert prediction_error(layer, est, X_test) < 0.05
    assert [r.phase for r in est.phase_report_ if r.phase.startswith("6")] == ["6-net"]


def test_phase_report_records_every_phase():
    X, y, _ = _planted(2)
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, random_state=0).fit(X, y)
    phases = [r.phase for r in est.phase_report_]
    assert phases[:2] == ["0-start", "1-crude-projection-sum"]
    assert est.phase_report_[0]["init"] == "phased"
    assert phases.count("2-4-certify-refine-hull") == est.n_iter_ == 5
    assert phases[-4:] == ["2-4-hull-selected", "5-span", "6-net", "6-polish"]
    assert all(r.seconds >= 0 for r in est.phase_report_)
    hull = est.phase_report_[-4]
    assert hull["n_heads"] == 2 and hull["augmented_gap_ratio"] > 3
    assert est.projection_sum_.shape == (8, 16)
    assert est.hull_directions_.shape == (1, 8, 8)


@pytest.mark.parametrize("m", [1, 2])
def test_auto_number_of_heads(m):
    X, y, _ = _planted(m, n=30000)
    est = MultiHeadAttentionRegressor(n_heads="auto", n_tokens=4, random_state=0)
    est.fit(X, y)
    assert est.n_heads_ == m
    assert est.attention_.shape[0] == m


def test_auto_finds_three_heads_when_rows_certify():
    """m = 3 needs rows on which three heads agree: k = 2 tokens make them common."""
    X, y, _ = _planted(3, d=8, k=2, d_out=16, n=30000, distribution="gaussian")
    est = MultiHeadAttentionRegressor(n_heads="auto", n_tokens=2, random_state=0)
    est.fit(X, y)
    assert est.n_heads_ == 3


def test_label_noise_gives_prediction_error_of_order_sigma():
    sigma = 0.05
    X, y, layer = _planted(2, noise=sigma)
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, random_state=0).fit(X, y)
    X_test = sample_inputs("boolean", 2000, 4, 8, random_state=1)
    clean = layer.transform(X_test)
    rms = np.sqrt(np.mean((est.predict(X_test) - clean) ** 2))
    assert rms < sigma  # an estimate from 1e4 examples: far below the noise level


def test_zero_weight_examples_are_ignored():
    X, y, layer = _planted(2)
    rng = np.random.default_rng(0)
    y_bad = np.vstack([y, rng.normal(size=(2000, y.shape[1])) * 10])
    X_bad = np.vstack([X, sample_inputs("boolean", 2000, 4, 8, random_state=5)])
    weights = np.r_[np.ones(len(X)), np.zeros(2000)]
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, random_state=0)
    est.fit(X_bad, y_bad, sample_weight=weights)
    errors = parameter_error(layer, est)
    assert max(errors.attention_error, errors.projection_error) <= 1e-6


def test_one_token_is_a_linear_model():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 3))
    W = rng.normal(size=(3, 2))
    est = MultiHeadAttentionRegressor(n_heads=2).fit(X, X @ W)
    np.testing.assert_allclose(est.predict(X), X @ W, atol=1e-10)
    assert est.n_tokens_ == 1 and est.n_iter_ == 0


def test_too_few_outputs_for_phase_two():
    X, y, _ = _planted(1, d=8, k=4, d_out=3, n=500)
    with pytest.raises(ValueError, match="n_outputs_per_token >= n_tokens"):
        MultiHeadAttentionRegressor(n_tokens=4, init="phased").fit(X, y)


def test_warns_when_certification_can_be_ambiguous():
    X, y, _ = _planted(2, d=8, k=4, d_out=8, n=20000)
    with pytest.warns(UserWarning, match=r"d_out > m k"):
        MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, random_state=0).fit(X, y)


def test_boolean_distribution_rejects_real_tokens():
    X, y, _ = _planted(1, n=200, distribution="gaussian")
    est = MultiHeadAttentionRegressor(n_tokens=4, input_distribution="boolean")
    with pytest.raises(ValueError, match="gaussian"):
        est.fit(X, y)


def test_too_few_certified_rows_names_the_tolerance():
    X, y, _ = _planted(2, n=300)
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, certify_tol=1e-4, certify_tol_final=1e-4, init="phased"
    )
    with pytest.raises(
        ValueError, match=r"(certified only|Too few certified).*certify_tol"
    ):
        est.fit(X, y)
    # init="auto" (the default) says the same in a warning and fits from random
    # starts instead
    est.set_params(init="auto", random_state=0)
    with pytest.warns(UserWarning, match=r"(certified only|Too few certified)"):
        est.fit(X, y)
    assert est.phase_report_[-1].phase == "6-polish"


def test_weak_hull_evidence_warns():
    """Three heads on k = 4 tokens: rows where all agree are too rare (measured)."""
    X, y, _ = _planted(3, n=5000)
    est = MultiHeadAttentionRegressor(n_heads=3, n_tokens=4, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.warns(ConvergenceWarning, match="Weak spectral evidence"):
            est.fit(X, y)


def test_bit_identical_refits():
    X, y, _ = _planted(2, n=5000)
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, random_state=3)
    first = est.fit(X, y).predict(X[:50])
    second = est.fit(X, y).predict(X[:50])
    np.testing.assert_array_equal(first, second)


def test_batch_size_only_bounds_memory():
    """The phased estimate (before the polish) does not depend on batch_size."""
    X, y, _ = _planted(2, n=8000)
    fits = [
        MultiHeadAttentionRegressor(
            n_heads=2, n_tokens=4, polish=False, batch_size=b, random_state=0
        ).fit(X, y)
        for b in (4096, 1000)
    ]
    np.testing.assert_allclose(
        fits[0].projection_sum_, fits[1].projection_sum_, rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(
        fits[0].predict(X[:100]), fits[1].predict(X[:100]), rtol=1e-8, atol=1e-10
    )


def test_confidence_floor_sharpens_the_phased_estimate():
    """Residual-weighted rows (opt-in) locate two heads better than equal weights."""
    X, y, layer = _planted(2, n=20000)
    errors = [
        parameter_error(
            layer,
            MultiHeadAttentionRegressor(
                n_heads=2,
                n_tokens=4,
                polish=False,
                confidence_floor=c,
                random_state=0,
            ).fit(X, y),
        ).attention_error
        for c in (None, 0.03)
    ]
    assert errors[1] < errors[0]
