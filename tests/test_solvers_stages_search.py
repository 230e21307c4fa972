"""The minibatch search: its batch gradient, its stops, its head replacements
(``stages/_search.py``)."""

import numpy as np
import pytest
from _helpers import search_planted as planted

from skattn.layer._math import softmax
from skattn.solvers import FactoredHeads, VarproProblem
from skattn.solvers.kernels._varpro import _intercept_direction
from skattn.solvers.stages._search import (
    batch_loss_gradient,
    head_contributions,
    minibatch_search,
)


@pytest.mark.parametrize("intercept", [False, True])
def test_batch_gradient_is_the_variable_projection_gradient(intercept):
    """The envelope gradient of a batch equals the Jacobian's adjoint on the
    residual of :class:`VarproProblem` (same reduced loss, float64)."""
    X, Y, truth = planted(60, 3, 5, 2, 2, 7, intercept=intercept)
    par = FactoredHeads(2, X.shape[2], 2)
    params = truth + 0.3 * np.random.default_rng(1).normal(size=par.size)
    direction = _intercept_direction(X) if intercept else None
    loss, gradient, zero = batch_loss_gradient(X, Y, params, par, direction)
    problem = VarproProblem(X, Y, None, par, intercept=intercept)
    residual = problem.residual(params)
    np.testing.assert_allclose(loss, 0.5 * residual @ residual, rtol=1e-7)
    exact = problem.rmatvec(params, residual)
    # up to the tiny ridge that keeps a batch's Gram solve defined
    assert np.linalg.norm(gradient - exact) <= 1e-7 * np.linalg.norm(exact)
    np.testing.assert_allclose(zero, 0.5 * np.sum(Y**2) / len(Y))
    # single precision: the same to float32's accuracy, returned in float64
    loss32, gradient32, _ = batch_loss_gradient(
        X.astype(np.float32), Y.astype(np.float32), params, par, direction
    )
    assert gradient32.dtype == np.float64
    assert np.linalg.norm(gradient32 - gradient) <= 1e-3 * np.linalg.norm(gradient)


def test_fixed_columns_are_eliminated_with_the_output_factors():
    """Fixed columns join the batch's design: the loss is the least-squares
    residual of ``[S_i X V_i, F]`` and the gradient its derivative (central
    differences); columns that are the outputs leave nothing to fit."""
    X, Y, truth = planted(40, 3, 5, 2, 2, 4, seed=3)
    par = FactoredHeads(2, 5, 2)
    rng = np.random.default_rng(4)
    params = truth + 0.3 * rng.normal(size=par.size)
    F = rng.normal(size=(40, 3, 3))
    loss, gradient, zero = batch_loss_gradient(X, Y, params, par, fixed=F)
    Q, K, V = par.factors(params)
    patterns = softmax(
        np.einsum("nqd,mde,nke->nmqk", X, Q @ np.swapaxes(K, 1, 2), X), axis=-1
    )
    columns = np.einsum("nmqk,nkd,mdr->nqmr", patterns, X, V).reshape(120, 4)
    design = np.concatenate([columns, F.reshape(120, 3)], axis=1)
    target = Y.reshape(120, 4)
    coef = np.linalg.lstsq(design, target, rcond=None)[0]
    explicit = 0.5 * np.sum((design @ coef - target) ** 2) / 40
    np.testing.assert_allclose(loss, explicit, rtol=1e-7)
    step = rng.normal(size=par.size)
    h = 1e-6
    slope = (
        batch_loss_gradient(X, Y, params + h * step, par, fixed=F)[0]
        - batch_loss_gradient(X, Y, params - h * step, par, fixed=F)[0]
    ) / (2 * h)
    np.testing.assert_allclose(gradient @ step, slope, rtol=1e-5)
    # (up to the Gram matrix's tiny ridge)
    assert batch_loss_gradient(X, Y, params, par, fixed=Y)[0] < 1e-16 * zero


