"""skattn.utils._warnings: warnings attributed to the user's line."""

import warnings

import numpy as np

from skattn import MultiHeadAttentionRegressor, make_attention_regression
from skattn.utils._warnings import warn_at_caller


def test_a_warning_points_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_at_caller("look here", UserWarning)
    assert caught[0].filename == __file__
    assert caught[0].category is UserWarning


def test_a_fits_warning_points_at_the_users_fit_call():
    # polish=False: the phases' shortfalls are the result's, so fit warns; the
    # warning names the estimator's parameters and points at this file
    X, y = make_attention_regression(
        3000, 4, 8, 2, n_outputs=16, distribution="boolean", random_state=0
    )
    est = MultiHeadAttentionRegressor(
        n_heads=2,
        n_tokens=4,
        input_distribution="boolean",
        polish=False,
        certify_tol_final=0.05,
        random_state=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, y)
    assert caught, "the weak hull of this fit should be warned about"
    for warning in caught:
        assert warning.filename == __file__
        assert "sculpt_hull" not in str(warning.message)
        assert "tol_final=" not in str(warning.message).replace("certify_tol_final", "")


def test_an_exact_fit_is_silent_and_keeps_its_notes():
    X, y = make_attention_regression(
        3000, 4, 8, 2, n_outputs=16, distribution="boolean", random_state=0
    )
    est = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, input_distribution="boolean", random_state=0
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, y)
    assert not caught, [str(w.message) for w in caught]
    notes = [r.info["notes"] for r in est.phase_report_ if "notes" in r.info]
    assert notes and "certify_tol_final" in " ".join(notes[0])
    assert np.isfinite(est.score(X, y))
