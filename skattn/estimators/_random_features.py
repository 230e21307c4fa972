"""Random-feature attention (Fu, Guo, Bai & Mei, NeurIPS 2023).

A single attention layer with ``M`` heads whose query-key matrices ``W_m`` are drawn
at random and frozen, and whose values ``v_m`` are trained:

    f(X) = sum_m sum_i sigma_m(x_q, x_i) <v_m, x_i>

``x_q`` is the query (a token of the sequence) and the ``x_i`` are the keys.  The
output is linear in the values, so ``X -> [sum_i sigma_m(x_q, x_i) x_i]_m`` is a
feature map (:class:`RandomAttentionFeatures`, in the spirit of
:class:`~sklearn.kernel_approximation.RBFSampler`) and learning the values is ridge
regression (:class:`RandomFeatureAttentionRegressor`).
"""

import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.base import (
    BaseEstimator,
    RegressorMixin,
    TransformerMixin,
    _fit_context,
)
from sklearn.linear_model import Ridge
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import (
    _check_feature_names_in,
    _check_sample_weight,
    check_is_fitted,
    validate_data,
)

from ..layer._math import softmax
from ..utils._validation import (
    all_or_nothing,
    check_fitted_tokens,
    check_magnitude,
    check_no_overflow,
    check_target,
    flatten_tokens,
    resolve_n_tokens,
    unflatten_tokens,
)
from ._base import (
    RESCALE_Y,
    check_enough_samples,
    check_score_weights,
    check_weights,
)

# The shapes of y RandomFeatureAttentionRegressor accepts, as said by its errors.
_Y_SHAPES = (
    "an array of shape (n_samples,) or (n_samples, n_outputs): one output vector "
    "per sequence"
)

# Elements of the largest (chunk, n_heads, n_tokens or n_features) intermediate.
_CHUNK_ELEMENTS = 2**22


def draw_query_key(n_heads, n_features, *, mean=0.0, scale=1.0, random_state=None):
    """Random query-key matrices ``scale * (mean * I + G_m / sqrt(d))``.

    Parameters
    ----------
    n_heads : int
        Number of matrices M.
    n_features : int
        Features per token d.
    mean : float, default=0.0
        Multiple of the identity added to every matrix (the non-zero mean).
    scale : float, default=1.0
        Factor applied to the whole matrix (the inverse temperature of the logits).
    random_state : int, RandomState instance or None, default=None

    Returns
    -------
    query_key : ndarray of shape (n_heads, n_features, n_features)
        ``G_m`` has i.i.d. standard Gaussian entries.

    Examples
    --------
    >>> draw_query_key(3, 2, mean=1.0, random_state=0).shape
    (3, 2, 2)
    """
    rng = check_random_state(random_state)
    gaussian = rng.standard_normal((n_heads, n_features, n_features))
    return scale * (mean * np.eye(n_features) + gaussian / np.sqrt(n_features))


def query_and_keys(X, *, query="first", keys="all"):
    """Split sequences into their query token and their key tokens.

    Parameters
    ----------
    X : ndarray of shape (n_samples, n_tokens, n_features)
    query : {"first", "mean"}, default="first"
        ``"first"``: the query is token 0; ``"mean"``: the query is the mean token.
    keys : {"all", "others"}, default="all"
        ``"all"``: every token is a key (the query attends to itself too);
        ``"others"``: every token but the query token (needs ``query="first"``
        and at least 2 tokens).

    Returns
    -------
    x_query : ndarray of shape (n_samples, n_features)
    x_keys : ndarray of shape (n_samples, n_keys, n_features)

    Examples
    --------
    >>> import numpy as np
    >>> q, K = query_and_keys(np.arange(12.0).reshape(2, 3, 2), keys="others")
    >>> q.shape, K.shape
    ((2, 2), (2, 2, 2))
    """
    x_query = X[:, 0] if query == "first" else X.mean(axis=1)
    x_keys = X[:, 1:] if keys == "others" else X
    return x_query, x_keys


