"""How close a learned attention layer is to the truth.

* :func:`parameter_error`: head-matched relative errors of the Theta_i and W_i;
* :func:`prediction_error`: relative error of the outputs on given inputs;
* :func:`attention_pattern_error`: head-matched total-variation distance between
  attention patterns.
"""

from ._recovery import attention_pattern_error, parameter_error, prediction_error

__all__ = ["attention_pattern_error", "parameter_error", "prediction_error"]
