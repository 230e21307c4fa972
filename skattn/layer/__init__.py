"""The object of study: a multi-head attention layer.

``F(X) = sum_i softmax(X Theta_i X^T) X W_i`` (plus optional key biases and an
intercept):

* the math of F as pure functions on arrays: :func:`softmax`,
  :func:`attention_logits`, :func:`attention_patterns`, :func:`head_features`,
  :func:`forward`, :func:`squared_loss_gradient`;
* :class:`AttentionLayer`, a fixed (planted or learned) layer as a scikit-learn
  transformer, with :func:`check_layer_parameters` and :func:`check_layer_biases`;
* :func:`as_layer`, the one coercion of a layer or a fitted estimator;
* converters to and from query/key/value/output projections, torch modules and
  checkpoints (``from_projections``, ``from_torch``, ``to_torch``), with torch
  imported lazily.
"""

from ._attention_layer import AttentionLayer, check_layer_biases, check_layer_parameters
from ._coerce import as_layer
from ._math import (
    attention_logits,
    attention_patterns,
    forward,
    head_features,
    softmax,
    squared_loss_gradient,
)

__all__ = [
    "AttentionLayer",
    "as_layer",
    "attention_logits",
    "attention_patterns",
    "check_layer_biases",
    "check_layer_parameters",
    "forward",
    "head_features",
    "softmax",
    "squared_loss_gradient",
]
