"""The learners: the phased learner of Chen & Li and two baselines."""

from ._phased import MultiHeadAttentionRegressor
from ._random_features import RandomAttentionFeatures, RandomFeatureAttentionRegressor

__all__ = [
    "MultiHeadAttentionRegressor",
    "RandomAttentionFeatures",
    "RandomFeatureAttentionRegressor",
]
