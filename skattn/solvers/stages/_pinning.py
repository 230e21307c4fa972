"""Heads the sequences do not pin: a head left unconverged whose attention the
refinement's sequences split on fewer rows than its logits need (the counting
bound of :func:`~..kernels._logits.split_rows_needed`) is solved again at once,
from its end, on as many sequences as the bound asks (times ``_PINNING_MARGIN``,
at most ``_PINNING_CAP`` times the refinement's and the training set); the heads
that converge are taken.
"""

import math

from ...utils._array_api import namespace
from ..kernels._logits import split_rows, split_rows_needed
from ._common import _fit_on, _take, _with_heads, _with_more
from ._rounds import _refine_on

# A head left unconverged whose attention the refinement's sequences split on
# fewer rows than its logits need (split_rows_needed: a counting bound) is solved
# again at once on as many sequences as the bound asks, times this margin, at most
# _PINNING_CAP times the refinement's (and at most the training set): a sharp head
# stalls, near or far, on sequences that do not pin it (all-MiniLM-L6-v2 layer 0,
# head 2 on random tokens, 4 % of rows split, 1596 needed: about 246 on the 376
# sequences, where its problem stalled at 5e-3; benchmarks/HISTORY.md).
_PINNING_MARGIN = 1.5
_PINNING_CAP = 9


def _unpinned(X, params, par, heads, direction, verbose=0):
    """``{head: sequences}`` for the unconverged ``heads`` (rows of the refinement,
    None when not refined) that ``X`` does not pin: the sequences the counting
    bound asks for, by each head's current split rows per sequence (``inf`` with
    none split)."""
    n, k, d = X.shape
    Q, K, _ = par.factors(params)
    needed = split_rows_needed(
        d - (direction is not None), par.rank, k, key_bias=direction is not None
    )
    wanted = {}
    for i, row in enumerate(heads):
        if row is None or row["converged"]:
            continue
        split = split_rows(X, Q[i, ...], K[i, ...])  # one host read
        if verbose:
            print(
                f"decoupled: head {i}: {split} of {n * k} rows split its attention "
                f"on {n} sequences, {needed} needed",
                flush=True,
            )
        if split < needed:
            wanted[i] = _sequences_needed(split, n, needed)
    return wanted


def _sequences_needed(split, sequences, needed):
    """Sequences like ``sequences`` of which ``split`` rows split a head's
    attention that give ``needed`` such rows (``inf`` when none split)."""
    if split >= needed:
        return sequences
    return math.inf if split == 0 else math.ceil(sequences * needed / split)


def _stage_size(wanted, rows, n):
    """Sequences of a stage for ``wanted`` (the bound's, possibly ``inf``):
    times ``_PINNING_MARGIN``, at most ``_PINNING_CAP`` times ``rows`` and ``n``."""
    cap = min(n, _PINNING_CAP * rows)
    if wanted == math.inf:
        return cap
    return min(cap, math.ceil(_PINNING_MARGIN * wanted))


def _on_enough_sequences(
    X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
):
    """The unconverged heads that the refinement's sequences (``rows``) do not
    pin (:func:`_unpinned`) refined again on as many as their logits need (times
    ``_PINNING_MARGIN``, at most ``_PINNING_CAP`` times ``rows`` and the training
    set), from their ends; those that converge are taken.  ``info["pinning"]``
    records the stage (``heads``, ``n_sequences``, ``wanted``, ``converged``)."""
    xp = namespace(X, Y)
    n = X.shape[0]
    wanted = _unpinned(
        _take(xp, X, rows), params, par, info["heads"], direction, verbose
    )
    if not wanted or n <= len(rows):
        return params, info
    size = _stage_size(max(wanted.values()), len(rows), n)
    if size <= len(rows):
        return params, info
    more = _with_more(rng, n, rows, size)
    heads = sorted(wanted)
    refined, again = _refine_on(
        X, Y, sample_weight, more, params, par, direction, heads, verbose, memory
    )
    info["n_products"] += again["n_products"]
    converged = [i for i in heads if again["heads"][i]["converged"]]
    info["pinning"] = {
        "heads": heads,
        "n_sequences": len(more),
        "wanted": {i: float(w) for i, w in wanted.items()},
        "converged": converged,
    }
    if verbose:
        print(
            f"decoupled: heads {heads} not pinned by {len(rows)} sequences, "
            f"solved on {len(more)}: converged {converged}"
        )
    if converged:
        params = _with_heads(xp, par, params, refined, converged)
        for i in converged:
            info["heads"][i] = again["heads"][i]
        info["residual"] = _fit_on(X, Y, params, par, sample_weight, direction, rows)
        info["kept"] = True
    return params, info
