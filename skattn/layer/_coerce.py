"""The one coercion of skattn: a layer, a fitted estimator or fitted parameters to
an :class:`AttentionLayer`.

Metrics and diagnostics take "a layer or a fitted estimator"; they call
:func:`as_layer` and compute with the layer's validated arrays.
"""

from sklearn.utils.validation import check_is_fitted

from ._attention_layer import AttentionLayer, check_layer_biases, check_layer_parameters

__all__ = ["as_layer"]


def as_layer(obj, name="layer"):
    """An :class:`AttentionLayer` from a layer, a fitted estimator or its parameters.

    The one coercion of skattn, used by every metric, display and diagnostic
    that takes "a layer or a fitted estimator":

    * an :class:`AttentionLayer` is returned as it is;
    * an estimator (anything with ``fit``) must be fitted
      (:func:`sklearn.utils.validation.check_is_fitted`); it gives its
      ``layer_`` when that is an :class:`AttentionLayer`, else a layer of its
      ``attention_``, ``projection_``, ``n_tokens_``, ``key_bias_`` and
      ``intercept_`` (the biases and ``n_tokens_`` when present);
    * any other object with ``attention_`` and ``projection_`` gives a layer of
      them in the same way.

    The layer's parameters are validated in every case.

    Parameters
    ----------
    obj : AttentionLayer, fitted estimator or object with ``attention_`` and \
``projection_``
        What to turn into a layer.
    name : str, default="layer"
        The argument's name in error messages.

    Returns
    -------
    layer : AttentionLayer
        ``obj`` itself, the estimator's ``layer_``, or a new layer holding the
        validated ``attention_`` and ``projection_`` (float64, one leading
        axis per head).

    Raises
    ------
    sklearn.exceptions.NotFittedError
        If ``obj`` is an estimator that is not fitted.
    TypeError
        If ``obj`` is none of the above (a fitted estimator with neither
        ``layer_`` nor ``attention_`` and ``projection_``, an array, ...).
    ValueError
        If the parameters are invalid (shapes that do not fit together,
        non-finite values); the message starts with ``name``.

    See Also
    --------
    skattn.metrics.parameter_error : compares two layers given in any of these forms.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import MultiHeadAttentionRegressor, make_attention_regression
    >>> from skattn.layer import AttentionLayer, as_layer
    >>> X, y = make_attention_regression(500, 1, 3, 1, random_state=0)
    >>> est = MultiHeadAttentionRegressor().fit(X, y)
    >>> as_layer(est) is est.layer_
    True
    >>> layer = AttentionLayer(np.zeros((2, 3, 3)), np.ones((2, 3, 4)))
    >>> as_layer(layer) is layer
    True
    >>> as_layer(MultiHeadAttentionRegressor())
    Traceback (most recent call last):
    ...
    sklearn.exceptions.NotFittedError: This MultiHeadAttentionRegressor instance ...
    >>> as_layer(np.zeros((2, 3, 3)), "learned")
    Traceback (most recent call last):
    ...
    TypeError: learned must be an AttentionLayer, ...
    """
    layer = obj
    if not isinstance(obj, AttentionLayer):
        if hasattr(obj, "fit"):
            check_is_fitted(obj)
            layer = getattr(obj, "layer_", None)
        if not isinstance(layer, AttentionLayer):
            return _from_attributes(obj, name)
    _check(layer.attention, layer.projection, layer.key_bias, layer.intercept, name)
    return layer


def _from_attributes(obj, name):
    """A layer of ``obj``'s ``attention_``, ``projection_``, biases, ``n_tokens_``."""
    if not (hasattr(obj, "attention_") and hasattr(obj, "projection_")):
        raise TypeError(
            f"{name} must be an AttentionLayer, a fitted estimator with layer_ or "
            f"with attention_ and projection_, or an object with attention_ and "
            f"projection_; got {type(obj).__name__}."
        )
    attention, projection, key_bias, intercept = _check(
        obj.attention_,
        obj.projection_,
        getattr(obj, "key_bias_", None),
        getattr(obj, "intercept_", None),
        name,
    )
    return AttentionLayer(
        attention,
        projection,
        n_tokens=getattr(obj, "n_tokens_", None),
        key_bias=key_bias,
        intercept=intercept,
    )


def _check(attention, projection, key_bias, intercept, name):
    """The validated parameters; a ValueError names the argument."""
    try:
        attention, projection = check_layer_parameters(attention, projection)
        key_bias, intercept = check_layer_biases(key_bias, intercept, *projection.shape)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    return attention, projection, key_bias, intercept
