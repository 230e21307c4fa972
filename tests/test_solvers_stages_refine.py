"""Decoupled heads refined one problem each, searched afresh, restarted
(``stages/_refine.py``)."""

import numpy as np
import pytest
from _helpers import fail_problems, nudged
from _helpers import refine_planted as planted

from skattn.solvers import (
    FactoredHeads,
    PolishOptions,
    RandomStartOptions,
    can_decouple,
    decoupled_refine,
    fit_from_random_starts,
)
from skattn.solvers.kernels._varpro import _intercept_direction
from skattn.solvers.stages._refine import decoupled_size, search_head


def identifiable_attention_error(par, params, truth, intercept=True):
    """Relative error of the Theta_i, heads in order; with tokens ``[x, 1]`` the
    column of the constant key coordinate only shifts a row of logits and cancels
    in the softmax, so it is left out."""
    cut = slice(None, -1) if intercept else slice(None)
    a, b = par.attention(params)[:, :, cut], par.attention(truth)[:, :, cut]
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def head_one_once(times=1):
    """A ``fails`` for :func:`fail_problems`: head 1's first ``times`` problems."""
    left = {"head 1": times}

    def fails(head):
        if head == 1 and left["head 1"]:
            left["head 1"] -= 1
            return True
        return False

    return fails


def three_heads(**options):
    """:func:`decoupled_refine` of three planted heads from a start 0.03 off:
    ``(par, start, refined, info)``."""
    X, Y, truth, _ = planted(300, 5, 5, 3, 2, 6, seed=12)
    par = FactoredHeads(3, 6, 2)
    start = truth + 0.03 * np.random.default_rng(13).normal(size=truth.size)
    refined, info = decoupled_refine(
        X, Y, start, par, intercept_direction=_intercept_direction(X), **options
    )
    return par, start, refined, info


def assert_head_one_kept_its_start(par, start, refined):
    Q, K, _ = par.factors(refined)
    Q0, K0, _ = par.factors(start)
    np.testing.assert_array_equal(Q[1], Q0[1])
    np.testing.assert_array_equal(K[1], K0[1])


def decoupled_after_the_search():
    """The decoupled record and the fit's residual of a minibatch search's fit."""
    X, Y, _, _ = planted(600, 6, 6, 3, 2, 6, seed=9)
    _, _, info = fit_from_random_starts(
        X,
        Y,
        3,
        random_state=0,
        polish=PolishOptions(head_rank=2, intercept=True),
        starts=RandomStartOptions(start_search="minibatch"),
    )
    return info["start_search"]["decoupled"], info["relative_residual"]


def test_can_decouple_and_sizes():
    assert can_decouple(12, 32, 384) and can_decouple(3, 2, 7)
    assert not can_decouple(3, 3, 7) and not can_decouple(2, None, 100)
    # enough equations per unknown, and a floor for tiny layers
    m, k, d, r, o = 12, 16, 385, 32, 384
    n = decoupled_size(m, k, d, r, o)
    assert n * k * r >= 4 * (2 * d * r + (d + o - r) * r)
    assert decoupled_size(2, 4, 5, 1, 2) == 200


@pytest.mark.parametrize(
    "d_out, intercept, weighted", [(6, True, False), (9, True, True), (6, False, False)]
)
def test_decoupled_refine_recovers_every_head_from_a_perturbed_start(
    d_out, intercept, weighted
):
    # m r = 6 <= d_out: every head on its own problem, whatever the others' errors
    X, Y, truth, _ = planted(400, 6, 6, 3, 2, d_out, seed=4, intercept=intercept)
    d = X.shape[2]
    par = FactoredHeads(3, d, 2)
    rng = np.random.default_rng(5)
    start = truth + 0.05 * rng.normal(size=truth.size)
    weights = rng.uniform(0.5, 2.0, size=400) if weighted else None
    direction = _intercept_direction(X) if intercept else None
    refined, info = decoupled_refine(
        X, Y, start, par, sample_weight=weights, intercept_direction=direction
    )
    assert info["kept"] and info["residual_start"] > 1e-3
    assert info["residual"] < 1e-10
    assert all(head["relative_residual"] < 1e-10 for head in info["heads"])
    assert identifiable_attention_error(par, refined, truth, intercept) < 1e-8


