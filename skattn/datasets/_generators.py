"""Planted multi-head attention layers and regression data drawn from them."""

from numbers import Integral, Real

import numpy as np
from sklearn.utils._param_validation import Interval, StrOptions, validate_params

from ..layer import AttentionLayer
from ..layer._math import forward, min_separation
from ._distributions import TokenDistribution, _as_generator, resolve_distribution

# Two planted heads closer than this (relative Frobenius distance) are redrawn.
_MIN_HEAD_DISTANCE = 1e-3
_MAX_DRAWS = 100

# A ``sharpness`` target is met on a fixed sample of inputs drawn from a generator of
# its own (the layer's and the data's draws are those of ``sharpness=None``):
# ``_SHARPNESS_SEQUENCES`` sequences (fewer for long ones, so that at most
# ``_SHARPNESS_FLOATS`` logits are held), of which ``_SHARPNESS_QUERIES`` random
# query rows each (all rows of shorter sequences).  The median is hit to within
# ``_SHARPNESS_TOL``, and to within ``_SHARPNESS_RTOL`` of ``1 - target`` (what is
# left off the largest weight: 1e-4 at 0.9999, which an absolute 5e-4 would not
# tell from 6e-4), on that sample (its sampling error is a few 1e-3 at most).
_SHARPNESS_SEED = 39
_SHARPNESS_SEQUENCES = 4096
_SHARPNESS_QUERIES = 8
_SHARPNESS_FLOATS = 2**22
_SHARPNESS_TOL = 5e-4
_SHARPNESS_RTOL = 0.02
# Theta_i is scaled by at most 2**40 (or at least 2**-40) in search of a target.
_SHARPNESS_MAX_DOUBLINGS = 40


def _planted_attention(rng, n_heads, n_features, structure, rank, scale):
    """Theta_i of the given structure, each of Frobenius norm ``scale``.

    ``(m, d, d)``; ``rank`` is used by ``"low_rank"`` only.
    """
    m, d = n_heads, n_features
    if structure == "random":
        raw = rng.standard_normal((m, d, d))
    elif structure == "diagonal":
        raw = np.zeros((m, d, d))
        raw[:, np.arange(d), np.arange(d)] = rng.standard_normal((m, d))
    else:  # "low_rank": Theta_i = U_i V_i^T
        left = rng.standard_normal((m, d, rank))
        right = rng.standard_normal((m, d, rank))
        raw = left @ np.swapaxes(right, 1, 2)
    norms = np.linalg.norm(raw.reshape(m, -1), axis=1)
    return raw * (scale / norms)[:, None, None]


def _is_number(value):
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_sharpness(sharpness, n_heads, n_tokens):
    """Per-head sharpness targets (a float, or ``None`` for none) from ``sharpness``.

    ``None`` when no head has a target.  Raises ``ValueError`` for anything but a
    number in ``(1/n_tokens, 1)`` or a sequence of ``n_heads`` such numbers (or
    ``None``), and when ``n_tokens`` is unknown.
    """
    if sharpness is None:
        return None
    if n_tokens is None:
        raise ValueError(
            "sharpness needs n_tokens: the median largest attention weight of a row "
            "depends on the sequence length it is measured at."
        )
    allowed = (
        f"a number in (1/n_tokens, 1) = ({1 / n_tokens:.6g}, 1) for all heads, or "
        f"a sequence of n_heads={n_heads} such numbers (None for a head left as "
        f"drawn)"
    )
    if _is_number(sharpness):
        targets = [sharpness] * n_heads
    elif isinstance(sharpness, str) or not np.iterable(sharpness):
        raise ValueError(f"sharpness must be {allowed}; got {sharpness!r}.")
    else:
        targets = list(sharpness)
        if len(targets) != n_heads:
            raise ValueError(
                f"sharpness must be {allowed}; got {len(targets)} values for "
                f"{n_heads} heads."
            )
    for target in targets:
        # NaN fails the comparison, as do 1/n_tokens and 1 themselves
        if target is not None and not (
            _is_number(target) and 1 / n_tokens < target < 1
        ):
            raise ValueError(
                f"sharpness must be {allowed}; got {sharpness!r} "
                f"(with n_tokens={n_tokens})."
            )
    targets = [None if t is None else float(t) for t in targets]
    return targets if any(t is not None for t in targets) else None


