"""Heads stuck near on more sequences: a head whose one-head problem ended near
its head but stopped improving (a sharp head's problem is badly conditioned on few
sequences) is solved again from its end on ``_STUCK_SEQUENCES`` times the
sequences, and on as many times those while it stays near and unconverged and the
training set has more; the heads that converge are taken.  A head that more
sequences barely move (it crawls: a sharp head whose small weights are wrong by
nats) is left to the restart from its patterns (:mod:`._from_patterns`), where
they can be read.
"""

from ...utils._array_api import namespace
from ._common import _fit_on, _with_heads, _with_more
from ._rounds import _NEAR, _refine_on
from ._sharp_heads import can_read_patterns

# Heads whose problems ended near but stopped improving are solved again on this
# many times the sequences, and again on this many times those while they stay
# near and unconverged and the training set has more: a sharp head's problem is
# badly conditioned on few (on MiniLM layer 1 of real text, heads 0, 2 and 3
# stopped at 5.5e-5-1.4e-4 on 376 sequences and converged on 1128; the sharpest
# head, 2.0e-4 on 376 and 2.6e-5 on 1128, converged alone on 3384 to 2.3e-12,
# held out 7.6e-12; benchmarks/HISTORY.md).
_STUCK_SEQUENCES = 3
# A stuck head whose stage on more sequences took its residual to more than this
# fraction of where it stood crawls there: more sequences do not condition a
# sharp head whose small weights are wrong by nats (Gauss-Newton moves a weight
# in proportion to itself), and the larger stages cost more for as little.  Where
# its patterns can be read it leaves for the restart from them (_from_patterns).
# On a planted positional previous-token head (issue 61's family with values of
# rank 16, 4000 sequences) the stages went 8.5e-5 -> 8.2e-5 on 600 sequences,
# 7.2e-5 on 1800 and 6.3e-5 on 4000 (8.6 minutes), and the restart from its
# patterns then ended at 1.7e-15 in 24 s; the MiniLM heads above converged or fell
# 7.7x on their first larger stage.
_CRAWL = 0.5


def _stalled(heads, among):
    """The heads of ``among`` whose problems (rows of ``heads``, None when not
    refined) ended near (at most ``_NEAR``) but unconverged."""
    return [
        i
        for i in among
        if heads[i] is not None
        and not heads[i]["converged"]
        and heads[i]["relative_residual"] <= _NEAR
    ]


def _on_more_sequences(
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
    leave_crawling=True,
):
    """The ``stuck`` heads refined again on ``_STUCK_SEQUENCES`` times the
    sequences (``rows`` and more), those still near and unconverged there on
    ``_STUCK_SEQUENCES`` times those, and so on while the training set has
    more; each stage starts from the previous one's ends, and the heads that
    converge are taken.  With ``leave_crawling``, where the patterns can be read
    (:func:`~._sharp_heads.can_read_patterns`), a head that a stage took to more
    than ``_CRAWL`` of its residual before it goes no further (it is left to
    the restart from its patterns).  ``info["stuck"]`` lists the stages
    (``heads``, ``n_sequences``, ``converged``, ``crawling``: the heads left
    there)."""
    xp = namespace(X, Y)
    n = X.shape[0]
    more, start, info["stuck"] = rows, params, []
    taken = []
    leave_crawling = leave_crawling and can_read_patterns(par.rank, X.shape[1])
    before = {i: info["heads"][i]["relative_residual"] for i in stuck}
    while stuck and len(more) < n:
        more = _with_more(rng, n, more, min(n, _STUCK_SEQUENCES * len(more)))
        start, again = _refine_on(
            X, Y, sample_weight, more, start, par, direction, stuck, verbose, memory
        )
        info["n_products"] += again["n_products"]
        converged = [i for i in stuck if again["heads"][i]["converged"]]
        if converged:
            params = _with_heads(xp, par, params, start, converged)
            for i in converged:
                info["heads"][i] = again["heads"][i]
            taken += converged
        heads, stuck = stuck, _stalled(again["heads"], stuck)
        residuals = {i: again["heads"][i]["relative_residual"] for i in stuck}
        crawling = (
            [i for i in stuck if residuals[i] > _CRAWL * before[i]]
            if leave_crawling
            else []
        )
        info["stuck"].append(
            {
                "heads": heads,
                "n_sequences": len(more),
                "converged": converged,
                "crawling": crawling,
            }
        )
        if verbose and crawling:
            print(
                f"decoupled: heads {crawling} crawl on {len(more)} sequences: left "
                f"to the restart from their patterns"
            )
        stuck = [i for i in stuck if i not in crawling]
        before = {i: residuals[i] for i in stuck}
    if taken:
        info["residual"] = _fit_on(X, Y, params, par, sample_weight, direction, rows)
        info["kept"] = True
    return params, info