def test_decoupled_refine_in_threads_gives_the_same_result():
    X, Y, truth, _ = planted(300, 5, 5, 2, 2, 4, seed=6)
    par = FactoredHeads(2, 6, 2)
    start = truth + 0.03 * np.random.default_rng(7).normal(size=truth.size)
    direction = _intercept_direction(X)
    one, _ = decoupled_refine(X, Y, start, par, intercept_direction=direction)
    two, _ = decoupled_refine(X, Y, start, par, intercept_direction=direction, n_jobs=2)
    np.testing.assert_array_equal(one, two)


def test_decoupled_refine_refuses_heads_that_do_not_fit_in_the_outputs():
    X, Y, truth, _ = planted(50, 3, 4, 3, 2, 6)
    with pytest.raises(ValueError, match="n_heads \\* head_rank <= n_outputs"):
        decoupled_refine(X, Y[:, :, :5], truth, FactoredHeads(3, 5, 2))


def test_decoupled_refine_keeps_the_start_when_it_fits_better():
    # at the truth there is nothing to gain: the start is returned as it is
    X, Y, truth, _ = planted(250, 4, 4, 2, 2, 4, seed=8)
    par = FactoredHeads(2, 5, 2)
    refined, info = decoupled_refine(
        X, Y, truth, par, intercept_direction=_intercept_direction(X), max_iter=1
    )
    assert info["residual"] <= info["residual_start"] < 1e-12
    if not info["kept"]:
        np.testing.assert_array_equal(refined, truth)


def test_an_unconverged_head_is_not_taken(monkeypatch):
    # a problem that does not converge (far) leaves its head as it was
    fail_problems(monkeypatch, lambda head: head == 1)
    par, start, refined, info = three_heads()
    assert_head_one_kept_its_start(par, start, refined)
    assert info["kept"] and info["residual"] < info["residual_start"]
    assert not info["heads"][1]["converged"] and info["heads"][0]["converged"]


def test_a_head_left_unsolved_is_searched_afresh_and_refined(monkeypatch):
    # head 1's problem "fails" (far) in the first refinement: it is searched
    # afresh on its own problem, refined alone again, and the fit is exact
    fail_problems(monkeypatch, head_one_once())
    decoupled_info, residual = decoupled_after_the_search()
    assert decoupled_info["replacements"] == [
        {"head": 1, "searched_on": "own problem", "converged": True}
    ]
    assert decoupled_info["heads"][1]["converged"]
    assert decoupled_info["residual"] < 1e-10
    assert residual < 1e-10


def test_a_lost_head_is_found_on_its_own_problem_whatever_the_others_errors():
    # head 1 lost (random), head 0 off: a search on what the other heads leave
    # would fit head 0's error too; head 1's own problem is realisable by it alone,
    # so the search there and one refinement find it while head 0 stays off
    X, Y, truth, _ = planted(1500, 6, 6, 3, 2, 6, seed=4)
    par = FactoredHeads(3, 7, 2)
    rng = np.random.default_rng(6)
    Q, K, V = (f.copy() for f in par.factors(truth))
    for factor in (Q, K, V):
        factor[1] = rng.normal(size=factor[1].shape) / 7**0.5
        factor[0] += 0.05 * rng.normal(size=factor[0].shape)
    start = np.concatenate([Q.ravel(), K.ravel(), V.ravel()])
    direction = _intercept_direction(X)
    found, info = search_head(
        X, Y, start, par, 1, intercept_direction=direction, random_state=0
    )
    assert info["residual"] < info["residuals"][0] / 10
    # only head 1 moved
    for before, after in zip(par.factors(start), par.factors(found), strict=True):
        np.testing.assert_array_equal(before[[0, 2]], after[[0, 2]])
    refined, again = decoupled_refine(
        X[:400], Y[:400], found, par, intercept_direction=direction, heads=[1]
    )
    assert again["heads"][1]["converged"]
    assert again["heads"][0] is None  # head 0 not refined, still off
    Qt, Kt, _ = par.factors(truth)
    Qr, Kr, _ = par.factors(refined)
    logits = [Qr[1] @ Kr[1].T, Qt[1] @ Kt[1].T]
    error = np.linalg.norm(logits[0][:, :-1] - logits[1][:, :-1])
    assert error < 1e-6 * np.linalg.norm(logits[1][:, :-1])


def test_a_head_still_far_is_then_searched_on_what_the_others_leave(monkeypatch):
    # head 1's first problem and its refinement after the search on its own
    # problem "fail" (far): the second pass searches it on what the other heads
    # leave, and that one converges
    fail_problems(monkeypatch, head_one_once(times=2))
    decoupled_info, residual = decoupled_after_the_search()
    assert decoupled_info["replacements"] == [
        {"head": 1, "searched_on": "own problem", "converged": False},
        {"head": 1, "searched_on": "what the others leave", "converged": True},
    ]
    assert decoupled_info["heads"][1]["converged"]
    assert residual < 1e-10


