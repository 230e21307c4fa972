"""Diagnostics of a layer or a fit: what the data and the parameters can tell.

* :func:`check_conditions`: the non-degeneracy conditions of a layer against the
  assumptions of Chen & Li's guarantee (:class:`ConditionReport`,
  :data:`THRESHOLDS`);
* :func:`certify`: is a fit exact, locally unique (the Jacobian's singular
  values), how well does it predict held out, are heads redundant
  (:class:`Certificate`);
* :func:`held_out_error`: the relative error of a layer on examples with a
  confidence interval; :func:`head_redundancy`: negligible and duplicate heads
  (both computed in :mod:`skattn.metrics`, which the phases use too);
* :func:`layer_jacobian`, :func:`jacobian_singular_values`: the Jacobian of the
  outputs in the parameters;
* :func:`min_separation`: the smallest relative distance between two heads (the
  geometry of the ``Theta_i``, computed in :mod:`skattn.layer`, which the planted
  layers of :mod:`skattn.datasets` use too).

The estimators import these; they import only :mod:`skattn.layer`,
:mod:`skattn.solvers`, :mod:`skattn.metrics` and :mod:`skattn.utils`.  The phases
(:mod:`skattn.phased`) and the datasets import no diagnostics.
"""

from ..metrics._held_out import held_out_error
from ..metrics._redundancy import head_redundancy
from . import _conditions
from ._certificate import VERDICTS, Certificate, certify
from ._conditions import (
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
from ._jacobian import jacobian_singular_values, layer_jacobian

# The conditions' table and the reasoning behind each threshold live with their
# code; the package documents them (the API reference shows this docstring).
__doc__ += "\n**The conditions.** " + _conditions.__doc__.split("\n", 2)[2]

__all__ = [
    "THRESHOLDS",
    "VERDICTS",
    "Certificate",
    "Condition",
    "ConditionReport",
    "certify",
    "check_conditions",
    "column_shares",
    "cosine_matrix",
    "diagonal_weights",
    "head_redundancy",
    "held_out_error",
    "jacobian_singular_values",
    "layer_jacobian",
    "min_separation",
    "stable_ranks",
]
