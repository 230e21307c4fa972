"""Shared machinery of skattn's regressors: token layout, validation, predict."""

import functools
import math
from numbers import Integral

import numpy as np
from sklearn import get_config
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.metrics import r2_score
from sklearn.utils._array_api import get_namespace
from sklearn.utils._param_validation import Interval
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import (
    _check_sample_weight,
    check_is_fitted,
    validate_data,
)

from ..layer import AttentionLayer
from ..layer._math import forward
from ..layer._positions import Rotary
from ..utils._array_api import (
    device,
    is_numpy,
    namespace,
    namespace_name,
    to_namespace,
    to_numpy,
    warn_if_scipy_array_api_ignored,
)
from ..utils._batches import TokenBatches, is_out_of_core, validate_batches
from ..utils._validation import (
    check_fitted_tokens,
    check_largest_magnitude,
    check_magnitude,
    check_no_overflow,
    check_target,
    flatten_tokens,
    is_foreign_array,
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

# Fewest samples of positive weight that ``fit`` takes: a single sequence is
# reproduced exactly by many layers, so a fit on it would report a perfect (or
# undefined) score that says nothing about the layer.
MIN_FIT_SAMPLES = 2


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
    if is_foreign_array(sample_weight):  # under array_api_dispatch
        xp = namespace(sample_weight)
        n_negative = int(xp.sum(xp.astype(sample_weight < 0, xp.int64)))
        total = float(xp.sum(sample_weight))
    else:
        n_negative, total = int(np.sum(sample_weight < 0)), np.sum(sample_weight)
    if n_negative:
        raise ValueError(
            f"sample_weight has {n_negative} negative value(s); expected "
            f"non-negative weights. Pass weights >= 0 (0 leaves a sample out)."
        )
    if not total > 0:
        raise ValueError(
            "sample_weight sums to zero; at least one sample needs a positive weight."
        )
    return sample_weight


def check_enough_samples(n_samples, sample_weight, owner, minimum=MIN_FIT_SAMPLES):
    """Raise unless at least ``minimum`` samples have a positive weight.

    Parameters
    ----------
    n_samples : int
        Number of samples (rows of X).
    sample_weight : array-like of shape (n_samples,) or None
        Validated weights; ``None``: every sample counts.
    owner : str
        The estimator's class name, for the message.
    minimum : int, default=MIN_FIT_SAMPLES
        Fewest samples of positive weight accepted.

    Examples
    --------
    >>> import numpy as np
    >>> check_enough_samples(3, None, "Est")
    >>> check_enough_samples(3, np.array([1.0, 0.0, 0.0]), "Est")
    Traceback (most recent call last):
    ...
    ValueError: Est got 1 sample with a positive weight (of 3) to fit, but needs ...
    """
    if sample_weight is None:
        n_fit = int(n_samples)
    elif is_foreign_array(sample_weight):  # under array_api_dispatch
        xp = namespace(sample_weight)
        n_fit = int(xp.sum(xp.astype(sample_weight > 0, xp.int64)))
    else:
        n_fit = int(np.count_nonzero(np.asarray(sample_weight) > 0))
    if n_fit >= minimum:
        return
    rows = "sample" if n_fit == 1 else "samples"
    weighted = "" if n_fit == n_samples else f" with a positive weight (of {n_samples})"
    raise ValueError(
        f"{owner} got {n_fit} {rows}{weighted} to fit, but needs at least "
        f"{minimum}: a single sequence is reproduced exactly by many attention "
        f"layers, so a fit on it says nothing about the layer (a training loss of "
        f"0, an undefined R^2). Pass at least {minimum} samples of positive "
        f"weight (in practice many more than the layer has parameters)."
    )


def check_score_weights(sample_weight):
    """The ``sample_weight`` of ``score``, checked like ``fit``'s: ``None``, or
    weights with no negative value and a positive sum (:func:`check_weights`).

    Parameters
    ----------
    sample_weight : array-like of shape (n_samples,) or None
        Weights of the samples in the score.

    Returns
    -------
    sample_weight : ndarray, array of X's namespace, or None
        A list (or other array-like) as a float64 ndarray.

    Examples
    --------
    >>> check_score_weights([1.0, 2.0])
    array([1., 2.])
    >>> check_score_weights([1.0, -2.0])
    Traceback (most recent call last):
    ...
    ValueError: sample_weight has 1 negative value(s); expected non-negative ...
    """
    if sample_weight is None:
        return None
    if not is_foreign_array(sample_weight):
        sample_weight = np.asarray(sample_weight, dtype=np.float64)
    return check_weights(sample_weight)


def augment_tokens(X):
    """Append the constant coordinate 1 to every token: ``(n, k, d) -> (n, k, d+1)``.

    Examples
    --------
    >>> import numpy as np
    >>> augment_tokens(np.zeros((1, 2, 1)))[0]
    array([[0., 1.],
           [0., 1.]])
    """
    if is_foreign_array(X):  # under array_api_dispatch: in X's namespace
        xp = namespace(X)
        ones = xp.ones(X.shape[:2] + (1,), dtype=X.dtype, device=device(X))
        return xp.concat([X, ones], axis=2)
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
    if is_foreign_array(attention):  # the array API has no copy/sum methods
        xp = namespace(attention, projection)
        return (
            xp.asarray(attention[:, :-1, :-1], copy=True),
            xp.asarray(attention[:, -1, :-1], copy=True),
            xp.asarray(projection[:, :-1, :], copy=True),
            xp.sum(projection[:, -1, :], axis=0),
        )
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
    if is_foreign_array(attention):  # under array_api_dispatch: on its device
        xp = namespace(attention, projection)
        theta = xp.zeros(
            (m, d + 1, d + 1), dtype=attention.dtype, device=device(attention)
        )
        theta[:, :d, :d] = attention
        theta[:, d, :d] = key_bias
        tail = xp.broadcast_to(intercept / m, (m, 1, d_out))
        return theta, xp.concat([projection, tail], axis=1)
    theta = np.zeros((m, d + 1, d + 1))
    theta[:, :d, :d] = attention
    theta[:, d, :d] = key_bias
    W = np.concatenate(
        [projection, np.broadcast_to(intercept / m, (m, 1, d_out))], axis=1
    )
    return theta, W


def _float_dtype(xp, where):
    """float64 in ``xp``, or float32 on a device without float64 (Apple's MPS)."""
    if is_numpy(xp):
        return np.float64
    try:
        names = xp.__array_namespace_info__().dtypes(kind="real floating", device=where)
    except (AttributeError, TypeError):  # an older namespace: assume float64
        return xp.float64
    return xp.float64 if "float64" in names else xp.float32


def _follow(value, xp, where):
    """``value`` (y or sample_weight) moved to the namespace ``xp`` and device
    ``where`` of X when it is an array of another one; else as it is (lists,
    DataFrames and scalars are validated as usual)."""
    if not (is_foreign_array(value) or isinstance(value, np.ndarray)):
        return value
    if isinstance(value, np.ndarray) and is_numpy(xp):
        return value
    return to_namespace(value, xp, where)


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

    def _validate_fit_data(
        self, X, y, sample_weight=None, *, min_samples=MIN_FIT_SAMPLES
    ):
        """Validate X, y (and weights) and return them as token tensors.

        Parameters
        ----------
        X, y, sample_weight
            The arguments of ``fit``.
        min_samples : int, default=MIN_FIT_SAMPLES
            Fewest samples of positive weight accepted (``partial_fit``: 1, a
            batch of a stream).

        Returns
        -------
        X3 : ndarray of shape (n_samples, k, d)
        Y3 : ndarray of shape (n_samples, k, d_out)
        sample_weight : ndarray of shape (n_samples,)

        Out-of-core X or y (memmap, zarr, h5py, dask) are checked in chunks and
        returned as :class:`skattn.utils._batches.TokenBatches`, read batch by batch.
        """
        if is_out_of_core(X) or is_out_of_core(y):
            return self._validate_fit_batches(X, y, sample_weight, min_samples)
        X, k3 = flatten_tokens(X)
        y = check_target(y, type(self).__name__, Y_SHAPES)
        if getattr(y, "ndim", 0) > 2:
            raise ValueError(
                f"y must be 2-D (n_samples, n_tokens * n_outputs), token-major, got "
                f"an array of shape {tuple(y.shape)}; flatten it with "
                f"y.reshape(len(y), -1)."
            )
        xp = self._input_namespace(X)
        host = xp is None or is_numpy(xp)  # numpy, as without array_api_dispatch
        where = None if host else device(X)
        if xp is not None:  # y and sample_weight follow X (scikit-learn's rule)
            y, sample_weight = _follow(y, xp, where), _follow(sample_weight, xp, where)
        dtype = np.float64 if host else _float_dtype(xp, where)
        X, y = validate_data(
            self,
            X,
            y,
            reset=True,
            multi_output=True,
            y_numeric=True,
            dtype=dtype,
        )
        k = resolve_n_tokens(X.shape[1], self.n_tokens, k3)
        y = np.asarray(y, dtype=np.float64) if host else xp.astype(y, dtype)
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
            _check_sample_weight(sample_weight, X, dtype=dtype)
        )
        name = type(self).__name__
        check_enough_samples(X.shape[0], sample_weight, name, min_samples)
        self.n_tokens_ = k
        self.n_features_per_token_ = X.shape[1] // k
        self.n_outputs_per_token_ = y.shape[1] // k
        return unflatten_tokens(X, k), unflatten_tokens(y, k), sample_weight

    def _input_namespace(self, X):
        """The array namespace that ``fit`` and ``predict`` compute in: X's under
        ``sklearn.config_context(array_api_dispatch=True)`` for an estimator
        tagged ``array_api_support``; ``None`` otherwise (numpy, as without
        dispatch: inputs are converted by ``np.asarray``)."""
        if not get_config().get("array_api_dispatch", False):
            return None
        warn_if_scipy_array_api_ignored()
        if not self.__sklearn_tags__().array_api_support:
            return None
        return get_namespace(X)[0]

    def _check_magnitudes(self, X, y):
        """Reject X and y too large for float64 arithmetic, before the fit.

        In memory X and y are arrays; out of core they are the
        :class:`~skattn.utils._batches.TokenBatches` of ``validate_batches``,
        whose largest ``|value|`` (``max_abs``) it measured in its one pass:
        the same limits, the same messages.
        """
        name = type(self).__name__
        what_x, what_y = self._x_products, "the squared errors"
        if isinstance(X, TokenBatches):
            size_x, size_y = math.prod(X.shape), math.prod(y.shape)
            check_largest_magnitude(
                X.max_abs, size_x, "X", self._x_degree, name, what=what_x
            )
            check_largest_magnitude(
                y.max_abs, size_y, "y", 2, name, what=what_y, fix=RESCALE_Y
            )
            return
        check_magnitude(X, "X", self._x_degree, name, what=what_x)
        check_magnitude(y, "y", 2, name, what=what_y, fix=RESCALE_Y)

    def _validate_fit_batches(self, X, y, sample_weight, min_samples=MIN_FIT_SAMPLES):
        """``_validate_fit_data`` for out-of-core X, y: nothing is loaded whole
        (one pass over each checks its values, magnitudes included)."""
        batch_size = getattr(self, "batch_size", None)
        batch_size = batch_size if isinstance(batch_size, Integral) else 4096
        X3, Y3 = validate_batches(X, y, self.n_tokens, batch_size)
        self._check_magnitudes(X3, Y3)
        n, k, d = X3.shape
        self.n_features_in_ = k * d
        if hasattr(self, "feature_names_in_"):
            del self.feature_names_in_
        self._y_1d = getattr(y, "ndim", 2) == 1
        sample_weight = check_weights(
            _check_sample_weight(sample_weight, np.empty((n, 0)), dtype=np.float64)
        )
        check_enough_samples(n, sample_weight, type(self).__name__, min_samples)
        self.n_tokens_ = k
        self.n_features_per_token_ = d
        self.n_outputs_per_token_ = Y3.shape[2]
        return X3, Y3, sample_weight

    def _validate_predict_data(self, X, method="predict"):
        check_is_fitted(self)
        X, k3 = flatten_tokens(X)
        xp = self._input_namespace(X)
        host = xp is None or is_numpy(xp)
        dtype = np.float64 if host else _float_dtype(xp, device(X))
        X = validate_data(self, X, reset=False, dtype=dtype)
        check_fitted_tokens(k3, self.n_tokens_)
        self._check_same_namespace(X, method)
        return unflatten_tokens(X, self.n_tokens_)

    def _check_same_namespace(self, X, method):
        """Raise unless the validated X is in the namespace and on the device of
        the fitted parameters (scikit-learn's ``check_same_namespace``, which
        scikit-learn < 1.9 lacks)."""
        fitted = self.attention_
        if not (is_foreign_array(X) or is_foreign_array(fitted)):
            return  # numpy and numpy
        xp_x, xp_fit = namespace(X), namespace(fitted)
        if xp_x is xp_fit and device(X) == device(fitted):
            return
        where = f"{namespace_name(xp_fit)} on {device(fitted)!r}"
        given = f"{namespace_name(xp_x)} on {device(X)!r}"
        if not get_config().get("array_api_dispatch", False):
            given += " (array_api_dispatch is off: X was converted to numpy)"
        raise ValueError(
            f"Inputs passed to {type(self).__name__}.{method}() must use the same "
            f"namespace and the same device as those passed to fit(): fitted in "
            f"{where}, got {given}. Pass X in the fit's namespace and device under "
            f"sklearn.config_context(array_api_dispatch=True), or move the "
            f"estimator to numpy with skattn.utils.estimator_to_numpy(estimator)."
        )

    def _model_tokens(self, X3):
        """The tokens the model sees: ``[x, 1]`` when fitting an intercept."""
        return augment_tokens(X3) if getattr(self, "fit_intercept", False) else X3

    def _model_parameters(self):
        """The fitted parameters in the model's coordinates (augmented or not)."""
        if getattr(self, "fit_intercept", False):
            return join_augmented(
                self.attention_, self.key_bias_, self.projection_, self.intercept_
            )
        if is_foreign_array(self.attention_):
            xp = namespace(self.attention_)
            return (
                xp.asarray(self.attention_, copy=True),
                xp.asarray(self.projection_, copy=True),
            )
        return self.attention_.copy(), self.projection_.copy()

    def _set_layer(self, attention, projection):
        """Store the learned parameters and the matching ``AttentionLayer``.

        ``attention`` and ``projection`` are in the model's coordinates: on
        augmented tokens when ``fit_intercept`` is True.
        """
        fit_intercept = getattr(self, "fit_intercept", False)
        if is_foreign_array(attention):  # under array_api_dispatch: X's namespace
            xp = namespace(attention, projection)
            attention = xp.astype(attention, xp.float64)
            projection = xp.astype(projection, xp.float64)
        else:
            attention = np.asarray(attention, dtype=np.float64)
            projection = np.asarray(projection, dtype=np.float64)
            xp = None
        if fit_intercept:
            attention, key_bias, projection, intercept = split_augmented(
                attention, projection
            )
        elif xp is None:
            m, d, d_out = projection.shape
            key_bias, intercept = np.zeros((m, d)), np.zeros(d_out)
        else:
            m, d, d_out = projection.shape
            where = {"dtype": attention.dtype, "device": device(attention)}
            key_bias, intercept = xp.zeros((m, d), **where), xp.zeros(d_out, **where)
        self.attention_, self.projection_ = attention, projection
        self.key_bias_, self.intercept_ = key_bias, intercept
        # the layer is a host object (AttentionLayer computes in numpy): numpy
        # copies of the parameters, the very arrays on numpy
        decoder = self._decoder_layer()
        for name in ("rotary_query", "rotary_key"):
            if decoder.get(name) is not None:
                decoder[name] = to_numpy(decoder[name])
        self.layer_ = AttentionLayer(
            to_numpy(self.attention_),
            to_numpy(self.projection_),
            n_tokens=self.n_tokens_,
            key_bias=to_numpy(key_bias) if fit_intercept else None,
            intercept=to_numpy(intercept) if fit_intercept else None,
            **decoder,
        )

    def _decoder_layer(self):
        """The fitted decoder settings as ``AttentionLayer`` keywords (``causal``,
        ``rotary_query``, ...); ``{}``: a position-free, unmasked layer."""
        return {}

    def _decoder_math(self):
        """The fitted decoder settings as keywords of the math's ``forward``
        (``causal``, ``rotary``), arrays in the fit's namespace."""
        layer = self._decoder_layer()
        decoder = {}
        if layer.get("causal"):
            decoder["causal"] = True
        if layer.get("rotary_query") is not None:
            decoder["rotary"] = Rotary(
                layer["rotary_query"],
                layer["rotary_key"],
                layer["rope_theta"],
                layer["rope_layout"],
            )
        return decoder

    def predict(self, X):
        """Predict with the learned layer.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        y_pred : ndarray of shape (n_samples, n_tokens * n_outputs)
            1-D when the training target was 1-D.  Under
            ``sklearn.config_context(array_api_dispatch=True)``, for an
            estimator with array API support, an array of X's namespace on X's
            device (which must be those of the fit).
        """
        X3 = self._validate_predict_data(X)
        Y = forward(
            X3,
            self.attention_,
            self.projection_,
            key_bias=getattr(self, "key_bias_", None),
            intercept=getattr(self, "intercept_", None),
            **self._decoder_math(),
        )
        if is_foreign_array(Y):  # under array_api_dispatch: the array API's reshape
            xp = namespace(Y)
            Y = xp.reshape(Y, (X3.shape[0], -1))
            check_no_overflow(Y, "predict", X=X3, attention_=self.attention_)
            return xp.reshape(Y, (-1,)) if self._y_1d else Y
        Y = Y.reshape(X3.shape[0], -1)
        check_no_overflow(
            Y,
            "predict",
            X=X3,
            attention_=self.attention_,
            projection_=self.projection_,
        )
        return Y.ravel() if self._y_1d else Y

    def score(self, X, y, sample_weight=None):
        """The coefficient of determination R^2 of the predictions.

        scikit-learn's :func:`~sklearn.metrics.r2_score` of ``predict(X)``
        against ``y`` (uniform average over the outputs), as
        :meth:`sklearn.base.RegressorMixin.score`.  Under
        ``sklearn.config_context(array_api_dispatch=True)`` it is computed in
        the namespace and on the device of the predictions: ``y`` and
        ``sample_weight`` of another namespace or device are moved there first.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences.
        y : array-like of shape (n_samples, n_tokens * n_outputs)
            True outputs, token-major.
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
            zero sum (checked as by ``fit``, before predicting).
        """
        sample_weight = check_score_weights(sample_weight)
        y_pred = self.predict(X)
        if is_foreign_array(y_pred):  # y and the weights follow the predictions
            xp, where = namespace(y_pred), device(y_pred)
            y, sample_weight = _follow(y, xp, where), _follow(sample_weight, xp, where)
        return r2_score(y, y_pred, sample_weight=sample_weight)
