"""The memory a decoder layer's fit needs, from the shapes alone (issue 62).

A fit that runs out of memory after an hour is killed without a word; one that
is told before it starts can refuse in a line.  :func:`decoder_fit_memory`
counts the largest arrays each stage of
:func:`~skattn.solvers._decoder.fit_decoder_from_random_starts` holds at once
(on the host, float64 but for the search's float32 batches), from the layer's
and the data's shapes: the examples, the minibatch search, the polish (its kept
per-sequence states, bounded by the problem's budget, and the solver's vectors
in the residuals' and the parameters' spaces), the near-gauge lift of the slow
rotary pairs (one Gram block a key group).  The counts follow the code's own
arrays; ``tests/test_solvers_memory.py`` checks them against peaks measured by
``tracemalloc`` on small shapes.

:func:`available_memory` is what the host can give (``MemAvailable``).
"""

import math
import os

from .kernels import _loss
from .kernels._near_gauge import slow_rotary_dims
from .kernels._varpro import _KEEP_FLOATS_PER_CHUNK_FLOAT
from .optimizers._lm_matrix_free import lift_sequences
from .stages._polish import choose_factor_values
from .stages._search import _BATCH_SIZE

__all__ = ["decoder_fit_memory", "available_memory"]

_DOUBLE, _SINGLE = 8, 4
# Vectors of the residuals' length (n k d_out) the trust-region solver and CGLS
# hold at once: the residuals and the trial's, J s and the two columns of the
# 2-D subspace, CGLS's residual and its product.
_RESIDUAL_VECTORS = 7
# Vectors of the parameters' length they hold: x, the gradient, CGLS's x, s, p
# and products, the step, the subspace's two columns, the trial point.
_PARAMETER_VECTORS = 12


def decoder_fit_memory(
    n_samples,
    n_tokens,
    n_features,
    n_outputs,
    n_heads,
    head_rank,
    *,
    n_kv_heads=None,
    rope_theta=None,
    rope_layout="half",
):
    """Bytes each stage of a decoder layer's fit holds at its peak, computed
    from the shapes.

    Parameters
    ----------
    n_samples, n_tokens, n_features, n_outputs : int
        The fitted windows ``n``, their tokens ``k``, the tokens' and the
        outputs' dimensions ``d`` (with an intercept's coordinate) and
        ``d_out``.
    n_heads, head_rank : int
        Query heads ``m`` and their dimension ``r``.
    n_kv_heads : int or None
        Key/value heads (None: ``m``).
    rope_theta : float or None
        The rotary base (None: no rotary positions, nothing lifted).
    rope_layout : {"half", "interleaved"}

    Returns
    -------
    dict
        Bytes: ``"examples"`` (the windows' tokens, their whitened copy and the
        outputs), ``"search"``, ``"polish"``, ``"lift"`` (0 without slow rotary
        pairs; its Gram blocks, and the problem on the share of the windows
        they come from), each a stage's own arrays beyond the examples, and ``"peak"``:
        the examples and the largest stage (the lift's with the polish's).

    Examples
    --------
    A Llama-3-8B-shaped layer (32 query heads sharing 8 key/value heads of 128,
    base 500 000) on 320 windows of 32 tokens:

    >>> need = decoder_fit_memory(320, 32, 4096, 4096, 32, 128, n_kv_heads=8,
    ...                           rope_theta=500000.0)
    >>> round(need["lift"] / 2**30, 1), round(need["peak"] / 2**30, 1)
    (18.0, 25.0)
    """
    n, k, d, d_out = (int(a) for a in (n_samples, n_tokens, n_features, n_outputs))
    m, r = int(n_heads), int(head_rank)
    m_kv = m if n_kv_heads is None else int(n_kv_heads)
    examples = n * k * (2 * d + d_out) * _DOUBLE
    # the search: float32 copies of the examples, and a batch's forward and
    # backward arrays (token maps, logits and patterns, design, residuals)
    b = min(_BATCH_SIZE, n)
    per_sequence = 8 * m * k * r + 4 * m * k * k + 2 * k * d_out + k * (d + d_out)
    searched = (2 * m + m_kv) * d * r
    search = (
        n * k * (d + d_out) * _SINGLE
        + b * per_sequence * _SINGLE
        + 2 * (m * r + 1) ** 2 * _DOUBLE
        + 6 * searched * _DOUBLE
    )
    # the polish: VarproProblem's per-sequence states (kept when they fit its
    # budget, else one chunk's), the solver's vectors
    factored = choose_factor_values(m, d, r) or not r < d
    if factored:
        width = m * r + 1
        state = m * k * (k + d_out + 3 * r) + k * width
        size = searched
    else:
        width = m * d
        state = m * k * (k + d + d_out + 2 * r)
        size = (m + m_kv) * d * r
    keep = _KEEP_FLOATS_PER_CHUNK_FLOAT * _loss._CHUNK_FLOATS
    chunk = min(n * state, max(_loss._CHUNK_FLOATS, 2 * state))  # a product's
    states = (n * state if n * state <= keep else chunk) + chunk
    polish = (
        states
        + _RESIDUAL_VECTORS * n * k * d_out
        + _PARAMETER_VECTORS * size
        + 2 * width * width
        + width * d_out
    ) * _DOUBLE
    # the lift: each key group's Gram block of its mixings (and key shifts),
    # its eigenvectors and scale; a direction a column
    lift = 0
    if rope_theta is not None:
        s = len(slow_rotary_dims(r, rope_theta, rope_layout, k))
        raw = s * s + s
        lift = (3 * m_kv * raw * raw + 4 * size) * _DOUBLE if s else 0
        # and the states of the problem on the share of the windows it is
        # whitened on (as many whatever the windows beyond it)
        n_lift = lift_sequences(n, k, width)
        if s and n_lift < n:
            part = min(n_lift * state, max(_loss._CHUNK_FLOATS, 2 * state))
            lift += (n_lift * state if n_lift * state <= keep else part) * _DOUBLE
    stages = {"search": search, "polish": polish, "lift": lift}
    # the lift is built while the polish's arrays are held
    during = max(search, polish + lift)
    return {"examples": examples, **stages, "peak": examples + during}


def available_memory():
    """Bytes the host can give a new allocation (``MemAvailable`` of
    ``/proc/meminfo``; else the free physical pages), or None where neither is
    known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _size_text(n_bytes):
    """``n_bytes`` for a line: GiB with one decimal from 1 GiB, MiB below.

    Examples
    --------
    >>> _size_text(25 * 2**30), _size_text(3 * 2**20), _size_text(10)
    ('25.0 GiB', '3 MiB', '1 MiB')
    """
    if n_bytes >= 2**30:
        return f"{math.ceil(10 * n_bytes / 2**30) / 10:.1f} GiB"
    return f"{max(1, math.ceil(n_bytes / 2**20))} MiB"
