"""Shared machinery of skattn's regressors: token layout, validation, predict."""

import functools
from numbers import Integral

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils._param_validation import Interval
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import (
    _check_sample_weight,
    check_is_fitted,
    validate_data,
)

from ..layer import AttentionLayer
from ..layer._math import forward
from ..utils._batches import is_out_of_core, validate_batches
from ..utils._validation import (
    check_fitted_tokens,
    check_magnitude,
    check_no_overflow,
    check_target,
    flatten_tokens,
    resolve_n_tokens,
    unflatten_tokens,
)

# The shape of y that the per-token regressors accept, as said by their errors.
Y_SHAPES = "a 2-D array of shape (n_samples, n_tokens * n_outputs), token-major"

# How to rescale a y too large for float64, as said by the errors.
RESCALE_Y = (
    "e.g. with sklearn.compose.TransformedTargetRegressor(regressor, "
    "transformer=StandardScaler())"
)


def available_if_explained(check):
    """scikit-learn's ``available_if``, raising the check's own AttributeError.

    ``check(self)`` returns True or raises an AttributeError saying why the method
    is missing.  ``available_if`` turns that into ``"This ... has no attribute
    ..."`` (the reason only in the chained exception); here the reason is the
    error itself.  ``hasattr`` is False all the same.

    Examples
    --------
    >>> def _needs_adam(self):
    ...     if self.optimizer != "adam":
    ...         raise AttributeError("partial_fit needs optimizer='adam'.")
    ...     return True
    >>> class Est:
    ...     optimizer = "lbfgs"
    ...     @available_if_explained(_needs_adam)
    ...     def partial_fit(self):
    ...         return "one epoch"
    >>> hasattr(Est(), "partial_fit")
    False
    >>> Est().partial_fit()
    Traceback (most recent call last):
    ...
    AttributeError: partial_fit needs optimizer='adam'.
    """

    def decorator(fn):
        return _ExplainedDescriptor(available_if(check)(fn))

    return decorator


class _ExplainedDescriptor:
    """Wraps ``available_if``'s descriptor; see :func:`available_if_explained`."""

    def __init__(self, descriptor):
        self._descriptor = descriptor
        self.fn = descriptor.fn  # the method, as on scikit-learn's descriptor
        functools.update_wrapper(self, descriptor.fn)

    def __get__(self, obj, owner=None):
        try:
            return self._descriptor.__get__(obj, owner)
        except AttributeError as exc:
            reason = exc.__cause__
            if isinstance(reason, AttributeError) and str(reason):
                raise reason from None
            raise


def check_weights(sample_weight):
    """Reject negative weights and an all-zero weight vector; return the weights.

    Examples
    --------
    >>> import numpy as np
    >>> check_weights(np.array([1.0, 0.0, 2.0]))
    array([1., 0., 2.])
    """
    if np.any(sample_weight < 0):
        raise ValueError(
            f"sample_weight has {int(np.sum(sample_weight < 0))} negative value(s); "
            f"expected non-negative weights."
        )
    if not np.sum(sample_weight) > 0:
        raise ValueError(
            "sample_weight sums to zero; at least one sample needs a positive weight."
        )
    return sample_weight


def augment_tokens(X):
    """Append the constant coordinate 1 to every token: ``(n, k, d) -> (n, k, d+1)``.

    Examples
    --------
    >>> import numpy as np
    >>> augment_tokens(np.zeros((1, 2, 1)))[0]
    array([[0., 1.],
           [0., 1.]])
    """
    return np.concatenate([X, np.ones(X.shape[:2] + (1,))], axis=2)


def split_augmented(attention, projection):
    """A layer on augmented tokens ``[x, 1]`` as ``(Theta, u, W, c)`` on ``x``.

    With ``Theta~_i = [[Theta_i, g_i], [u_i^T, t_i]]`` and ``W~_i = [W_i; w0_i]``
    the logits on ``[x, 1]`` tokens are ``x_l^T Theta_i x_a + u_i^T x_a`` plus
    terms constant in ``a`` (the last column: a gauge, dropped) and the output
    gains ``c = sum_i w0_i`` (only the sum is identifiable).

    Parameters
    ----------
    attention : ndarray of shape (m, d + 1, d + 1)
    projection : ndarray of shape (m, d + 1, d_out)

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    key_bias : ndarray of shape (m, d)
    projection : ndarray of shape (m, d, d_out)
    intercept : ndarray of shape (d_out,)

    Examples
    --------
    >>> import numpy as np
    >>> th, u, W, c = split_augmented(np.ones((2, 3, 3)), np.ones((2, 3, 4)))
    >>> th.shape, u.shape, W.shape, c
    ((2, 2, 2), (2, 2), (2, 2, 4), array([2., 2., 2., 2.]))
    """
    return (
        attention[:, :-1, :-1].copy(),
        attention[:, -1, :-1].copy(),
        projection[:, :-1].copy(),
        projection[:, -1].sum(axis=0),
    )


