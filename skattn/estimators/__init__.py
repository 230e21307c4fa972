"""The learners: the phased learner of Chen & Li and two baselines."""

from ._random_features import RandomAttentionFeatures, RandomFeatureAttentionRegressor

__all__ = ["RandomAttentionFeatures", "RandomFeatureAttentionRegressor"]
