"""How close a learned attention layer is to the truth, and plots of it.

* :func:`parameter_error`: head-matched relative errors of the Theta_i and W_i;
* :func:`prediction_error`: relative error of the outputs on given inputs;
* :func:`attention_pattern_error`: head-matched total-variation distance between
  attention patterns;
* :class:`AttentionPatternDisplay`, :class:`RecoveryCurveDisplay`: plots of true
  versus learned patterns and of recovery curves (matplotlib imported lazily).
* :func:`make_recovery_scorer`, :func:`relative_prediction_error`: scores for
  model selection (``GridSearchCV(scoring=...)``);
* :func:`sharpness_profile`: per head, how concentrated the attention rows are
  (median largest weight, share of nearly one-hot rows, logit margins);
* :func:`sharp_head_pinning`: per head, whether the inputs split its attention on
  enough rows to pin its logits (a counting bound), and about how many sequences
  would;
* :func:`data_verdict`: before a fit, whether the number of sequences can
  determine a layer of that shape at all (equations against unknowns, rows
  against the counting bound), and :class:`IdentifiabilityWarning`, which a fit
  raises at once when it cannot.

The held-out error of a layer and the redundancy of its heads are computed here too
(private modules, for the phases' selection of the number of heads and for the
certificates); their public names are :func:`skattn.diagnostics.held_out_error` and
:func:`skattn.diagnostics.head_redundancy`.  The metrics import only
:mod:`skattn.layer`, :mod:`skattn.solvers` (the least-squares projections that
head redundancy re-solves) and :mod:`skattn.utils`; the displays take fitted
estimators as :func:`skattn.layer.as_layer` reads them, never importing them.
"""

from ._identifiability import IdentifiabilityWarning, data_verdict
from ._plot import AttentionPatternDisplay, RecoveryCurveDisplay
from ._recovery import (
    attention_pattern_error,
    parameter_error,
    prediction_error,
    reached_directions,
)
from ._scorers import make_recovery_scorer, relative_prediction_error
from ._sharpness import sharp_head_pinning, sharpness_profile

__all__ = [
    "AttentionPatternDisplay",
    "IdentifiabilityWarning",
    "RecoveryCurveDisplay",
    "attention_pattern_error",
    "data_verdict",
    "make_recovery_scorer",
    "parameter_error",
    "prediction_error",
    "reached_directions",
    "relative_prediction_error",
    "sharp_head_pinning",
    "sharpness_profile",
]
