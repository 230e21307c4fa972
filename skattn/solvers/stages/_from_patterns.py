"""Heads restarted from their patterns: each head left unconverged after the
other stages has its attention patterns read off its share of the outputs, its
logits fitted to them (:mod:`._sharp_heads`, with ``head_rank >= k``), and is
refined alone from there, on enough sequences to pin it; it is taken when the
layer fits better with it on sequences the restart did not use.
"""

from ...utils._array_api import namespace
from .._checkpoints import kept
from ..kernels._logits import split_rows_needed
from ._common import _fit_on, _judged_on, _on_rows, _with_more
from ._more_sequences import _STUCK_SEQUENCES, _on_more_sequences, _stalled
from ._pinning import _sequences_needed, _stage_size
from ._rounds import _NEAR, _refine_on
from ._sharp_heads import can_read_patterns, fit_logits, read_patterns


def _from_patterns(
    X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
):
    """Each head left unconverged, restarted from its patterns: read off the
    outputs (:func:`~._sharp_heads.read_patterns`) on ``_STUCK_SEQUENCES`` times
    the refinement's sequences (``rows`` and more; as many as
    :func:`~._pinning._on_enough_sequences` took, if more), or, when the patterns
    read there split too few rows to pin the head, read again on as many as they
    ask (``_stage_size``); then fitted in logit space there
    (:func:`~._sharp_heads.fit_logits`) and refined alone; taken
    when it converges or ends near, and the layer fits better with it on
    sequences the restart did not use (:func:`~._common._judged_on`); one that
    ends near but unconverged goes on from its end on more sequences
    (:func:`~._more_sequences._on_more_sequences`).  A head whose patterns ask for
    more sequences than the training set has is left as it is: no fit there pins
    it.  Only when
    the patterns can be read (``head_rank >= k``).  ``info["from_patterns"]``
    lists the tries (``head``, ``n_sequences``, ``sequences_needed``,
    ``logit_cost``, ``relative_residual``, ``converged``, ``judged_on``,
    ``layer_residuals``: the layer's relative residual there before and after,
    ``taken``, ``seconds``, ``stuck``: the stages on more sequences; the fit's
    entries None for a head left as it is)."""
    xp = namespace(X, Y)
    n, k = X.shape[:2]
    info["from_patterns"] = []
    pending = [i for i, row in enumerate(info["heads"]) if row and not row["converged"]]
    if not pending or not can_read_patterns(par.rank, k):
        return params, info
    # as many as the stage on enough sequences took, when it ran
    size = max(
        _STUCK_SEQUENCES * len(rows), info.get("pinning", {}).get("n_sequences", 0)
    )
    more = _with_more(rng, n, rows, min(n, size))
    needed = split_rows_needed(
        X.shape[2] - (direction is not None),
        par.rank,
        k,
        key_bias=direction is not None,
    )
    first = more
    for head in pending:

        def restart(_, head=head, p=params):
            # the read-off patterns show how sharp the head is: when they split
            # too few rows to pin it, they are read again on as many sequences
            # as it needs before its logits are fitted (on MiniLM layer 0's
            # previous-token head, random tokens, a fit on 1128 sequences, where
            # the real head splits about 740 rows of 1592 needed, reached 7.3e-5
            # there and 2.0e-3 on 3384)
            chosen, seconds = first, 0.0
            while True:
                Xc, Yc, wc = _on_rows(xp, chosen, X, Y, sample_weight)
                patterns, read = read_patterns(
                    Xc,
                    Yc,
                    p,
                    par,
                    head,
                    sample_weight=wc,
                    intercept_direction=direction,
                )
                seconds += read.pop("seconds")
                wanted = _sequences_needed(read["n_split_rows"], len(chosen), needed)
                read["sequences_needed"] = float(wanted)
                if wanted > n:
                    # by the counting bound, no fit on the training set pins
                    # the head: it would learn the sequences it sees, not the
                    # head (see the judging below), at the cost of a fit
                    return None, {**read, "seconds": seconds}, chosen
                size = _stage_size(wanted, len(rows), n) if wanted > len(chosen) else 0
                if size <= len(chosen):
                    break
                chosen = _with_more(rng, n, chosen, size)
            found, fit = fit_logits(Xc, patterns, p, par, head, sample_weight=wc)
            fit["seconds"] += seconds
            return found, {**read, **fit}, chosen

        candidate, read, more = kept(memory, "from-patterns", restart, rng)
        entry = {
            "head": int(head),
            "n_sequences": len(more),
            "sequences_needed": read["sequences_needed"],
            "logit_cost": None,
            "relative_residual": None,
            "converged": False,
            "judged_on": 0,
            "layer_residuals": None,
            "taken": False,
            "seconds": read["seconds"],
            "stuck": [],
        }
        if candidate is None:
            info["from_patterns"].append(entry)
            if verbose:
                print(
                    f"decoupled: head {head} left as it is: its patterns split "
                    f"{read['n_split_rows']} rows on {len(more)} sequences, "
                    f"{read['sequences_needed']:.0f} needed to pin it, {n} given"
                )
            continue
        refined, again = _refine_on(
            X,
            Y,
            sample_weight,
            more,
            candidate,
            par,
            direction,
            [head],
            verbose,
            memory,
        )
        solved = again["heads"][head]
        info["n_products"] += again["n_products"]  # spent, taken or not
        grown = []
        if _stalled(again["heads"], [head]) and n > len(more):
            # near but stopped: on more sequences from its end, as a stuck head
            # (on MiniLM layer 0's previous-token head, random tokens: 5.1e-3
            # before the restart, 1.1e-4 after it on 1128 sequences)
            again["n_products"] = 0
            refined, again = _on_more_sequences(
                X,
                Y,
                refined,
                par,
                direction,
                sample_weight,
                rng,
                verbose,
                again,
                [head],
                more,
                memory,
                leave_crawling=False,  # it comes from its patterns
            )
            info["n_products"] += again["n_products"]
            solved, grown = again["heads"][head], again["stuck"]
        # a converged head, or a near one's end, is taken when the layer fits
        # better with it on sequences the restart did not use (a near end stays
        # unconverged in the record, and the fit warns).  On MiniLM layer 0's
        # previous-token head, random tokens, the restart on 3384 sequences ended
        # at 2.7e-10 from 5.1e-3; on real text, which does not pin that head, at
        # 9.3e-5 on its 3384 windows and 0.026 on 1616 others (0.015 before it;
        # the refinement's windows, a part of its 3384, favoured it)
        judge = _judged_on(rng, n, more, rows)
        before, after = (
            _fit_on(X, Y, p, par, sample_weight, direction, judge)
            for p in (params, refined)
        )
        near = solved["converged"] or solved["relative_residual"] <= _NEAR
        taken = bool(near and after < before)
        if taken:
            params, info["kept"], info["heads"][head] = refined, True, solved
            info["residual"] = _fit_on(
                X, Y, params, par, sample_weight, direction, rows
            )
        entry.update(
            logit_cost=read["logit_cost"],
            relative_residual=solved["relative_residual"],
            converged=bool(solved["converged"]),
            judged_on=len(judge),
            layer_residuals=(before, after),
            taken=taken,
            seconds=read["seconds"] + solved["seconds"],
            stuck=grown,
        )
        info["from_patterns"].append(entry)
        if verbose:
            print(
                f"decoupled: head {head} restarted from its patterns "
                f"({len(more)} sequences, logit cost {read['logit_cost']:.3g}): "
                f"relative residual {solved['relative_residual']:.3g}, taken: {taken}"
            )
    return params, info