def test_batch_halves_in_threads_give_the_same_bits():
    # the batch is computed in two halves whose sums make the result: two
    # threads give the same bits as one, and the search the same parameters
    X, Y, truth = planted(300, 4, 6, 2, 2, 8, seed=5, intercept=True)
    X, Y = X.astype(np.float32), Y.astype(np.float32)
    par = FactoredHeads(2, X.shape[2], 2)
    params = truth + 0.3 * np.random.default_rng(2).normal(size=par.size)
    direction = _intercept_direction(X)
    one, two = (
        batch_loss_gradient(X, Y, params, par, direction, n_jobs=jobs)
        for jobs in (1, 2)
    )
    assert one[0] == two[0] and one[2] == two[2]
    np.testing.assert_array_equal(one[1], two[1])
    searched = [
        minibatch_search(
            X,
            Y,
            params,
            par,
            batch_size=64,
            max_steps=100,
            n_jobs=jobs,
            random_state=0,
        )[0]
        for jobs in (1, 2)
    ]
    np.testing.assert_array_equal(*searched)


def test_minibatch_search_reaches_the_basin_of_a_planted_layer():
    X, Y, truth = planted(3000, 4, 8, 2, 2, 8, seed=2)
    par = FactoredHeads(2, 8, 2)
    start = np.random.default_rng(3).normal(size=par.size) / 4
    params, info = minibatch_search(
        X, Y, start, par, batch_size=64, stop_residual=1e-2, random_state=0
    )
    assert info["stop_reason"] == "residual"
    assert info["residual"] <= 1e-2 < info["residuals"][0]
    assert info["n_steps"] % 50 == 0 and info["n_steps"] <= 5000
    # the same batches: the same result
    again, _ = minibatch_search(
        X, Y, start, par, batch_size=64, stop_residual=1e-2, random_state=0
    )
    np.testing.assert_array_equal(params, again)


def test_minibatch_search_stops_on_its_budget_and_on_no_progress():
    X, Y, _ = planted(500, 3, 5, 2, 2, 6, seed=4)
    par = FactoredHeads(2, 5, 2)
    start = np.random.default_rng(0).normal(size=par.size)
    _, info = minibatch_search(
        X, Y, start, par, batch_size=32, max_steps=20, check_every=10, random_state=0
    )
    assert info["stop_reason"] == "max_iter" and info["n_steps"] == 20
    assert len(info["residuals"]) == 3
    # a step size too small to move: every check stalls, each cut, then stop
    _, info = minibatch_search(
        X,
        Y,
        start,
        par,
        batch_size=32,
        learning_rate=1e-12,
        check_every=5,
        patience=2,
        n_decays=2,
        n_replacements=0,
        random_state=0,
    )
    assert info["stop_reason"] == "no_decrease"
    assert info["n_decays"] == 2 and info["n_steps"] == 5 * 2 * 3
    assert info["replacements"] == []


def test_off_numpy_the_search_copies_its_rows_ahead_and_draws_the_same(monkeypatch):
    # torch: the rows of eight check intervals are copied to the device at once,
    # drawn by the generator with its state put back; the steps still draw them
    # as numpy's search does: the same steps as a copy an interval (to the bit),
    # numpy's result (to rounding) and the generator's state after
    torch = pytest.importorskip("torch")
    from skattn.solvers.stages import _search
    from skattn.utils._device_work import DeviceWork

    X, Y, _ = planted(500, 3, 5, 2, 2, 6, seed=4)
    par = FactoredHeads(2, 5, 2)
    start = np.random.default_rng(0).normal(size=par.size)
    options = dict(
        batch_size=32, max_steps=160, check_every=10, n_replacements=0, dtype=float
    )
    rng = np.random.RandomState(0)
    expected, info = minibatch_search(X, Y, start, par, random_state=rng, **options)
    assert info["n_steps"] == 160  # 16 check intervals

    def on_torch(random_state):
        with DeviceWork() as work:
            found, _ = minibatch_search(
                torch.asarray(X),
                torch.asarray(Y),
                torch.asarray(start),
                par,
                random_state=random_state,
                **options,
            )
        return found.numpy(), work.waits["other"]["host copy"]

    ahead_rng = np.random.RandomState(0)
    found, copies = on_torch(ahead_rng)
    np.testing.assert_allclose(found, expected, rtol=1e-8, atol=1e-10)
    assert ahead_rng.randint(2**31) == rng.randint(2**31)
    monkeypatch.setattr(_search, "_DRAWN_AHEAD", 1)  # a copy an interval
    one_by_one, before = on_torch(np.random.RandomState(0))
    np.testing.assert_array_equal(found, one_by_one)
    # the start, the evaluation rows, then the steps' rows twice (16 intervals,
    # 8 at a time) where a copy an interval made 16
    assert copies <= before - 14, (copies, before)


