"""Far heads searched afresh on their own problem or on what the other heads
leave, and refined alone again (``stages/_search_afresh.py``)."""

import numpy as np
from _helpers import decoupled_after_the_search, fail_problems, head_one_once, nudged
from _helpers import refine_planted as planted

from skattn.solvers import FactoredHeads, decoupled_refine
from skattn.solvers.kernels._varpro import _intercept_direction
from skattn.solvers.stages._search_afresh import search_head


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


def test_a_near_head_is_continued_not_searched_afresh(monkeypatch):
    # head 1's first problem ends near (1e-5, slightly off): it is restarted from
    # its end, not replaced by a new search
    fail_problems(monkeypatch, head_one_once(), residual=1e-5, end=nudged(1e-5, 17))
    decoupled_info, residual = decoupled_after_the_search()
    assert decoupled_info["replacements"] == []
    assert decoupled_info["heads"][1]["converged"]
    assert decoupled_info["heads"][1]["rounds"] == 2
    assert residual < 1e-10
