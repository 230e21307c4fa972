"""First-order training of a full attention layer: L-BFGS and Adam on all parameters.

The optimiser of :class:`skattn.GradientAttentionRegressor`: the (weighted,
ridge-penalised) squared loss

    J(Theta, W) = sum_n w_n ||F(X_n) - Y_n||_F^2 / (2 sum_n w_n)
                  + alpha / 2 (||Theta||_F^2 + ||W||_F^2)

with the analytic gradient of :func:`skattn.layer._math.squared_loss_gradient`,
minimised by full-batch L-BFGS (scipy, :func:`_fit_lbfgs`; on the factors
``Q_i, K_i, V_i, O_i`` for low-rank heads) or mini-batch Adam (numpy,
:func:`_fit_adam`), from a random start (:func:`_initial_parameters`).  Pure
functions on token tensors; the estimator validates and keeps the result.
"""

import numpy as np

from ._lbfgs import _lbfgs
from ._objective import _loss_gradient, solve_projections
from ._parametrization import balanced_factors

_ADAM_BETA1 = 0.9
_ADAM_BETA2 = 0.999
_ADAM_EPSILON = 1e-8
# scipy's L-BFGS-B status -> why training stopped (stop_reason_).
_LBFGS_STOP = {0: "tol", 1: "max_iter", 2: "no_progress"}


def _pack(attention, projection):
    """Flatten (Theta, W) into one parameter vector: ``-> (m*d*d + m*d*d_out,)``."""
    return np.concatenate([attention.ravel(), projection.ravel()])


def _unpack(params, n_heads, n_features, n_outputs):
    """Inverse of :func:`_pack`: ``-> (m, d, d), (m, d, d_out)``."""
    split = n_heads * n_features * n_features
    attention = params[:split].reshape(n_heads, n_features, n_features)
    projection = params[split:].reshape(n_heads, n_features, n_outputs)
    return attention, projection


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

    Theta_i has i.i.d. ``N(0, (init_scale / d)^2)`` entries, so that
    ``E ||Theta_i||_F^2 = init_scale^2``: the typical attention logit
    ``x^T Theta_i x'`` of unit-variance tokens has standard deviation
    ``init_scale``.  W then solves the (ridge) least squares problem given Theta.

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    """
    d = X.shape[2]
    attention = random_state.standard_normal((n_heads, d, d)) * (init_scale / d)
    # J's ridge on Theta does not change the minimising W given Theta
    projection = solve_projections(X, Y, attention, sample_weight, alpha)
    return attention, projection


def _pack_factors(attention, projection, rank):
    """Balanced rank-r factors (Q, K, V, O) of (Theta, W), flattened."""
    query, key = balanced_factors(attention, rank)
    value, output = balanced_factors(projection, rank)
    return np.concatenate(
        [f.ravel() for f in (query, key, value, np.swapaxes(output, 1, 2))]
    )


def _unpack_factors(params, n_heads, n_features, n_outputs, rank):
    """``Q, K, V (m, d, r)``, ``O (m, r, d_out)`` from :func:`_pack_factors`."""
    m, d, r = n_heads, n_features, rank
    sizes = np.cumsum([m * d * r] * 3)
    query, key, value = (
        part.reshape(m, d, r) for part in np.split(params[: sizes[-1]], sizes[:-1])
    )
    output = params[sizes[-1] :].reshape(m, r, n_outputs)
    return query, key, value, output


def _factor_objective(X, Y, params, shape, sample_weight, alpha, chunk_size):
    """J and its gradient in the factors: Theta_i = Q_i K_i^T, W_i = V_i O_i.

    The chain rule on the gradient in the products: ``dQ = dTheta K``,
    ``dK = dTheta^T Q``, ``dV = dW O^T``, ``dO = V^T dW``.
    """
    query, key, value, output = _unpack_factors(params, *shape)
    attention = query @ np.swapaxes(key, 1, 2)
    projection = value @ output
    loss, g_att, g_proj = _objective(
        X, Y, attention, projection, sample_weight, alpha, chunk_size
    )
    grads = (
        g_att @ key,
        np.swapaxes(g_att, 1, 2) @ query,
        g_proj @ np.swapaxes(output, 1, 2),
        np.swapaxes(value, 1, 2) @ g_proj,
    )
    return loss, np.concatenate([g.ravel() for g in grads])


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
    m, d, d_out = projection.shape
    if head_rank is None:

        def fun(params):
            loss, g_att, g_proj = _objective(
                X, Y, *_unpack(params, m, d, d_out), sample_weight, alpha, chunk_size
            )
            return loss, _pack(g_att, g_proj)

        def products(params):
            return _unpack(params, m, d, d_out)

        start = _pack(attention, projection)
    else:
        shape = (m, d, d_out, head_rank)

        def fun(params):
            return _factor_objective(
                X, Y, params, shape, sample_weight, alpha, chunk_size
            )

        def products(params):
            query, key, value, output = _unpack_factors(params, *shape)
            return query @ np.swapaxes(key, 1, 2), value @ output

        start = _pack_factors(attention, projection, head_rank)

    loss_curve = []

    def callback(intermediate_result):
        loss_curve.append(float(intermediate_result.fun))
        if verbose >= 2:
            print(f"iteration {len(loss_curve)}, loss = {loss_curve[-1]:.6e}")

    # scipy's default memory (maxcor=10) and a budget of function evaluations
    result = _lbfgs(
        fun,
        start,
        max_iter,
        tol,
        maxcor=10,
        maxfun=2 * max_iter + 20,
        callback=callback,
    )
    attention, projection = products(result.x)
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
    m, d, d_out = projection.shape
    n = X.shape[0]
    params = _pack(attention, projection)
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
            *_unpack(params, m, d, d_out),
            batch_weight,
            alpha,
            chunk_size,
        )
        epoch_loss += share * loss
        grad = _pack(g_att, g_proj)
        state["step"] += 1
        t = state["step"]
        state["first"] = _ADAM_BETA1 * state["first"] + (1 - _ADAM_BETA1) * grad
        state["second"] = _ADAM_BETA2 * state["second"] + (1 - _ADAM_BETA2) * grad**2
        step_size = learning_rate * np.sqrt(1 - _ADAM_BETA2**t) / (1 - _ADAM_BETA1**t)
        params = params - step_size * state["first"] / (
            np.sqrt(state["second"]) + _ADAM_EPSILON
        )
    attention, projection = _unpack(params, m, d, d_out)
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
