"""How sharp each head's attention is: the largest weight of a row and its margin.

A softmax row's derivative is about its off-argmax mass, so the outputs of a layer
pin a sharp head's logits (a row nearly one-hot) only weakly: such heads are the
slow ones to learn (``benchmarks/README.md``, *Sharp heads are the slow ones*).
:func:`sharpness_profile` measures it per head on given inputs.
"""

from numbers import Integral, Real

import numpy as np
from sklearn.utils import Bunch, check_array

from ..layer import AttentionLayer, as_layer
from ..layer._math import attention_logits
from ..utils._validation import flatten_tokens, layer_sequences

# Rows of X whose logits (rows x heads x k x k floats) are computed at once.
_CHUNK_FLOATS = 2**22


def _is_layer(value):
    return isinstance(value, AttentionLayer) or hasattr(value, "attention_")


def sharpness_profile(
    attention,
    X,
    key_bias=None,
    *,
    threshold=0.99,
    quantiles=(0.1, 0.5, 0.9),
):
    """How concentrated each head's attention rows are on inputs X.

    For every sequence of X, head ``i`` and query token ``l``, the row
    ``softmax_a(x_l^T Theta_i x_a + u_i^T x_a)`` has a largest weight and a
    *logit margin*: its largest logit minus its second largest (the row is
    one-hot in the limit of an infinite margin; a margin of ``log 99 + log(k - 1)``
    or more puts at least 0.99 on the argmax).  Per head, over all the rows of all
    the sequences: the median largest weight, the share of rows whose largest
    weight exceeds ``threshold``, and quantiles of the margin.  Computed
    vectorised over the sequences (in chunks that bound memory).

    Parameters
    ----------
    attention : array-like of shape (n_heads, n_features, n_features), \
AttentionLayer or fitted estimator
        The heads' ``Theta_i``; or a layer or fitted estimator, as
        :func:`skattn.layer.as_layer` reads it (its key biases are then used
        unless ``key_bias`` is given).
    X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
        Input sequences (token-major when 2-D); ``n_tokens`` is taken from a 3-D
        X, else from the layer, else ``width // n_features``.
    key_bias : array-like of shape (n_heads, n_features), default=None
        The key biases ``u_i`` (logit term ``u_i^T x_a`` of key ``a``); ``None``:
        none (or the layer's).
    threshold : float, default=0.99
        A row is *sharp* when its largest weight exceeds this, in ``(0, 1)``.
    quantiles : sequence of float, default=(0.1, 0.5, 0.9)
        Quantiles of the logit margin to report, each in ``[0, 1]``.

    Returns
    -------
    profile : sklearn.utils.Bunch
        median_largest_weight : ndarray of shape (n_heads,)
            Median over rows of the row's largest attention weight (``1 / k``
            for uniform attention, 1 for one-hot rows).
        sharp_share : ndarray of shape (n_heads,)
            Share of rows whose largest weight exceeds ``threshold``.
        margin_quantiles : ndarray of shape (n_heads, len(quantiles))
            Quantiles over rows of the logit margin (``inf`` with one token).
        quantiles : ndarray of shape (len(quantiles),)
            The quantiles of ``margin_quantiles``' columns.
        threshold : float
            The ``threshold`` of ``sharp_share``.
        n_rows : int
            Rows per head: ``n_samples * n_tokens``.

    Raises
    ------
    ValueError
        If the shapes disagree, X is empty or not finite, ``threshold`` is not in
        ``(0, 1)`` or a quantile not in ``[0, 1]``.

    See Also
    --------
    attention_pattern_error : head-matched distance between two layers' patterns.

    Examples
    --------
    A head whose logits favour the token itself by a wide margin is nearly one-hot;
    a zero head attends uniformly:

    >>> import numpy as np
    >>> from skattn.metrics import sharpness_profile
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(200, 4, 8))
    >>> attention = np.stack([20 * np.eye(8), np.zeros((8, 8))])
    >>> profile = sharpness_profile(attention, X)
    >>> profile.median_largest_weight, profile.sharp_share
    (array([1.  , 0.25]), array([0.985, 0.   ]))
    >>> profile.margin_quantiles  # 10 %, 50 %, 90 % of the rows, per head
    array([[ 40., 120., 160.],
           [  0.,   0.,   0.]])

    (1.5 % of the rows of head 0 see their own token twice: two equal largest
    logits, margin 0, largest weight 0.5.)
    """
    n_tokens = None
    if _is_layer(attention):
        theta, _, u, _, n_tokens = as_layer(attention, "attention")._arrays()
        if key_bias is None:
            key_bias = u
    else:
        theta = check_array(
            attention,
            dtype=np.float64,
            ensure_2d=False,
            allow_nd=True,
            input_name="attention",
        )
        if theta.ndim != 3 or theta.shape[1] != theta.shape[2] or not theta.size:
            raise ValueError(
                f"attention must have shape (n_heads, n_features, n_features), got "
                f"{theta.shape}."
            )
    m, d = theta.shape[:2]
    if key_bias is not None:
        key_bias = check_array(key_bias, dtype=np.float64, input_name="key_bias")
        if key_bias.shape != (m, d):
            raise ValueError(
                f"key_bias must have shape (n_heads, n_features) = ({m}, {d}), got "
                f"{key_bias.shape}."
            )
    if (
        not isinstance(threshold, Real)
        or isinstance(threshold, bool)
        or not 0 < threshold < 1
    ):
        raise ValueError(f"threshold must be a number in (0, 1), got {threshold!r}.")
    q = np.asarray(quantiles, dtype=np.float64).reshape(-1)
    if q.size == 0 or not np.all((q >= 0) & (q <= 1)):
        raise ValueError(
            f"quantiles must be a non-empty sequence of numbers in [0, 1], got "
            f"{quantiles!r}."
        )
    X2, k3 = flatten_tokens(X)
    X2 = check_array(X2, dtype=np.float64, input_name="X")
    X3 = layer_sequences(
        X2, n_tokens if isinstance(n_tokens, Integral) else None, k3, d
    )
    n, k = X3.shape[:2]
    largest = np.empty((n, m, k))
    margin = np.full((n, m, k), np.inf)
    step = max(1, _CHUNK_FLOATS // (m * k * k))
    for start in range(0, n, step):
        rows = slice(start, start + step)
        logits = attention_logits(X3[rows], theta, key_bias)  # (n, m, k, k)
        top = logits.max(axis=-1, keepdims=True)
        largest[rows] = 1.0 / np.exp(logits - top).sum(axis=-1)
        if k > 1:
            two = np.partition(logits, (k - 2, k - 1), axis=-1)
            margin[rows] = two[..., k - 1] - two[..., k - 2]
    rows_per_head = np.moveaxis(largest, 1, 0).reshape(m, -1)
    margins = np.moveaxis(margin, 1, 0).reshape(m, -1)
    if k > 1:
        margin_quantiles = np.quantile(margins, q, axis=1).T
    else:
        margin_quantiles = np.full((m, q.size), np.inf)
    return Bunch(
        median_largest_weight=np.median(rows_per_head, axis=1),
        sharp_share=(rows_per_head > threshold).mean(axis=1),
        margin_quantiles=margin_quantiles,
        quantiles=q,
        threshold=float(threshold),
        n_rows=n * k,
    )
