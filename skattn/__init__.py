"""skattn: learning multi-head attention layers from examples, with guarantees.

A multi-head attention layer maps k tokens X (k x d) to
``F(X) = sum_i softmax(X Theta_i X^T) X W_i``.  skattn plants such layers, samples
examples, and learns them back: with the provable phased learner of Chen & Li
(``MultiHeadAttentionRegressor``) and two baselines from the same literature.
"""

from .estimators import RandomAttentionFeatures, RandomFeatureAttentionRegressor
from .layer import AttentionLayer

__version__ = "0.1.0.dev0"

__all__ = [
    "AttentionLayer",
    "RandomAttentionFeatures",
    "RandomFeatureAttentionRegressor",
    "__version__",
]
