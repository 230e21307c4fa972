"""The phased learner of Chen & Li: one module per phase, pure functions.

Each phase takes arrays (token tensors ``X`` of shape ``(n, k, d)`` and ``Y`` of
shape ``(n, k, d_out)``) and returns its estimate and an info dict, recorded as
a :class:`PhaseReport`:

* phase 1, :func:`crude_projection_sum`: ``W_sum = sum_i W_i`` from the token
  sums;
* phases 2-4, :func:`sculpt_hull`: certify rows on which all heads agree, carve
  the affine hull of the ``Theta_i`` and refine ``W_sum``
  (:func:`refine_projection_sum`), round after round;
* phase 5, :func:`hull_span`: the span of the hull;
* phase 6, :func:`fit_from_hull`: an epsilon-net over the hull, then the polish.

Their options are frozen objects, one per stage (:class:`PhasedOptions`,
defaults written once in :mod:`._options`).  :func:`phased_fit` composes them
(the learner of :class:`~skattn.MultiHeadAttentionRegressor`), with the fallback
to random starts; :func:`search_n_heads` selects the number of heads
(:func:`select_n_heads`, then :func:`polish_on_all`).  When too few rows certify
at a tolerance, phases 2-4 raise :class:`CertificationError` (a ``ValueError``)
or, after a first successful round, stop early with a
:class:`CertificationWarning`.
"""

from ._affine_hull import sculpt_hull
from ._errors import CertificationError, CertificationWarning
from ._model_selection import polish_on_all, select_n_heads
from ._net import fit_from_hull
from ._options import (
    PARAMETERS,
    HeadSearchOptions,
    HullOptions,
    NetOptions,
    PhasedOptions,
)
from ._pipeline import phased_fit, search_n_heads
from ._projection_sum import crude_projection_sum, refine_projection_sum
from ._report import PhaseReport, format_reports
from ._span import hull_span

__all__ = [
    "PARAMETERS",
    "CertificationError",
    "CertificationWarning",
    "HeadSearchOptions",
    "HullOptions",
    "NetOptions",
    "PhaseReport",
    "PhasedOptions",
    "crude_projection_sum",
    "fit_from_hull",
    "format_reports",
    "hull_span",
    "phased_fit",
    "polish_on_all",
    "refine_projection_sum",
    "sculpt_hull",
    "search_n_heads",
    "select_n_heads",
]
