"""Public path kept for :mod:`skattn.diagnostics`' conditions (see there)."""

from .diagnostics._conditions import (
    THRESHOLDS,
    Condition,
    ConditionReport,
    check_conditions,
    column_shares,
    cosine_matrix,
    diagonal_weights,
    min_separation,
    stable_ranks,
)

__all__ = [
    "THRESHOLDS",
    "Condition",
    "ConditionReport",
    "check_conditions",
    "column_shares",
    "cosine_matrix",
    "diagonal_weights",
    "min_separation",
    "stable_ranks",
]
