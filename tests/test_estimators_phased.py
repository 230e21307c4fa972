"""MultiHeadAttentionRegressor: end-to-end recovery, the phases alone, errors,
where the polish starts, low-rank heads, solvers (``estimators/_phased.py``)."""

import warnings

import numpy as np
import pytest
from _helpers import fail_problems, nudged
from _helpers import refine_planted as planted
from sklearn.exceptions import ConvergenceWarning

from skattn import (
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
    prediction_error,
)
from skattn.datasets import sample_inputs
from skattn.estimators._phased import MIN_HELD_OUT, _check_auto_samples
from skattn.metrics import IdentifiabilityWarning
from skattn.phased import CertificationError, CertificationWarning
from skattn.phased._model_selection import split_indices


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
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=1).fit(X, X @ W)
    np.testing.assert_allclose(est.predict(X), X @ W, atol=1e-10)
    assert est.n_tokens_ == 1 and est.n_iter_ == 0
    # n_tokens left out: the same fit, and a warning that k = 1 was read
    with pytest.warns(IdentifiabilityWarning, match="each row is read as one token"):
        again = MultiHeadAttentionRegressor(n_heads=2).fit(X, X @ W)
    np.testing.assert_allclose(again.predict(X), X @ W, atol=1e-10)


def test_too_few_outputs_for_phase_two():
    X, y, _ = _planted(1, d=8, k=4, d_out=3, n=500)
    with pytest.raises(ValueError, match="n_outputs_per_token >= n_tokens"):
        MultiHeadAttentionRegressor(n_tokens=4, init="phased").fit(X, y)


def test_warns_when_certification_can_be_ambiguous():
    # the phases' estimate is the result (polish=False): warned at the user's line
    X, y, _ = _planted(2, d=8, k=4, d_out=8, n=20000)
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, polish=False, random_state=0
    )
    with pytest.warns(UserWarning, match=r"d_out > m k") as caught:
        est.fit(X, y)
    assert any(w.filename == __file__ for w in caught)


def test_an_exact_polish_makes_the_phases_warnings_notes():
    X, y, _ = _planted(2, d=8, k=4, d_out=8, n=20000)
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.fit(X, y)
    notes = [r.info["notes"] for r in est.phase_report_ if "notes" in r.info]
    assert any("d_out > m k" in note for note in notes[0])


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
    est = MultiHeadAttentionRegressor(
        n_heads=3, n_tokens=4, polish=False, random_state=0
    )
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
    with warnings.catch_warnings():
        # the fit is exact, so skipping the phases is a note, not a warning
        warnings.simplefilter("error")
        est.fit(X, y)
    assert "Phases 1-5 of Chen & Li were skipped" in _starts(est)[0]["notes"][0]
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


def test_auto_heads_needs_ten_held_out_examples():
    X, y, _ = _data(n=3)
    est = MultiHeadAttentionRegressor(n_heads="auto", n_tokens=4, random_state=0)
    with pytest.raises(
        ValueError,
        match=r"n_heads='auto' .*3 sample\(s\) leave 1 held out, too few for its "
        r"paired test \(at least 10\)\. Pass at least 48 samples .*or an integer "
        r"n_heads",
    ):
        est.fit(X, y)
    # the count is the head search's own split, for any validation_fraction
    for fraction in (0.2, 0.5, 0.01, 0.9, 0.999):
        with pytest.raises(ValueError, match="Pass at least") as info:
            _check_auto_samples(3, fraction)
        needed = int(str(info.value).split("Pass at least ")[1].split()[0])
        assert len(split_indices(needed, fraction)[1]) >= MIN_HELD_OUT
        assert len(split_indices(needed - 1, fraction)[1]) < MIN_HELD_OUT
        _check_auto_samples(needed, fraction)
    # one token: no search (the layer is linear), so any number of samples
    X1, y1 = X[:, :6], y[:, :12]
    MultiHeadAttentionRegressor(n_heads="auto", n_tokens=1).fit(X1, y1)


@pytest.mark.parametrize("scale", [1e100, 1e200])
def test_values_too_large_for_float64_are_rejected_up_front(scale):
    X, y, _ = _data(n=300)
    est = MultiHeadAttentionRegressor(n_tokens=4, random_state=0)
    # X of 1e100 made the phases' eigensolver fail (LinAlgError); fourth powers
    with pytest.raises(
        ValueError,
        match=r"X has entries up to 1e\+\d+ .*sums products of 4 of them.*Rescale X "
        r"\(e.g. with sklearn.preprocessing.StandardScaler\)",
    ):
        est.fit(X * scale, y)
    if scale > 1e160:  # y of 1e200 fitted to a score of NaN behind two warnings
        with pytest.raises(ValueError, match=r"y has entries up to .*Rescale y"):
            est.fit(X, y * scale)


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


