"""The phased learner of Chen & Li: one module per phase, pure functions.

``MultiHeadAttentionRegressor`` runs the phases; what each did is kept in its
``phase_report_`` as :class:`PhaseReport` records.  When too few rows certify at a
tolerance, phases 2-4 raise :class:`CertificationError` (a ``ValueError``) or, after
a first successful round, stop early with a :class:`CertificationWarning`.
"""

from ._errors import CertificationError, CertificationWarning
from ._report import PhaseReport, format_reports

__all__ = [
    "CertificationError",
    "CertificationWarning",
    "PhaseReport",
    "format_reports",
]
