"""scikit-learn's checks and skattn's checks over every public estimator."""

import numpy as np
import pytest

from skattn import AttentionLayer, RandomFeatureAttentionRegressor
from skattn.utils.discovery import all_estimators
from skattn.utils.estimator_checks import parametrize_with_checks

LEARNERS = [cls() for name, cls in all_estimators() if cls is not AttentionLayer]
PLANTED_LAYER = AttentionLayer(
    np.random.default_rng(0).normal(size=(2, 5, 5)),
    np.random.default_rng(1).normal(size=(2, 5, 5)),
)


# Every check passes on every default estimator: no expected failures.
@parametrize_with_checks([*LEARNERS, PLANTED_LAYER])
def test_estimator_checks(estimator, check):
    check(estimator)


def test_all_estimators_finds_the_layer():
    names = [name for name, _ in all_estimators()]
    assert "AttentionLayer" in names
    with pytest.raises(ValueError, match="type_filter"):
        all_estimators("classifier")


def test_no_check_is_marked_for_the_defaults():
    params = parametrize_with_checks([*LEARNERS, PLANTED_LAYER]).mark.args[1]
    assert params and not [p.id for p in params if p.marks]


def test_expected_failures_are_marked_xfail():
    # sklearn yields its expected failures as pytest.param (a 3-tuple): the harness
    # must unpack them, not mistake them for (estimator, check) pairs.
    check = "check_sample_weight_equivalence_on_dense_data"
    decorator = parametrize_with_checks(
        [RandomFeatureAttentionRegressor(n_heads=2)],
        expected_failed_checks=lambda estimator: {check: "a reason"},
    )
    params = decorator.mark.args[1]
    marked = [p.id for p in params if p.marks]
    assert marked == [f"RandomFeatureAttentionRegressor-{check}"]
