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


def expected_failed_checks(estimator):
    """Checks known to fail, each with its reason."""
    if (
        isinstance(estimator, RandomFeatureAttentionRegressor)
        and estimator.alpha is None
    ):
        # Leaving out one row of a weighted sample is not leaving out every copy of
        # a repeated row, so the penalty chosen by leave-one-out differs; with a
        # fixed alpha the check passes (tests/test_random_features.py).
        return {
            "check_sample_weight_equivalence_on_dense_data": (
                "alpha=None chooses the ridge penalty by leave-one-out, which is "
                "not invariant to repeating rows"
            )
        }
    return {}


@parametrize_with_checks(
    [*LEARNERS, PLANTED_LAYER], expected_failed_checks=expected_failed_checks
)
def test_estimator_checks(estimator, check):
    check(estimator)


def test_all_estimators_finds_the_layer():
    names = [name for name, _ in all_estimators()]
    assert "AttentionLayer" in names
    with pytest.raises(ValueError, match="type_filter"):
        all_estimators("classifier")


def test_expected_failures_are_marked_xfail():
    # sklearn yields its expected failures as pytest.param (a 3-tuple): the harness
    # must unpack them, not mistake them for (estimator, check) pairs.
    decorator = parametrize_with_checks(
        [RandomFeatureAttentionRegressor(n_heads=2)],
        expected_failed_checks=expected_failed_checks,
    )
    params = decorator.mark.args[1]
    marked = [p.id for p in params if p.marks]
    assert marked == [
        "RandomFeatureAttentionRegressor-check_sample_weight_equivalence_on_dense_data"
    ]
