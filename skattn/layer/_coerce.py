"""Coercion of layers and fitted estimators to a layer or to its parameters.

:func:`as_layer` gives an :class:`AttentionLayer`; the private helpers give the
validated parameter arrays that metrics and diagnostics compute with.
"""

import numpy as np
from sklearn.utils.validation import check_is_fitted

from ._attention_layer import AttentionLayer, check_layer_biases, check_layer_parameters

__all__ = ["as_layer"]


def as_layer(learned, name="layer"):
    """An :class:`AttentionLayer` from a layer or a fitted estimator.

    The one coercion of skattn: a layer is returned as it is; a fitted estimator
    gives its ``layer_`` or, failing that, a layer of its ``attention_`` and
    ``projection_`` (and ``n_tokens_``).

    Parameters
    ----------
    learned : AttentionLayer or fitted estimator
        The layer, or an estimator with ``layer_`` or ``attention_`` and
        ``projection_``.
    name : str, default="layer"
        The argument's name in error messages.

    Returns
    -------
    layer : AttentionLayer

    Raises
    ------
    TypeError
        If ``learned`` is neither.

    Examples
    --------
    >>> from skattn import MultiHeadAttentionRegressor, make_attention_regression
    >>> from skattn.layer import as_layer
    >>> X, y = make_attention_regression(500, 1, 3, 1, random_state=0)
    >>> est = MultiHeadAttentionRegressor().fit(X, y)
    >>> as_layer(est).n_heads
    1
    """
    if isinstance(learned, AttentionLayer):
        return learned
    if hasattr(learned, "fit"):
        check_is_fitted(learned)
        layer = getattr(learned, "layer_", None)
        if isinstance(layer, AttentionLayer):
            return layer
        if hasattr(learned, "attention_") and hasattr(learned, "projection_"):
            return AttentionLayer(
                learned.attention_,
                learned.projection_,
                n_tokens=getattr(learned, "n_tokens_", None),
            )
    raise TypeError(
        f"{name} must be an AttentionLayer or a fitted estimator with attention_ "
        f"and projection_ (or layer_), got {type(learned).__name__}."
    )


def _layer_parameters(layer, name):
    """``(attention, projection, n_tokens)`` of a layer or a fitted estimator."""
    if isinstance(layer, AttentionLayer):
        attention, projection = layer.attention, layer.projection
        n_tokens = getattr(layer, "n_tokens_", None) or layer.n_tokens
    elif hasattr(layer, "attention_") and hasattr(layer, "projection_"):
        attention, projection = layer.attention_, layer.projection_
        n_tokens = getattr(layer, "n_tokens_", None)
    else:
        raise TypeError(
            f"{name} must be an AttentionLayer or a fitted estimator with attention_ "
            f"and projection_ attributes, got {type(layer).__name__}. If it is an "
            f"estimator, fit it first."
        )
    try:
        attention, projection = check_layer_parameters(attention, projection)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    return attention, projection, n_tokens


def _layer_biases(layer, attention, projection):
    """``(key_bias, intercept)`` of a layer or fitted estimator, zeros when absent."""
    if isinstance(layer, AttentionLayer):
        key_bias, intercept = layer.key_bias, layer.intercept
    else:
        key_bias = getattr(layer, "key_bias_", None)
        intercept = getattr(layer, "intercept_", None)
    m, d, d_out = projection.shape
    key_bias, intercept = check_layer_biases(key_bias, intercept, m, d, d_out)
    return (
        np.zeros((m, d)) if key_bias is None else key_bias,
        np.zeros(d_out) if intercept is None else intercept,
    )
