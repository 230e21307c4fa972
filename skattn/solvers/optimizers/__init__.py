"""The iterative methods the stages run, one per module.

* :mod:`._lm_dense`: Levenberg-Marquardt with the Gauss-Newton matrix formed
  (small layers);
* :mod:`._lm_matrix_free`: Levenberg-Marquardt from Jacobian products (large
  layers), by the one trust-region core :mod:`._trf` (one problem or a batch of
  heads, :mod:`._batched_lm`), its steps by :mod:`._cgls`;
* :mod:`._lbfgs`: L-BFGS-B on the reduced loss or on all parameters;
* :mod:`._adam`: mini-batch Adam on all parameters (the gradient baseline).

Every one reports ``stop_reason`` in the words of
:data:`skattn.solvers._stop.STOP_REASONS`.
"""
