"""First-order training of a full attention layer: L-BFGS and Adam on all parameters.

The optimiser of :class:`skattn.GradientAttentionRegressor`: the (weighted,
ridge-penalised) squared loss

    J(Theta, W) = sum_n w_n ||F(X_n) - Y_n||_F^2 / (2 sum_n w_n)
                  + alpha / 2 (||Theta||_F^2 + ||W||_F^2)

with the analytic gradient of :func:`skattn.layer._math.squared_loss_gradient`,
minimised by full-batch L-BFGS (scipy, :func:`_fit_lbfgs`) or mini-batch Adam
(numpy, :func:`_fit_adam`), from a random start (:func:`_initial_parameters`).
The unknowns (:class:`_Unknowns`) are the attention part of a parametrization of
:mod:`skattn.solvers._parametrization` (``Theta_i``, or ``Q_i K_i^T`` for
low-rank heads) followed by the projections (``W_i``, or ``V_i O_i``).  Pure
functions on token tensors; the estimator validates and keeps the result.
"""

import numpy as np

from ._lbfgs import _lbfgs
from ._objective import _loss_gradient, solve_projections
from ._parametrization import balanced_factors, make_parametrization, random_attention

_ADAM_BETA1 = 0.9
_ADAM_BETA2 = 0.999
_ADAM_EPSILON = 1e-8
# scipy's L-BFGS-B status -> why training stopped (stop_reason_).
_LBFGS_STOP = {0: "tol", 1: "max_iter", 2: "no_progress"}


class _Projections:
    """The projections ``W_i`` in full (``rank=None``: ``m d d_out`` parameters) or
    as ``V_i O_i`` (``V (m, d, r)`` then ``O (m, r, d_out)``: ``m r (d + d_out)``).

    The projection counterpart of :class:`~skattn.solvers.FullRank` and
    :class:`~skattn.solvers.LowRank`, for solvers that train ``W`` by gradient
    rather than eliminating it.
    """

    def __init__(self, n_heads, n_features, n_outputs, rank=None):
        self.shape = (n_heads, n_features, n_outputs)
        self.rank = rank
        if rank is None:
            self.size = n_heads * n_features * n_outputs
        else:
            self.size = n_heads * rank * (n_features + n_outputs)

    def factors(self, params):
        """``V (m, d, r)``, ``O (m, r, d_out)``."""
        m, d, d_out = self.shape
        split = m * d * self.rank
        return (
            params[:split].reshape(m, d, self.rank),
            params[split:].reshape(m, self.rank, d_out),
        )

    def projection(self, params):
        """``W (m, d, d_out)`` from the flat parameters."""
        if self.rank is None:
            return params.reshape(self.shape)
        value, output = self.factors(params)
        return value @ output

    def from_projection(self, projection):
        """Flat parameters of ``W``: balanced factors of its best rank-r
        approximation for low rank."""
        if self.rank is None:
            return np.asarray(projection, dtype=float).reshape(-1).copy()
        value, output = balanced_factors(projection, self.rank)
        return np.concatenate(
            [value.reshape(-1), np.swapaxes(output, 1, 2).reshape(-1)]
        )

    def projection_vjp(self, params, grad_projection):
        """Pull a gradient ``G`` in ``W`` back: ``dV_i = G_i O_i^T``,
        ``dO_i = V_i^T G_i``, flat."""
        if self.rank is None:
            return np.asarray(grad_projection, dtype=float).reshape(-1)
        value, output = self.factors(params)
        return np.concatenate(
            [
                (grad_projection @ np.swapaxes(output, 1, 2)).reshape(-1),
                (np.swapaxes(value, 1, 2) @ grad_projection).reshape(-1),
            ]
        )


class _Unknowns:
    """The flat unknowns of a layer: the attention part, then the projections.

    ``head_rank=None``: ``Theta`` and ``W`` in full; else (a rank below
    ``min(d, d_out)``) the factors ``Q, K`` (:class:`~skattn.solvers.LowRank`)
    then ``V, O`` (:class:`_Projections`).
    """

    def __init__(self, n_heads, n_features, n_outputs, head_rank=None):
        self.attention_part = make_parametrization(n_heads, n_features, head_rank)
        self.projection_part = _Projections(n_heads, n_features, n_outputs, head_rank)
        self.size = self.attention_part.size + self.projection_part.size

    def pack(self, attention, projection):
        """Flat parameters of the layer ``(Theta, W)``."""
        return np.concatenate(
            [
                self.attention_part.from_attention(attention),
                self.projection_part.from_projection(projection),
            ]
        )

    def unpack(self, params):
        """``Theta (m, d, d)``, ``W (m, d, d_out)`` from the flat parameters."""
        split = self.attention_part.size
        return (
            self.attention_part.attention(params[:split]),
            self.projection_part.projection(params[split:]),
        )

    def gradient(self, params, grad_attention, grad_projection):
        """The gradient in the flat parameters from those in ``Theta`` and ``W``."""
        split = self.attention_part.size
        return np.concatenate(
            [
                self.attention_part.attention_vjp(params[:split], grad_attention),
                self.projection_part.projection_vjp(params[split:], grad_projection),
            ]
        )


