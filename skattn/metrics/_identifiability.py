"""What the data can pin, counted before a fit: equations against unknowns.

A fit spends minutes to hours; whether its data can determine the layer at all is
a count, known at once.  :func:`data_verdict` compares, for a layer of ``m``
heads on sequences of ``k`` tokens of ``d`` features with ``d_out`` outputs:

* **overall**: the ``n k d_out`` output values against the layer's unknowns
  (each head's logits, ``r (2 d - r)`` for a rank-r ``Theta_i`` or ``d^2`` at
  full rank, and its values, ``d d_out`` for a full ``W_i`` or ``r (d + d_out)
  - r^2`` for ``V_i O_i``);
* **per head**: the rows of attention the sequences have, ``n k``, against the
  rows that split a head's attention that the counting bound of
  :func:`~skattn.solvers.kernels._logits.split_rows_needed` asks for to pin its
  logits (each row gives at most ``k - 1`` logit differences): every row may
  split at best, so fewer rows than that cannot pin the head whatever the layer.

Both are necessary conditions: data that pass may still not pin a sharp head
(rows whose largest weight is near 1 say little; for a known teacher
:func:`~skattn.metrics.sharp_head_pinning` counts the rows that do split), but
data that fail cannot determine the layer, and the verdict says how many
sequences could.

Passing the count is not enough for the search from random starts either: it
needs room.  On MiniLM's layers 0 and 1 on real text it stalled at a relative
residual of 0.2, every head far, with 4 and 8 output values per unknown, and
went on to a few hundredths with 17 and more
(``benchmarks/studies/study_search_rows.py``).
The verdict's ``search_samples_needed`` is the fewest sequences with
``SEARCH_MARGIN`` per unknown; :func:`describe_margin` says it.
"""

import math

from ..layer._positions import rotary_frequencies
from ..solvers.kernels._logits import logit_unknowns, split_rows_needed
from ..solvers.kernels._near_gauge import SLOW_ANGLE

__all__ = [
    "IdentifiabilityWarning",
    "data_verdict",
    "describe_verdict",
    "slow_mixing_pinning",
]

# Output values per unknown below which the search from random starts has been
# seen to stall (MiniLM layers 0 and 1, real text: at 4.2 and 8.3 it stalled at a
# residual of 0.2; at 17.4 it went on, to 0.014 at k = 64 and 0.040 at k = 16;
# at 54 to 0.022; study_search_rows.py)
SEARCH_MARGIN = 16

# The relative change of a layer's outputs that a float64 fit resolves: exact
# fits end at held-out relative errors of about 1e-15 (planted layers, MiniLM's
# layers, decoder layers at bases 1e4 to 1e6; benchmarks/README.md)
RESOLVED_OUTPUT = 1e-15

# The precision asked of a rotary head's slow mixings: the relative error at
# which a layer is called exact (``skattn layer``'s EXACT_LAYER)
SLOW_MIXING_PRECISION = 1e-6


class IdentifiabilityWarning(UserWarning):
    """The data cannot determine the layer, by :func:`data_verdict`.

    Raised by a fit before its long work, with the number of sequences that
    could.

    Examples
    --------
    >>> import warnings
    >>> from skattn.metrics import IdentifiabilityWarning
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("10 sequences cannot determine this layer",
    ...                   IdentifiabilityWarning)
    >>> caught[0].category.__name__
    'IdentifiabilityWarning'
    """


def _value_unknowns(n_features, head_rank, n_outputs):
    """Unknowns of one head's values: ``d d_out`` for a full ``W_i``, ``r (d +
    d_out) - r^2`` for ``V_i O_i`` (the gauge of ``r x r`` invertible maps)."""
    d, o = int(n_features), int(n_outputs)
    if head_rank is None or head_rank >= d:
        return d * o
    r = int(head_rank)
    return r * (d + o) - r * r


