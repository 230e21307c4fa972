"""The random-start path of decoder heads (``solvers/_decoder.py``)."""

import numpy as np
import pytest
from _helpers import blas_threads, record_polish_threads

from skattn.datasets import make_attention_regression
from skattn.layer._math import forward
from skattn.layer._positions import Rotary, rotary_pairs
from skattn.solvers._decoder import (
    _relative,
    _reorient,
    fit_decoder_from_random_starts,
    group_query_heads,
    random_decoder_start,
    tie_key_heads,
)
from skattn.solvers.kernels._loss import REALISABLE_RESIDUAL
from skattn.solvers.kernels._near_gauge import reflect_slow_dims, slow_rotary_dims
from skattn.solvers.kernels._parametrization import FactoredHeads, LowRank
from skattn.solvers.kernels._varpro import VarproProblem
from skattn.solvers.optimizers._lm_matrix_free import varpro_least_squares


def test_random_decoder_start_has_the_scale_of_random_attention():
    par = FactoredHeads(4, 40, 8, n_kv_heads=2)
    Q, K, V = par.factors(random_decoder_start(par, 0))
    theta = Q @ np.swapaxes(K[[0, 0, 1, 1]], 1, 2)
    np.testing.assert_allclose(np.linalg.norm(theta, axis=(1, 2)), 1.0, rtol=0.3)
    np.testing.assert_allclose(
        np.swapaxes(V, 1, 2) @ V, np.eye(8)[None].repeat(4, 0), atol=1e-12
    )
    assert random_decoder_start(LowRank(4, 40, 8), 0).shape == (2 * 4 * 40 * 8,)


@pytest.mark.parametrize(
    "decoder",
    [
        {"causal": True, "rope": True, "n_kv_heads": 2},
        {"causal": True, "n_kv_heads": 1},
    ],
)
def test_planted_grouped_decoder_is_learned_to_rounding(decoder):
    m, k, d, r = 4, 5, 8, 2
    X, y, layer = make_attention_regression(
        1500,
        k,
        d,
        m,
        head_rank=r,
        rope_theta=100.0,
        random_state=1,
        return_layer=True,
        **decoder,
    )
    X, Y = X.reshape(-1, k, d), y.reshape(-1, k, d)
    rope_theta = 100.0 if decoder.get("rope") else None
    Q, K, W, info = fit_decoder_from_random_starts(
        X[:1200],
        Y[:1200],
        m,
        r,
        causal=True,
        rope_theta=rope_theta,
        n_kv_heads=decoder["n_kv_heads"],
        random_state=0,
    )
    assert K.shape == (decoder["n_kv_heads"], d, r)
    assert info["relative_residual"] <= 1e-10
    assert info["decoupled"] is None and "jointly" in info["decoupled_note"]
    group = np.arange(m) // (m // decoder["n_kv_heads"])
    if rope_theta is None:
        attention, rotary = Q @ np.swapaxes(K[group], 1, 2), None
    else:
        attention, rotary = np.zeros((m, d, d)), Rotary(Q, K, rope_theta)
    held = forward(X[1200:], attention, W, causal=True, rotary=rotary)
    error = np.linalg.norm(held - Y[1200:]) / np.linalg.norm(Y[1200:])
    assert error <= 1e-8


