"""skattn's estimator checks for sequence estimators (``utils/estimator_checks.py``)."""

import warnings

import numpy as np
import pytest
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import Ridge

from skattn import AttentionLayer, GradientAttentionRegressor
from skattn.utils.estimator_checks import (
    SkattnCheckSkipped,
    check_estimator,
    check_n_tokens_mismatch,
    skattn_checks_generator,
)


class _IgnoresTokens(RegressorMixin, BaseEstimator):
    """A sequence estimator that takes ``n_tokens`` but never checks it."""

    def __init__(self, n_tokens=None, random_state=None):
        self.n_tokens = n_tokens
        self.random_state = random_state

    def fit(self, X, y):
        self.ridge_ = Ridge().fit(np.reshape(X, (len(X), -1)), y)
        return self

    def predict(self, X):
        return self.ridge_.predict(np.reshape(X, (len(X), -1)))


def _names(estimator):
    return [check.func.__name__ for _, check in skattn_checks_generator(estimator)]


def test_the_checks_depend_on_what_the_estimator_is():
    layer = AttentionLayer(np.zeros((1, 5, 5)), np.eye(5)[None])
    assert "check_layer_wrong_width" in _names(layer)
    assert "check_recovers_planted_layer" not in _names(layer)
    regressor = _names(GradientAttentionRegressor())
    assert {"check_n_tokens_mismatch", "check_recovers_planted_layer"} <= set(regressor)
    sequence = _names(_IgnoresTokens())
    assert "check_n_tokens_mismatch" in sequence
    assert "check_recovers_planted_layer" not in sequence
    assert _names(Ridge()) == []  # no n_tokens, no attention: none of skattn's


def test_a_check_fails_an_estimator_that_ignores_n_tokens():
    with pytest.raises(AssertionError, match="_IgnoresTokens accepted X of shape"):
        check_n_tokens_mismatch("_IgnoresTokens", _IgnoresTokens())


def test_check_estimator_passes_a_layer_and_skips_expected_failures():
    layer = AttentionLayer(np.zeros((1, 5, 5)), np.eye(5)[None])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_estimator(layer)
    reason = {"check_layer_pickle": "not picklable here"}
    with pytest.warns(SkattnCheckSkipped, match="not picklable here"):
        check_estimator(layer, expected_failed_checks=reason)
