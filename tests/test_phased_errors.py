"""What phases 2-4 raise and warn when too few rows certify (``phased/_errors.py``)."""

import warnings

import numpy as np
import pytest
from _helpers import phased_planted

from skattn import MultiHeadAttentionRegressor
from skattn.phased import CertificationError, CertificationWarning


def _fit(init):
    X, Y, _, _ = phased_planted(600, 3, 4, 2, d_out=8)
    return MultiHeadAttentionRegressor(
        n_heads=2,
        n_tokens=3,
        certify_tol=1e-9,
        certify_tol_final=1e-9,
        init=init,
        polish_max_iter=20,
        random_state=0,
    ).fit(X.reshape(600, -1), Y.reshape(600, -1))


def test_certification_error_is_a_value_error_naming_the_tolerance():
    assert issubclass(CertificationError, ValueError)
    # scikit-learn (a search's error_score, check_estimator) catches ValueError
    with pytest.raises(ValueError, match="certify_tol") as caught:
        _fit("phased")
    assert type(caught.value) is CertificationError


def test_certification_warning_is_a_user_warning_of_the_fallback():
    assert issubclass(CertificationWarning, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _fit("auto")
    kinds = [w.category for w in caught]
    assert CertificationWarning in kinds
    assert np.isfinite(model.attention_).all()
