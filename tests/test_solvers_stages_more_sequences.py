"""Heads stuck near solved again on more sequences
(``stages/_more_sequences.py``)."""

from _helpers import decoupled_after_the_search, stall_head_one_below


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
    import skattn.solvers.stages._rounds as rounds

    monkeypatch.setattr(rounds, "_MIN_SEQUENCES", 50)
    small = stall_head_one_below(monkeypatch, 9)
    decoupled_info, residual = decoupled_after_the_search()
    assert small == [50]
    assert decoupled_info["stuck"] == [
        {"heads": [1], "n_sequences": 150, "converged": []},
        {"heads": [1], "n_sequences": 450, "converged": [1]},
    ]
    assert decoupled_info["heads"][1]["converged"]
    assert residual < 1e-10