def test_near_unconverged_heads_are_restarted_from_their_ends():
    # three iterations leave every head near (about 1e-4), unconverged; a second
    # round from their ends, the decoupling map recomputed, solves them
    X, Y, truth, _ = planted(400, 6, 6, 3, 2, 6, seed=4)
    par = FactoredHeads(3, 7, 2)
    start = truth + 0.05 * np.random.default_rng(5).normal(size=truth.size)
    direction = _intercept_direction(X)
    once, info_once = decoupled_refine(
        X, Y, start, par, intercept_direction=direction, max_iter=3, restarts=0
    )
    assert all(1e-10 < h["relative_residual"] <= 1e-3 for h in info_once["heads"])
    assert [h["rounds"] for h in info_once["heads"]] == [1, 1, 1]
    # the near ends are taken: the layer fits better than at the start
    assert info_once["kept"] and info_once["residual"] < 1e-3
    refined, info = decoupled_refine(
        X, Y, start, par, intercept_direction=direction, max_iter=3, restarts=3
    )
    # every head restarted (how many rounds of three iterations each took is the
    # path of its float32 and float64 solves, which another BLAS may change)
    assert all(2 <= h["rounds"] <= 4 for h in info["heads"])
    assert all(h["converged"] and h["n_iter"] > 3 for h in info["heads"])
    assert info["residual"] < 1e-10
    assert identifiable_attention_error(par, refined, truth) < 1e-8


def test_far_heads_are_not_restarted_and_their_ends_not_taken():
    X, Y, truth, _ = planted(400, 6, 6, 3, 2, 6, seed=4)
    par = FactoredHeads(3, 7, 2)
    start = truth + 0.1 * np.random.default_rng(5).normal(size=truth.size)
    refined, info = decoupled_refine(
        X, Y, start, par, intercept_direction=_intercept_direction(X), max_iter=2
    )
    assert all(h["relative_residual"] > 1e-3 for h in info["heads"])
    assert [h["rounds"] for h in info["heads"]] == [1, 1, 1]
    assert not info["kept"]
    np.testing.assert_array_equal(refined, start)


def test_a_head_that_stops_improving_is_not_restarted_again(monkeypatch):
    # head 1 reports 1e-5 every round (and ends slightly off, so the layer does
    # not fit to rounding): restarted once (it was near), then its residual did
    # not fall tenfold and it stops; the others converge in round 1
    fail_problems(
        monkeypatch, lambda head: head == 1, residual=1e-5, end=nudged(1e-7, 16)
    )
    _, _, _, info = three_heads(restarts=3)
    assert [h["rounds"] for h in info["heads"]] == [1, 2, 1]
    assert not info["heads"][1]["converged"] and info["heads"][0]["converged"]


def test_a_near_end_that_fits_the_layer_worse_is_not_taken(monkeypatch):
    # head 1's problem reports a near residual but ends at random factors: the
    # layer without that end fits better, so head 1 keeps its start
    rng = np.random.default_rng(14)
    fail_problems(
        monkeypatch,
        lambda head: head == 1,
        residual=1e-5,
        end=lambda q, k, v: tuple(rng.normal(size=f.shape) for f in (q, k, v)),
    )
    par, start, refined, info = three_heads()
    assert_head_one_kept_its_start(par, start, refined)
    assert info["kept"] and info["heads"][0]["converged"]


def test_a_near_head_is_continued_not_searched_afresh(monkeypatch):
    # head 1's first problem ends near (1e-5, slightly off): it is restarted from
    # its end, not replaced by a new search
    fail_problems(monkeypatch, head_one_once(), residual=1e-5, end=nudged(1e-5, 17))
    decoupled_info, residual = decoupled_after_the_search()
    assert decoupled_info["replacements"] == []
    assert decoupled_info["heads"][1]["converged"]
    assert decoupled_info["heads"][1]["rounds"] == 2
    assert residual < 1e-10


def test_a_head_just_under_the_converged_rule_is_restarted_to_rounding(monkeypatch):
    # head 1's first problem reports 5e-11 and ends slightly off: converged
    # (taken) but above 1e-12, and the layer not fitted to 1e-10, so it goes on
    # for another round, which ends at rounding
    fail_problems(monkeypatch, head_one_once(), residual=5e-11, end=nudged(1e-7, 15))
    _, _, _, info = three_heads()
    assert [h["rounds"] for h in info["heads"]] == [1, 2, 1]
    assert all(h["converged"] for h in info["heads"])
    assert info["heads"][1]["relative_residual"] <= 1e-12
    assert info["residual"] < 1e-10


