"""Heads left unconverged restarted from their patterns, fitted in logit space,
and judged on sequences the restart did not use (``stages/_from_patterns.py``)."""

from _helpers import fail_problems, head_one_once, nudged, two_rank_four_heads
from _helpers import refine_planted as planted


def test_a_head_left_unconverged_is_restarted_from_its_patterns(monkeypatch):
    # head 1 of a layer whose heads have as many value features as tokens
    # (r = k = 4) "fails" (far) in the first refinement and in the search afresh:
    # it is restarted from the patterns the outputs imply, fitted in logit
    # space, then refined alone, where it converges and is taken
    import skattn.solvers.stages._search_afresh as search_afresh

    fail_problems(monkeypatch, head_one_once(times=2))
    X, Y, _, _ = planted(600, 4, 6, 2, 4, 8, seed=9)
    monkeypatch.setattr(search_afresh, "_DECOUPLED_PASSES", ("own problem",))
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    assert [r["converged"] for r in decoupled_info["replacements"]] == [False]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["head"] == 1 and restart["converged"] and restart["taken"]
    assert restart["n_sequences"] == 600
    assert decoupled_info["heads"][1]["converged"]
    assert info["relative_residual"] < 1e-10


def test_a_restart_from_patterns_that_ends_near_goes_on_on_more_sequences(
    monkeypatch,
):
    # head 1 "fails" (far) in the first refinement and in the search afresh, and
    # its restart from its patterns (on 600 of 1500 sequences) ends near: it goes
    # on from there on three times those (all 1500), converges and is taken
    import skattn.solvers.stages._rounds as rounds
    import skattn.solvers.stages._search_afresh as search_afresh

    solve = rounds._solve_head
    calls = {"head 1": 0}

    def solve_or_stall(X, shares, head, *args, **kwargs):
        q, kk, values, info = solve(X, shares, head, *args, **kwargs)
        if head == 1:
            calls["head 1"] += 1
            if calls["head 1"] <= 2:  # the round and the search afresh: far
                info["relative_residual"] = 1.0
            elif len(X) < 1500:  # the restart from its patterns: near
                info["relative_residual"] = 1e-5
                q = nudged(1e-6, 21)(q, kk, values)[0]
        return q, kk, values, info

    monkeypatch.setattr(rounds, "_solve_head", solve_or_stall)
    monkeypatch.setattr(search_afresh, "_DECOUPLED_PASSES", ("own problem",))
    X, Y, _, _ = planted(1500, 4, 6, 2, 4, 8, seed=9)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["n_sequences"] == 600
    assert restart["stuck"] == [
        {"heads": [1], "n_sequences": 1500, "converged": [1], "crawling": []}
    ]
    assert restart["converged"] and restart["taken"]
    # judged on 600 of the 900 sequences the restart did not read
    before, after = restart["layer_residuals"]
    assert restart["judged_on"] == 600 and after < 1e-10 < before
    assert decoupled_info["heads"][1]["converged"]
    assert info["relative_residual"] < 1e-10


def test_a_restart_reads_again_on_as_many_sequences_as_its_patterns_need(
    monkeypatch,
):
    # the counting bound made to ask for 4000 split rows: head 1, far in the
    # round, on the sequences the bound asks for and after its search afresh, is
    # restarted from its patterns on 600 of 1500 sequences; they split too few rows,
    # so they are read again on as many as they ask (all 1500), fitted there, and
    # refined there, where it converges
    import skattn.solvers.stages._from_patterns as from_patterns
    import skattn.solvers.stages._pinning as pinning
    import skattn.solvers.stages._search_afresh as search_afresh

    for module in (pinning, from_patterns):
        monkeypatch.setattr(module, "split_rows_needed", lambda *a, **kw: 4000)
    calls = {"head 1": 0}

    def fails(head):
        if head == 1:
            calls["head 1"] += 1
            return calls["head 1"] <= 3
        return False

    fail_problems(monkeypatch, fails)
    monkeypatch.setattr(search_afresh, "_DECOUPLED_PASSES", ("own problem",))
    X, Y, _, _ = planted(1500, 4, 6, 2, 4, 8, seed=9)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    assert decoupled_info["pinning"]["heads"] == [1]
    assert decoupled_info["pinning"]["converged"] == []
    (restart,) = decoupled_info["from_patterns"]
    assert restart["n_sequences"] == 1500 and restart["stuck"] == []
    assert restart["sequences_needed"] <= 1500
    assert restart["converged"] and restart["taken"]
    assert info["relative_residual"] < 1e-10


def test_a_head_the_training_set_cannot_pin_is_left_as_it_is(monkeypatch):
    # the counting bound made to ask for more split rows than 1500 sequences
    # have: head 1, far in the round and after its search afresh, has its
    # patterns read, which ask for more sequences than the training set has; it
    # is left as it is, its logits not fitted
    import skattn.solvers.stages._from_patterns as from_patterns
    import skattn.solvers.stages._pinning as pinning
    import skattn.solvers.stages._search_afresh as search_afresh

    for module in (pinning, from_patterns):
        monkeypatch.setattr(module, "split_rows_needed", lambda *a, **kw: 10**6)
    fail_problems(monkeypatch, lambda head: head == 1)
    monkeypatch.setattr(search_afresh, "_DECOUPLED_PASSES", ("own problem",))

    def no_fit(*args, **kwargs):
        raise AssertionError("the logits of a head that cannot be pinned were fitted")

    monkeypatch.setattr(from_patterns, "fit_logits", no_fit)
    X, Y, _, _ = planted(1500, 4, 6, 2, 4, 8, seed=9)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["head"] == 1 and not restart["taken"]
    assert restart["sequences_needed"] > 1500
    assert restart["logit_cost"] is None and restart["layer_residuals"] is None
    assert info["unconverged_heads"] == [1]


def test_a_restart_that_ends_near_is_taken_when_the_layer_fits_better(monkeypatch):
    # head 1 "fails" (far) in the round and in its search afresh, and its restart
    # from its patterns ends near (1e-5, slightly off) however many sequences:
    # that end is taken (the layer fits far better than with the search's head),
    # the head stays unconverged in the record, and the fit says so
    import skattn.solvers.stages._rounds as rounds
    import skattn.solvers.stages._search_afresh as search_afresh

    solve = rounds._solve_head
    calls = {"head 1": 0}

    def solve_or_stall(X, shares, head, *args, **kwargs):
        q, kk, values, info = solve(X, shares, head, *args, **kwargs)
        if head == 1:
            calls["head 1"] += 1
            far = calls["head 1"] <= 2
            info["relative_residual"] = 1.0 if far else 1e-5
            if not far:
                q = nudged(1e-6, 22)(q, kk, values)[0]
        return q, kk, values, info

    monkeypatch.setattr(rounds, "_solve_head", solve_or_stall)
    monkeypatch.setattr(search_afresh, "_DECOUPLED_PASSES", ("own problem",))
    X, Y, _, _ = planted(600, 4, 6, 2, 4, 8, seed=9)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["taken"] and not restart["converged"]
    assert restart["relative_residual"] == 1e-5
    assert not decoupled_info["heads"][1]["converged"]
    assert decoupled_info["residual"] < 1e-4
    assert info["unconverged_heads"] == [1] and info["relative_residual"] < 1e-4