def data_verdict(n_samples, n_tokens, n_features, n_outputs, n_heads, head_rank=None):
    """Whether ``n_samples`` sequences can determine a layer, by counting.

    Parameters
    ----------
    n_samples : int
        Sequences (of positive weight).
    n_tokens, n_features, n_outputs : int
        ``k``, ``d`` (the model's tokens: with an intercept, ``d + 1``) and
        ``d_out``.
    n_heads : int
    head_rank : int or None
        ``r`` of low-rank heads (``None``: full-rank ``Theta_i`` and ``W_i``).

    Returns
    -------
    verdict : dict
        ``determined`` (bool: both counts pass), ``equations`` and ``unknowns``
        (overall), ``rows`` (``n k``) and ``rows_needed`` (per head, the
        counting bound), ``heads`` (per head: ``pinned`` by the count, a bool),
        ``samples_needed``: the fewest sequences that pass both counts, and
        ``search_samples_needed``: the fewest with ``SEARCH_MARGIN`` output values
        per unknown (at least ``samples_needed``), where a search from random
        starts has room.

    Examples
    --------
    >>> v = data_verdict(10, 16, 385, 384, 12, head_rank=32)  # MiniLM, 10 windows
    >>> v["determined"], v["rows"], v["rows_needed"], v["samples_needed"]
    (False, 160, 1575, 99)
    >>> data_verdict(5000, 16, 385, 384, 12, head_rank=32)["determined"]
    True
    """
    n, k, d, o, m = (
        int(v) for v in (n_samples, n_tokens, n_features, n_outputs, n_heads)
    )
    per_head = logit_unknowns(d, head_rank) + _value_unknowns(d, head_rank, o)
    unknowns = m * per_head
    equations = n * k * o
    rows = n * k
    needed = split_rows_needed(d, head_rank, k) if k > 1 else 0
    pinned = rows >= needed
    samples_needed = max(
        math.ceil(unknowns / (k * o)), math.ceil(needed / k) if k > 1 else 0
    )
    search_samples = max(samples_needed, math.ceil(SEARCH_MARGIN * unknowns / (k * o)))
    return {
        "determined": bool(equations >= unknowns and pinned),
        "equations": equations,
        "unknowns": unknowns,
        "rows": rows,
        "rows_needed": needed,
        "heads": [{"head": i, "pinned": bool(pinned)} for i in range(m)],
        "samples_needed": samples_needed,
        "search_samples_needed": search_samples,
        "n_samples": n,
    }


def describe_verdict(verdict, unit="sequences"):
    """One line for a verdict that fails (empty for one that passes).

    Examples
    --------
    >>> verdict = data_verdict(10, 16, 385, 384, 12, head_rank=32)
    >>> print(describe_verdict(verdict, "windows"))
    10 windows cannot determine this layer: 160 rows of attention where the
    counting bound asks for 1575 a head to pin its logits; 61440 output values
    for 566400 unknowns; give at least 99 windows.
    """
    if verdict["determined"]:
        return ""
    n, need = verdict["n_samples"], verdict["samples_needed"]
    reasons = []
    if verdict["rows"] < verdict["rows_needed"]:
        reasons.append(
            f"{verdict['rows']} rows of attention where the counting bound asks "
            f"for {verdict['rows_needed']} a head to pin its logits"
        )
    if verdict["equations"] < verdict["unknowns"]:
        reasons.append(
            f"{verdict['equations']} output values for {verdict['unknowns']} unknowns"
        )
    return (
        f"{n} {unit} cannot determine this layer: {'; '.join(reasons)}; give at "
        f"least {need} {unit}."
    )