def test_no_step_size_cut_on_the_start_plateau():
    """8 planted heads of rank 8 at d = 64 (m r = d, as a BERT-base layer's): from
    a random start the residual sits near 0.7 for some 70 steps before it falls.
    The plain stall rule cuts the step size there and ends on the plateau; with
    no cut on it the search leaves it and reaches its target.  (12 heads at
    d = 96 and 2000 sequences show the same, in ten times the time.)"""
    from skattn.datasets import GaussianTokens, make_attention_layer
    from skattn.layer import AttentionLayer
    from skattn.solvers import whitening_map
    from skattn.solvers.kernels._parametrization import random_attention

    d, m, r, n, k = 64, 8, 8, 1000, 16
    base = make_attention_layer(m, d, head_rank=r, random_state=0)
    rng = np.random.default_rng(1)
    # key biases in the keys' span, and an intercept (bench_gpu.py's planted768)
    key_bias = np.einsum("mde,md->me", base.attention, rng.normal(size=(m, d)))
    key_bias /= np.linalg.norm(key_bias, axis=1, keepdims=True)
    layer = AttentionLayer(
        base.attention,
        base.projection,
        key_bias=key_bias,
        intercept=rng.normal(size=d),
        n_tokens=k,
    )
    X = np.asarray(GaussianTokens(k, d).sample(n, random_state=0)).reshape(n, k, d)
    Y = layer.transform(X.reshape(n, -1)).reshape(n, k, d)
    X = np.concatenate([X, np.ones((n, k, 1))], axis=2)
    X = X @ whitening_map(X)[0]
    par = FactoredHeads(m, d + 1, r)
    rng = np.random.RandomState(0)
    attention = random_attention(m, d + 1, rng)
    values = rng.normal(scale=1 / (d + 1), size=(m, d + 1, r))
    start = par.from_attention(attention, values @ rng.normal(size=(m, r, d)))
    options = dict(
        intercept_direction=_intercept_direction(X),
        batch_size=128,
        check_every=10,
        patience=2,
        max_steps=1000,
        n_replacements=0,
        random_state=0,
    )
    _, plain = minibatch_search(X, Y, start, par, plateau_steps=0, **options)
    assert plain["stop_reason"] == "no_decrease" and plain["residual"] > 0.6
    assert plain["n_steps"] < 200 and plain["n_decays"] == 3
    _, info = minibatch_search(X, Y, start, par, plateau_steps=1000, **options)
    assert info["stop_reason"] == "residual" and info["residual"] <= 2e-2
    # the plateau: 70 steps still above 0.85 times the start
    assert min(info["residuals"][:7]) > 0.85 * info["residuals"][0]


def test_a_fall_of_the_values_alone_does_not_end_the_plateau():
    """Outputs whose only learnable part is the tokens' mean (a pattern any soft
    start has) under noise: the values fit it by the first check, a fall of more
    than a tenth of the start's residual, and then the residual sits still.  That
    fall is not a way off the plateau: no cut is made in the first
    ``plateau_steps`` steps.  (With the level at 0.9 times the start's, it was
    crossed at the first check and the search was cut from its third; a
    Llama-shaped layer's values fell 0.824 -> 0.726 at its first check, and its
    search ended at 0.48 on an H200.)"""
    from skattn.solvers._decoder import random_decoder_start

    rng = np.random.default_rng(0)
    n, k, d = 2000, 8, 16
    X = rng.normal(size=(n, k, d))
    A = rng.normal(size=(d, d)) / np.sqrt(d)
    Y = 2 * X.mean(axis=1, keepdims=True) @ A + rng.normal(size=(n, k, d))
    par = FactoredHeads(2, d, 4)
    _, info = minibatch_search(
        X,
        Y,
        random_decoder_start(par, 1),
        par,
        check_every=10,
        patience=2,
        n_decays=1,
        n_replacements=0,
        plateau_steps=200,
        max_steps=1000,
        random_state=0,
    )
    residuals = info["residuals"]
    assert residuals[1] < 0.9 * residuals[0]  # the values' fall, at once
    assert max(residuals[2:]) > 0.95 * residuals[1]  # then no way off
    # no cut before step 200; then a stall of two checks, a cut, two more
    assert info["stop_reason"] == "no_decrease" and info["n_decays"] == 1
    assert info["n_steps"] >= 200, info["n_steps"]


