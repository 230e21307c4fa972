"""Mini-batch Adam on all parameters of a layer (``optimizers/_adam.py``)."""

import numpy as np
from _helpers import planted

from skattn.solvers import STOP_REASONS
from skattn.solvers.optimizers._adam import _adam_epoch, _adam_state, _fit_adam


def _start(attention, projection, seed=0):
    rng = np.random.default_rng(seed)
    return (
        0.3 * rng.normal(size=attention.shape),
        0.3 * rng.normal(size=projection.shape),
    )


def test_adam_epochs_decrease_the_loss():
    X, Y, attention, projection = planted(256, 3, 4, 1, 4, seed=2)
    att, proj = _start(attention, projection)
    state = _adam_state(att, proj)
    weight = np.ones(256)
    losses = []
    for epoch in range(30):
        att, proj, loss = _adam_epoch(
            X, Y, weight, att, proj, state, 0.0, 1e-2, 32, np.random.default_rng(epoch)
        )
        losses.append(loss)
    assert state["step"] == 30 * 256 // 32  # one step per batch
    assert losses[-1] < 1e-2 * losses[0]
    assert losses[9] < losses[0]


def test_adam_epoch_skips_batches_of_zero_weight():
    # batches of one example: the 32 of zero weight take no step, and their
    # targets change nothing, to the bit
    X, Y, attention, projection = planted(64, 3, 4, 1, 4, seed=3)
    weight = np.r_[np.ones(32), np.zeros(32)]
    results = []
    for garbage in (1e6, -1e6):
        Y_bad = Y.copy()
        Y_bad[32:] = garbage
        att, proj = _start(attention, projection)
        state = _adam_state(att, proj)
        rng = np.random.default_rng(0)
        epoch = _adam_epoch(X, Y_bad, weight, att, proj, state, 0.1, 1e-2, 1, rng)
        assert state["step"] == 32
        results.append(epoch)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_fit_adam_stops_on_its_budget_or_when_the_loss_stalls():
    X, Y, attention, projection = planted(256, 3, 4, 1, 4, seed=2)
    att, proj = _start(attention, projection)
    weight = np.ones(256)

    def fit(max_iter, tol, n_iter_no_change):
        return _fit_adam(
            X,
            Y,
            weight,
            att,
            proj,
            _adam_state(att, proj),
            0.0,
            1e-2,
            32,
            max_iter,
            tol,
            n_iter_no_change,
            np.random.default_rng(0),
        )

    *_, curve, n_iter, reason = fit(3, 0.0, 10)
    assert reason == "max_iter" and n_iter == len(curve) == 3
    assert reason in STOP_REASONS and curve[-1] < curve[0]
    # an improvement of 1e3 is never reached: the loss "stalls" from epoch one
    *_, curve, n_iter, reason = fit(50, 1e3, 2)
    assert reason == "no_decrease" and n_iter == len(curve) == 3
    assert reason in STOP_REASONS
