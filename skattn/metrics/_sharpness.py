"""How sharp each head's attention is: the largest weight of a row and its margin.

A softmax row's derivative is about its off-argmax mass, so the outputs of a layer
pin a sharp head's logits (a row nearly one-hot) only weakly: such heads are the
slow ones to learn (``benchmarks/README.md``, *Sharp heads are the slow ones*).
:func:`sharpness_profile` measures it per head on given inputs;
:func:`sharp_head_pinning` counts, per head, the rows that split its attention
against the number its logits need.
"""

from numbers import Integral, Real

import numpy as np
from sklearn.utils import Bunch, check_array

from ..layer import AttentionLayer, as_layer
from ..layer._math import attention_logits
from ..solvers.kernels._logits import logit_unknowns, split_rows_needed
from ..utils._validation import flatten_tokens, layer_sequences

# Rows of X whose logits (rows x heads x k x k floats) are computed at once.
_CHUNK_FLOATS = 2**22


def _is_layer(value):
    return isinstance(value, AttentionLayer) or hasattr(value, "attention_")


def _heads_and_bias(attention, key_bias):
    """``(theta, key_bias, n_tokens, layer)`` validated from ``attention``.

    ``layer`` is the :class:`AttentionLayer` that ``attention`` gave (None for an
    array); its key biases are used when ``key_bias`` is None.
    """
    n_tokens = layer = None
    if _is_layer(attention):
        layer = as_layer(attention, "attention")
        theta, _, u, _, n_tokens = layer._arrays()
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
    return theta, key_bias, n_tokens if isinstance(n_tokens, Integral) else None, layer


def _check_threshold(threshold):
    if (
        not isinstance(threshold, Real)
        or isinstance(threshold, bool)
        or not 0 < threshold < 1
    ):
        raise ValueError(f"threshold must be a number in (0, 1), got {threshold!r}.")


def _token_tensor(X, n_tokens, d):
    """X validated as a token tensor ``(n, k, d)``."""
    X2, k3 = flatten_tokens(X)
    X2 = check_array(X2, dtype=np.float64, input_name="X")
    return layer_sequences(X2, n_tokens, k3, d)