def dead_head_start(truth, par):
    """Head 0 of the truth and a zero head 1: the zero head's columns are zero, so
    its gradient is zero and Adam never moves it; head 1 stays unfound."""
    Q, K, V = (factor.copy() for factor in par.factors(truth))
    for factor in (Q, K, V):
        factor[1] = 0.0
    return np.concatenate([Q.ravel(), K.ravel(), V.ravel()])


def test_a_stalled_search_replaces_its_weakest_head():
    X, Y, truth = planted(2000, 4, 8, 2, 2, 8, seed=6)
    par = FactoredHeads(2, 8, 2)
    start = dead_head_start(truth, par)
    options = dict(batch_size=64, stop_residual=1e-2, random_state=0, check_every=25)
    stuck, info = minibatch_search(X, Y, start, par, n_replacements=0, **options)
    assert info["stop_reason"] == "no_decrease" and info["residual"] > 0.1
    assert not np.any(par.factors(stuck)[2][1])  # the dead head never moved
    found, info = minibatch_search(X, Y, start, par, **options)
    (replacement,) = info["replacements"]
    assert replacement["kept"] and replacement["head"] in (0, 1)
    assert replacement["residual_before"] > 0.1
    assert info["stop_reason"] == "residual" and info["residual"] <= 1e-2
    # the other real head is found: each real head has a learned head with
    # nearly its patterns
    real = par.logits(X[:200], truth)
    learned = par.logits(X[:200], found)
    for i in range(2):
        gaps = [np.abs(learned[:, j] - real[:, i]).mean() for j in range(2)]
        assert min(gaps) < 0.2 * np.abs(real[:, i]).mean()


def rotary_planted(n, k, d, m, r, d_out, theta, seed=0):
    """Causal rotary heads with ``W_i = V_i O_i`` on Gaussian tokens (the
    decoder's ``FactoredHeads``): tokens, outputs, parameters."""
    rng = np.random.default_rng(seed)
    par = FactoredHeads(m, d, r, causal=True, rope_theta=theta)
    X = rng.normal(size=(n, k, d))
    truth = np.concatenate(
        [np.sqrt(2) * rng.normal(size=2 * m * d * r) / np.sqrt(d)]
        + [rng.normal(size=m * d * r) / np.sqrt(d)]
    )
    patterns = softmax(par.logits(X, truth), axis=-1)
    outputs = rng.normal(size=(m, r, d_out))
    Y = np.einsum("nmqk,nmkr,mro->nqo", patterns, par.values(X, truth), outputs)
    return X, Y, truth


def test_a_stalled_rotary_search_replaces_its_head_by_a_rotary_one():
    """A causal rotary layer searched with a dead head: the replacement is
    searched masked and rotated as the layer's heads (a position-free head
    cannot take the dead one's place), and the search ends at its target."""
    X, Y, truth = rotary_planted(2000, 5, 8, 2, 2, 8, theta=10.0, seed=6)
    par = FactoredHeads(2, 8, 2, causal=True, rope_theta=10.0)
    start = dead_head_start(truth, par)
    options = dict(batch_size=64, stop_residual=1e-2, random_state=0, check_every=25)
    stuck, info = minibatch_search(X, Y, start, par, n_replacements=0, **options)
    assert info["stop_reason"] == "no_decrease" and info["residual"] > 0.1
    found, info = minibatch_search(X, Y, start, par, **options)
    (replacement,) = info["replacements"]
    assert replacement["kept"] and replacement["residual_before"] > 0.1
    assert info["stop_reason"] == "residual" and info["residual"] <= 1e-2
    # query heads sharing a key head are not replaced one by one
    grouped = FactoredHeads(2, 8, 2, causal=True, rope_theta=10.0, n_kv_heads=1)
    Q, K, V = par.factors(start)
    shared = np.concatenate([Q.ravel(), K[:1].ravel(), V.ravel()])
    _, info = minibatch_search(X, Y, shared, grouped, **options)
    assert info["stop_reason"] == "no_decrease" and info["replacements"] == []


