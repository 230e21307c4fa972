"""Heads stuck near solved again on more sequences
(``stages/_more_sequences.py``)."""

from _helpers import (
    decoupled_after_the_search,
    refine_planted,
    stall_head_one_below,
    two_rank_four_heads,
)


def test_a_head_stuck_near_is_solved_again_on_more_sequences(monkeypatch):
    # stuck on the refinement's own sequences: refined again on three times
    # them, where it converges, and the fit is exact
    small = stall_head_one_below(monkeypatch, 2)
    decoupled_info, residual = decoupled_after_the_search()
    assert decoupled_info["stuck"] == [
        {"heads": [1], "n_sequences": 3 * small[0], "converged": [1], "crawling": []}
    ]
    assert decoupled_info["heads"][1]["converged"]
    assert decoupled_info["replacements"] == []
    assert residual < 1e-10


def test_a_head_still_stuck_on_more_sequences_gets_more_again(monkeypatch):
    # as the sharpest MiniLM heads: stuck on the refinement's sequences and on
    # three times them, converged on nine times them (the training set has 600)
    import skattn.solvers.stages._rounds as rounds

    monkeypatch.setattr(rounds, "_MIN_SEQUENCES", 50)
    small = stall_head_one_below(monkeypatch, 9)
    decoupled_info, residual = decoupled_after_the_search()
    assert small == [50]
    assert decoupled_info["stuck"] == [
        {"heads": [1], "n_sequences": 150, "converged": [], "crawling": []},
        {"heads": [1], "n_sequences": 450, "converged": [1], "crawling": []},
    ]
    assert decoupled_info["heads"][1]["converged"]
    assert residual < 1e-10


def test_a_head_that_crawls_on_more_sequences_is_restarted_from_its_patterns(
    monkeypatch,
):
    # head 1 (rank 4 = k: its patterns can be read) stays at 1e-5 on the
    # refinement's sequences and on three times them (it crawls: as a sharp head
    # whose small weights are wrong by nats): it goes no further there, and is
    # restarted from its patterns, which go on on more sequences, where it
    # converges and is taken
    X, Y, _, _ = refine_planted(1500, 4, 6, 2, 4, 8, seed=9)
    small = stall_head_one_below(monkeypatch, 4)
    info = two_rank_four_heads(X, Y)
    decoupled_info = info["start_search"]["decoupled"]
    assert 3 * small[0] < 4 * small[0] <= 1500
    assert decoupled_info["stuck"] == [
        {"heads": [1], "n_sequences": 3 * small[0], "converged": [], "crawling": [1]}
    ]
    (restart,) = decoupled_info["from_patterns"]
    assert restart["head"] == 1 and restart["converged"] and restart["taken"]
    assert decoupled_info["heads"][1]["converged"]
    assert info["relative_residual"] < 1e-10
