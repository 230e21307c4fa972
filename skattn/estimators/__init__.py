"""The learners: the phased learner of Chen & Li and two baselines."""

from ._gradient import GradientAttentionRegressor
from ._phased import MultiHeadAttentionRegressor
from ._random_features import RandomAttentionFeatures, RandomFeatureAttentionRegressor

__all__ = [
    "GradientAttentionRegressor",
    "MultiHeadAttentionRegressor",
    "RandomAttentionFeatures",
    "RandomFeatureAttentionRegressor",
]
