"""Shared machinery of skattn's regressors: token layout, validation, predict."""

from numbers import Integral

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils._param_validation import Interval
from sklearn.utils.validation import (
    _check_sample_weight,
    check_is_fitted,
    validate_data,
)

from .._batches import is_out_of_core, validate_batches
from .._layer import forward
from .._sequences import (
    check_fitted_tokens,
    flatten_tokens,
    resolve_n_tokens,
    unflatten_tokens,
)
from ..layer import AttentionLayer


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


class BaseAttentionRegressor(RegressorMixin, BaseEstimator):
    """Base class of regressors whose model is a multi-head attention layer.

    Subclasses implement ``fit`` (wrapped in ``_fit_context``) and call
    :meth:`_validate_fit_data` first and :meth:`_set_layer` last; ``predict`` and
    ``score`` come from here.  Fitted attributes set by this class:
    ``n_features_in_``, ``n_tokens_``, ``n_features_per_token_``,
    ``n_outputs_per_token_``, ``attention_``, ``projection_``, ``layer_``.
    """

    # Per-token outputs: skattn's estimator checks treat this as an attention regressor.
    _skattn_per_token_outputs = True

    _parameter_constraints = {
        "n_tokens": [Interval(Integral, 1, None, closed="left"), None],
    }

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
        returned as :class:`skattn._batches.TokenBatches`, read batch by batch.
        """
        if is_out_of_core(X) or is_out_of_core(y):
            return self._validate_fit_batches(X, y, sample_weight)
        X, k3 = flatten_tokens(X)
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

    def _set_layer(self, attention, projection):
        """Store the learned parameters and the matching ``AttentionLayer``."""
        self.attention_ = np.asarray(attention, dtype=np.float64)
        self.projection_ = np.asarray(projection, dtype=np.float64)
        self.layer_ = AttentionLayer(
            self.attention_, self.projection_, n_tokens=self.n_tokens_
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
        Y = forward(X3, self.attention_, self.projection_).reshape(X3.shape[0], -1)
        return Y.ravel() if self._y_1d else Y
