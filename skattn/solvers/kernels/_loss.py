"""The weighted squared loss of an attention layer, its gradient, and the
least-squares projections given the attention matrices.

Pure functions on token tensors (no validation; callers validate):

* ``X``: ``(n, k, d)``, ``Y``: ``(n, k, d_out)``, ``sample_weight``: ``(n,)`` or None;
* ``attention``: ``(m, d, d)`` (the Theta_i), ``projection``: ``(m, d, d_out)`` (W_i).

The loss is the one of :func:`skattn.layer._math.squared_loss_gradient`,

    L(Theta, W) = sum_n w_n ||F(X_n) - Y_n||_F^2 / (2 sum_n w_n) + alpha ||W||_F^2 / 2,

with an optional ridge ``alpha`` on the projections only.

Given the Theta_i the layer is linear in the W_i, ``F(X) = sum_i (S_i X) W_i``, so
the W_i are one least-squares solve away (:func:`solve_projections`).  Eliminating them
gives the reduced (variable projection) objective ``L(Theta, W*(Theta))``
(:func:`reduced_loss_gradient`).

Everything that touches the samples runs in chunks of samples, so memory stays
bounded by a fixed budget (about ``_CHUNK_FLOATS`` floats per intermediate on the
host; a share of the memory free on a device) whatever n; a device that runs out of
memory all the same has the computation redone with half the chunk.

The arrays may be of any array-API namespace (numpy, torch, CuPy, array-api-strict):
results are in the inputs' namespace and on their device, and numpy arrays get the
numpy (and scipy) results of before, bit for bit.  Sample weights are normalised on
the host.
"""

import math

import numpy as np
from scipy import linalg
from sklearn.externals import array_api_compat as _compat

from ...layer._math import (
    _chunk_floats,
    _halving,
    _namespace,
    _squared_loss_gradient,
    attention_patterns,
    forward,
)
from ...utils._array_api import (
    cholesky_unchecked,
    device,
    is_numpy,
    lstsq,
    rank_ridge,
    solve_triangular,
    to_namespace,
    to_numpy,
)
from ...utils._validation import _normalized_weights

# A fit whose relative RMS residual is below this is taken as realisable (noise-free
# data fitted to rounding): a further stage on more examples cannot improve it.
REALISABLE_RESIDUAL = 1e-10
# Budget (number of float64s) for one chunk's largest intermediate.
_CHUNK_FLOATS = 2**21


def _chunk_budget(x):
    """Floats of one chunk's largest intermediate for samples like ``x``:
    ``_CHUNK_FLOATS`` on the host, a share of the memory free on a device."""
    return _chunk_floats(x, _CHUNK_FLOATS)


