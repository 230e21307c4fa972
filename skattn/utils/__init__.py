"""Utilities: the estimator-check harness and estimator discovery."""