def _median_largest(gaps, log_scale):
    """Median over rows of the largest softmax weight of ``exp(log_scale) * logits``.

    ``gaps``: the logits minus their row maximum (``<= 0``), ``(..., k)``.
    """
    return float(np.median(1.0 / np.exp(np.exp(log_scale) * gaps).sum(axis=-1)))


def _log_scale_for(gaps, target, head, distribution):
    """``log c`` such that the median largest weight of ``c * logits`` is ``target``.

    The median largest weight is continuous and non-decreasing in ``c`` (from
    ``1/k`` at 0 to its value for hard rows): bracket by doubling, then bisect on
    ``log c`` until within ``_SHARPNESS_TOL`` (and ``_SHARPNESS_RTOL (1 -
    target)``).
    """
    tol = min(_SHARPNESS_TOL, _SHARPNESS_RTOL * (1.0 - target))
    step = np.log(2.0)
    lo = hi = 0.0
    f_lo = f_hi = _median_largest(gaps, 0.0)
    for _ in range(_SHARPNESS_MAX_DOUBLINGS):
        if f_lo <= target <= f_hi:
            break
        if f_hi < target:
            lo, f_lo = hi, f_hi
            hi += step
            f_hi = _median_largest(gaps, hi)
        else:
            hi, f_hi = lo, f_lo
            lo -= step
            f_lo = _median_largest(gaps, lo)
    else:
        raise ValueError(
            f"sharpness={target} cannot be planted in head {head}: on "
            f"{distribution!r} inputs its median largest attention weight levels "
            f"off at {f_hi:.4g} however Theta_{head} is scaled (rows whose largest "
            f"logits tie, e.g. repeated tokens). Ask for less, or use more "
            f"n_features or another structure."
        )
    for _ in range(100):
        if abs(f_lo - target) <= tol:
            return lo
        if abs(f_hi - target) <= tol:
            return hi
        mid = 0.5 * (lo + hi)
        f_mid = _median_largest(gaps, mid)
        if f_mid < target:
            lo, f_lo = mid, f_mid
        else:
            hi, f_hi = mid, f_mid
    return lo if target - f_lo < f_hi - target else hi  # pragma: no cover


