"""Fixtures shared by several test modules (helpers: tests/_helpers.py)."""

import pytest
from _helpers import one_head_regression, two_heads_regression

K, D = 3, 4  # tokens per sequence, features per token of the fixtures


@pytest.fixture(scope="module")
def two_heads():
    """A planted 2-head layer the phased learner can fit in a fraction of a second."""
    return two_heads_regression(K, D)


@pytest.fixture(scope="module")
def one_head():
    """A planted 1-head layer the gradient learner recovers exactly."""
    return one_head_regression(K, D)
