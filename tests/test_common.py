"""scikit-learn's checks and skattn's checks over every public estimator."""

import numpy as np
import pytest

from skattn import AttentionLayer
from skattn.utils.discovery import all_estimators
from skattn.utils.estimator_checks import parametrize_with_checks

LEARNERS = [cls() for name, cls in all_estimators() if cls is not AttentionLayer]
PLANTED_LAYER = AttentionLayer(
    np.random.default_rng(0).normal(size=(2, 5, 5)),
    np.random.default_rng(1).normal(size=(2, 5, 5)),
)


@parametrize_with_checks([*LEARNERS, PLANTED_LAYER])
def test_estimator_checks(estimator, check):
    check(estimator)


def test_all_estimators_finds_the_layer():
    names = [name for name, _ in all_estimators()]
    assert "AttentionLayer" in names
    with pytest.raises(ValueError, match="type_filter"):
        all_estimators("classifier")