def _chunks(n, per_sample, budget=None):
    """Slices of at most ``budget // per_sample`` samples covering range(n).

    ``budget`` (floats) defaults to ``_CHUNK_FLOATS``; :func:`_chunk_budget`
    gives the one for arrays on a device.
    """
    budget = _CHUNK_FLOATS if budget is None else budget
    size = max(1, budget // max(1, int(per_sample)))
    return _slices(n, size)


def _slices(n, size):
    """Slices of ``size`` samples covering range(n)."""
    return [slice(start, min(n, start + size)) for start in range(0, n, size)]


def _loss_chunk_size(n, k, d, d_out, m, budget=None):
    """Samples per chunk of the loss and gradient (:func:`_loss_gradient`).

    Its largest intermediates (patterns, head features, back-propagated pattern
    gradients) have ``m k max(k, d, d_out)`` floats per sample; ``budget`` as in
    :func:`_chunks`.

    Examples
    --------
    >>> _loss_chunk_size(10, 4, 8, 8, 2)
    10
    """
    budget = _CHUNK_FLOATS if budget is None else budget
    per_sample = max(m, 1) * k * max(k, d, d_out)  # m = 0: a layer of no heads
    return int(min(n, max(1, budget // per_sample)))


def _weights(n, sample_weight, like):
    """The normalised weights ``w / sum w`` on the host (numpy) and as an array
    like ``like`` (its namespace and device; float64)."""
    omega = _normalized_weights(n, to_numpy(sample_weight))
    xp = _namespace(like)
    if sample_weight is None and not is_numpy(xp):  # made there: no host copy
        return omega, xp.full((n,), 1.0 / n, dtype=xp.float64, device=device(like))
    return omega, to_namespace(omega, xp, device(like), dtype=xp.float64)


def _device_weights(n, sample_weight, like):
    """The normalised weights as an array like ``like`` (float64) alone: off
    numpy, made on its device from weights already of its namespace (or
    uniform), without the host read and copy of :func:`_weights` (the
    refinement builds its problems on device weights, about a hundred times a
    fit).  numpy: :func:`_weights`'s, to the bit."""
    xp = _namespace(like)
    on_device = sample_weight is None or (
        not isinstance(sample_weight, np.ndarray) and _namespace(sample_weight) is xp
    )
    if is_numpy(xp) or not on_device or sample_weight is None:
        return _weights(n, sample_weight, like)[1]  # uniform: made there
    w = to_namespace(sample_weight, xp, device(like), dtype=xp.float64)
    return w / xp.sum(w)


def _loss_gradient(
    X,
    Y,
    attention,
    projection,
    sample_weight=None,
    alpha=0.0,
    chunk_size=None,
    *,
    alpha_attention=0.0,
    gradient=True,
):
    """The weighted, ridge-penalised squared loss and its gradient, in chunks.

    ``J = sum_n w_n ||F(X_n) - Y_n||^2 / (2 sum_n w_n) + alpha ||W||^2 / 2 +
    alpha_attention ||Theta||^2 / 2``.  Each chunk's weighted mean loss (and
    gradient) from :func:`skattn.layer._math.squared_loss_gradient` is rescaled by the
    chunk's share of the weight; chunks of zero weight are skipped.  Memory is
    bounded by the chunk, whatever n; the result depends on the chunking only by
    rounding.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    sample_weight : ndarray of shape (n,) or None
        Non-negative with a positive sum; ``None`` weighs samples equally.
    alpha : float, default=0.0
        Ridge penalty on the projections.
    chunk_size : int or None, default=None
        Samples per chunk; ``None`` picks one from ``_CHUNK_FLOATS``
        (:func:`_loss_chunk_size`).
    alpha_attention : float, default=0.0
        Ridge penalty on the attention matrices.
    gradient : bool, default=True
        ``False`` computes only the loss (the forward pass; gradients are None).

    Returns
    -------
    loss : float
    grad_attention : ndarray of shape (m, d, d) or None
    grad_projection : ndarray of shape (m, d, d_out) or None

    Examples
    --------
    >>> import numpy as np
    >>> X = np.ones((5, 2, 3)); th = np.zeros((1, 3, 3)); W = np.zeros((1, 3, 1))
    >>> loss, g_th, g_w = _loss_gradient(X, np.ones((5, 2, 1)), th, W, chunk_size=2)
    >>> float(loss), g_th.shape, g_w.shape
    (1.0, (1, 3, 3), (1, 3, 1))
    """
    xp = _namespace(X, Y, attention, projection)
    n, k, d = X.shape
    if chunk_size is None:
        chunk_size = _loss_chunk_size(
            n, k, d, Y.shape[2], attention.shape[0], _chunk_budget(X)
        )
    omega, omega_x = _weights(n, sample_weight, X)

    def in_chunks(size):
        loss = 0.0  # a 0-d array after the first chunk: one host sync at the end
        grad_attention = xp.zeros_like(attention) if gradient else None
        grad_projection = xp.zeros_like(projection) if gradient else None
        for start in range(0, n, size):
            rows = slice(start, min(n, start + size))  # the standard: stop <= n
            share = float(np.sum(omega[rows]))
            if share == 0.0:
                continue
            x, y, w = X[rows, ...], Y[rows, ...], omega_x[rows]
            if not gradient:
                residual = forward(x, attention, projection) - y
                loss += 0.5 * xp.sum(w[:, None, None] * residual**2)
                continue
            chunk_loss, chunk_ga, chunk_gp = _squared_loss_gradient(
                x, y, attention, projection, w
            )
            loss += share * chunk_loss
            grad_attention += share * chunk_ga
            grad_projection += share * chunk_gp
        return float(loss), grad_attention, grad_projection

    loss, grad_attention, grad_projection = _halving(chunk_size, in_chunks)
    if alpha:
        loss += 0.5 * alpha * float(xp.sum(projection**2))
        if gradient:
            grad_projection += alpha * projection
    if alpha_attention:
        loss += 0.5 * alpha_attention * float(xp.sum(attention**2))
        if gradient:
            grad_attention += alpha_attention * attention
    return loss, grad_attention, grad_projection


def projection_normal_equations(X, Y, attention, sample_weight=None):
    """Normal equations of the projections given the attention matrices.

    With the design ``A`` whose row (n, l) is ``[(S_1 X_n)_l, ..., (S_m X_n)_l]``
    (length ``m d``), returns ``gram = A^T Omega A``, ``rhs = A^T Omega Y`` and
    ``y_sq = tr(Y^T Omega Y)``, ``Omega`` the normalised sample weights. Accumulated
    in chunks of samples.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    sample_weight : ndarray of shape (n,) or None

    Returns
    -------
    gram : ndarray of shape (m * d, m * d)
    rhs : ndarray of shape (m * d, d_out)
    y_sq : float

    Examples
    --------
    >>> import numpy as np
    >>> X = np.ones((3, 2, 2)); Y = np.ones((3, 2, 1))
    >>> gram, rhs, y_sq = projection_normal_equations(X, Y, np.zeros((1, 2, 2)))
    >>> gram.shape, rhs.shape, y_sq
    ((2, 2), (2, 1), 2.0)
    """
    xp = _namespace(X, Y, attention)
    n, k, d = X.shape
    m = attention.shape[0]
    d_out = Y.shape[2]
    omega = _device_weights(n, sample_weight, X)
    per_sample = m * k * (k + d)
    size = max(1, _chunk_budget(X) // max(1, per_sample))

    def in_chunks(size):
        gram = xp.zeros((m * d, m * d), dtype=xp.float64, device=device(X))
        rhs = xp.zeros((m * d, d_out), dtype=xp.float64, device=device(X))
        y_sq = 0.0  # a 0-d array after the first chunk: one host sync at the end
        for part in _slices(n, size):
            x, y, w = X[part, ...], Y[part, ...], omega[part]
            features = xp.matmul(attention_patterns(x, attention), x[:, None, ...])
            # rows (n, l), columns (i, p)
            design = xp.reshape(xp.permute_dims(features, (0, 2, 1, 3)), (-1, m * d))
            weighted = design * xp.repeat(w, k)[:, None]
            gram += weighted.T @ design
            rhs += weighted.T @ xp.reshape(y, (-1, d_out))
            y_sq += xp.sum(w[:, None, None] * y**2)
        return gram, rhs, float(y_sq)

    return _halving(size, in_chunks)


class _PseudoInverse:
    """The minimum-norm solve of a singular symmetric matrix, factored once.

    ``V diag(1 / lambda) V^T`` over the eigenvalues with ``|lambda| > size eps
    max|lambda|`` (the rank tolerance of ``numpy.linalg.matrix_rank``): what
    ``scipy.linalg.lstsq`` with that ``cond`` returns for a symmetric matrix,
    without a new SVD for every right-hand side.
    Gram matrices are singular when the tokens reach a proper subspace (inputs
    after a LayerNorm with the constant coordinate of ``fit_intercept``).
    """

    def __init__(self, matrix):
        xp = _namespace(matrix)
        if is_numpy(xp):
            values, vectors = linalg.eigh(matrix, driver="evd", check_finite=False)
        else:
            values, vectors = xp.linalg.eigh(matrix)
        largest = float(xp.max(xp.abs(values))) if values.shape[0] else 0.0
        cutoff = values.shape[0] * float(np.finfo(float).eps) * largest
        keep = xp.abs(values) > cutoff
        if is_numpy(xp):
            self.vectors = vectors[:, keep]
        else:  # a boolean index may only stand alone in the array API
            self.vectors = xp.take(vectors, xp.nonzero(keep)[0], axis=1)
        self.inverse_values = 1.0 / values[keep]

    def solve(self, rhs):
        xp = _namespace(self.vectors)
        coef = self.vectors.T @ rhs
        coef *= xp.reshape(self.inverse_values, (-1, *([1] * (coef.ndim - 1))))
        return self.vectors @ coef


class _Cholesky:
    """The lower Cholesky factor ``L`` of a positive definite matrix, outside numpy
    (numpy keeps scipy's ``cho_factor``): solves by two triangular solves."""

    def __init__(self, lower):
        self.lower = lower

    def solve(self, rhs):
        xp = _namespace(self.lower)
        vector = rhs.ndim == 1  # torch's triangular solve takes matrices only
        if vector:
            rhs = rhs[:, None]
        half = solve_triangular(xp, self.lower, rhs, lower=True)
        out = solve_triangular(xp, self.lower.T, half, lower=False)
        return out[:, 0] if vector else out


def _factor(matrix):
    """Cholesky factor of a symmetric PSD matrix; a :class:`_PseudoInverse` when it
    is not positive definite (singular, or indefinite by rounding).

    numpy: scipy's ``cho_factor``; other namespaces: a :class:`_Cholesky` (their
    Cholesky raises, or -- CuPy -- returns NaN, on a matrix that is not).  On
    torch no value is read by the host (a GPU's host would wait at every
    residual for the check, issue 63): the factor of ``matrix``, and where it
    is not definite that of ``matrix`` ridged by ``w eps max(diag)`` (the rank
    tolerance of ``numpy.linalg.matrix_rank``, as the batched heads' solves:
    coefficients of least norm up to it, the same fitted values), chosen on the
    device.
    """
    xp = _namespace(matrix)
    if is_numpy(xp):
        try:
            return linalg.cho_factor(matrix, lower=False, check_finite=False)
        except linalg.LinAlgError:
            return _PseudoInverse(matrix)
    if _compat.is_torch_namespace(xp):
        return _Cholesky(cholesky_unchecked(xp, matrix, rank_ridge(xp, matrix)))
    try:
        lower = xp.linalg.cholesky(matrix)
    except Exception:  # torch: _LinAlgError, others: their LinAlgError
        return _PseudoInverse(matrix)
    if not bool(xp.all(xp.isfinite(lower))):
        return _PseudoInverse(matrix)
    return _Cholesky(lower)


def _solve_psd(matrix, rhs, factor=None):
    """Solve ``matrix x = rhs`` for a symmetric PSD ``matrix``.

    Cholesky when it succeeds; otherwise the minimum-norm least-squares solution
    (:class:`_PseudoInverse`, as ``scipy.linalg.lstsq``), which also covers a
    singular Gram.  ``factor`` (from :func:`_factor`) is reused across calls.
    """
    if factor is None:
        factor = _factor(matrix)
    if isinstance(factor, (_PseudoInverse, _Cholesky)):
        return factor.solve(rhs)
    return linalg.cho_solve(factor, rhs, check_finite=False)


def solve_projections(X, Y, attention, sample_weight=None, alpha=0.0):
    """Least-squares projections ``W*`` given the attention matrices.

    ``W* = argmin_W sum_n w_n ||sum_i S_i X_n W_i - Y_n||^2 / (2 sum w) +
    alpha ||W||^2 / 2``: the normal equations ``(A^T Omega A + alpha I) W = A^T
    Omega Y`` are accumulated in chunks of samples (memory independent of n), solved
    by Cholesky (SVD-based ``scipy.linalg.lstsq`` when the Gram matrix is singular),
    then corrected by one step of iterative refinement whose residual is recomputed
    from the data (corrected semi-normal equations), which restores the accuracy
    lost by squaring the condition number in the Gram matrix.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    sample_weight : ndarray of shape (n,) or None
    alpha : float, default=0.0
        Ridge penalty on the projections, in units of the (normalised) loss.

    Returns
    -------
    projection : ndarray of shape (m, d, d_out)

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(200, 3, 4))
    >>> th = rng.normal(size=(2, 4, 4)); W = rng.normal(size=(2, 4, 2))
    >>> W_hat = solve_projections(X, forward(X, th, W), th)
    >>> bool(np.allclose(W_hat, W, atol=1e-10))
    True
    """
    projection, _ = _solve_projections(X, Y, attention, sample_weight, alpha)
    return projection


def _solve_projections(X, Y, attention, sample_weight, alpha, refine=True):
    """:func:`solve_projections` returning also ``(gram + alpha I)``'s factor."""
    xp = _namespace(X, Y, attention)
    m, d, _ = attention.shape
    d_out = Y.shape[2]
    gram, rhs, _ = projection_normal_equations(X, Y, attention, sample_weight)
    matrix = gram + alpha * xp.eye(m * d, dtype=gram.dtype, device=device(gram))
    factor = _factor(matrix)
    flat = _solve_psd(matrix, rhs, factor)
    if refine:
        # residual of the normal equations computed from the data: -(dL/dW)
        _, _, grad = _loss_gradient(
            X, Y, attention, xp.reshape(flat, (m, d, d_out)), sample_weight, alpha
        )
        correction = xp.reshape(grad, (m * d, d_out))
        flat = flat - _solve_psd(matrix, correction, factor)
    return xp.reshape(flat, (m, d, d_out)), (matrix, factor)


def reduced_loss_gradient(X, Y, attention, sample_weight=None, alpha=0.0):
    """Variable projection: the loss with the projections eliminated, and its gradient.

    ``phi(Theta) = L(Theta, W*(Theta))`` with ``W*`` from :func:`solve_projections`.
    By the envelope theorem (``dL/dW = 0`` at ``W*``) its gradient is the partial
    Theta-gradient of the loss at ``W*``, i.e. that of
    :func:`skattn.layer._math.squared_loss_gradient`.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    sample_weight : ndarray of shape (n,) or None
    alpha : float, default=0.0

    Returns
    -------
    loss : float
    grad_attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
        The minimising ``W*(Theta)``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(100, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 2))
    >>> loss, grad, W_hat = reduced_loss_gradient(X, forward(X, th, W), th)
    >>> bool(loss < 1e-20 and np.abs(grad).max() < 1e-10)
    True
    """
    projection, _ = _solve_projections(X, Y, attention, sample_weight, alpha)
    loss, grad_attention, _ = _loss_gradient(
        X, Y, attention, projection, sample_weight, alpha
    )
    return loss, grad_attention, projection


def _loss(X, Y, attention, projection, sample_weight, alpha):
    """The (ridge-penalised) weighted squared loss, computed from the residuals."""
    return _loss_gradient(
        X, Y, attention, projection, sample_weight, alpha, gradient=False
    )[0]


def relative_residual(X, Y, attention, projection, sample_weight=None):
    """``sqrt(sum w ||F(X) - Y||^2 / sum w ||Y||^2)`` (absolute when Y is 0).

    Examples
    --------
    >>> import numpy as np
    >>> X = np.ones((2, 2, 2)); th = np.zeros((1, 2, 2)); W = np.eye(2)[None]
    >>> relative_residual(X, X, th, W)
    0.0
    """
    omega = _device_weights(X.shape[0], sample_weight, X)
    y_sq = float(_namespace(X, Y).sum(omega[:, None, None] * Y**2))
    loss = _loss(X, Y, attention, projection, sample_weight, 0.0)
    return math.sqrt(2.0 * loss / y_sq) if y_sq > 0 else math.sqrt(2.0 * loss)


def uniform_residual(X, Y, sample_weight=None):
    """The relative residual of the best layer whose heads all attend uniformly.

    With ``Theta_i = 0`` every row of every head is the sequence's mean token
    ``x_bar``, and the layer is ``1 x_bar^T W`` (``W = sum_i W_i``): the least
    squares of ``Y`` on the mean tokens, which explains the tokens' shared part and
    nothing that depends on where a head attends.  A fit no better than this has
    found no head.  ``sqrt(sum w ||Y - 1 x_bar^T W||^2 / sum w ||Y||^2)`` at the
    best ``W`` (1.0 when ``Y`` is 0), in ``O(n k (d + d_out) + d^3)``.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(50, 4, 3))
    >>> uniform = np.repeat(X.mean(axis=1, keepdims=True), 4, axis=1)
    >>> Y = uniform @ rng.normal(size=(3, 2))
    >>> bool(uniform_residual(X, Y) < 1e-12), bool(uniform_residual(X, X) > 0.5)
    (True, True)
    """
    xp = _namespace(X, Y)
    n, k, _ = X.shape
    omega = _device_weights(n, sample_weight, X)
    # per-sequence sums in the arrays' dtype (no float64 copy of X or Y), then
    # float64: every row of a uniform head is the sequence's mean token
    x_bar = xp.astype(xp.mean(X, axis=1), xp.float64)  # (n, d)
    y_mean = xp.mean(Y, axis=1, keepdims=True)
    y_bar = xp.astype(y_mean[:, 0, :], xp.float64)  # (n, d_out)
    total = float(omega @ xp.astype(xp.sum(Y**2, axis=(1, 2)), xp.float64))
    if total <= 0:
        return 1.0
    # sum_l ||y_l - c||^2 = sum_l ||y_l - y_bar||^2 + k ||y_bar - c||^2
    spread = xp.astype(xp.sum((Y - y_mean) ** 2, axis=(1, 2)), xp.float64)
    root = xp.sqrt(omega)[:, None]
    coef = lstsq(xp, root * x_bar, root * y_bar)
    within = float(omega @ spread)
    between = k * float(xp.sum((root * (x_bar @ coef - y_bar)) ** 2))
    return math.sqrt(max(within + between, 0.0) / total)


def _penalized_loss_gradient(
    X, Y, attention, projection, sample_weight, alpha, chunk_size=None
):
    """The training objective J and its gradient, accumulated over sample chunks.

    ``J = sum_n w_n ||F(X_n) - Y_n||^2 / (2 sum_n w_n) + alpha/2 (||Theta||^2 +
    ||W||^2)``, by :func:`_loss_gradient` (the ridge on both
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
