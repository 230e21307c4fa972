"""Solvers for the parameters of an attention layer: pure functions, no estimators.

One module per concern:

* :mod:`._objective`: the weighted squared loss and its gradient, the normal
  equations and least-squares projections ``W*(Theta)``, the reduced (variable
  projection) loss;
* :mod:`._parametrization`: full ``Theta_i`` or low rank ``Q_i K_i^T`` (and
  factored values ``W_i = V_i O_i``), with the logits' Jacobian-vector and
  vector-Jacobian products;
* :mod:`._dense`: Levenberg-Marquardt with the Gauss-Newton matrix formed (small
  layers);
* :mod:`._matrix_free`: Levenberg-Marquardt from Jacobian products
  (``scipy.optimize.least_squares`` with LSMR; large layers);
* :mod:`._lbfgs`: L-BFGS-B stages;
* :mod:`._minibatch`: :func:`minibatch_search`, Adam on the reduced loss of
  random batches, which moves random starts of many heads to where
  Levenberg-Marquardt converges, replacing a head that found nothing
  (:func:`head_contributions`) when it stalls;
* :mod:`._decoupled`: :func:`decoupled_refine`, every head refined on its own
  one-head problem through the inverse of the stacked output factors (low-rank
  heads with ``n_heads * head_rank <= d_out``, the shape of real transformers),
  and :func:`search_head`, a head searched afresh on that problem;
* :mod:`._patterns`: :func:`invert_patterns`, a head's attention patterns read
  off its share of the outputs (least squares on the probability simplex);
* :mod:`._polish`: :func:`polish`, which runs them and picks the solver by size;
  the random starts and :func:`whitening_map`, their preconditioner.
"""

from ._decoupled import can_decouple, decoupled_refine, search_head
from ._matrix_free import VarproProblem, varpro_least_squares
from ._minibatch import head_contributions, minibatch_search
from ._objective import (
    projection_normal_equations,
    reduced_loss_gradient,
    solve_projections,
)
from ._parametrization import (
    FactoredHeads,
    FullRank,
    LowRank,
    balanced_factors,
    make_parametrization,
)
from ._patterns import invert_patterns
from ._polish import choose_factor_values, choose_solver, polish, whitening_map

__all__ = [
    "FactoredHeads",
    "FullRank",
    "LowRank",
    "VarproProblem",
    "balanced_factors",
    "can_decouple",
    "choose_factor_values",
    "choose_solver",
    "decoupled_refine",
    "head_contributions",
    "invert_patterns",
    "make_parametrization",
    "minibatch_search",
    "polish",
    "projection_normal_equations",
    "reduced_loss_gradient",
    "search_head",
    "solve_projections",
    "varpro_least_squares",
    "whitening_map",
]
