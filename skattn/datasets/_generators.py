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
):
    """The planted layer of :func:`make_attention_layer` (arguments validated).

    The one drawing of a planted layer: :func:`make_attention_layer`,
    :func:`make_attention_regression` and
    :func:`~skattn.datasets.write_attention_regression` all call it, so the same
    arguments and seed plant the same layer everywhere.  ``random_state`` is turned
    into a fresh generator (advancing a ``Generator`` or ``RandomState`` instance by
    that one draw); ``n_tokens`` is set on the layer.
    """
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
    return AttentionLayer(attention, projection, n_tokens=n_tokens, head_rank=head_rank)


@validate_params(
    {
        "n_heads": [Interval(Integral, 1, None, closed="left")],
        "n_features": [Interval(Integral, 1, None, closed="left")],
        "n_outputs": [Interval(Integral, 1, None, closed="left"), None],
        "attention_scale": [Interval(Real, 0, None, closed="left")],
        "structure": [StrOptions({"random", "diagonal", "low_rank"})],
        "rank": [Interval(Integral, 1, None, closed="left"), None],
        "head_rank": [Interval(Integral, 1, None, closed="left"), None],
        "random_state": ["random_state", np.random.Generator],
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
    random_state=None,
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
    random_state : int, RandomState instance, Generator or None, default=None
        Seed of the parameters.

    Returns
    -------
    layer : AttentionLayer
        With ``attention`` of shape ``(n_heads, n_features, n_features)`` and
        ``projection`` of shape ``(n_heads, n_features, n_outputs)``;
        ``n_tokens=None`` (any sequence length).

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
    )


# The parameters of planted regression data, in memory or written to disk
# (``write_attention_regression`` adds its path and chunk size).
_REGRESSION_PARAMETERS = {
    "n_samples": [Interval(Integral, 1, None, closed="left")],
    "n_tokens": [Interval(Integral, 1, None, closed="left")],
    "n_features": [Interval(Integral, 1, None, closed="left")],
    "n_heads": [Interval(Integral, 1, None, closed="left")],
    "n_outputs": [Interval(Integral, 1, None, closed="left"), None],
    "distribution": [StrOptions({"boolean", "gaussian"}), TokenDistribution],
    "noise": [Interval(Real, 0, None, closed="left")],
    "attention_scale": [Interval(Real, 0, None, closed="left")],
    "structure": [StrOptions({"random", "diagonal", "low_rank"})],
    "head_rank": [Interval(Integral, 1, None, closed="left"), None],
    "random_state": ["random_state", np.random.Generator],
    "return_layer": ["boolean"],
}


@validate_params(_REGRESSION_PARAMETERS, prefer_skip_nested_validation=True)
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
    random_state=None,
    return_layer=False,
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
    distribution : {"boolean", "gaussian"} or TokenDistribution, default="boolean"
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
    random_state : int, RandomState instance, Generator or None, default=None
        Seed of the layer, the inputs and the noise.
    return_layer : bool, default=False
        Also return the planted layer.

    Returns
    -------
    X : ndarray of shape (n_samples, n_tokens * n_features)
        Inputs, token-major.
    y : ndarray of shape (n_samples, n_tokens * n_outputs)
        Targets ``F(X) + noise``, token-major.
    layer : AttentionLayer
        Only when ``return_layer=True``: the planted layer (``n_tokens`` set).

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
    )
    dist = resolve_distribution(distribution, n_tokens, n_features)
    X = dist.sample(n_samples, random_state=rng)
    y = forward(
        X.reshape(n_samples, n_tokens, n_features), layer.attention, layer.projection
    ).reshape(n_samples, -1)
    if noise > 0:
        y = y + noise * rng.standard_normal(y.shape)
    return (X, y, layer) if return_layer else (X, y)
