"""The per-head refinement of the random-start path (:func:`refine_heads`), its
stages in the order it runs them:

1. the rounds of one-head solves on :func:`~._rounds.decoupled_size` random
   sequences (:mod:`._rounds`: :func:`~._rounds.decoupled_refine`);
2. the unconverged heads those sequences do not pin, on as many as they need
   (:mod:`._pinning`);
3. the heads stuck near, on more sequences (:mod:`._more_sequences`);
4. the heads still far, searched afresh and refined alone again
   (:mod:`._search_afresh`);
5. the heads still unconverged, restarted from their patterns
   (:mod:`._from_patterns`, by :mod:`._sharp_heads`).

The helpers the stages share are in :mod:`._common`.
"""

import numpy as np

from ...utils._array_api import namespace
from ...utils._progress import stage_bar
from ._common import _on_rows
from ._from_patterns import _from_patterns
from ._more_sequences import _on_more_sequences, _stalled
from ._pinning import _on_enough_sequences
from ._rounds import decoupled_refine, decoupled_size
from ._search_afresh import _searched_afresh

__all__ = ["refine_heads"]


def refine_heads(
    X, Y, params, par, direction, sample_weight, rng, verbose, memory=None
):
    """:func:`~._rounds.decoupled_refine` on :func:`~._rounds.decoupled_size`
    random sequences; then each head it could not bring near (a head the search
    left mixed with another, or found only roughly) is searched afresh and refined
    alone again, in the passes of ``_DECOUPLED_PASSES`` (at most ``m`` tries;
    :func:`~._search_afresh._searched_afresh`).  Before that, heads left
    unconverged that the refinement's sequences do not pin (too few rows split
    their attention, by a counting bound) are refined again on as many as the
    bound asks (:func:`~._pinning._on_enough_sequences`), and the other heads that
    ended near but unconverged on more sequences
    (:func:`~._more_sequences._on_more_sequences`).  Heads still unconverged at
    the end are restarted from their patterns, fitted in logit space
    (:func:`~._from_patterns._from_patterns`; with ``head_rank >= k``).  Returns the
    parameters and the refinement's info, with ``pinning`` (``heads``,
    ``n_sequences``, ``wanted``, ``converged``; when there were such heads),
    ``stuck`` (per stage on more sequences: ``heads``, ``n_sequences``,
    ``converged``; when there were such heads), ``replacements`` (per try:
    ``head``, ``searched_on`` and ``converged``) and ``from_patterns`` (per
    restart: ``head``, ``n_sequences``, ``logit_cost``, ``relative_residual``,
    ``converged``, ``taken``, ``seconds``).
    ``memory`` (a StageMemory) keeps each head's solve and each search afresh
    with the generator's state after it."""
    # open-ended: heads that do not converge are solved again, on more sequences
    with stage_bar(f"refine ({par.n_heads} heads, some solved again)", None, "head"):
        return _refine_heads(
            X, Y, params, par, direction, sample_weight, rng, verbose, memory
        )


def _refine_heads(X, Y, params, par, direction, sample_weight, rng, verbose, memory):
    """:func:`refine_heads` within its progress bar."""
    xp = namespace(X, Y)
    n, k = X.shape[:2]
    size = decoupled_size(par.n_heads, k, par.n_features, par.rank, Y.shape[2])
    rows = np.sort(rng.choice(n, size=min(n, size), replace=False))
    Xd, Yd, weights = _on_rows(xp, rows, X, Y, sample_weight)
    params, info = decoupled_refine(
        Xd,
        Yd,
        params,
        par,
        sample_weight=weights,
        intercept_direction=direction,
        verbose=verbose,
        memory=memory,
    )
    params, info = _on_enough_sequences(
        X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
    )
    # (heads solved on enough sequences already are not grown again from rows)
    pinned_stage = info.get("pinning", {}).get("heads", [])
    stuck = [
        i for i in _stalled(info["heads"], range(par.n_heads)) if i not in pinned_stage
    ]
    if stuck and n > len(rows):
        params, info = _on_more_sequences(
            X,
            Y,
            params,
            par,
            direction,
            sample_weight,
            rng,
            verbose,
            info,
            stuck,
            rows,
            memory,
        )
    params, info = _searched_afresh(
        X,
        Y,
        params,
        par,
        direction,
        sample_weight,
        rng,
        verbose,
        info,
        Xd,
        Yd,
        weights,
        memory,
    )
    return _from_patterns(
        X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
    )
