"""The random-start path: kernels, optimizers, stages and one driver.

Read top-down:

* :mod:`._driver`: :func:`fit_from_random_starts`, the path as it runs (search,
  per-head refinement, joint polish, from the best of a few random starts);
* :mod:`._options`: the frozen options of each stage, defaults written once;
* :mod:`._stop`: the one vocabulary of stop reasons;
* :mod:`.stages`: the search (:func:`minibatch_search`), the per-head refinement
  (:func:`decoupled_refine`; a sharp head restarted from its patterns in logit
  space, ``stages._sharp_heads``), the joint polish (:func:`polish`);
* :mod:`.optimizers`: Levenberg-Marquardt (dense, matrix-free), L-BFGS, Adam;
* :mod:`.kernels`: the loss and eliminated projections, parametrizations and
  their Jacobian products, the reduced problem, decoupling, whitening, a head's
  patterns read off the outputs and its logits fitted to them.

Pure functions on token tensors, no estimators.
"""

from ._driver import fit_from_random_starts
from ._options import PolishOptions, RandomStartOptions
from ._stop import STOP_REASONS
from .kernels._loss import (
    projection_normal_equations,
    reduced_loss_gradient,
    solve_projections,
)
from .kernels._parametrization import (
    FactoredHeads,
    FullRank,
    LowRank,
    balanced_factors,
    make_parametrization,
)
from .kernels._patterns import invert_patterns
from .kernels._varpro import VarproProblem
from .kernels._whitening import whitening_map
from .optimizers._lm_matrix_free import varpro_least_squares
from .stages._polish import choose_factor_values, choose_solver, polish
from .stages._rounds import can_decouple, decoupled_refine
from .stages._search import head_contributions, minibatch_search
from .stages._search_afresh import search_head

__all__ = [
    "STOP_REASONS",
    "FactoredHeads",
    "FullRank",
    "LowRank",
    "PolishOptions",
    "RandomStartOptions",
    "VarproProblem",
    "balanced_factors",
    "can_decouple",
    "choose_factor_values",
    "choose_solver",
    "decoupled_refine",
    "fit_from_random_starts",
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