def test_no_round_starts_once_the_layer_fits_to_rounding(monkeypatch):
    # the same report, but head 1's end is exact: the layer fits to rounding
    # after round one, so head 1 is not restarted
    fail_problems(monkeypatch, head_one_once(), residual=5e-11)
    _, _, _, info = three_heads()
    assert [h["rounds"] for h in info["heads"]] == [1, 1, 1]
    assert info["residual"] < 1e-10


def stall_head_one_below(monkeypatch, times):
    """Head 1's problem ends near (1e-5) and stops improving on fewer than
    ``times`` times the refinement's own sequences (as sharp heads do); returns
    the list that receives that number of sequences."""
    import skattn.solvers.stages._refine as decoupled

    solve = decoupled._solve_head
    small = []

    def stalled(X, shares, head, *args, **kwargs):
        q, kk, values, info = solve(X, shares, head, *args, **kwargs)
        if not small:  # the first problem is on the refinement's own sequences
            small.append(len(X))
        if head == 1 and len(X) < times * small[0]:
            info["relative_residual"] = 1e-5
            q = nudged(1e-6, 19)(q, kk, values)[0]
        return q, kk, values, info

    monkeypatch.setattr(decoupled, "_solve_head", stalled)
    return small


def test_a_head_stuck_near_is_solved_again_on_more_sequences(monkeypatch):
    # stuck on the refinement's own sequences: refined again on three times
    # them, where it converges, and the fit is exact
    small = stall_head_one_below(monkeypatch, 2)
    decoupled_info, residual = decoupled_after_the_search()
    assert decoupled_info["stuck"] == [
        {"heads": [1], "n_sequences": 3 * small[0], "converged": [1]}
    ]
    assert decoupled_info["heads"][1]["converged"]
    assert decoupled_info["replacements"] == []
    assert residual < 1e-10


def test_a_head_still_stuck_on_more_sequences_gets_more_again(monkeypatch):
    # as the sharpest MiniLM heads: stuck on the refinement's sequences and on
    # three times them, converged on nine times them (the training set has 600)
    import skattn.solvers.stages._refine as decoupled

    monkeypatch.setattr(decoupled, "_MIN_SEQUENCES", 50)
    small = stall_head_one_below(monkeypatch, 9)
    decoupled_info, residual = decoupled_after_the_search()
    assert small == [50]
    assert decoupled_info["stuck"] == [
        {"heads": [1], "n_sequences": 150, "converged": []},
        {"heads": [1], "n_sequences": 450, "converged": [1]},
    ]
    assert decoupled_info["heads"][1]["converged"]
    assert residual < 1e-10