def join_augmented(attention, key_bias, projection, intercept):
    """Inverse of :func:`split_augmented` in the gauge ``g_i = t_i = 0``,
    ``w0_i = c / m``.

    Examples
    --------
    >>> import numpy as np
    >>> th, W = join_augmented(np.eye(2)[None], np.ones((1, 2)), np.eye(2)[None],
    ...                        np.ones(2))
    >>> th[0]
    array([[1., 0., 0.],
           [0., 1., 0.],
           [1., 1., 0.]])
    """
    m, d, d_out = projection.shape
    theta = np.zeros((m, d + 1, d + 1))
    theta[:, :d, :d] = attention
    theta[:, d, :d] = key_bias
    W = np.concatenate(
        [projection, np.broadcast_to(intercept / m, (m, 1, d_out))], axis=1
    )
    return theta, W


class BaseAttentionRegressor(RegressorMixin, BaseEstimator):
    """Base class of regressors whose model is a multi-head attention layer.

    Subclasses implement ``fit`` (wrapped in ``_fit_context`` and
    ``skattn.utils._validation.all_or_nothing``, so that a fit that raises
    leaves the previous fit exactly as it was) and call :meth:`_validate_fit_data`
    first and :meth:`_set_layer` last; ``predict`` and ``score`` come from here.
    Fitted attributes set by this class:
    ``n_features_in_``, ``n_tokens_``, ``n_features_per_token_``,
    ``n_outputs_per_token_``, ``attention_``, ``projection_``, ``key_bias_``,
    ``intercept_``, ``layer_``.

    Subclasses with a ``fit_intercept`` parameter learn the biased model
    ``sum_i softmax(X Theta_i X^T + 1 (X u_i)^T) X W_i + 1 c^T`` on augmented
    tokens ``[x, 1]`` (:meth:`_model_tokens`); :meth:`_set_layer` maps the
    augmented parameters back (:func:`split_augmented`).
    """

    # Per-token outputs: skattn's estimator checks treat this as an attention regressor.
    _skattn_per_token_outputs = True

    _parameter_constraints = {
        "n_tokens": [Interval(Integral, 1, None, closed="left"), None],
    }

    # Most entries of X the fit multiplies together (the logits x_l^T Theta x_a),
    # and what those products are: larger X is rejected up front
    # (check_magnitude), not turned into NaN.
    _x_degree, _x_products = 2, "the attention logits"

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = True
        return tags

    def _validate_fit_data(self, X, y, sample_weight=None):
        """Validate X, y (and weights) and return them as token tensors.

        Returns
        -------
        X3 : ndarray of shape (n_samples, k, d)
        Y3 : ndarray of shape (n_samples, k, d_out)
        sample_weight : ndarray of shape (n_samples,)

        Out-of-core X or y (memmap, zarr, h5py, dask) are checked in chunks and
        returned as :class:`skattn.utils._batches.TokenBatches`, read batch by batch.
        """
        if is_out_of_core(X) or is_out_of_core(y):
            return self._validate_fit_batches(X, y, sample_weight)
        X, k3 = flatten_tokens(X)
        y = check_target(y, type(self).__name__, Y_SHAPES)
        if getattr(y, "ndim", 0) > 2:
            raise ValueError(
                f"y must be 2-D (n_samples, n_tokens * n_outputs), token-major, got "
                f"an array of shape {np.shape(y)}; flatten it with "
                f"y.reshape(len(y), -1)."
            )
        X, y = validate_data(
            self,
            X,
            y,
            reset=True,
            multi_output=True,
            y_numeric=True,
            dtype=np.float64,
        )
        k = resolve_n_tokens(X.shape[1], self.n_tokens, k3)
        y = np.asarray(y, dtype=np.float64)
        self._check_magnitudes(X, y)
        self._y_1d = y.ndim == 1
        if y.ndim == 1:
            y = y[:, None]
        if self._y_1d and k != 1:
            raise ValueError(
                f"y is 1-D but n_tokens={k}: pass y of shape (n_samples, n_tokens * "
                f"n_outputs)."
            )
        if y.shape[1] % k:
            raise ValueError(
                f"y has {y.shape[1]} columns, which is not divisible by n_tokens={k}; "
                f"expected n_tokens * n_outputs columns (token-major), one output "
                f"vector per token."
            )
        sample_weight = check_weights(
            _check_sample_weight(sample_weight, X, dtype=np.float64)
        )
        self.n_tokens_ = k
        self.n_features_per_token_ = X.shape[1] // k
        self.n_outputs_per_token_ = y.shape[1] // k
        return unflatten_tokens(X, k), unflatten_tokens(y, k), sample_weight

    def _check_magnitudes(self, X, y):
        """Reject X and y too large for float64 arithmetic, before the fit."""
        name = type(self).__name__
        check_magnitude(X, "X", self._x_degree, name, what=self._x_products)
        check_magnitude(y, "y", 2, name, what="the squared errors", fix=RESCALE_Y)

    def _validate_fit_batches(self, X, y, sample_weight):
        """``_validate_fit_data`` for out-of-core X, y: nothing is loaded whole."""
        batch_size = getattr(self, "batch_size", None)
        batch_size = batch_size if isinstance(batch_size, Integral) else 4096
        X3, Y3 = validate_batches(X, y, self.n_tokens, batch_size)
        n, k, d = X3.shape
        self.n_features_in_ = k * d
        if hasattr(self, "feature_names_in_"):
            del self.feature_names_in_
        self._y_1d = getattr(y, "ndim", 2) == 1
        sample_weight = check_weights(
            _check_sample_weight(sample_weight, np.empty((n, 0)), dtype=np.float64)
        )
        self.n_tokens_ = k
        self.n_features_per_token_ = d
        self.n_outputs_per_token_ = Y3.shape[2]
        return X3, Y3, sample_weight

    def _validate_predict_data(self, X):
        check_is_fitted(self)
        X, k3 = flatten_tokens(X)
        X = validate_data(self, X, reset=False, dtype=np.float64)
        check_fitted_tokens(k3, self.n_tokens_)
        return unflatten_tokens(X, self.n_tokens_)

    def _model_tokens(self, X3):
        """The tokens the model sees: ``[x, 1]`` when fitting an intercept."""
        return augment_tokens(X3) if getattr(self, "fit_intercept", False) else X3

    def _model_parameters(self):
        """The fitted parameters in the model's coordinates (augmented or not)."""
        if getattr(self, "fit_intercept", False):
            return join_augmented(
                self.attention_, self.key_bias_, self.projection_, self.intercept_
            )
        return self.attention_.copy(), self.projection_.copy()

    def _set_layer(self, attention, projection):
        """Store the learned parameters and the matching ``AttentionLayer``.

        ``attention`` and ``projection`` are in the model's coordinates: on
        augmented tokens when ``fit_intercept`` is True.
        """
        attention = np.asarray(attention, dtype=np.float64)
        projection = np.asarray(projection, dtype=np.float64)
        fit_intercept = getattr(self, "fit_intercept", False)
        if fit_intercept:
            attention, key_bias, projection, intercept = split_augmented(
                attention, projection
            )
        else:
            m, d, d_out = projection.shape
            key_bias, intercept = np.zeros((m, d)), np.zeros(d_out)
        self.attention_, self.projection_ = attention, projection
        self.key_bias_, self.intercept_ = key_bias, intercept
        self.layer_ = AttentionLayer(
            self.attention_,
            self.projection_,
            n_tokens=self.n_tokens_,
            key_bias=key_bias if fit_intercept else None,
            intercept=intercept if fit_intercept else None,
        )

    def predict(self, X):
        """Predict with the learned layer.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        y_pred : ndarray of shape (n_samples, n_tokens * n_outputs)
            1-D when the training target was 1-D.
        """
        X3 = self._validate_predict_data(X)
        Y = forward(
            X3,
            self.attention_,
            self.projection_,
            key_bias=getattr(self, "key_bias_", None),
            intercept=getattr(self, "intercept_", None),
        ).reshape(X3.shape[0], -1)
        check_no_overflow(
            Y,
            "predict",
            X=X3,
            attention_=self.attention_,
            projection_=self.projection_,
        )
        return Y.ravel() if self._y_1d else Y
