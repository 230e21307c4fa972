"""skattn: learning multi-head attention layers from examples, with guarantees.

A multi-head attention layer maps k tokens X (k x d) to
``F(X) = sum_i softmax(X Theta_i X^T) X W_i``.  skattn plants such layers, samples
examples, and learns them back: with the provable phased learner of Chen & Li
(``MultiHeadAttentionRegressor``) and two baselines from the same literature.
"""

from ._version import __version__
from .datasets import make_attention_layer, make_attention_regression
from .diagnostics import Certificate, ConditionReport, certify, check_conditions
from .estimators import (
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    RandomAttentionFeatures,
    RandomFeatureAttentionRegressor,
)
from .layer import AttentionLayer
from .metrics import attention_pattern_error, parameter_error, prediction_error
from .utils import estimator_to_numpy

__all__ = [
    "AttentionLayer",
    "Certificate",
    "ConditionReport",
    "GradientAttentionRegressor",
    "MultiHeadAttentionRegressor",
    "RandomAttentionFeatures",
    "RandomFeatureAttentionRegressor",
    "__version__",
    "attention_pattern_error",
    "certify",
    "check_conditions",
    "estimator_to_numpy",
    "make_attention_layer",
    "make_attention_regression",
    "parameter_error",
    "prediction_error",
]
