"""AttentionLayer: a fixed (planted or learned) multi-head attention layer."""

from numbers import Integral

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin, _fit_context
from sklearn.utils import check_array
from sklearn.utils._param_validation import Interval
from sklearn.utils.validation import check_is_fitted, validate_data

from ._layer import attention_patterns, forward
from ._sequences import check_finite, flatten_tokens, layer_sequences


def check_layer_parameters(attention, projection):
    """Validate Theta (m, d, d) and W (m, d, d_out); return them as float64 arrays.

    Raises a ValueError naming the parameter, what was received and what is
    expected.

    Examples
    --------
    >>> import numpy as np
    >>> th, W = check_layer_parameters(np.zeros((2, 3, 3)), np.zeros((2, 3, 4)))
    >>> th.shape, W.shape
    ((2, 3, 3), (2, 3, 4))
    """
    attention = np.asarray(attention, dtype=float)
    projection = np.asarray(projection, dtype=float)
    if attention.ndim == 2:
        attention = attention[None]
    if projection.ndim == 2:
        projection = projection[None]
    if attention.ndim != 3 or attention.shape[1] != attention.shape[2]:
        raise ValueError(
            f"attention must have shape (n_heads, n_features, n_features), got "
            f"{attention.shape}."
        )
    if projection.ndim != 3:
        raise ValueError(
            f"projection must have shape (n_heads, n_features, n_outputs), got "
            f"{projection.shape}."
        )
    if attention.shape[0] != projection.shape[0]:
        raise ValueError(
            f"attention has {attention.shape[0]} heads but projection has "
            f"{projection.shape[0]}; both need shape (n_heads, ...) with the same "
            f"n_heads."
        )
    if attention.shape[1] != projection.shape[1]:
        raise ValueError(
            f"attention acts on {attention.shape[1]} features per token but "
            f"projection expects {projection.shape[1]}; projection must have shape "
            f"(n_heads, {attention.shape[1]}, n_outputs)."
        )
    check_finite(attention, "attention")
    check_finite(projection, "projection")
    return attention, projection


class AttentionLayer(TransformerMixin, BaseEstimator):
    """A multi-head attention layer ``F(X) = sum_i softmax(X Theta_i X^T) X W_i``.

    A fixed function: use it as a planted teacher (``transform`` gives the labels),
    as the result of a learner (``estimator.layer_``), or as a step of a Pipeline.
    ``fit`` only validates the input widths; ``transform`` also works unfitted.

    Parameters
    ----------
    attention : array-like of shape (n_heads, n_features, n_features)
        The attention matrices Theta_i (query times key, any scaling folded in).
    projection : array-like of shape (n_heads, n_features, n_outputs)
        The projection matrices W_i (value times output map).
    n_tokens : int, default=None
        Tokens per sequence.  ``None`` infers it from a 3-D input, else from the
        width of a 2-D input divided by ``n_features``.

    Attributes
    ----------
    n_features_in_ : int
        Width of the flattened input seen in ``fit``.
    n_tokens_ : int
        Tokens per sequence seen in ``fit``.

    See Also
    --------
    skattn.datasets.make_attention_layer : plant a random layer.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> layer = AttentionLayer(np.zeros((1, 2, 2)), np.eye(2)[None])
    >>> X = np.array([[1.0, -1.0, 1.0, 1.0]])  # 2 tokens of 2 features
    >>> layer.transform(X)  # uniform attention: every row is the token mean
    array([[1., 0., 1., 0.]])
    """

    _parameter_constraints = {
        "attention": ["array-like"],
        "projection": ["array-like"],
        "n_tokens": [Interval(Integral, 1, None, closed="left"), None],
    }

    def __init__(self, attention, projection, *, n_tokens=None):
        self.attention = attention
        self.projection = projection
        self.n_tokens = n_tokens

    @property
    def n_heads(self):
        """Number of heads m (a 2-D attention matrix is one head)."""
        return check_layer_parameters(self.attention, self.projection)[0].shape[0]

    @property
    def n_features(self):
        """Features per input token d."""
        return np.shape(self.attention)[-1]

    @property
    def n_outputs(self):
        """Features per output token d_out."""
        return np.shape(self.projection)[-1]

    def _sequences(self, X, reset):
        X, k3 = flatten_tokens(X)
        ndim = X.ndim if hasattr(X, "ndim") else np.ndim(X)
        if ndim != 2:
            raise ValueError(
                f"X must be 2-D (n_samples, n_tokens * n_features) or 3-D "
                f"(n_samples, n_tokens, n_features), got a {ndim}-D array of shape "
                f"{np.shape(X)}."
            )
        if reset or hasattr(self, "n_features_in_"):
            X = validate_data(self, X, reset=reset, dtype=np.float64)
        else:  # an unfitted (planted) layer: plain array checks, no fitted state
            X = check_array(X, dtype=np.float64, input_name="X")
        return layer_sequences(X, self.n_tokens, k3, np.shape(self.attention)[-1])

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None):
        """Validate X's widths against the layer; nothing is learned.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)
        y : ignored

        Returns
        -------
        self : AttentionLayer
        """
        check_layer_parameters(self.attention, self.projection)
        X3 = self._sequences(X, reset=True)
        self.n_tokens_ = X3.shape[1]
        return self

    def transform(self, X):
        """Apply the layer: ``F(X)`` flattened token-major.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        Y : ndarray of shape (n_samples, n_tokens * n_outputs)
        """
        attention, projection = check_layer_parameters(self.attention, self.projection)
        X3 = self._sequences(X, reset=False)
        Y = forward(X3, attention, projection)
        return Y.reshape(X3.shape[0], -1)

    def attention_patterns(self, X):
        """Per-head attention patterns on X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        patterns : ndarray of shape (n_samples, n_heads, n_tokens, n_tokens)
            Row l of head i is the distribution softmax_a(x_l^T Theta_i x_a).
        """
        attention, _ = check_layer_parameters(self.attention, self.projection)
        return attention_patterns(self._sequences(X, reset=False), attention)

    def get_feature_names_out(self, input_features=None):
        """Output names ``token{t}_out{j}``, token-major.

        Parameters
        ----------
        input_features : array-like of str or None, default=None
            Ignored: the names depend only on the number of tokens seen by
            ``fit`` and on ``n_outputs``.

        Returns
        -------
        feature_names_out : ndarray of str objects of shape \
(n_tokens * n_outputs,)
            ``token{t}_out{j}`` for token ``t`` and output feature ``j``.
        """
        check_is_fitted(self, "n_tokens_")
        k = self.n_tokens_
        return np.asarray(
            [f"token{t}_out{j}" for t in range(k) for j in range(self.n_outputs)],
            dtype=object,
        )

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = False
        return tags