@pytest.mark.parametrize("layout", ["half", "interleaved", None])
def test_tie_key_heads_recovers_the_groups_and_the_logits(layout):
    """Ungrouped heads that are a grouped layer in disguise (each query head's
    own key map its group's, moved by a random gauge; heads shuffled) are tied
    back: the true groups, and the same logits head by head."""
    rng = np.random.default_rng(3)
    m, m_kv, d, r = 6, 2, 7, 4
    rope = {} if layout is None else {"rope_theta": 100.0, "rope_layout": layout}
    free = FactoredHeads(m, d, r, causal=True, **rope)
    grouped = FactoredHeads(m, d, r, causal=True, n_kv_heads=m_kv, **rope)
    Q, K, V = (rng.normal(size=(h, d, r)) for h in (m, m_kv, m))
    shuffle = rng.permutation(m)
    group_of = (np.arange(m) // (m // m_kv))[shuffle]
    pairs = None if layout is None else rotary_pairs(r, layout)
    Qs, Ks = [], []
    for i in range(m):
        if pairs is None:
            M = rng.normal(size=(r, r)) + 3 * np.eye(r)
        else:
            M = np.zeros((r, r))
            for pair in pairs:
                a, b = rng.normal(size=2)
                M[np.ix_(pair, pair)] = [[a, -b], [b, a]]
        Ks.append(K[group_of[i]] @ M)
        Qs.append(Q[shuffle[i]] @ np.linalg.inv(M).T)
    params = np.concatenate([np.ravel(Qs), np.ravel(Ks), V[shuffle].ravel()])
    tied, groups = tie_key_heads(params, free, grouped)
    true_groups = [sorted(np.flatnonzero(group_of == g).tolist()) for g in range(m_kv)]
    assert sorted(sorted(group) for group in groups) == sorted(true_groups)
    order = [j for group in groups for j in group]
    X = rng.normal(size=(4, 5, d))
    np.testing.assert_allclose(
        grouped.logits(X, tied), free.logits(X, params)[:, order], atol=1e-10
    )


def test_tie_key_heads_maps_the_slow_block_freely():
    """At a released base most rotary pairs barely turn over a window: query
    heads searched apart have key maps that differ by any map of those slow
    dimensions, not by scaled rotations only (issue 62)."""
    rng = np.random.default_rng(4)
    m, m_kv, d, r, k, theta = 4, 2, 10, 16, 32, 5e5
    free = FactoredHeads(m, d, r, causal=True, rope_theta=theta)
    grouped = FactoredHeads(m, d, r, causal=True, rope_theta=theta, n_kv_heads=m_kv)
    slow = slow_rotary_dims(r, theta, "half", k)
    assert 0 < len(slow) < r
    Q, K, V = (rng.normal(size=(h, d, r)) for h in (m, m_kv, m))
    group_of = np.array([0, 1, 0, 1])
    Ks, Qs = [], []
    for i in range(m):
        M = np.eye(r)
        if i >= m_kv:  # the second head of each group: moved by a slow-block map
            M[np.ix_(slow, slow)] += rng.normal(size=(len(slow), len(slow)))
        Ks.append(K[group_of[i]] @ M)
        Qs.append(Q[i] @ np.linalg.inv(M).T)
    params = np.concatenate([np.ravel(Qs), np.ravel(Ks), V.ravel()])
    pairs = rotary_pairs(r, "half")
    _, rotations = group_query_heads(np.stack(Ks), m_kv, pairs)
    groups, misfit = group_query_heads(np.stack(Ks), m_kv, pairs, slow)
    assert sorted(sorted(g) for g in groups) == [[0, 2], [1, 3]]
    assert misfit[0, 2] < 1e-20 and misfit[1, 3] < 1e-20
    assert rotations[0, 2] > 0.05 and rotations[1, 3] > 0.05
    tied, groups = tie_key_heads(params, free, grouped, n_tokens=k)
    query, key = grouped.factors(tied)[:2]
    order = [j for group in groups for j in group]
    for i, j in enumerate(order):  # each head's Q K^T, through its group's key
        np.testing.assert_allclose(
            query[i] @ key[i // 2].T, Qs[j] @ Ks[j].T, rtol=0, atol=1e-9
        )


def test_grouped_search_is_regrouped_and_recorded():
    X, y = make_attention_regression(
        300, 6, 8, 4, head_rank=2, causal=True, rope=True, rope_theta=100.0,
        n_kv_heads=2, distribution="gaussian", random_state=0,
    )  # fmt: skip
    X, Y = X.reshape(300, 6, 8), y.reshape(300, 6, 8)
    options = dict(causal=True, rope_theta=100.0, n_kv_heads=2, n_starts=1)
    *_, info = fit_decoder_from_random_starts(
        X, Y, 4, 2, random_state=0, max_iter=2, **options
    )
    regrouped = info["start_search"]["regrouped"]
    assert sorted(j for group in regrouped["groups"] for j in group) == [0, 1, 2, 3]
    assert regrouped["n_steps"] > 0 and regrouped["residual"] < 1
    *_, info = fit_decoder_from_random_starts(
        X, Y, 4, 2, random_state=0, max_iter=2, regroup_keys=False, **options
    )
    assert info["start_search"]["regrouped"] is None


def _slow_pairs_layer(n):
    """``n`` sequences of a planted causal rotary layer (4 query heads sharing 2
    key heads of rank 8, d = 12, base 10 000, k = 32: pairs 2-3 of 4 slow):
    ``(X, Y, par, truth)``, ``truth`` its parameters in ``par`` (LowRank)."""
    m, m_kv, d, k, r = 4, 2, 12, 32, 8
    X, y, layer = make_attention_regression(
        n, k, d, m, head_rank=r, causal=True, rope=True, n_kv_heads=m_kv,
        distribution="gaussian", random_state=0, return_layer=True,
    )  # fmt: skip
    par = LowRank(m, d, r, n_kv_heads=m_kv, causal=True, rope_theta=layer.rope_theta)
    truth = np.concatenate([layer.rotary_query.ravel(), layer.rotary_key.ravel()])
    return X.reshape(n, k, d), y.reshape(n, k, -1), par, truth


def test_a_key_group_with_its_slow_block_reflected_is_reoriented():
    # a planted causal rotary layer (base 10 000, k = 32: pairs 2-3 of 4 slow);
    # the start: 1 % noise in the slow dimensions, then key group 1's slow
    # block reflected, an orientation the lifted polish cannot leave
    X, Y, par, truth = _slow_pairs_layer(40)
    m, m_kv, d, r, k = par.n_heads, par.n_kv_heads, par.n_features, par.rank, 32
    dims = slow_rotary_dims(r, par.rope_theta, "half", k)
    noise = np.zeros((m + m_kv, d, r))
    noise[..., dims] = np.random.default_rng(1).normal(size=noise[..., dims].shape)
    start = truth + 0.01 * np.sqrt(np.mean(truth**2)) * noise.ravel()
    options = {"max_iter": 16, "stop_below": REALISABLE_RESIDUAL, "coarse": False}
    start, _, _ = varpro_least_squares(
        X, Y, reflect_slow_dims(start, par, 1, dims), par, **{**options, "max_iter": 6}
    )
    problem = VarproProblem(X, Y, None, par)
    residual = _relative(problem, start, Y, None)
    params, end, record = _reorient(
        (X, Y, None), start, residual, problem, options, lambda *a: None
    )
    assert residual > 1e-4 and end < 1e-10, record
    # every set screened; the lowest screen (group 1's) polished on first,
    # and fitted: no other polished on
    screened = dict((tuple(g), residual) for g, residual in record["screened"])
    assert list(screened) == [(0,), (1,), (0, 1)]
    assert min(screened, key=screened.get) == (1,)
    assert screened[(0,)] > 1e-4  # group 0 reflected too: still wrong
    assert record["kept"] == [1] and [g for g, _ in record["tried"]] == [[1]]
    np.testing.assert_allclose(
        par.attention(params),
        par.attention(truth),
        atol=1e-8 * np.abs(par.attention(truth)).max(),
    )


def test_an_interrupted_decoder_fit_resumes_to_the_uninterrupted_layer(tmp_path):
    # a grouped rotary layer (ungrouped search, grouped search, warm-up, polish;
    # three iterations each, so that the warm-up does not end the fit): Ctrl-C
    # in the polish on all examples; run again with the same memory, the
    # searches and the warm-up are read back, the polish computed, and the layer
    # is the uninterrupted fit's, bit for bit
    import skattn.solvers._decoder as decoder_module

    X, y = make_attention_regression(
        1200, 5, 8, 4, head_rank=2, causal=True, rope=True, rope_theta=100.0,
        n_kv_heads=2, random_state=1,
    )  # fmt: skip
    X, Y = X.reshape(-1, 5, 8), y.reshape(-1, 5, 8)
    options = dict(
        causal=True, rope_theta=100.0, n_kv_heads=2, n_starts=1, random_state=0,
        n_warmup_samples=400, max_iter=3,
    )  # fmt: skip
    *uninterrupted, info = fit_decoder_from_random_starts(X, Y, 4, 2, **options)
    assert info["memory"] is None and info["final_stage"] == "ran"
    polish = decoder_module.varpro_least_squares

    def interrupted(X_polished, *args, **kwargs):
        if len(X_polished) == len(X):  # the polish on all examples
            raise KeyboardInterrupt
        return polish(X_polished, *args, **kwargs)

    decoder_module.varpro_least_squares = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            fit_decoder_from_random_starts(X, Y, 4, 2, memory=tmp_path, **options)
    finally:
        decoder_module.varpro_least_squares = polish
    *resumed, info = fit_decoder_from_random_starts(
        X, Y, 4, 2, memory=tmp_path, **options
    )
    kept = info["memory"]
    assert kept["reused"] == [
        "decoder-search-ungrouped-1",
        "decoder-search-1",
        "decoder-warmup-1",
    ]
    assert kept["computed"] == ["decoder-polish-1.lm-1", "decoder-polish-1"]
    for got, expected in zip(resumed, uninterrupted, strict=True):
        np.testing.assert_array_equal(got, expected)
    # once more: everything read back
    *again, info = fit_decoder_from_random_starts(
        X, Y, 4, 2, memory=tmp_path, **options
    )
    assert info["memory"]["computed"] == [] and len(info["memory"]["reused"]) == 4
    np.testing.assert_array_equal(again[2], uninterrupted[2])


def _two_rotary_heads(n):
    """``n`` sequences of 5 tokens (d = 8) through 2 causal rotary heads of rank
    2 (base 100): ``(X, Y)`` as ``(n, 5, 8)``."""
    X, y = make_attention_regression(
        n, 5, 8, 2, head_rank=2, causal=True, rope=True, rope_theta=100.0,
        random_state=1,
    )  # fmt: skip
    return X.reshape(-1, 5, 8), y.reshape(-1, 5, 8)


def test_decoder_starts_go_through_the_drivers_loop_and_polish_subsets(monkeypatch):
    # one driver: the decoder's starts report to the same progress hook as the
    # encoder's, and its polish takes the polish set and its warm-up subset
    # as staged_polish does (polish_rows), the search all examples
    X, Y = _two_rotary_heads(900)
    import skattn.solvers._decoder as decoder_module

    searched_on, search = [], decoder_module.minibatch_search

    def recorded(X_searched, *args, **kwargs):
        searched_on.append(len(X_searched))
        return search(X_searched, *args, **kwargs)

    monkeypatch.setattr(decoder_module, "minibatch_search", recorded)
    calls = []
    *_, info = fit_decoder_from_random_starts(
        X, Y, 2, 2, causal=True, rope_theta=100.0, n_polish_samples=600,
        n_warmup_samples=200, random_state=0,
        progress=lambda message, done: calls.append((message, done)),
    )  # fmt: skip
    assert info["relative_residual"] <= 1e-10
    assert info["n_polish_samples"] == 600 and info["warmup"] is not None
    assert searched_on == [900] * info["n_starts_run"]
    begun = [message for message, done in calls if not done]
    assert begun[:2] == ["start 1: search", "start 1: joint polish"]
    message, done = calls[-1]
    assert done and message.startswith(f"start {info['n_starts_run']}: relative")
    assert info["n_starts_run"] == len(info["start_residuals"])


def test_the_decoder_polish_runs_its_chunks_in_threads_of_one_blas_thread(
    monkeypatch,
):
    # with two BLAS threads the small products of a decoder polish ran 2.5
    # times slower than on one: the polish limits BLAS to one thread and runs
    # the products' chunks in as many jobs as BLAS had threads (at most 2)
    from threadpoolctl import threadpool_limits

    X, Y = _two_rotary_heads(300)
    import skattn.solvers._decoder as decoder_module

    seen = record_polish_threads(monkeypatch, decoder_module)
    for threads in (1, 2):
        seen.clear()
        with threadpool_limits(threads, user_api="blas"):
            jobs = min(2, blas_threads())  # a BLAS built for one thread: 1
            *_, info = fit_decoder_from_random_starts(
                X, Y, 2, 2, causal=True, rope_theta=100.0, n_starts=1,
                random_state=0,
            )  # fmt: skip
        assert info["relative_residual"] <= 1e-10
        assert seen and set(seen) == {(jobs, 1)}


def test_anisotropic_tokens_are_whitened_and_the_heads_mapped_back():
    # a rotary causal layer on tokens whose coordinates span two decades (as a
    # trained GPT-2's second layer sees): the same layer in other coordinates,
    # fitted on whitened tokens and mapped back to these
    from skattn import MultiHeadAttentionRegressor
    from skattn.datasets import make_attention_regression

    X, y = make_attention_regression(
        600,
        4,
        6,
        2,
        head_rank=2,
        causal=True,
        rope=True,
        rope_theta=100.0,
        random_state=0,
    )
    X = (X.reshape(600, 4, 6) * np.logspace(-1, 1, 6)).reshape(600, -1)
    est = MultiHeadAttentionRegressor(
        n_heads=2,
        n_tokens=4,
        head_rank=2,
        causal=True,
        rope=True,
        rope_theta=100.0,
        random_state=0,
    ).fit(X, y)
    info = est.phase_report_[-1].info
    assert info["whitening"]["applied"] and info["whitening"]["condition"] > 1e3
    error = np.linalg.norm(est.predict(X) - y) / np.linalg.norm(y)
    assert error <= 1e-8


def test_a_raised_cap_goes_on_from_the_kept_polish_and_its_lift(tmp_path, monkeypatch):
    # a rotary polish (base 10 000, k = 32: the slow pairs lifted after 4 plain
    # evaluations) cut at 6 evaluations, then run under a cap of 40 with the
    # same memory: the plain steps and the lift's scale are read back (no scale
    # computed again), the lifted stage gone on from its kept iterate, and the
    # layer is the uninterrupted run's, bit for bit; a cap of 7 after it gives
    # the run cut at 7
    from skattn.solvers._checkpoints import StageMemory
    from skattn.solvers.optimizers import _lm_matrix_free

    X, Y, par, truth = _slow_pairs_layer(24)
    m, m_kv, d, r, k = par.n_heads, par.n_kv_heads, par.n_features, par.rank, 32
    noise = np.random.default_rng(1).normal(size=(m + m_kv, d, r))
    slow = slow_rotary_dims(r, par.rope_theta, "half", k)
    fast = [i for i in range(r) if i not in slow]
    noise[..., fast] *= 0.1
    start = truth + 0.03 * np.sqrt(np.mean(truth**2)) * noise.ravel()
    scales = []
    lift = _lm_matrix_free.lift_near_gauge

    def counted(*args, scale=None, **kwargs):
        scales.append(scale is None)  # a scale computed
        return lift(*args, scale=scale, **kwargs)

    monkeypatch.setattr(_lm_matrix_free, "lift_near_gauge", counted)

    def polish(cap, kept=False):
        memory = None
        if kept:  # every iterate kept
            memory = StageMemory(tmp_path, {"max_iter": cap}, (X, Y))
            memory.iterate_interval = 0.0
        scales.clear()
        found, _, info = varpro_least_squares(
            X, Y, start, par, max_iter=cap, coarse=False, memory=memory
        )
        return found, info, memory

    reference, info, _ = polish(40)
    assert info["converged"] and info["loss"] < 1e-20 and scales == [True]
    cut = polish(6, kept=True)[1]
    assert cut["stop_reason"] == "max_iter" and scales == [True]
    resumed, info, memory = polish(40, kept=True)
    assert scales == [False]  # the scale read back
    assert "lm-1-plain" in memory.reused and memory.continued == ["lm-1"]
    assert any("iterate" in name for name in memory.reused)
    np.testing.assert_array_equal(resumed, reference)
    np.testing.assert_array_equal(polish(7, kept=True)[0], polish(7)[0])


@pytest.mark.parametrize("case", ["scale lost", "kept before fingerprints"])
def test_a_kept_lifted_iterate_is_gone_on_from_only_under_its_scale(
    tmp_path, monkeypatch, case
):
    # the lifted stage cut with its iterate kept.  "scale lost": the lift's
    # scale then lost and computed otherwise (another version's whitening): the
    # kept iterate's variables are another point under it, so the stage runs
    # again, to the layer of the run under that scale uninterrupted.  "kept
    # before fingerprints": the iterate without its scale's fingerprint (an
    # earlier version's) and the scale read back: gone on from, to the
    # uninterrupted run's layer
    from skattn.solvers._checkpoints import StageMemory
    from skattn.solvers.optimizers import _lm_matrix_free

    X, Y, par, truth = _slow_pairs_layer(24)
    m, m_kv, d, r, k = par.n_heads, par.n_kv_heads, par.n_features, par.rank, 32
    noise = np.random.default_rng(1).normal(size=(m + m_kv, d, r))
    slow = slow_rotary_dims(r, par.rope_theta, "half", k)
    noise[..., [i for i in range(r) if i not in slow]] *= 0.1
    start = truth + 0.03 * np.sqrt(np.mean(truth**2)) * noise.ravel()
    lift, otherwise = _lm_matrix_free.lift_near_gauge, [False]

    def scaled(*args, scale=None, **kwargs):
        out = lift(*args, scale=scale, **kwargs)
        if scale is None and otherwise[0]:
            out.scale = 2.0 * out.scale
        return out

    monkeypatch.setattr(_lm_matrix_free, "lift_near_gauge", scaled)

    def polish(cap, kept=False):
        memory = None
        if kept:
            memory = StageMemory(tmp_path, {"max_iter": cap}, (X, Y))
            memory.iterate_interval = 0.0
        found, _, info = varpro_least_squares(
            X, Y, start, par, max_iter=cap, coarse=False, memory=memory
        )
        return found, info, memory

    cut = polish(6, kept=True)
    assert cut[1]["stop_reason"] == "max_iter"
    if case == "scale lost":
        for entry in tmp_path.rglob("*lm-1-lift*"):
            entry.unlink()
        otherwise[0] = True
    else:
        earlier = StageMemory(tmp_path, {"max_iter": 6}, (X, Y))
        found, iterate = earlier.load("lm-1-iterate")
        assert found and "lift" in iterate
        del iterate["lift"]
        earlier.save("lm-1-iterate", iterate)
    reference, info, _ = polish(40)
    assert info["converged"]
    resumed, _, memory = polish(40, kept=True)
    assert "lm-1-plain" in memory.reused
    gone_on = any("iterate" in name for name in memory.reused)
    assert gone_on == (case == "kept before fingerprints")
    np.testing.assert_array_equal(resumed, reference)