def random_attention_features(
    x_query, x_keys, query_key, *, attention="softmax", value_bias=False
):
    """Per-head attention-weighted sums of the keys: the random-feature map.

    For head m, with logits ``z_mi = x_q^T W_m x_i`` over the N keys, the weights
    are ``softmax_i(z_mi)`` (``attention="softmax"``) or ``max(z_mi, 0) / N``
    (``attention="relu"``), and the features are ``sum_i w_mi x_i``, followed by
    ``sum_i w_mi`` when ``value_bias`` is set.  So that for values ``V`` of shape
    ``(n_heads, n_values)``, ``features @ V.ravel()`` is the layer's output
    ``sum_m sum_i w_mi <v_m, x_i>`` (with ``x_i`` extended by a constant 1 when
    ``value_bias``).  Computed in chunks of samples; no loop over heads.

    Parameters
    ----------
    x_query : ndarray of shape (n_samples, n_features)
    x_keys : ndarray of shape (n_samples, n_keys, n_features)
    query_key : ndarray of shape (n_heads, n_features, n_features)
    attention : {"softmax", "relu"}, default="softmax"
    value_bias : bool, default=False

    Returns
    -------
    features : ndarray of shape (n_samples, n_heads * n_values)
        Head-major; ``n_values = n_features + value_bias``.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    >>> random_attention_features(X[:, 0], X, np.zeros((1, 2, 2)))
    array([[0.5, 0.5]])
    """
    n, n_keys, d = x_keys.shape
    m = query_key.shape[0]
    n_values = d + bool(value_bias)
    out = np.empty((n, m, n_values))
    chunk = max(1, _CHUNK_ELEMENTS // (m * max(n_keys, d)))
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        keys_t = np.swapaxes(x_keys[rows], 1, 2)[:, None]  # (c, 1, d, N)
        # (x_q^T W_m) for every head, then its inner product with every key.
        left = np.einsum("nd,mde->nme", x_query[rows], query_key, optimize=True)
        logits = np.matmul(left[:, :, None], keys_t)[:, :, 0]  # (c, m, N)
        if attention == "softmax":
            weights = softmax(logits, axis=-1)
        else:
            weights = np.maximum(logits, 0.0) / n_keys
        # sum_i w_mi x_i: (c, m, 1, N) @ (c, 1, N, d) -> (c, m, d)
        out[rows, :, :d] = np.matmul(weights[:, :, None], x_keys[rows][:, None])[
            :, :, 0
        ]
        if value_bias:
            out[rows, :, d] = weights.sum(axis=-1)
    return out.reshape(n, m * n_values)


def resolve_keys(query, keys, n_tokens):
    """The key tokens' rule a fit uses: ``keys`` with ``"auto"`` resolved.

    Parameters
    ----------
    query : {"first", "mean"}
    keys : {"auto", "all", "others"}
        ``"auto"`` is ``"others"`` when the query is token 0 of a sequence of at
        least 2 tokens (the setting of Fu et al.), else ``"all"``.
    n_tokens : int

    Returns
    -------
    keys : {"all", "others"}

    Examples
    --------
    >>> resolve_keys("first", "auto", 6), resolve_keys("first", "auto", 1)
    ('others', 'all')
    """
    if keys == "auto":
        return "others" if query == "first" and n_tokens >= 2 else "all"
    if keys == "others" and query != "first":
        raise ValueError(
            f"keys='others' excludes the query token from the keys, which needs "
            f"query='first'; got query={query!r}. Use keys='all' with query={query!r}."
        )
    if keys == "others" and n_tokens < 2:
        raise ValueError(
            f"keys='others' needs at least 2 tokens per sequence (a query and a key), "
            f"got n_tokens={n_tokens}. Pass n_tokens (or a 3-D X) or use keys='all'."
        )
    return keys


# Default ridge grid, relative to the scale of the features (see _default_alphas).
_RELATIVE_ALPHAS = np.logspace(-6, 3, 19)


def _default_alphas(features, sample_weight=None):
    """Ridge penalties ``_RELATIVE_ALPHAS * trace(F_c^T S F_c) / p``.

    ``F_c`` are the features centred by their (weighted) means, ``S`` the diagonal of
    sample weights and ``p`` the number of features: the grid is relative to the
    mean eigenvalue of the centred Gram matrix the penalty is added to, so it
    follows the scale of the data (ReLU features scale like ``|x|^3``).

    Parameters
    ----------
    features : ndarray of shape (n_samples, n_features)
    sample_weight : ndarray of shape (n_samples,) or None

    Returns
    -------
    alphas : ndarray of shape (len(_RELATIVE_ALPHAS),)
    """
    weights = np.ones(len(features)) if sample_weight is None else sample_weight
    centred = features - np.average(features, axis=0, weights=weights)
    scale = np.einsum("n,nj,nj->", weights, centred, centred) / features.shape[1]
    if not (np.isfinite(scale) and scale > 0):  # constant features: any grid
        scale = 1.0
    return _RELATIVE_ALPHAS * scale


def _check_alphas(alphas):
    """Reject an empty grid and penalties that are not finite and positive."""
    if alphas.size == 0:
        raise ValueError("alphas is empty; pass at least one positive penalty.")
    bad = ~(np.isfinite(alphas) & (alphas > 0))
    if bad.any():
        raise ValueError(
            f"alphas must be finite and > 0; got {alphas[bad][:5].tolist()} at "
            f"position(s) {np.flatnonzero(bad)[:5].tolist()}."
        )


def _leave_one_out_errors(features, y, alphas, sample_weight=None):
    """Leave-one-out squared error of ridge regression for every penalty.

    A row of weight ``w_i`` stands for ``w_i`` copies of itself, and leaving it
    out leaves out one copy, ``u_i = min(w_i, 1)`` of its weight (the whole row
    when ``w_i <= 1``), so that integer weights give exactly the leave-one-out
    error of the repeated rows.  With the intercept unpenalised, the per-unit
    leverage of row i is ``h_i = 1 / sum(w) + x_ci^T (F_c^T S F_c + alpha I)^{-1}
    x_ci`` (``F_c`` centred by the weighted means, ``S = diag(w)``), and the
    residual with ``u_i`` of row i left out is ``e_i / (1 - u_i h_i)``
    (Sherman-Morrison), ``e_i`` the in-sample residual.  One eigendecomposition,
    of the ``n x n`` weighted Gram matrix or of the ``p x p`` weighted
    covariance (whichever is smaller), serves every penalty.

    Parameters
    ----------
    features : ndarray of shape (n_samples, n_features)
    y : ndarray of shape (n_samples,) or (n_samples, n_outputs)
    alphas : ndarray of shape (n_alphas,)
        Positive penalties.
    sample_weight : ndarray of shape (n_samples,) or None
        Non-negative weights with a positive sum; ``None`` is all ones.

    Returns
    -------
    errors : ndarray of shape (n_alphas,)
        ``sum_i w_i ||loo residual_i||^2 / (sum(w) * n_outputs)``.

    Notes
    -----
    Unlike :class:`~sklearn.linear_model.RidgeCV`, which leaves out the whole
    weighted row (``u_i = w_i``), the error is invariant to replacing a row of
    integer weight ``w_i`` by ``w_i`` copies of weight 1, hence so is the penalty
    it selects.

    Examples
    --------
    >>> import numpy as np
    >>> F = np.random.default_rng(0).normal(size=(6, 2))
    >>> _leave_one_out_errors(F, F[:, 0], np.array([1e-3, 1e3])).round(3)
    array([0.   , 0.786])
    """
    Y = y.reshape(len(y), -1)
    weights = np.ones(len(Y)) if sample_weight is None else sample_weight
    keep = weights > 0  # rows of weight 0 take no part in the fit or the error
    features, Y, weights = features[keep], Y[keep], weights[keep]
    total = weights.sum()
    centred = features - weights @ features / total
    Y = Y - weights @ Y / total
    roots = np.sqrt(weights)[:, None]
    removed = np.minimum(weights, 1.0)
    n, p = centred.shape
    errors = np.zeros(len(alphas))
    if n <= p:
        # Weighted Gram matrix S^1/2 F_c F_c^T S^1/2 = U diag(lam) U^T.  In the
        # scaled problem, I - hat = U diag(alpha / (lam + alpha)) U^T - s s^T / W
        # (s = sqrt(w)); the residuals and 1 - hat are computed from it directly,
        # not as 1 minus a number close to 1, which loses every digit when the
        # features nearly interpolate (n << p).
        scaled = roots * centred
        lam, U = _eigh_exact_null(scaled @ scaled.T)
        projected = U.T @ (roots * Y)
        squares = U**2
        for j, alpha in enumerate(alphas):
            keep_part = alpha / (lam + alpha)
            residual = (U @ (keep_part[:, None] * projected)) / roots
            # w_i h_i = 1 - (diag of I - hat)
            weighted_leverage = 1.0 - (squares @ keep_part - weights / total)
            leverage = weighted_leverage / weights
            errors[j] = _weighted_loo_error(residual, leverage, removed, weights)
    else:
        # Weighted covariance F_c^T S F_c = V diag(lam) V^T; with Z = F_c V the
        # coefficients are V diag(1 / (lam + alpha)) Z^T S Y.
        lam, V = _eigh_exact_null(centred.T @ (weights[:, None] * centred))
        Z = centred @ V
        projected = Z.T @ (weights[:, None] * Y)
        squares = Z**2
        for j, alpha in enumerate(alphas):
            inverse = 1.0 / (lam + alpha)
            residual = Y - Z @ (inverse[:, None] * projected)
            leverage = 1.0 / total + squares @ inverse
            errors[j] = _weighted_loo_error(residual, leverage, removed, weights)
    return errors / (total * Y.shape[1])


def _eigh_exact_null(gram):
    """``eigh`` of a positive semi-definite matrix, with the eigenvalues below its
    rounding level (``size * eps * largest``) set to exactly 0.

    Repeated rows and the centring make the Gram matrix singular; its computed
    null eigenvalues are rounding noise of size ``eps * largest``, and a penalty
    much smaller than ``sqrt(eps) * largest`` would turn that noise into errors
    larger than the leave-one-out quantities themselves.
    """
    lam, vectors = np.linalg.eigh(gram)
    rounding = len(lam) * np.finfo(np.float64).eps * max(lam[-1], 0.0)
    return np.where(lam > rounding, lam, 0.0), vectors


def _weighted_loo_error(residual, leverage, removed, weights):
    """``sum_i w_i ||e_i / (1 - u_i h_i)||^2``; a row that alone fixes its own fit
    (``u_i h_i = 1``, e.g. a single row) has ``e_i = 0`` and adds nothing."""
    denominator = np.maximum(1.0 - removed * leverage, np.finfo(np.float64).eps)
    loo = residual / denominator[:, None]
    return float(weights @ np.einsum("ij,ij->i", loo, loo))


_FEATURE_CONSTRAINTS = {
    "n_heads": [Interval(Integral, 1, None, closed="left")],
    "n_tokens": [Interval(Integral, 1, None, closed="left"), None],
    "query": [StrOptions({"first", "mean"})],
    "keys": [StrOptions({"auto", "all", "others"})],
    "attention": [StrOptions({"softmax", "relu"})],
    "mean": [Interval(Real, None, None, closed="neither")],
    "scale": [Interval(Real, None, None, closed="neither")],
    "value_bias": ["boolean"],
    "random_state": ["random_state"],
}


def _feature_degree(attention):
    """Highest power of X in the features: ReLU weights ``z / N`` are logits (two
    entries of X), times a key; softmax weights are bounded, so only the key."""
    return 3 if attention == "relu" else 1


def _check_leave_one_out(n_samples, sample_weight):
    """Raise unless leave-one-out has 2 rows of positive weight to leave out."""
    n_fit = n_samples if sample_weight is None else int(np.sum(sample_weight > 0))
    if n_fit < 2:
        rows = "sample" if n_fit == 1 else "samples"
        weighted = "" if sample_weight is None else " with a positive weight"
        raise ValueError(
            f"alpha=None chooses the ridge penalty by leave-one-out "
            f"cross-validation, which needs at least 2 samples with a positive "
            f"weight; got {n_fit} {rows}{weighted}. Pass more samples, or a fixed "
            f"penalty (e.g. alpha=1.0)."
        )


def _warn_per_token_layout(name, width, n_tokens):
    """Warn that a y of ``n_tokens * j`` columns may be per-token outputs."""
    per_token = width // n_tokens
    warnings.warn(
        f"y has {width} columns, a multiple of n_tokens={n_tokens}: if they are "
        f"per-token outputs (n_tokens * n_outputs, token-major, as skattn's other "
        f"regressors take them), {name} fits them all from the query's features "
        f"alone, because it predicts one output vector per sequence. Pass the "
        f"query token's outputs (y[:, :{per_token}] for query='first') or use "
        f"GradientAttentionRegressor or MultiHeadAttentionRegressor, which predict "
        f"every token. If y is one vector per sequence, ignore this warning.",
        UserWarning,
        stacklevel=5,  # this, fit, all_or_nothing, _fit_context: the caller's line
    )


class RandomAttentionFeatures(TransformerMixin, BaseEstimator):
    """Random-feature attention: frozen random query-key heads as a feature map.

    Each sequence of ``k`` tokens has a query ``x_q`` and keys ``x_1..x_N``.  Head
    ``m`` has a frozen random query-key matrix ``W_m`` and weights the keys by
    ``sigma(x_q^T W_m x_i)``: ``relu(z) / N`` or ``softmax`` over the keys.  The
    features of head m are the weighted sum of the keys ``sum_i sigma_mi x_i`` (and
    the total weight ``sum_i sigma_mi``), so a linear map of the features with
    coefficients ``v_m`` is exactly the output ``sum_m sum_i sigma_mi <v_m, x_i>``
    of the attention layer of Fu et al. (2023) with trainable values.  Fitting only
    draws the matrices.

    The defaults are the variant Fu et al. analyse (ReLU attention, non-zero-mean
    query-key matrices, the value bias, keys other than the query), the same as
    :class:`RandomFeatureAttentionRegressor`'s, so that this transformer followed
    by ridge regression is that regressor.

    Parameters
    ----------
    n_heads : int, default=100
        Number of random heads M.
    n_tokens : int, default=None
        Tokens per sequence k.  ``None`` takes k from a 3-D X, else k = 1 (the
        single token is then both the query and the only key).
    query : {"first", "mean"}, default="first"
        Which vector queries: the first token, or the mean of the tokens.
    keys : {"auto", "all", "others"}, default="auto"
        ``"others"``: tokens 1..k-1 are the keys and token 0 is only the query, the
        setting of Fu et al.; needs ``query="first"`` and ``k >= 2``.
        ``"all"``: every token is a key, the query token included, so that with
        ``attention="softmax"`` the features are the first row of a self-attention
        layer (``skattn.layer._math.head_features(X, query_key_)[:, :, 0]``).
        ``"auto"`` (default): ``"others"`` when ``query="first"`` and ``k >= 2``,
        else ``"all"``.  Default because a target of the query and the *other*
        tokens, such as ``mean_i f(<x_0, x_i>)``, is not blurred by the query's
        attention to itself; ``"auto"`` rather than ``"others"`` so that
        single-token data still works.
    attention : {"relu", "softmax"}, default="relu"
        ``"relu"``: weights ``max(x_q^T W_m x_i, 0) / N`` with N the number of
        keys, the ReLU attention with ``1/N`` normalisation analysed by Fu et al.
        ``"softmax"``: weights ``softmax_i(x_q^T W_m x_i)``, summing to 1 over the
        keys.  ReLU is the default because its weights are not normalised, so the
        features carry *how much* each key matches the query, which targets like
        ``mean_i f(<x_q, x_i>)`` need; softmax weights only say which keys match
        best.
    mean : float, default=2.0
        Non-zero mean of the query-key matrices:
        ``W_m = scale * (mean * I_d + G_m / sqrt(d))`` with ``G_m`` standard
        Gaussian.  A positive mean biases every head towards attending to keys
        aligned with the query, which Fu et al. show lowers the sample complexity
        of targets of the form ``sum_i f(<x_q, x_i>)``.  The logits are then
        ``mean * <x_q, x_i>`` plus a random part of about the same spread as
        ``<x_q, x_i>`` whatever d, so ``mean=2`` makes the alignment dominate in
        every dimension without switching off the random directions.  Use
        ``mean=0`` for the zero-mean random features, which do better on targets
        even in ``<x_q, x_i>`` (such as ``|<x_q, x_i>|``).
    scale : float, default=1.0
        Factor on the whole matrix, i.e. the inverse temperature of the logits.
        For ``attention="relu"`` it only rescales the features.
    value_bias : bool, default=True
        Append a constant 1 to every key's value vector, i.e. add the total weight
        ``sum_i sigma_mi`` of each head as a feature (``n_features + 1`` features
        per head).  Default because under ReLU it is what lets the layer express
        targets like ``(1/N) sum_i f(<x_q, x_i>)`` that do not depend linearly on
        the keys (Fu et al. append a constant coordinate to every token for the
        same effect); under softmax it is a constant feature.
    random_state : int, RandomState instance or None, default=None
        Seeds the query-key matrices.

    Attributes
    ----------
    query_key_ : ndarray of shape (n_heads, n_features, n_features)
        The frozen query-key matrices ``W_m`` (``scale`` and ``mean`` folded in).
    keys_ : {"all", "others"}
        The keys rule used, ``keys`` with ``"auto"`` resolved.
    n_features_in_ : int
        Width of the flattened input seen in ``fit``.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Input column names, when X has string column names.
    n_tokens_ : int
        Tokens per sequence k.
    n_features_per_token_ : int
        Features per token d.
    n_values_per_head_ : int
        Features per head: ``d + value_bias``.

    See Also
    --------
    RandomFeatureAttentionRegressor : these features followed by ridge regression.
    sklearn.kernel_approximation.RBFSampler : random Fourier features of the RBF
        kernel, the generic counterpart.

    Notes
    -----
    ``transform`` computes only the query's row of each attention pattern, in
    ``O(n M k d + n M d^2)`` time, in chunks of samples to bound the memory.

    References
    ----------
    H. Fu, T. Guo, Y. Bai and S. Mei. What can a single attention layer learn? A
    study through the random features lens. NeurIPS 2023. arXiv:2307.11353.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import RandomAttentionFeatures
    >>> X = np.random.default_rng(0).normal(size=(5, 4, 3))  # 4 tokens of 3 features
    >>> rfa = RandomAttentionFeatures(n_heads=10, random_state=0)
    >>> rfa.fit_transform(X).shape  # 10 heads, 3 features + the total weight each
    (5, 40)
    >>> rfa.query_key_.shape, rfa.n_tokens_, rfa.keys_
    ((10, 3, 3), 4, 'others')
    """

    _parameter_constraints = dict(_FEATURE_CONSTRAINTS)

    def __init__(
        self,
        n_heads=100,
        n_tokens=None,
        *,
        query="first",
        keys="auto",
        attention="relu",
        mean=2.0,
        scale=1.0,
        value_bias=True,
        random_state=None,
    ):
        self.n_heads = n_heads
        self.n_tokens = n_tokens
        self.query = query
        self.keys = keys
        self.attention = attention
        self.mean = mean
        self.scale = scale
        self.value_bias = value_bias
        self.random_state = random_state

    @_fit_context(prefer_skip_nested_validation=True)
    @all_or_nothing
    def fit(self, X, y=None):
        """Draw the frozen query-key matrices for sequences shaped like X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)
        y : ignored

        Returns
        -------
        self : RandomAttentionFeatures

        Raises
        ------
        ValueError
            On invalid X (a ragged list, NaN, a width not divisible by
            ``n_tokens``, values too large for float64 arithmetic); the fitted
            attributes of a previous fit are then left as they were.
        """
        X, k3 = flatten_tokens(X)
        X = validate_data(self, X, reset=True, dtype=np.float64)
        check_magnitude(
            X,
            "X",
            max(_feature_degree(self.attention), 2),  # the features, the logits
            type(self).__name__,
            what="the logits and the attention-weighted keys",
        )
        k = resolve_n_tokens(X.shape[1], self.n_tokens, k3)
        self.keys_ = resolve_keys(self.query, self.keys, k)
        d = X.shape[1] // k
        self.n_tokens_ = k
        self.n_features_per_token_ = d
        self.n_values_per_head_ = d + bool(self.value_bias)
        self.query_key_ = draw_query_key(
            self.n_heads,
            d,
            mean=self.mean,
            scale=self.scale,
            random_state=self.random_state,
        )
        return self

    def transform(self, X):
        """Random-feature attention features of X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        features : ndarray of shape (n_samples, n_heads * `n_values_per_head_`)
            Head-major: columns ``[m * n_values_per_head_, (m + 1) *
            n_values_per_head_)`` are ``sum_i sigma_mi x_i`` for head m (then
            ``sum_i sigma_mi`` when ``value_bias``).
        """
        check_is_fitted(self)
        X, k3 = flatten_tokens(X)
        X = validate_data(self, X, reset=False, dtype=np.float64)
        check_fitted_tokens(k3, self.n_tokens_)
        x_query, x_keys = query_and_keys(
            unflatten_tokens(X, self.n_tokens_), query=self.query, keys=self.keys_
        )
        features = random_attention_features(
            x_query,
            x_keys,
            self.query_key_,
            attention=self.attention,
            value_bias=self.value_bias,
        )
        return check_no_overflow(
            features, "The random attention features", X=X, query_key_=self.query_key_
        )

    def get_feature_names_out(self, input_features=None):
        """Output names ``head{m}_feature{j}`` (and ``head{m}_weight``), head-major.

        Parameters
        ----------
        input_features : array-like of str or None, default=None
            Only checked against the input seen in ``fit``.

        Returns
        -------
        feature_names_out : ndarray of str objects
        """
        check_is_fitted(self)
        _check_feature_names_in(self, input_features, generate_names=False)
        per_head = [f"feature{j}" for j in range(self.n_features_per_token_)]
        if self.value_bias:
            per_head.append("weight")
        return np.asarray(
            [f"head{m}_{name}" for m in range(self.n_heads) for name in per_head],
            dtype=object,
        )


class RandomFeatureAttentionRegressor(RegressorMixin, BaseEstimator):
    """Random-feature attention layer trained by ridge regression (Fu et al. 2023).

    :class:`RandomAttentionFeatures` (frozen random query-key heads) followed by
    ridge regression on the features, which learns the values ``v_m``.  The model
    is the attention layer
    ``f(X) = sum_m sum_i sigma(x_q^T W_m x_i) <v_m, x_i> + intercept``.

    The defaults are the random-feature attention of Fu et al.: ReLU attention
    with ``1/N`` normalisation, query-key matrices with a non-zero mean, the value
    bias, and keys other than the query; and the ridge penalty is chosen by
    efficient leave-one-out cross-validation (as in
    :class:`~sklearn.linear_model.RidgeCV`, but with sample weights counting
    copies of a row; see Notes).  The softmax and zero-mean variants
    are one parameter away (``attention="softmax"``, ``mean=0.0``).

    It predicts one output vector per sequence (the query's output), not one per
    token, so unlike skattn's other regressors it does not subclass
    ``BaseAttentionRegressor`` and ``y`` has shape ``(n_samples,)`` or
    ``(n_samples, n_outputs)``.  Per-token targets are a mistake here (every
    token's outputs would be fitted from the query alone): a 3-D ``y`` of shape
    ``(n_samples, n_tokens, n_outputs)`` raises a ValueError, and a 2-D ``y``
    whose width is a multiple of ``n_tokens`` (the token-major layout of the
    other regressors, which its shape alone cannot tell from as many outputs
    per sequence) gives a ``UserWarning``.

    Parameters
    ----------
    n_heads : int, default=100
        Number of random heads M.
    n_tokens : int, default=None
        Tokens per sequence k.  ``None`` takes k from a 3-D X, else k = 1.
    query : {"first", "mean"}, default="first"
        Which vector queries; see :class:`RandomAttentionFeatures`.
    keys : {"auto", "all", "others"}, default="auto"
        Which tokens are keys; ``"auto"`` is ``"others"`` (every token but the
        query, as in Fu et al.) when ``query="first"`` and ``k >= 2``, else
        ``"all"``.  See :class:`RandomAttentionFeatures`.
    attention : {"relu", "softmax"}, default="relu"
        ``relu(z) / N`` (Fu et al.'s ReLU attention; its unnormalised weights say
        how much each key matches the query), or ``softmax`` over the keys.
    mean : float, default=2.0
        Non-zero mean: ``W_m = scale * (mean * I_d + G_m / sqrt(d))``.  Fu et al.
        show that a mean aligning queries with keys lowers the sample complexity
        of targets ``sum_i f(<x_q, x_i>)``; ``mean=2`` makes that alignment
        dominate the random part in any dimension.  ``mean=0.0`` gives the
        zero-mean random features.
    scale : float, default=1.0
        Factor on the query-key matrices (inverse temperature).
    value_bias : bool, default=True
        Append a constant 1 to the keys' value vectors (adds each head's total
        attention weight as a feature); with ReLU attention this is what
        expresses targets ``(1/N) sum_i f(<x_q, x_i>)`` that are not linear in
        the keys.
    alpha : float or None, default=None
        Ridge penalty on the values.  ``None`` chooses it from ``alphas`` by
        efficient leave-one-out cross-validation (see Notes): the right penalty
        depends on the scale of the features, which grows like ``|x|^3``, so no
        fixed value is a sensible default.  A float fixes it (plain
        :class:`~sklearn.linear_model.Ridge`).
    alphas : array-like of float or None, default=None
        Candidate penalties when ``alpha=None``, used as given.  ``None``: 19
        values log-spaced over ``1e-6 .. 1e3`` times the mean eigenvalue of the
        centred Gram matrix of the features, ``trace(F_c^T F_c) / p``, so that
        the grid follows the scale of the data.  Ignored when ``alpha`` is set.
    random_state : int, RandomState instance or None, default=None
        Seeds the query-key matrices.

    Attributes
    ----------
    features_ : RandomAttentionFeatures
        The fitted feature map (holds ``query_key_`` and ``keys_``).
    ridge_ : Ridge
        The fitted ridge regression on the features, at penalty ``alpha_``.
    alpha_ : float
        The ridge penalty used: the leave-one-out choice when ``alpha=None``,
        else ``alpha``.
    alphas_ : ndarray of shape (n_alphas,)
        The penalties searched; only when ``alpha=None``.
    loo_errors_ : ndarray of shape (n_alphas,)
        The weighted leave-one-out mean squared error of each penalty in
        ``alphas_``; ``alpha_`` is the first with the least.  Only when
        ``alpha=None``.
    values_ : ndarray of shape (n_heads, n_values_per_head, n_outputs)
        The learned values ``v_m`` (``ridge_.coef_`` per head; n_outputs is 1 for
        a 1-D y).
    intercept_ : float or ndarray of shape (n_outputs,)
        ``ridge_.intercept_``.
    n_features_in_ : int
        Width of the flattened input seen in ``fit``.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Input column names, when X has string column names.
    n_tokens_ : int
        Tokens per sequence k.
    n_features_per_token_ : int
        Features per token d.

    See Also
    --------
    RandomAttentionFeatures : the feature map alone, for use in a Pipeline.
    sklearn.linear_model.RidgeCV : ridge regression with efficient
        leave-one-out cross-validation, which leaves out whole weighted rows.

    Notes
    -----
    With ``alpha=None`` the penalty minimises the leave-one-out error computed
    in closed form from one eigendecomposition (of the ``n x n`` Gram matrix or
    the ``p x p`` covariance of the centred features, whichever is smaller).  A
    sample weight ``w_i`` counts copies of row i, as it does in the ridge
    objective ``sum_i w_i ||y_i - f(x_i)||^2 + alpha ||v||^2``: leaving row i
    out removes one copy (the whole row when ``w_i <= 1``) and its error counts
    ``w_i`` times.  So integer weights give exactly the penalty, hence the fit,
    of the repeated rows.  :class:`~sklearn.linear_model.RidgeCV` leaves out a
    whole weighted row instead, which is a different criterion from
    leave-one-out on the repeated rows and can select a penalty 100 times
    larger.

    References
    ----------
    H. Fu, T. Guo, Y. Bai and S. Mei. What can a single attention layer learn? A
    study through the random features lens. NeurIPS 2023. arXiv:2307.11353.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import RandomFeatureAttentionRegressor
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 5, 4))  # query + 4 keys
    >>> y = np.maximum(np.einsum("nd,nkd->nk", X[:, 0], X[:, 1:]), 0).mean(axis=1)
    >>> reg = RandomFeatureAttentionRegressor(n_heads=50, random_state=0)
    >>> reg.fit(X[:200], y[:200]).score(X[200:], y[200:]) > 0.9
    True
    >>> reg.values_.shape, reg.features_.keys_
    ((50, 5, 1), 'others')
    """

    _parameter_constraints = {
        **_FEATURE_CONSTRAINTS,
        "alpha": [Interval(Real, 0, None, closed="left"), None],
        "alphas": ["array-like", None],
    }

    def __init__(
        self,
        n_heads=100,
        n_tokens=None,
        *,
        query="first",
        keys="auto",
        attention="relu",
        mean=2.0,
        scale=1.0,
        value_bias=True,
        alpha=None,
        alphas=None,
        random_state=None,
    ):
        self.n_heads = n_heads
        self.n_tokens = n_tokens
        self.query = query
        self.keys = keys
        self.attention = attention
        self.mean = mean
        self.scale = scale
        self.value_bias = value_bias
        self.alpha = alpha
        self.alphas = alphas
        self.random_state = random_state

    @_fit_context(prefer_skip_nested_validation=True)
    @all_or_nothing
    def fit(self, X, y, sample_weight=None):
        """Draw the random heads and fit the values by ridge regression.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            The target of each sequence (the query's output).
        sample_weight : array-like of shape (n_samples,), default=None
            Passed to the ridge regression's ``fit``.

        Returns
        -------
        self : RandomFeatureAttentionRegressor

        Raises
        ------
        ValueError
            On invalid X, y or sample_weight (ragged lists, NaN, per-token y of
            shape ``(n_samples, n_tokens, n_outputs)``, values too large for
            float64 arithmetic), and on fewer than 2 samples of positive weight
            (with ``alpha=None`` the message names leave-one-out, which needs
            2).  The fitted attributes of a previous fit are then left as they
            were.
        TypeError
            On sparse X or y.

        Warns
        -----
        UserWarning
            When y has a multiple of ``n_tokens`` columns (``n_tokens >= 2``):
            the layout of per-token targets, which this estimator would fit from
            the query alone.
        """
        X, k3 = flatten_tokens(X)
        y = check_target(y, type(self).__name__, _Y_SHAPES)
        if getattr(y, "ndim", 0) > 2:
            raise ValueError(
                f"y has shape {np.shape(y)}, one output vector per token, but "
                f"{type(self).__name__} predicts one output vector per sequence "
                f"(the query's): pass y of shape (n_samples,) or (n_samples, "
                f"n_outputs), e.g. the query token's outputs y[:, 0] for "
                f"query='first', or fit GradientAttentionRegressor or "
                f"MultiHeadAttentionRegressor, which predict every token."
            )
        X, y = validate_data(
            self, X, y, reset=True, multi_output=True, y_numeric=True, dtype=np.float64
        )
        name = type(self).__name__
        check_magnitude(
            X,
            "X",
            max(2 * _feature_degree(self.attention), 2),  # the Gram matrix, the logits
            name,
            what="the logits and the Gram matrix of the attention features",
        )
        check_magnitude(y, "y", 2, name, what="the squared errors", fix=RESCALE_Y)
        k = resolve_n_tokens(X.shape[1], self.n_tokens, k3)
        if sample_weight is not None:
            sample_weight = _check_sample_weight(sample_weight, X, dtype=np.float64)
            check_weights(sample_weight)
        if self.alpha is None:  # first: the reason that names alpha
            _check_leave_one_out(len(X), sample_weight)
        check_enough_samples(len(X), sample_weight, name)
        if k >= 2 and y.ndim == 2 and y.shape[1] % k == 0:
            _warn_per_token_layout(name, y.shape[1], k)
        self.features_ = RandomAttentionFeatures(
            self.n_heads,
            k,
            query=self.query,
            keys=self.keys,
            attention=self.attention,
            mean=self.mean,
            scale=self.scale,
            value_bias=self.value_bias,
            random_state=self.random_state,
        )
        features = self.features_.fit_transform(X)
        if self.alpha is None:
            if self.alphas is None:
                alphas = _default_alphas(features, sample_weight)
            else:
                alphas = np.asarray(self.alphas, dtype=np.float64).ravel()
                _check_alphas(alphas)
            errors = _leave_one_out_errors(features, y, alphas, sample_weight)
            self.alphas_ = alphas
            self.loo_errors_ = errors
            self.alpha_ = float(alphas[int(np.argmin(errors))])
        else:
            self.alpha_ = float(self.alpha)
        self.ridge_ = Ridge(alpha=self.alpha_).fit(
            features, y, sample_weight=sample_weight
        )
        self.n_tokens_ = k
        self.n_features_per_token_ = X.shape[1] // k
        coef = np.atleast_2d(self.ridge_.coef_)  # (n_outputs, n_heads * n_values)
        self.values_ = coef.T.reshape(
            self.n_heads, self.features_.n_values_per_head_, coef.shape[0]
        )
        self.intercept_ = self.ridge_.intercept_
        return self

    def predict(self, X):
        """Output of the fitted random-feature attention layer.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        y_pred : ndarray of shape (n_samples,) or (n_samples, n_outputs)
        """
        check_is_fitted(self)
        X, k3 = flatten_tokens(X)
        X = validate_data(self, X, reset=False, dtype=np.float64)
        check_fitted_tokens(k3, self.n_tokens_)
        y_pred = self.ridge_.predict(self.features_.transform(X))
        return check_no_overflow(y_pred, "predict", X=X, values_=self.values_)

    def score(self, X, y, sample_weight=None):
        """The coefficient of determination R^2 of the predictions.

        :meth:`sklearn.base.RegressorMixin.score`, with ``sample_weight``
        checked as by ``fit`` first (no negative value, a positive sum).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            True outputs of the sequences.
        sample_weight : array-like of shape (n_samples,), default=None
            Weights of the samples.

        Returns
        -------
        score : float
            R^2 of ``predict(X)`` (1 for a perfect fit).

        Raises
        ------
        ValueError
            On invalid X, and on ``sample_weight`` with a negative value or a
            zero sum (before predicting).
        """
        sample_weight = check_score_weights(sample_weight)
        return super().score(X, y, sample_weight=sample_weight)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        return tags
