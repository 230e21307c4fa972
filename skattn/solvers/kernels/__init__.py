"""Kernels of the random-start path: arrays in, arrays out.

* :mod:`._loss`: the weighted squared loss and its gradient, the eliminated
  projections ``W*(Theta)`` (normal equations, least squares), the reduced loss;
* :mod:`._parametrization`: full ``Theta_i``, low rank ``Q_i K_i^T``, factored
  values ``W_i = V_i O_i``, with the logits' Jacobian products; random starts;
* :mod:`._varpro`: the reduced problem's residual and Jacobian products;
* :mod:`._decoupling`: each head's share of the outputs through the output
  factors' inverse (the one-head problems);
* :mod:`._patterns`: a head's attention patterns read off its share (simplex
  least squares);
* :mod:`._whitening`: the tokens mapped to identity second moment.
"""