def test_the_estimator_warns_which_heads_stayed_unconverged(monkeypatch):
    from sklearn.exceptions import ConvergenceWarning

    from skattn import MultiHeadAttentionRegressor

    fail_problems(
        monkeypatch, lambda head: head == 1, residual=1e-5, end=nudged(1e-6, 18)
    )
    X, Y, _, _ = planted(600, 6, 6, 3, 2, 6, seed=9, intercept=False)
    model = MultiHeadAttentionRegressor(
        n_heads=3,
        n_tokens=6,
        head_rank=2,
        init="random",
        start_search="minibatch",
        n_restarts=1,
        random_state=0,
    )
    with pytest.warns(ConvergenceWarning, match=r"Heads \[1\] did not converge"):
        model.fit(X.reshape(600, -1), Y.reshape(600, -1))
    assert model.score(X.reshape(600, -1), Y.reshape(600, -1)) > 0.99


# -- decoder layers (issue 50): causal masks, rotary positions, shared key heads
@pytest.mark.parametrize(
    "decoder",
    [{"rope": True}, {"rope": True, "n_kv_heads": 1}, {"n_kv_heads": 1}],
)
def test_planted_causal_decoder_is_learned_to_held_out_precision(decoder, capsys):
    X, y, layer = make_attention_regression(
        3000,
        6,
        8,
        2,
        head_rank=2,
        causal=True,
        random_state=0,
        return_layer=True,
        **decoder,
    )
    est = MultiHeadAttentionRegressor(
        2, 6, head_rank=2, causal=True, random_state=0, verbose=1, **decoder
    ).fit(X[:2500], y[:2500])
    assert "the random-start path ran" in capsys.readouterr().out
    error = np.linalg.norm(est.predict(X[2500:]) - y[2500:]) / np.linalg.norm(y[2500:])
    assert error <= 1e-6
    # the fitted layer carries the mask and the positions
    assert est.layer_.causal
    np.testing.assert_allclose(
        est.layer_.transform(X[2500:]).reshape(500, -1),
        est.predict(X[2500:]),
        rtol=1e-12,
        atol=1e-12,
    )
    info = est.phase_report_[0].info
    assert "random-start path" in info["reason"] and info["decoupled"] is None
    if decoder.get("rope"):
        assert est.rotary_query_.shape == (2, 8, 2)
        assert est.rotary_key_.shape == (decoder.get("n_kv_heads", 2), 8, 2)
        assert np.all(est.attention_ == 0.0)
    else:
        assert est.rotary_query_ is None  # Theta_i = Q_i K^T: rank 2, shared K
        assert np.linalg.matrix_rank(est.attention_[0], tol=1e-8) == 2
        transposes = np.hstack([theta.T for theta in est.attention_])
        shared = np.linalg.matrix_rank(transposes, tol=1e-8)
        assert shared == 2  # both heads' Theta_i^T share the key's column space
    # refitting a position-free layer forgets the decoder
    Xp, yp = make_attention_regression(300, 3, 4, 1, random_state=0)
    plain = est.set_params(
        causal=False,
        rope=False,
        n_kv_heads=None,
        head_rank=None,
        n_heads=1,
        n_tokens=3,
        verbose=0,
    ).fit(Xp, yp)
    assert not plain.layer_.causal and plain.rotary_query_ is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"causal": True, "init": "phased"}, "init='phased' runs the phases"),
        ({"causal": True, "n_heads": "auto"}, "an integer n_heads"),
        ({"rope": True}, "needs head_rank"),
        ({"rope": True, "head_rank": 3}, "an even head_rank"),
        ({"n_kv_heads": 3, "n_heads": 4, "head_rank": 2}, "n_kv_heads dividing"),
        ({"causal": True, "polish": False}, "polish=True"),
        ({"causal": True, "certificate": True}, "certificate=False"),
    ],
)
def test_decoder_settings_the_path_cannot_learn_are_one_line_errors(params, message):
    X, y = make_attention_regression(60, 3, 4, 2, random_state=0)
    est = MultiHeadAttentionRegressor(**{"n_heads": 2, "n_tokens": 3, **params})
    with pytest.raises(ValueError, match=message) as raised:
        est.fit(X, y)
    assert "\n" not in str(raised.value)
    assert "A decoder layer (" in str(raised.value)


def test_rotary_decoder_with_an_intercept_is_learned():
    # tokens [x, 1]: the rotary maps gain a bias row, the intercept is eliminated
    X, y = make_attention_regression(
        2000,
        5,
        6,
        2,
        head_rank=2,
        causal=True,
        rope=True,
        rope_theta=100.0,
        random_state=0,
    )
    shift = 0.3 * np.arange(6.0)
    y = y + np.tile(shift, 5)[None]
    est = MultiHeadAttentionRegressor(
        2,
        5,
        head_rank=2,
        causal=True,
        rope=True,
        rope_theta=100.0,
        fit_intercept=True,
        random_state=0,
    ).fit(X[:1500], y[:1500])
    assert est.rotary_query_.shape == (2, 7, 2)
    np.testing.assert_allclose(est.intercept_, shift, atol=1e-8)
    error = np.linalg.norm(est.predict(X[1500:]) - y[1500:]) / np.linalg.norm(y[1500:])
    assert error <= 1e-6
    np.testing.assert_allclose(
        est.layer_.transform(X[1500:]).reshape(500, -1),
        est.predict(X[1500:]),
        rtol=1e-12,
        atol=1e-12,
    )
