"""The phased learner of Chen & Li: one module per phase, pure functions.

``MultiHeadAttentionRegressor`` runs the phases; what each did is kept in its
``phase_report_`` as :class:`PhaseReport` records.
"""

from ._report import PhaseReport, format_reports

__all__ = ["PhaseReport", "format_reports"]
