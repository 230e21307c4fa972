"""Utilities: the estimator-check harness, estimator discovery, and
:func:`estimator_to_numpy` (a fitted estimator's arrays moved to numpy)."""

from ._convert import estimator_to_numpy

__all__ = ["estimator_to_numpy"]
