"""One vocabulary of stop reasons for every optimizer and stage (``_stop.py``)."""

import numpy as np
import pytest
from _helpers import factored_planted, planted, refine_planted

from skattn.solvers import (
    STOP_REASONS,
    FactoredHeads,
    FullRank,
    minibatch_search,
    polish,
    varpro_least_squares,
)
from skattn.solvers._stop import check_stop_reason
from skattn.solvers.optimizers._adam import _adam_state, _fit_adam
from skattn.solvers.optimizers._lbfgs import lbfgs_layer, lbfgs_reduced
from skattn.solvers.optimizers._lm_dense import _varpro_levenberg_marquardt
from skattn.solvers.stages._polish import staged_polish


def test_stop_reasons_are_words_with_a_meaning():
    for word, meaning in STOP_REASONS.items():
        assert word.isidentifier() and word.islower()
        assert meaning.split(":")[0] in ("converged", "stopped", "nothing to do")
        assert check_stop_reason(word) == word
    with pytest.raises(AssertionError, match="not one of"):
        check_stop_reason("CONVERGENCE: NORM OF PROJECTED GRADIENT <= PGTOL")


def _layer():
    X, Y, attention, projection = planted(100, 3, 3, 2, 3, seed=4)
    start = attention + 0.1 * np.random.default_rng(5).normal(size=attention.shape)
    return X, Y, start, projection


def _factored():
    X, Y, truth = factored_planted(100, 3, 3, 2, 1, 4, seed=6, intercept=True)
    start = truth + 0.1 * np.random.default_rng(7).normal(size=truth.size)
    return X, Y, start, FactoredHeads(2, 4, 1)


def _reasons(run):
    """Every ``stop_reason`` of ``run()``'s report, its stages' and heads' too."""
    info = run()
    records = [info, *info.get("stages", []), *(info.get("heads") or [])]
    return [r["stop_reason"] for r in records if r and "stop_reason" in r]


def _lm_dense(max_iter):
    X, Y, start, _ = _layer()
    return _varpro_levenberg_marquardt(X, Y, start, None, 0.0, None, max_iter, 1e-10)[2]


def _lm_matrix_free(max_iter, stop_below=None):
    X, Y, start, _ = _layer()
    par = FullRank(2, 3)
    return varpro_least_squares(
        X,
        Y,
        par.from_attention(start),
        par,
        max_iter=max_iter,
        stop_below=stop_below,
    )[2]


def _lbfgs_layer(max_iter):
    X, Y, start, projection = _layer()
    return lbfgs_layer(X, Y, start, projection, None, 0.0, max_iter, 1e-10)[2]


def _lbfgs_reduced(max_iter):
    X, Y, start, _ = _layer()
    return lbfgs_reduced(X, Y, start, None, 0.0, None, max_iter, 1e-10)[2]


def _adam(max_iter, tol):
    X, Y, start, projection = _layer()
    *_, reason = _fit_adam(
        X,
        Y,
        np.ones(len(X)),
        start,
        projection,
        _adam_state(start, projection),
        0.0,
        1e-3,
        25,
        max_iter,
        tol,
        2,
        np.random.default_rng(0),
    )
    return {"stop_reason": reason}


def _polish(method, mode):
    X, Y, start, _ = _layer()
    return polish(X, Y, start, method=method, mode=mode, max_iter=50)[2]


def _staged_polish():
    X, Y, start, _ = _layer()
    return staged_polish(X, Y, start, n_warmup_samples=50, random_state=0)[2]


def _search(max_steps, stop_residual):
    X, Y, start, par = _factored()
    return minibatch_search(
        X,
        Y,
        start,
        par,
        batch_size=20,
        max_steps=max_steps,
        check_every=10,
        stop_residual=stop_residual,
        random_state=0,
    )[1]


RUNS = {
    "lm-dense": (lambda: _lm_dense(100), None),
    "lm-dense-budget": (lambda: _lm_dense(1), "max_iter"),
    "lm-matrix-free": (lambda: _lm_matrix_free(100), None),
    "lm-matrix-free-budget": (lambda: _lm_matrix_free(1), "max_iter"),
    "lm-matrix-free-start": (lambda: _lm_matrix_free(100, stop_below=1.0), "start"),
    "lbfgs-layer": (lambda: _lbfgs_layer(200), None),
    "lbfgs-layer-budget": (lambda: _lbfgs_layer(1), "max_iter"),
    "lbfgs-reduced": (lambda: _lbfgs_reduced(200), None),
    "adam-budget": (lambda: _adam(3, 0.0), "max_iter"),
    "adam-stalled": (lambda: _adam(50, 1e3), "no_decrease"),
    "polish-lm": (lambda: _polish("levenberg-marquardt", "varpro"), None),
    "polish-lbfgs-both": (lambda: _polish("lbfgs", "both"), None),
    "staged-polish": (_staged_polish, None),
    "search-budget": (lambda: _search(40, 0.0), "max_iter"),
    "search-target": (lambda: _search(40, 1.0), "residual"),
}


@pytest.mark.parametrize("name", RUNS)
def test_every_optimizer_and_stage_reports_a_word_of_the_vocabulary(name):
    run, expected = RUNS[name]
    reasons = _reasons(run)
    assert reasons
    for reason in reasons:
        assert check_stop_reason(reason) == reason
    if expected is not None:
        assert reasons[0] == expected


def test_the_per_head_refinement_reports_each_heads_stop_reason():
    from skattn.solvers import decoupled_refine
    from skattn.solvers.kernels._varpro import _intercept_direction

    X, Y, truth, _ = refine_planted(300, 5, 5, 3, 2, 6, seed=12)
    start = truth + 0.03 * np.random.default_rng(13).normal(size=truth.size)
    _, info = decoupled_refine(
        X, Y, start, FactoredHeads(3, 6, 2), intercept_direction=_intercept_direction(X)
    )
    reasons = [head["stop_reason"] for head in info["heads"]]
    assert len(reasons) == 3
    assert all(check_stop_reason(reason) for reason in reasons)