def _sharpen(attention, key_bias, targets, distribution, n_tokens):
    """Rescale each targeted ``Theta_i`` (and ``u_i``) to its sharpness target.

    Returns new ``attention`` and ``key_bias`` arrays.  The inputs are a fixed
    sample of ``distribution`` from a generator of its own; the logits are
    computed once per head and vectorised over the sample.
    """
    m, d = attention.shape[:2]
    k = n_tokens
    dist = resolve_distribution(distribution, k, d)
    n_queries = min(k, _SHARPNESS_QUERIES)
    n = max(1, min(_SHARPNESS_SEQUENCES, _SHARPNESS_FLOATS // (n_queries * k)))
    rng = np.random.default_rng(_SHARPNESS_SEED)
    X = dist.sample(n, random_state=rng).reshape(n, k, d)
    if n_queries < k:  # distinct random query rows of every sequence
        rows = np.argsort(rng.random((n, k)), axis=1)[:, :n_queries]
        queries = np.take_along_axis(X, rows[:, :, None], axis=1)
    else:
        queries = X
    keys = np.swapaxes(X, 1, 2)
    attention = attention.copy()
    key_bias = None if key_bias is None else np.array(key_bias, dtype=np.float64)
    for i, target in enumerate(targets):
        if target is None:
            continue
        logits = queries @ attention[i] @ keys  # (n, n_queries, k)
        if key_bias is not None:
            logits += (X @ key_bias[i])[:, None, :]
        gaps = logits - logits.max(axis=-1, keepdims=True)
        scale = np.exp(_log_scale_for(gaps, target, i, dist))
        attention[i] *= scale
        if key_bias is not None:
            key_bias[i] *= scale
    return attention, key_bias


def _draw_layer(
    n_heads,
    n_features,
    *,
    n_outputs,
    attention_scale,
    structure,
    rank,
    head_rank,
    random_state,
    n_tokens=None,
    sharpness=None,
    distribution="boolean",
    causal=False,
    rope=False,
    rope_theta=10000.0,
    rope_layout="half",
    n_kv_heads=None,
):
    """The planted layer of :func:`make_attention_layer` (arguments validated).

    The one drawing of a planted layer: :func:`make_attention_layer`,
    :func:`make_attention_regression` and
    :func:`~skattn.datasets.write_attention_regression` all call it, so the same
    arguments and seed plant the same layer everywhere.  ``random_state`` is turned
    into a fresh generator (advancing a ``Generator`` or ``RandomState`` instance by
    that one draw); ``n_tokens`` is set on the layer.  ``sharpness`` targets (see
    :func:`_check_sharpness`) rescale the drawn heads on a sample of
    ``distribution`` of a generator of its own, so the draws from ``random_state``
    are those of ``sharpness=None``.  ``causal``, ``rope`` and ``n_kv_heads``
    plant a decoder layer (:func:`_draw_decoder`); without them the draws are
    those of before.
    """
    if causal or rope or n_kv_heads is not None:
        return _draw_decoder(
            n_heads,
            n_features,
            n_outputs=n_outputs,
            attention_scale=attention_scale,
            structure=structure,
            rank=rank,
            head_rank=head_rank,
            random_state=random_state,
            n_tokens=n_tokens,
            sharpness=sharpness,
            causal=causal,
            rope=rope,
            rope_theta=rope_theta,
            rope_layout=rope_layout,
            n_kv_heads=n_kv_heads,
        )
    targets = _check_sharpness(sharpness, n_heads, n_tokens)
    if targets is not None and attention_scale == 0:
        raise ValueError(
            "sharpness cannot be planted with attention_scale=0: zero heads attend "
            "uniformly however they are scaled. Use attention_scale > 0."
        )
    d = n_features
    d_out = d if n_outputs is None else n_outputs
    if head_rank is not None:
        if structure == "diagonal" or (rank is not None and rank != head_rank):
            raise ValueError(
                f"head_rank={head_rank} plants Theta_i = Q_i K_i^T of rank "
                f"head_rank; it cannot be combined with structure={structure!r}"
                f" and rank={rank}. Pass only head_rank."
            )
        if head_rank > min(d, d_out):
            raise ValueError(
                f"head_rank={head_rank} exceeds min(n_features, n_outputs) = "
                f"{min(d, d_out)}."
            )
        structure, rank = "low_rank", head_rank
    if structure == "low_rank":
        rank = max(1, d // 4) if rank is None else rank
        if rank > d:
            raise ValueError(
                f"rank={rank} exceeds n_features={d}; a low-rank Theta_i of shape "
                f"({d}, {d}) has rank at most {d}."
            )
    if attention_scale > 0 and n_heads > 2 and d == 1:
        raise ValueError(
            f"n_heads={n_heads} distinct heads cannot be planted with n_features=1: "
            f"a 1 x 1 Theta_i of norm attention_scale is +attention_scale or "
            f"-attention_scale. Use n_features >= 2 or n_heads <= 2."
        )
    rng = _as_generator(random_state)
    for _ in range(_MAX_DRAWS):
        attention = _planted_attention(
            rng, n_heads, d, structure, rank, attention_scale
        )
        if (
            attention_scale == 0
            or n_heads == 1
            or min_separation(attention) >= _MIN_HEAD_DISTANCE
        ):
            break
    else:  # pragma: no cover - probability ~2**-100 for the cases allowed above
        raise RuntimeError("could not draw distinct heads; use another random_state.")
    if head_rank is None:
        projection = rng.standard_normal((n_heads, d, d_out)) / np.sqrt(d)
    else:
        value = rng.standard_normal((n_heads, d, head_rank))
        output = rng.standard_normal((n_heads, head_rank, d_out))
        projection = value @ output / np.sqrt(head_rank * d)
    if targets is not None:
        attention, _ = _sharpen(attention, None, targets, distribution, n_tokens)
    return AttentionLayer(attention, projection, n_tokens=n_tokens, head_rank=head_rank)


# The decoder options of a planted layer (make_attention_layer,
# make_attention_regression).
_DECODER_PARAMETERS = {
    "causal": ["boolean"],
    "rope": ["boolean"],
    "rope_theta": [Interval(Real, 0, None, closed="neither")],
    "rope_layout": [StrOptions({"half", "interleaved"})],
    "n_kv_heads": [Interval(Integral, 1, None, closed="left"), None],
}


def _draw_decoder(
    n_heads,
    n_features,
    *,
    n_outputs,
    attention_scale,
    structure,
    rank,
    head_rank,
    random_state,
    n_tokens,
    sharpness,
    causal,
    rope,
    rope_theta,
    rope_layout,
    n_kv_heads,
):
    """A planted decoder layer: causal, rotary and/or grouped-query heads.

    Query head i and its key/value head ``g = i // (n_heads / n_kv_heads)``:
    ``Q_i``, ``K_g``, ``V_g`` of shape ``(d, head_rank)`` and ``O_i`` of shape
    ``(head_rank, d_out)`` with i.i.d. ``N(0, 1)`` entries, ``Q_i`` scaled so
    that ``||Q_i K_g^T||_F = attention_scale``, and ``W_i = V_g O_i / sqrt(
    head_rank d)``.  With ``rope`` the logits are rotary, ``Q_i R K_g^T``
    (``rotary_query``, ``rotary_key``; ``attention`` zero), else ``Theta_i =
    Q_i K_g^T``.  Only ``causal`` (no ``rope``, no ``n_kv_heads``) keeps the
    draws of the position-free layer and masks it.
    """
    if sharpness is not None:
        raise ValueError(
            "sharpness is measured on unmasked, position-free heads; it cannot be "
            "planted with causal=True, rope=True or n_kv_heads."
        )
    if not rope and n_kv_heads is None:  # the position-free draws, masked
        layer = _draw_layer(
            n_heads,
            n_features,
            n_outputs=n_outputs,
            attention_scale=attention_scale,
            structure=structure,
            rank=rank,
            head_rank=head_rank,
            random_state=random_state,
            n_tokens=n_tokens,
        )
        return layer.set_params(causal=True)
    what = "rope=True" if rope else f"n_kv_heads={n_kv_heads}"
    if head_rank is None:
        raise ValueError(
            f"{what} needs head_rank: the head dimension that the rotation acts on "
            f"and the groups of query heads share."
        )
    if structure != "random" or rank is not None:
        raise ValueError(
            f"{what} plants heads Q_i K_g^T of rank head_rank; it cannot be combined "
            f"with structure={structure!r} or rank={rank}."
        )
    m, d, r = n_heads, n_features, head_rank
    d_out = d if n_outputs is None else n_outputs
    if r > min(d, d_out):
        raise ValueError(
            f"head_rank={r} exceeds min(n_features, n_outputs) = {min(d, d_out)}."
        )
    if rope and r % 2:
        raise ValueError(
            f"rope=True rotates pairs of dimensions: head_rank={r} must be even."
        )
    m_kv = m if n_kv_heads is None else n_kv_heads
    if m % m_kv:
        raise ValueError(
            f"n_kv_heads={m_kv} does not divide n_heads={m}: each group of "
            f"n_heads / n_kv_heads query heads shares one key/value head."
        )
    rng = _as_generator(random_state)
    group = np.arange(m) // (m // m_kv)
    query = rng.standard_normal((m, d, r))
    key = rng.standard_normal((m_kv, d, r))
    value = rng.standard_normal((m_kv, d, r))
    output = rng.standard_normal((m, r, d_out))
    products = query @ np.swapaxes(key[group], 1, 2)
    norms = np.linalg.norm(products.reshape(m, -1), axis=1)
    query *= (attention_scale / norms)[:, None, None]
    projection = value[group] @ output / np.sqrt(r * d)
    params = {"causal": bool(causal), "n_kv_heads": n_kv_heads}
    if rope:
        attention = np.zeros((m, d, d))
        params.update(
            rotary_query=query,
            rotary_key=key,
            rope_theta=float(rope_theta),
            rope_layout=rope_layout,
        )
    else:
        attention = query @ np.swapaxes(key[group], 1, 2)
    return AttentionLayer(
        attention, projection, n_tokens=n_tokens, head_rank=head_rank, **params
    )


@validate_params(
    {
        "n_heads": [Interval(Integral, 1, None, closed="left")],
        "n_features": [Interval(Integral, 1, None, closed="left")],
        "n_outputs": [Interval(Integral, 1, None, closed="left"), None],
        "attention_scale": [Interval(Real, 0, None, closed="left")],
        "structure": [StrOptions({"random", "diagonal", "low_rank"})],
        "rank": [Interval(Integral, 1, None, closed="left"), None],
        "head_rank": [Interval(Integral, 1, None, closed="left"), None],
        "n_tokens": [Interval(Integral, 1, None, closed="left"), None],
        "distribution": [
            StrOptions({"boolean", "gaussian", "vocabulary"}),
            TokenDistribution,
        ],
        "sharpness": "no_validation",  # checked by _check_sharpness
        "random_state": ["random_state", np.random.Generator],
        **_DECODER_PARAMETERS,
    },
    prefer_skip_nested_validation=True,
)
def make_attention_layer(
    n_heads,
    n_features,
    *,
    n_outputs=None,
    attention_scale=2.0,
    structure="random",
    rank=None,
    head_rank=None,
    n_tokens=None,
    distribution="boolean",
    sharpness=None,
    random_state=None,
    causal=False,
    rope=False,
    rope_theta=10000.0,
    rope_layout="half",
    n_kv_heads=None,
):
    """Plant a random multi-head attention layer.

    ``F(X) = sum_i softmax(X Theta_i X^T) X W_i`` with ``n_heads`` heads.

    Parameters
    ----------
    n_heads : int
        Number of heads m.
    n_features : int
        Features per input token d.
    n_outputs : int, default=None
        Features per output token d_out; ``None`` means ``n_features``.
    attention_scale : float, default=2.0
        Standard deviation of the attention logit between two distinct tokens:
        every ``Theta_i`` is scaled to ``||Theta_i||_F = attention_scale``, so for
        independent tokens ``x_a, x_b`` (``a != b``) with i.i.d. mean-0
        variance-1 entries (Boolean or standard Gaussian),
        ``x_a^T Theta_i x_b`` has mean 0 and standard deviation
        ``attention_scale`` exactly. See Notes for the diagonal logits.
    structure : {"random", "diagonal", "low_rank"}, default="random"
        Shape of the ``Theta_i`` before scaling: i.i.d. Gaussian entries
        (generic: a.s. full rank, pairwise distinct and non-parallel);
        a diagonal with i.i.d. Gaussian entries; or ``U_i V_i^T`` with
        ``U_i, V_i`` of shape ``(d, rank)`` with i.i.d. Gaussian entries.
    rank : int, default=None
        Rank of the ``"low_rank"`` heads, at most ``n_features``; ``None`` means
        ``max(1, n_features // 4)``. Ignored otherwise.
    head_rank : int, default=None
        Plant low-rank heads, the shape of real transformers: ``Theta_i = Q_i
        K_i^T`` (as ``structure="low_rank"`` with ``rank=head_rank``) and
        ``W_i = V_i O_i`` with ``V_i`` of shape ``(n_features, head_rank)`` with
        i.i.d. ``N(0, 1)`` entries and ``O_i`` of shape ``(head_rank, n_outputs)``
        with i.i.d. ``N(0, 1/(head_rank n_features))`` entries (so the entries of
        ``W_i`` have variance ``1/d`` as in the full-rank case).  The layer's
        ``head_rank`` is set.  ``None``: full-rank heads as ``structure`` says.
    n_tokens : int, default=None
        Tokens per sequence k, set on the layer; required with ``sharpness``,
        which is measured on sequences of that length.  ``None``: any length.
    distribution : {"boolean", "gaussian", "vocabulary"} or TokenDistribution, \
default="boolean"
        Inputs on which ``sharpness`` is measured (see
        :func:`make_attention_regression`); unused without ``sharpness``.
    sharpness : float or sequence of float, default=None
        Plant heads this sharp: the target median, over the rows of sequences
        drawn from ``distribution`` (``n_tokens`` tokens each), of a row's largest
        attention weight ``max_a softmax_a(x_l^T Theta_i x_a)``, as
        :func:`skattn.metrics.sharpness_profile` measures it.  One number for all
        heads or one per head (``None`` for a head left as drawn), each in
        ``(1/n_tokens, 1)``: ``1/n_tokens`` is uniform attention, 1 one-hot rows;
        0.99 and above plant near-hard heads, as the previous-token heads of real
        models.  Each targeted ``Theta_i`` is drawn as usual, then multiplied by
        the scalar (found by bisection on its logarithm) that hits its target to
        within 0.0005 on a fixed sample of a few thousand sequences (a generator
        of its own, so every other draw is that of ``sharpness=None``); its norm
        is then no longer ``attention_scale``, which only sets the starting
        scale.  ``None``: no rescaling.
    random_state : int, RandomState instance, Generator or None, default=None
        Seed of the parameters.
    causal : bool, default=False
        Plant a decoder (causal) layer: token l attends to tokens ``a <= l``.
        Alone, the heads are drawn as without it.
    rope : bool, default=False
        Rotary position embeddings on the heads (``head_rank`` required, even):
        head i's logit is ``x_l^T Q_i R((a - l) omega) K_g^T x_a`` (see
        :class:`~skattn.AttentionLayer`'s ``rotary_query``), ``attention`` zero,
        ``Q_i`` scaled so that ``||Q_i K_g^T||_F = attention_scale`` (the logit
        scale at relative position 0).
    rope_theta : float, default=10000.0
        The RoPE base.
    rope_layout : {"half", "interleaved"}, default="half"
        Which dimensions pair up (``rotate_half`` or GPT-J's interleaving).
    n_kv_heads : int, default=None
        Grouped-query heads (``head_rank`` required): consecutive groups of
        ``n_heads / n_kv_heads`` query heads share one key map ``K_g`` and one
        value map ``V_g`` (``W_i = V_g O_i``).  ``None``: every head its own.

    Returns
    -------
    layer : AttentionLayer
        With ``attention`` of shape ``(n_heads, n_features, n_features)`` and
        ``projection`` of shape ``(n_heads, n_features, n_outputs)``;
        ``n_tokens`` as given (``None``: any sequence length).

    Raises
    ------
    ValueError
        If a ``sharpness`` target is not in ``(1/n_tokens, 1)`` (NaN included),
        a sequence of them has not ``n_heads`` entries, ``n_tokens`` is not given
        with it, ``attention_scale=0``, or a head cannot reach its target (its
        rows' largest logits tie, e.g. repeated Boolean tokens with few
        features); or if ``rope`` or ``n_kv_heads`` come without ``head_rank``,
        with ``sharpness``, ``structure`` or ``rank``, with an odd ``head_rank``
        (``rope``) or with ``n_kv_heads`` not dividing ``n_heads``.

    See Also
    --------
    make_attention_regression : examples ``(X, F(X) + noise)`` of such a layer.
    skattn.diagnostics.check_conditions : diagnose a planted layer.

    Notes
    -----
    Projections: ``W_i`` has i.i.d. ``N(0, 1/d)`` entries, so that each output
    coordinate of a head, ``(S_i X W_i)_{l j}``, has variance at most
    ``||(S_i X)_l||^2 / d <= 1`` for Boolean tokens (equality when the head
    attends to one token): every head contributes O(1) per coordinate.

    Diagonal logits (a token with itself): ``x^T Theta x`` has mean
    ``Tr(Theta)`` under both distributions, and variance
    ``sum_{p<q} (Theta_pq + Theta_qp)^2`` for Boolean tokens (the diagonal of
    Theta contributes the constant ``Tr(Theta)``) or ``2 ||(Theta + Theta^T)/2||_F^2``
    for Gaussian tokens. So the self-logit is offset by ``Tr(Theta)`` with
    ``E[Tr(Theta)^2] = attention_scale^2 / d`` for ``"random"`` heads (a small
    bias), but ``E[Tr(Theta)^2] = attention_scale^2`` for ``"diagonal"`` heads,
    whose self-logit is moreover the constant ``Tr(Theta)`` on Boolean tokens.
    ``skattn.diagnostics`` reports ``Tr(Theta)^2 / ||Theta||_F^2`` as the
    "diagonal weight".

    Heads are redrawn (at most 100 times) until every two ``Theta_i`` differ by
    at least 0.1 % in relative Frobenius distance; with ``n_features=1`` at most
    two distinct heads of the prescribed norm exist.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.datasets import make_attention_layer
    >>> layer = make_attention_layer(2, 4, n_outputs=3, random_state=0)
    >>> layer.attention.shape, layer.projection.shape
    ((2, 4, 4), (2, 4, 3))
    >>> float(np.linalg.norm(layer.attention[0]))
    2.0

    Near-hard heads, as measured on fresh Boolean sequences of 8 tokens:

    >>> from skattn.metrics import sharpness_profile
    >>> from skattn.datasets import BooleanTokens
    >>> sharp = make_attention_layer(
    ...     2, 16, n_tokens=8, sharpness=[0.99, 0.5], random_state=0)
    >>> X = BooleanTokens(8, 16).sample(4000, random_state=1)
    >>> measured = sharpness_profile(sharp, X).median_largest_weight
    >>> bool(np.all(np.abs(measured - [0.99, 0.5]) < 0.01))
    True

    A causal layer with rotary positions, 8 query heads sharing 2 key/value
    heads:

    >>> dec = make_attention_layer(8, 64, head_rank=16, causal=True, rope=True,
    ...                            n_kv_heads=2, random_state=0)
    >>> dec.rotary_query.shape, dec.rotary_key.shape
    ((8, 64, 16), (2, 64, 16))
    """
    return _draw_layer(
        n_heads,
        n_features,
        n_outputs=n_outputs,
        attention_scale=attention_scale,
        structure=structure,
        rank=rank,
        head_rank=head_rank,
        random_state=random_state,
        n_tokens=n_tokens,
        sharpness=sharpness,
        distribution=distribution,
        causal=causal,
        rope=rope,
        rope_theta=rope_theta,
        rope_layout=rope_layout,
        n_kv_heads=n_kv_heads,
    )


# The parameters of planted regression data, in memory or written to disk
# (``write_attention_regression`` adds its path and chunk size).
_REGRESSION_PARAMETERS = {
    "n_samples": [Interval(Integral, 1, None, closed="left")],
    "n_tokens": [Interval(Integral, 1, None, closed="left")],
    "n_features": [Interval(Integral, 1, None, closed="left")],
    "n_heads": [Interval(Integral, 1, None, closed="left")],
    "n_outputs": [Interval(Integral, 1, None, closed="left"), None],
    "distribution": [
        StrOptions({"boolean", "gaussian", "vocabulary"}),
        TokenDistribution,
    ],
    "noise": [Interval(Real, 0, None, closed="left")],
    "attention_scale": [Interval(Real, 0, None, closed="left")],
    "structure": [StrOptions({"random", "diagonal", "low_rank"})],
    "head_rank": [Interval(Integral, 1, None, closed="left"), None],
    "random_state": ["random_state", np.random.Generator],
    "return_layer": ["boolean"],
}


@validate_params(
    {
        **_REGRESSION_PARAMETERS,
        **_DECODER_PARAMETERS,
        "sharpness": "no_validation",  # _check_sharpness
    },
    prefer_skip_nested_validation=True,
)
def make_attention_regression(
    n_samples,
    n_tokens,
    n_features,
    n_heads,
    *,
    n_outputs=None,
    distribution="boolean",
    noise=0.0,
    attention_scale=2.0,
    structure="random",
    head_rank=None,
    sharpness=None,
    random_state=None,
    return_layer=False,
    causal=False,
    rope=False,
    rope_theta=10000.0,
    rope_layout="half",
    n_kv_heads=None,
):
    """Regression examples ``(X, F(X) + noise)`` of a planted attention layer.

    The layer is :func:`make_attention_layer` ``(n_heads, n_features,
    n_outputs=..., attention_scale=..., structure=...)``; the inputs are drawn
    from ``distribution``; the targets are ``F(X)`` plus i.i.d. Gaussian noise of
    standard deviation ``noise`` on every entry.

    Parameters
    ----------
    n_samples : int
        Number of sequences.
    n_tokens : int
        Tokens per sequence k.
    n_features : int
        Features per input token d.
    n_heads : int
        Number of heads m of the planted layer.
    n_outputs : int, default=None
        Features per output token d_out; ``None`` means ``n_features``.
    distribution : {"boolean", "gaussian", "vocabulary"} or TokenDistribution, \
default="boolean"
        Input distribution: uniform ±1 entries, standard normal entries, or a
        distribution instance of shape ``(n_tokens, n_features)`` (e.g.
        :class:`TokenizedMixture`).
    noise : float, default=0.0
        Standard deviation of the Gaussian noise added to every target entry.
    attention_scale : float, default=2.0
        ``||Theta_i||_F``: the standard deviation of the logit between two
        distinct independent tokens (see :func:`make_attention_layer`).
    structure : {"random", "diagonal", "low_rank"}, default="random"
        Structure of the ``Theta_i`` (see :func:`make_attention_layer`).
    head_rank : int, default=None
        Low-rank heads ``Theta_i = Q_i K_i^T``, ``W_i = V_i O_i`` of this rank
        (see :func:`make_attention_layer`).  ``None``: full rank.
    sharpness : float or sequence of float, default=None
        Plant heads this sharp: the target median, over the rows of sequences
        drawn from ``distribution`` (``n_tokens`` tokens each, as X), of a row's
        largest attention weight ``max_a softmax_a(x_l^T Theta_i x_a)``, as
        :func:`skattn.metrics.sharpness_profile` measures it.  One number for all
        heads or one per head (``None`` for a head left as drawn), each in
        ``(1/n_tokens, 1)``: ``1/n_tokens`` is uniform attention, 1 one-hot rows;
        0.99 and above plant near-hard heads, as the previous-token heads of real
        models.  Each targeted ``Theta_i`` is drawn as usual, then multiplied by
        the scalar (found by bisection on its logarithm) that hits its target to
        within 0.0005 on a fixed sample of a few thousand sequences (a generator
        of its own, so every other draw is that of ``sharpness=None``); its norm
        is then no longer ``attention_scale``, which only sets the starting
        scale.  ``None``: no rescaling.
    random_state : int, RandomState instance, Generator or None, default=None
        Seed of the layer, the inputs and the noise.
    return_layer : bool, default=False
        Also return the planted layer.
    causal : bool, default=False
        A causal (decoder) layer (see :func:`make_attention_layer`).
    rope : bool, default=False
        Rotary positions (``head_rank`` required; see
        :func:`make_attention_layer`).
    rope_theta : float, default=10000.0
        The RoPE base.
    rope_layout : {"half", "interleaved"}, default="half"
        Which dimensions pair up.
    n_kv_heads : int, default=None
        Grouped-query heads: groups of ``n_heads / n_kv_heads`` query heads
        share a key and a value map (``head_rank`` required).

    Returns
    -------
    X : ndarray of shape (n_samples, n_tokens * n_features)
        Inputs, token-major.
    y : ndarray of shape (n_samples, n_tokens * n_outputs)
        Targets ``F(X) + noise``, token-major.
    layer : AttentionLayer
        Only when ``return_layer=True``: the planted layer (``n_tokens`` set).

    Raises
    ------
    ValueError
        If a ``sharpness`` target is not in ``(1/n_tokens, 1)`` (NaN included),
        a sequence of them has not ``n_heads`` entries, or a head cannot reach
        its target (see :func:`make_attention_layer`).

    See Also
    --------
    make_attention_layer : the planted layer alone.
    BooleanTokens, GaussianTokens, TokenizedMixture : input distributions.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.datasets import make_attention_regression
    >>> X, y, layer = make_attention_regression(
    ...     100, 3, 4, 2, n_outputs=8, random_state=0, return_layer=True)
    >>> X.shape, y.shape
    ((100, 12), (100, 24))
    >>> np.allclose(layer.transform(X), y)
    True
    """
    rng = _as_generator(random_state)
    layer = _draw_layer(
        n_heads,
        n_features,
        n_outputs=n_outputs,
        attention_scale=attention_scale,
        structure=structure,
        rank=None,
        head_rank=head_rank,
        random_state=rng,
        n_tokens=n_tokens,
        sharpness=sharpness,
        distribution=distribution,
        causal=causal,
        rope=rope,
        rope_theta=rope_theta,
        rope_layout=rope_layout,
        n_kv_heads=n_kv_heads,
    )
    dist = resolve_distribution(distribution, n_tokens, n_features)
    X = dist.sample(n_samples, random_state=rng)
    y = forward(
        X.reshape(n_samples, n_tokens, n_features),
        layer.attention,
        layer.projection,
        **layer._decoder(),
    ).reshape(n_samples, -1)
    if noise > 0:
        y = y + noise * rng.standard_normal(y.shape)
    return (X, y, layer) if return_layer else (X, y)