def test_a_stall_with_every_head_contributing_replaces_nothing():
    """Noise sets the floor: the search stalls above its target with both real
    heads found, each explaining far more than is left, and none is replaced."""
    X, Y, truth = planted(2000, 4, 8, 2, 2, 8, seed=6)
    noisy = Y + 0.3 * Y.std() * np.random.default_rng(0).normal(size=Y.shape)
    par = FactoredHeads(2, 8, 2)
    _, info = minibatch_search(
        X, noisy, truth, par, batch_size=64, check_every=25, random_state=0
    )
    assert info["stop_reason"] == "no_decrease" and info["residual"] > 0.1
    assert info["replacements"] == []


def test_head_contributions_finds_a_useless_head():
    X, Y, truth = planted(300, 4, 8, 2, 2, 8, seed=7)
    par = FactoredHeads(2, 8, 2)
    residual, without = head_contributions(X, Y, truth, par)
    # exact but for the tiny ridge of the batch solve
    assert residual < 1e-8 and np.all(without > 0.05)
    # a zero head explains nothing
    residual, without = head_contributions(X, Y, dead_head_start(truth, par), par)
    assert residual > 0.05
    assert without[0] > residual + 0.05
    np.testing.assert_allclose(without[1], residual, rtol=1e-6)


def test_minibatch_search_draws_batches_by_weight():
    """Zero-weight examples are never drawn: what their targets are changes
    nothing, to the bit."""
    X, Y, _ = planted(400, 3, 5, 2, 2, 6, seed=5)
    weights = np.r_[np.ones(200), np.zeros(200)]
    par = FactoredHeads(2, 5, 2)
    start = np.random.default_rng(0).normal(size=par.size) / 4
    kwargs = dict(sample_weight=weights, batch_size=32, max_steps=100, random_state=0)
    results = []
    for garbage in (1e6, -1e6):
        Y_bad = Y.copy()
        Y_bad[200:] = garbage
        results.append(minibatch_search(X, Y_bad, start, par, **kwargs))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[0][1]["residuals"] == results[1][1]["residuals"]
    assert results[0][1]["residual"] < results[0][1]["residuals"][0]


def test_an_interrupted_search_resumes_to_the_uninterrupted_result(
    tmp_path, monkeypatch
):
    # issue 64: a search of hours (MiniLM layer 4 at k = 64 on 2 cores) started
    # again at step 0 after each interruption; its Adam runs now keep their state
    # at checks, and a run interrupted in the first Adam run or in the one after
    # a head replacement ends with the uninterrupted run's bits
    from skattn.solvers._checkpoints import StageMemory
    from skattn.solvers.stages import _search

    X, Y, truth = planted(2000, 4, 8, 2, 2, 8, seed=6)
    par = FactoredHeads(2, 8, 2)
    start = dead_head_start(truth, par)
    options = dict(batch_size=64, stop_residual=1e-2, check_every=25)
    expected, info = minibatch_search(X, Y, start, par, random_state=0, **options)
    assert len(info["replacements"]) == 1  # two Adam runs
    gradient = _search.batch_loss_gradient
    for stop_at in (60, info["n_steps"] - 30):
        calls = [0]

        def interrupted(*args, calls=calls, stop_at=stop_at, **kwargs):
            calls[0] += 1
            if calls[0] == stop_at:
                raise KeyboardInterrupt
            return gradient(*args, **kwargs)

        def memory(stop_at=stop_at):
            kept = StageMemory(tmp_path / str(stop_at), {}, (X,))
            kept.iterate_interval = 0.0  # keep every check
            return kept

        monkeypatch.setattr(_search, "batch_loss_gradient", interrupted)
        with pytest.raises(KeyboardInterrupt):
            minibatch_search(
                X, Y, start, par, random_state=0, memory=memory(), **options
            )
        monkeypatch.setattr(_search, "batch_loss_gradient", gradient)
        again = memory()
        found, resumed = minibatch_search(
            X, Y, start, par, random_state=0, memory=again, **options
        )
        assert again.reused  # a kept state was read back
        np.testing.assert_array_equal(found, expected)
        assert resumed == info