def describe_margin(verdict, unit="sequences"):
    """One line for data that pass the count without the search's room
    (``search_samples_needed``; empty otherwise, and for data that fail).

    Examples
    --------
    >>> print(describe_margin(data_verdict(96, 64, 385, 384, 12, head_rank=32),
    ...                       "windows"))
    96 windows pass the count with 4.2 output values per unknown; the search from
    random starts has stalled below 16 (MiniLM's real layers: a residual of 0.2,
    every head far): give about 369 windows.
    """
    n, need = verdict["n_samples"], verdict["search_samples_needed"]
    if not verdict["determined"] or n >= need:
        return ""
    ratio = verdict["equations"] / verdict["unknowns"]
    return (
        f"{n} {unit} pass the count with {ratio:.1f} output values per unknown; "
        f"the search from random starts has stalled below {SEARCH_MARGIN} "
        f"(MiniLM's real layers: a residual of 0.2, every head far): give about "
        f"{need} {unit}."
    )


def slow_mixing_pinning(
    head_dim, rope_theta, n_tokens, precision=SLOW_MIXING_PRECISION
):
    """How weakly windows of ``n_tokens`` tokens pin a rotary head's slow
    mixings.

    A rotary pair of frequency ``omega_p`` turns by ``omega_p t`` between tokens
    ``t`` apart, at most ``theta_p = omega_p (k - 1)`` in a window.  A mixing
    ``G = I + E`` of the slow pairs' dimensions (those with ``theta_p <=`` pi/2,
    which the polish lifts: :func:`~skattn.solvers.kernels._near_gauge.
    slow_rotary_dims`) changes the logits by ``Q [E, R(t)] K^T``, of the order
    of ``theta |E|``; within the slowest pair (its mixings that are not scaled
    rotations, the exact gauge) by ``theta_min |E|``, ``theta_min`` the slowest
    pair's turn.  A fit that resolves relative output changes of
    ``RESOLVED_OUTPUT`` (float64 rounding, where exact fits end) therefore pins
    these mixings to about ``RESOLVED_OUTPUT / theta_min``: weakly pinned
    directions, not free ones.  Longer windows pin them more (the turn grows
    with ``k``); more windows of the same length do not.  An order of magnitude,
    not a bound: the rows of a window see every distance up to ``k - 1``.

    Parameters
    ----------
    head_dim : int
        The rotary dimension ``r`` (even).
    rope_theta : float
        RoPE's base.
    n_tokens : int
        ``k``, the window's length.
    precision : float, default=SLOW_MIXING_PRECISION
        The precision asked of the mixings.

    Returns
    -------
    pinning : dict
        ``slow_pairs`` (of ``r / 2``), ``smallest_turn`` (``theta_min``, in
        radians), ``pinned_to`` (``RESOLVED_OUTPUT / theta_min``), ``pinned``
        (``pinned_to <= precision``) and ``tokens_needed``: the shortest
        window that pins them to ``precision``.

    Examples
    --------
    Llama 3's base, heads of 128, windows of 32 tokens: 49 of the 64 pairs are
    slow, the slowest turns by 7.6e-5 rad, its mixings pinned to about 1e-11,
    far inside 1e-6.

    >>> p = slow_mixing_pinning(128, 500000.0, 32)
    >>> p["slow_pairs"], f"{p['smallest_turn']:.1e}", f"{p['pinned_to']:.0e}"
    (49, '7.6e-05', '1e-11')
    >>> p["pinned"], p["tokens_needed"]
    (True, 2)
    >>> slow_mixing_pinning(16, 1e12, 32)["pinned"]  # a base no model uses
    False
    """
    k = int(n_tokens)
    omega = rotary_frequencies(int(head_dim), float(rope_theta))
    turns = omega * max(k - 1, 0)
    smallest = float(turns.min())
    pinned_to = RESOLVED_OUTPUT / smallest if smallest > 0 else math.inf
    tokens_needed = 1 + math.ceil(RESOLVED_OUTPUT / (precision * float(omega.min())))
    return {
        "slow_pairs": int((turns <= SLOW_ANGLE).sum()),
        "smallest_turn": smallest,
        "pinned_to": pinned_to,
        "pinned": bool(pinned_to <= precision),
        "tokens_needed": max(2, tokens_needed),
    }