def _objective(X, Y, attention, projection, sample_weight, alpha, chunk_size=None):
    """The training objective J and its gradient, accumulated over sample chunks.

    ``J = sum_n w_n ||F(X_n) - Y_n||^2 / (2 sum_n w_n) + alpha/2 (||Theta||^2 +
    ||W||^2)``, by :func:`skattn.solvers._objective._loss_gradient` (the ridge on both
    Theta and W); ``chunk_size=None`` picks the chunks from its memory budget.

    Returns
    -------
    loss : float
    grad_attention : ndarray of shape (m, d, d)
    grad_projection : ndarray of shape (m, d, d_out)
    """
    return _loss_gradient(
        X,
        Y,
        attention,
        projection,
        sample_weight,
        alpha,
        chunk_size,
        alpha_attention=alpha,
    )


def _initial_parameters(X, Y, sample_weight, n_heads, init_scale, alpha, random_state):
    """A random start: small random Theta, then the best W for that Theta.

    Theta by :func:`skattn.solvers._parametrization.random_attention` at scale
    ``init_scale``: the typical attention logit ``x^T Theta_i x'`` of
    unit-variance tokens has standard deviation ``init_scale``.  W then solves
    the (ridge) least squares problem given Theta.

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    """
    attention = random_attention(n_heads, X.shape[2], random_state, scale=init_scale)
    # J's ridge on Theta does not change the minimising W given Theta
    projection = solve_projections(X, Y, attention, sample_weight, alpha)
    return attention, projection


def _fit_lbfgs(
    X,
    Y,
    sample_weight,
    attention,
    projection,
    alpha,
    max_iter,
    tol,
    chunk_size=None,
    verbose=0,
    head_rank=None,
):
    """Full-batch L-BFGS-B on the flattened parameters from a given start.

    Stops when the largest absolute gradient entry is below ``tol``, when the
    line search can make no further progress (the loss is at the limit of
    floating point precision), or after ``max_iter`` iterations.

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    loss_curve : list of float
        The objective after each iteration.
    n_iter : int
    stop_reason : {"tol", "no_progress", "max_iter"}
        Why it stopped: the gradient is below ``tol``; the line search makes
        no progress (the loss is at its rounding floor); ``max_iter`` (or the
        function-evaluation budget) ran out.
    """
    unknowns = _Unknowns(*projection.shape, head_rank)

    def fun(params):
        loss, g_att, g_proj = _objective(
            X, Y, *unknowns.unpack(params), sample_weight, alpha, chunk_size
        )
        return loss, unknowns.gradient(params, g_att, g_proj)

    loss_curve = []

    def callback(intermediate_result):
        loss_curve.append(float(intermediate_result.fun))
        if verbose >= 2:
            print(f"iteration {len(loss_curve)}, loss = {loss_curve[-1]:.6e}")

    # scipy's default memory (maxcor=10) and a budget of function evaluations
    result = _lbfgs(
        fun,
        unknowns.pack(attention, projection),
        max_iter,
        tol,
        maxcor=10,
        maxfun=2 * max_iter + 20,
        callback=callback,
    )
    attention, projection = unknowns.unpack(result.x)
    if not loss_curve or loss_curve[-1] != float(result.fun):
        loss_curve.append(float(result.fun))
    return (
        attention.copy(),
        projection.copy(),
        loss_curve,
        int(result.nit),
        _LBFGS_STOP.get(int(result.status), "no_progress"),
    )


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
        loss, g_att, g_proj = _objective(
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
    stop_reason : {"tol", "max_iter"}
        ``"tol"``: the epoch loss stalled; ``"max_iter"``: the epochs ran out.
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
            return attention, projection, loss_curve, len(loss_curve), "tol"
    return attention, projection, loss_curve, len(loss_curve), "max_iter"
