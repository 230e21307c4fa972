"""Heads their sequences do not pin solved again on as many as they need
(``stages/_pinning.py``)."""

from _helpers import decoupled_after_the_search, stall_head_one_below


def test_a_head_its_sequences_do_not_pin_is_solved_on_as_many_as_it_needs(
    monkeypatch,
):
    # the counting bound (split_rows_needed) made to ask for 2000 split rows:
    # head 1 stalls (near) on fewer than twice the refinement's 200 sequences,
    # and is solved at once on as many as its split rows per sequence ask (times
    # 1.5, at most the training set's 600), where it converges; it is not grown
    # again from 200 by the stages on more sequences
    import skattn.solvers.stages._pinning as pinning_module

    monkeypatch.setattr(pinning_module, "split_rows_needed", lambda *args, **kw: 2000)
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
