"""Mini-batch Adam on all parameters of a layer (the gradient baseline).

The optimizer of :class:`skattn.GradientAttentionRegressor` with
``optimizer="adam"``: shuffled passes of mini-batch Adam over the (weighted,
ridge-penalised) squared loss ``J(Theta, W)``
(:func:`~skattn.solvers.kernels._loss._penalized_loss_gradient`), from a random
start (:func:`~skattn.solvers.kernels._parametrization._initial_parameters`).
Its full-batch sibling is :func:`~skattn.solvers.optimizers._lbfgs.lbfgs_layer`.
"""

import numpy as np

from ..kernels._loss import _penalized_loss_gradient
from ..kernels._parametrization import _Unknowns

_ADAM_BETA1 = 0.9
_ADAM_BETA2 = 0.999
_ADAM_EPSILON = 1e-8


def _adam_state(attention, projection):
    """Fresh Adam moments for parameters of the given shapes."""
    size = attention.size + projection.size
    return {"first": np.zeros(size), "second": np.zeros(size), "step": 0}


def _adam_epoch(
    X,
    Y,
    sample_weight,
    attention,
    projection,
    state,
    alpha,
    learning_rate,
    batch_size,
    random_state,
    chunk_size=None,
):
    """One shuffled pass of mini-batch Adam over (X, Y); updates ``state`` in place.

    Each mini-batch step follows the batch's weighted objective (its weighted
    mean loss plus the ridge term); batches whose weights are all zero are
    skipped.

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    epoch_loss : float
        Weight-averaged objective of the batches, each evaluated before its step.
    """
    unknowns = _Unknowns(*projection.shape)
    n = X.shape[0]
    params = unknowns.pack(attention, projection)
    order = random_state.permutation(n)
    total = float(np.sum(sample_weight))
    epoch_loss = 0.0
    for start in range(0, n, batch_size):
        batch = order[start : start + batch_size]
        batch_weight = sample_weight[batch]
        share = float(np.sum(batch_weight)) / total
        if share == 0.0:
            continue
        loss, g_att, g_proj = _penalized_loss_gradient(
            X[batch],
            Y[batch],
            *unknowns.unpack(params),
            batch_weight,
            alpha,
            chunk_size,
        )
        epoch_loss += share * loss
        grad = unknowns.gradient(params, g_att, g_proj)
        state["step"] += 1
        t = state["step"]
        state["first"] = _ADAM_BETA1 * state["first"] + (1 - _ADAM_BETA1) * grad
        state["second"] = _ADAM_BETA2 * state["second"] + (1 - _ADAM_BETA2) * grad**2
        step_size = learning_rate * np.sqrt(1 - _ADAM_BETA2**t) / (1 - _ADAM_BETA1**t)
        params = params - step_size * state["first"] / (
            np.sqrt(state["second"]) + _ADAM_EPSILON
        )
    attention, projection = unknowns.unpack(params)
    return attention.copy(), projection.copy(), epoch_loss


def _fit_adam(
    X,
    Y,
    sample_weight,
    attention,
    projection,
    state,
    alpha,
    learning_rate,
    batch_size,
    max_iter,
    tol,
    n_iter_no_change,
    random_state,
    chunk_size=None,
    verbose=0,
):
    """Mini-batch Adam epochs until the epoch loss stalls or ``max_iter`` epochs.

    Training stops when the epoch loss has not improved on the best one by at
    least ``tol`` for ``n_iter_no_change`` consecutive epochs.

    Returns
    -------
    attention, projection : ndarrays
    loss_curve : list of float
        The epoch losses.
    n_iter : int
    stop_reason : {"no_decrease", "max_iter"}
        ``"no_decrease"``: the epoch loss stalled; ``"max_iter"``: the epochs ran
        out.
    """
    loss_curve = []
    best_loss = np.inf
    no_improvement = 0
    for _ in range(max_iter):
        attention, projection, epoch_loss = _adam_epoch(
            X,
            Y,
            sample_weight,
            attention,
            projection,
            state,
            alpha,
            learning_rate,
            batch_size,
            random_state,
            chunk_size,
        )
        loss_curve.append(epoch_loss)
        if verbose >= 2:
            print(f"epoch {len(loss_curve)}, loss = {epoch_loss:.6e}")
        if epoch_loss > best_loss - tol:
            no_improvement += 1
        else:
            no_improvement = 0
        best_loss = min(best_loss, epoch_loss)
        if no_improvement >= n_iter_no_change:
            return attention, projection, loss_curve, len(loss_curve), "no_decrease"
    return attention, projection, loss_curve, len(loss_curve), "max_iter"