def test_a_head_its_sequences_do_not_pin_is_solved_on_as_many_as_it_needs(
    monkeypatch,
):
    # the counting bound (split_rows_needed) made to ask for 2000 split rows:
    # head 1 stalls (near) on fewer than twice the refinement's 200 sequences,
    # and is solved at once on as many as its split rows per sequence ask (times
    # 1.5, at most the training set's 600), where it converges; it is not grown
    # again from 200 by the stages on more sequences
    import skattn.solvers.stages._refine as decoupled

    monkeypatch.setattr(decoupled, "split_rows_needed", lambda *args, **kw: 2000)
    small = stall_head_one_below(monkeypatch, 2)
    decoupled_info, residual = decoupled_after_the_search()
    assert small == [200]
    pinning = decoupled_info["pinning"]
    assert pinning["heads"] == [1] and pinning["converged"] == [1]
    assert 400 <= pinning["n_sequences"] <= 600
    assert pinning["n_sequences"] == min(600, -(-3 * pinning["wanted"][1] // 2))
    assert "stuck" not in decoupled_info
    assert decoupled_info["heads"][1]["converged"]
    assert residual < 1e-10


def test_pinned_heads_are_not_solved_on_more_sequences():
    # the planted heads split their attention on most rows: nothing to pin
    decoupled_info, residual = decoupled_after_the_search()
    assert "pinning" not in decoupled_info
    assert decoupled_info["from_patterns"] == []
    assert residual < 1e-10


def two_rank_four_heads(X, Y):
    """The fit's record of two heads of rank 4 (as many value features as the
    planted tokens, so that their patterns can be read) from a minibatch search."""
    return fit_from_random_starts(
        X,
        Y,
        2,
        random_state=0,
        polish=PolishOptions(head_rank=4, intercept=True),
        starts=RandomStartOptions(start_search="minibatch"),
    )[2]


def test_a_head_left_unconverged_is_restarted_from_its_patterns(monkeypatch):
    # head 1 of a layer whose heads have as many value features as tokens
    # (r = k = 4) "fails" (far) in the first refinement and in the search afresh:
    # it is restarted from the patterns the outputs imply, fitted in logit
    # space, then refined alone, where it converges and is taken
    import skattn.solvers.stages._refine as decoupled

    fail_problems(monkeypatch, head_one_once(times=2))
    X, Y, _, _ = planted(600, 4, 6, 2, 4, 8, seed=9)
    monkeypatch.setattr(decoupled, "_DECOUPLED_PASSES", ("own problem",))
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
    import skattn.solvers.stages._refine as decoupled

    solve = decoupled._solve_head
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

    monkeypatch.setattr(decoupled, "_solve_head", solve_or_stall)
    monkeypatch.setattr(decoupled, "_DECOUPLED_PASSES", ("own problem",))
    X, Y, _, _ = planted(1500, 4, 6, 2, 4, 8, seed=9)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["n_sequences"] == 600
    assert restart["stuck"] == [{"heads": [1], "n_sequences": 1500, "converged": [1]}]
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
    import skattn.solvers.stages._refine as decoupled

    monkeypatch.setattr(decoupled, "split_rows_needed", lambda *a, **kw: 4000)
    calls = {"head 1": 0}

    def fails(head):
        if head == 1:
            calls["head 1"] += 1
            return calls["head 1"] <= 3
        return False

    fail_problems(monkeypatch, fails)
    monkeypatch.setattr(decoupled, "_DECOUPLED_PASSES", ("own problem",))
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
    import skattn.solvers.stages._refine as decoupled

    monkeypatch.setattr(decoupled, "split_rows_needed", lambda *a, **kw: 10**6)
    fail_problems(monkeypatch, lambda head: head == 1)
    monkeypatch.setattr(decoupled, "_DECOUPLED_PASSES", ("own problem",))

    def no_fit(*args, **kwargs):
        raise AssertionError("the logits of a head that cannot be pinned were fitted")

    monkeypatch.setattr(decoupled, "fit_logits", no_fit)
    X, Y, _, _ = planted(1500, 4, 6, 2, 4, 8, seed=9)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["head"] == 1 and not restart["taken"]
    assert restart["sequences_needed"] > 1500
    assert restart["logit_cost"] is None and restart["layer_residuals"] is None
    assert info["unconverged_heads"] == [1]


def test_a_restart_is_judged_on_sequences_it_did_not_use():
    from skattn.solvers.stages._refine import _judged_on

    rng = np.random.default_rng(0)
    used, rows = np.arange(0, 1000, 3), np.arange(0, 1000, 9)
    judge = _judged_on(rng, 1000, used, rows)
    assert len(judge) == len(used) and not np.intersect1d(judge, used).size
    assert np.all(np.diff(judge) > 0) and judge.max() < 1000
    most = np.setdiff1d(np.arange(400), np.arange(0, 400, 5))
    # fewer others than used: all of them
    np.testing.assert_array_equal(
        _judged_on(rng, 400, most, rows), np.arange(0, 400, 5)
    )
    # a restart that used every sequence is judged on the refinement's
    np.testing.assert_array_equal(_judged_on(rng, 400, np.arange(400), rows), rows)


def test_a_restart_that_ends_near_is_taken_when_the_layer_fits_better(monkeypatch):
    # head 1 "fails" (far) in the round and in its search afresh, and its restart
    # from its patterns ends near (1e-5, slightly off) however many sequences:
    # that end is taken (the layer fits far better than with the search's head),
    # the head stays unconverged in the record, and the fit says so
    import skattn.solvers.stages._refine as decoupled

    solve = decoupled._solve_head
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

    monkeypatch.setattr(decoupled, "_solve_head", solve_or_stall)
    monkeypatch.setattr(decoupled, "_DECOUPLED_PASSES", ("own problem",))
    X, Y, _, _ = planted(600, 4, 6, 2, 4, 8, seed=9)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["taken"] and not restart["converged"]
    assert restart["relative_residual"] == 1e-5
    assert not decoupled_info["heads"][1]["converged"]
    assert decoupled_info["residual"] < 1e-4
    assert info["unconverged_heads"] == [1] and info["relative_residual"] < 1e-4