def _row_statistics(X3, theta, key_bias, margins):
    """Per head, every row's largest weight (and logit margin), ``(m, n * k)``.

    Vectorised over the sequences, in chunks of about ``_CHUNK_FLOATS`` logits.
    ``margins=False`` skips the margins (returned as None).
    """
    n, k = X3.shape[:2]
    m = theta.shape[0]
    largest = np.empty((n, m, k))
    margin = np.full((n, m, k), np.inf) if margins else None
    step = max(1, _CHUNK_FLOATS // (m * k * k))
    for start in range(0, n, step):
        rows = slice(start, start + step)
        logits = attention_logits(X3[rows], theta, key_bias)  # (n, m, k, k)
        top = logits.max(axis=-1, keepdims=True)
        largest[rows] = 1.0 / np.exp(logits - top).sum(axis=-1)
        if margins and k > 1:
            two = np.partition(logits, (k - 2, k - 1), axis=-1)
            margin[rows] = two[..., k - 1] - two[..., k - 2]
    per_head = np.moveaxis(largest, 1, 0).reshape(m, -1)
    if not margins:
        return per_head, None
    return per_head, np.moveaxis(margin, 1, 0).reshape(m, -1)


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
    theta, key_bias, n_tokens, _ = _heads_and_bias(attention, key_bias)
    _check_threshold(threshold)
    q = np.asarray(quantiles, dtype=np.float64).reshape(-1)
    if q.size == 0 or not np.all((q >= 0) & (q <= 1)):
        raise ValueError(
            f"quantiles must be a non-empty sequence of numbers in [0, 1], got "
            f"{quantiles!r}."
        )
    X3 = _token_tensor(X, n_tokens, theta.shape[1])
    n, k = X3.shape[:2]
    m = theta.shape[0]
    rows_per_head, margins = _row_statistics(X3, theta, key_bias, margins=True)
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


def sharp_head_pinning(attention, X, key_bias=None, *, head_rank=None, threshold=0.99):
    """Whether inputs X split each head's attention on enough rows to pin its logits.

    A softmax row's derivative in its logits is about its off-argmax mass, so a row
    whose largest weight is near one (``> threshold``) says almost nothing about
    the head's logits: only the rows that *split* their attention (largest weight
    ``<= threshold``) pin them to useful precision.  Each split row gives at most
    ``k - 1`` logit differences (a softmax row of ``k`` weights is invariant to a
    common shift of its logits), and a head's logits have

    * ``u = r (2 d - r)`` unknowns for a rank-r ``Theta_i`` (the dimension of the
      ``d x d`` matrices of rank r), ``d^2`` at full rank,
    * plus ``d`` with key biases ``u_i``,

    so a head needs at least ``n_needed = ceil(u / (k - 1))`` split rows.  This is
    a **necessary counting condition, a heuristic, not a proof**: a head with
    fewer split rows is left with directions of its logits that the outputs pin
    only through rows' tiny off-argmax mass, and a fit of it stalls or fails to
    generalise; a head with enough may still be ill-conditioned (the split rows
    can repeat the same differences).

    Measured motivation (``benchmarks/README.md``, *Sharp heads are the slow
    ones*): all-MiniLM-L6-v2 layer 0 head 2 (d = 384, head rank 32, k = 16, with
    key bias: ``u = 32 (768 - 32) + 384 = 23 936``, ``n_needed = 1596``) had 86
    split rows in 64 000 (4000 windows), and no fit of it generalised; layer 1's
    sharp heads (median largest weight 0.76-0.90) stalled on 376 windows and
    converged on 1128-3384.

    Parameters
    ----------
    attention : array-like of shape (n_heads, n_features, n_features), \
AttentionLayer or fitted estimator
        The heads' ``Theta_i``; or a layer or fitted estimator, as
        :func:`skattn.layer.as_layer` reads it (its key biases are then used
        unless ``key_bias`` is given, and its ``head_rank`` unless ``head_rank``
        is).
    X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
        Input sequences (token-major when 2-D), as for :func:`sharpness_profile`;
        at least two tokens per sequence.
    key_bias : array-like of shape (n_heads, n_features), default=None
        The key biases ``u_i``; ``None``: the layer's, else none.  Given (or the
        layer's), they add ``d`` unknowns per head.
    head_rank : int, default=None
        Rank r of the heads' ``Theta_i``; ``None``: the layer's or estimator's
        ``head_rank`` when it has one, else full rank.  Ranks above ``d`` count as
        full rank.
    threshold : float, default=0.99
        A row *splits* its attention when its largest weight is at most this, in
        ``(0, 1)``.

    Returns
    -------
    pinning : sklearn.utils.Bunch
        median_largest_weight : ndarray of shape (n_heads,)
            Median over rows of the row's largest weight
            (:func:`sharpness_profile`).
        n_split_rows : ndarray of int of shape (n_heads,)
            Rows (sequence x query token) whose largest weight is ``<=
            threshold``.
        n_unknowns : ndarray of int of shape (n_heads,)
            Unknowns ``u`` of each head's logits.
        n_needed : ndarray of int of shape (n_heads,)
            ``ceil(u / (k - 1))``: split rows the counting bound asks for.
        pinned : ndarray of bool of shape (n_heads,)
            ``n_split_rows >= n_needed``.
        sequences_needed : ndarray of float of shape (n_heads,)
            About how many sequences like those of X would give ``n_needed``
            split rows: ``ceil(n_sequences * n_needed / n_split_rows)`` (at most
            ``n_sequences`` for a pinned head).  **NaN** where a head has no
            split row at all: the estimate has nothing to scale, and more
            sequences of the same kind may never split that head's attention;
            inputs of another kind are needed.
        n_rows : int
            Rows per head: ``n_samples * n_tokens``.
        n_sequences : int
            ``n_samples``.
        n_tokens : int
            Tokens per sequence k.
        head_rank : int or None
            The rank counted (``None``: full).
        key_bias : bool
            Whether key biases were counted.
        threshold : float
            The ``threshold`` of a split row.

    Raises
    ------
    ValueError
        If the shapes disagree, X is empty or not finite, has one token per
        sequence (the softmax is then 1: the outputs do not depend on the
        logits), ``head_rank`` is not a positive integer or ``threshold`` not in
        ``(0, 1)``.

    See Also
    --------
    sharpness_profile : how concentrated each head's rows are.
    skattn.diagnostics.certify : reports this for a fit on its training data.

    Examples
    --------
    Head 0 is nearly one-hot (1.5 % of its rows split, where the same token
    appears twice); head 1 attends uniformly.  At d = 8, full rank, k = 4 a head
    has 64 unknowns and needs ``ceil(64 / 3) = 22`` split rows:

    >>> import numpy as np
    >>> from skattn.metrics import sharp_head_pinning
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(200, 4, 8))
    >>> attention = np.stack([20 * np.eye(8), np.zeros((8, 8))])
    >>> pinning = sharp_head_pinning(attention, X)
    >>> pinning.n_split_rows, pinning.n_needed, pinning.pinned
    (array([ 12, 800]), array([22, 22]), array([False,  True]))
    >>> pinning.sequences_needed  # sequences like these for 22 split rows
    array([367.,   6.])
    """
    has_bias = key_bias is not None
    theta, key_bias, n_tokens, layer = _heads_and_bias(attention, key_bias)
    if layer is not None:
        has_bias = has_bias or layer.key_bias is not None
        if head_rank is None:
            head_rank = getattr(attention, "head_rank", None)
        if head_rank is None:
            head_rank = getattr(layer, "head_rank", None)
    if head_rank is not None and (
        not isinstance(head_rank, Integral)
        or isinstance(head_rank, bool)
        or head_rank < 1
    ):
        raise ValueError(
            f"head_rank must be a positive integer or None, got {head_rank!r}."
        )
    _check_threshold(threshold)
    m, d = theta.shape[:2]
    X3 = _token_tensor(X, n_tokens, d)
    n, k = X3.shape[:2]
    if k < 2:
        raise ValueError(
            "sharp_head_pinning needs at least 2 tokens per sequence: with one "
            "the softmax is 1 and the outputs do not depend on the logits."
        )
    largest, _ = _row_statistics(X3, theta, key_bias, margins=False)
    n_split = np.count_nonzero(largest <= threshold, axis=1)
    unknowns = np.full(m, logit_unknowns(d, head_rank, has_bias))
    needed = np.full(m, split_rows_needed(d, head_rank, k, has_bias))
    # no split row: nothing to scale (NaN, documented), not a pretend estimate
    sequences = np.where(
        n_split > 0, np.ceil(n * needed / np.maximum(n_split, 1)), np.nan
    )
    return Bunch(
        median_largest_weight=np.median(largest, axis=1),
        n_split_rows=n_split,
        n_unknowns=unknowns,
        n_needed=needed,
        pinned=n_split >= needed,
        sequences_needed=sequences,
        n_rows=n * k,
        n_sequences=n,
        n_tokens=k,
        head_rank=None if head_rank is None or head_rank >= d else int(head_rank),
        key_bias=bool(has_bias),
        threshold=float(threshold),
    )


def _describe_pinning(pinning, head):
    """One head's line of :func:`sharp_head_pinning`: its sharpness, its split
    rows against the bound, and the verdict (for the certificate and the fit's
    warning).

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.utils import Bunch
    >>> pinning = Bunch(median_largest_weight=np.array([1.0]), n_split_rows=[86],
    ...                 n_rows=64000, n_needed=[1596], pinned=[False],
    ...                 sequences_needed=[74233.0], n_sequences=4000)
    >>> _describe_pinning(pinning, 0)
    'median largest weight 1, split rows 86 of 64000, needed 1596 -> NOT pinned \
(about 74233 sequences like these needed, now 4000)'
    """
    text = (
        f"median largest weight {pinning.median_largest_weight[head]:.5g}, split "
        f"rows {int(pinning.n_split_rows[head])} of {int(pinning.n_rows)}, needed "
        f"{int(pinning.n_needed[head])} -> "
    )
    if pinning.pinned[head]:
        return text + "pinned"
    wanted = pinning.sequences_needed[head]
    if not np.isfinite(wanted):
        return text + (
            "NOT pinned (no row splits its attention: more sequences of this kind "
            "may never pin it)"
        )
    return (
        text + f"NOT pinned (about {int(wanted)} sequences like these needed, now "
        f"{int(pinning.n_sequences)})"
    )
