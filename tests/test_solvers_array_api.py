"""The random-start path in other array namespaces (array-api-strict, torch on the
CPU): every stage and ``fit_from_random_starts`` give numpy's fit, their arrays in
the input's namespace, their records Python numbers (``stages/``, ``_driver.py``).

Fits are compared where they are identified: with tokens ``[x, 1]`` the column of
the constant key coordinate of every ``Theta_i`` only shifts a row of logits, which
the softmax cancels; no stage moves it on purpose, and from the search's Adam steps
(which move every coordinate by about its step size, zero gradients included) or
the Levenberg-Marquardt steps it ends wherever rounding took it.  There the
predictions and the other columns are compared.
"""

import functools

import numpy as np
import pytest
from _helpers import (
    array_namespaces,
    factored_planted,
    fail_problems,
    planted,
    refine_planted,
)
from _helpers import search_planted as search_data
from scipy.optimize import linear_sum_assignment

import skattn.solvers.stages._search as search_module
from skattn.layer._math import forward
from skattn.solvers import (
    FactoredHeads,
    PolishOptions,
    RandomStartOptions,
    fit_from_random_starts,
)
from skattn.solvers.kernels._varpro import _intercept_direction
from skattn.solvers.stages._polish import polish, staged_polish
from skattn.solvers.stages._refine import refine_heads
from skattn.solvers.stages._rounds import decoupled_refine
from skattn.solvers.stages._search import head_contributions, minibatch_search
from skattn.utils._array_api import namespace, to_numpy

pytestmark = pytest.mark.parametrize("to_array", array_namespaces())

TOLERANCE = 1e-10


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def assert_in_namespace(like, *arrays):
    for array in arrays:
        assert namespace(array) is namespace(like)


def assert_python_numbers(record):
    """Every leaf of an info dict is a Python number, string, bool or None (a
    numpy scalar passes as its float; no array of any namespace)."""
    if isinstance(record, dict):
        for value in record.values():
            assert_python_numbers(value)
    elif isinstance(record, (list, tuple)):
        for value in record:
            assert_python_numbers(value)
    else:
        assert record is None or isinstance(record, (bool, int, float, str)), record


def assert_same_layer(X, got, expected, intercept):
    """``got`` (namespace arrays) is ``expected`` (numpy) up to the order of the
    heads: the same predictions, and the same attention but for the constant key
    coordinate's column (see above)."""
    attention, projection = (to_numpy(a) for a in got)
    cut = slice(None, -1) if intercept else slice(None)
    cost = np.linalg.norm(
        attention[:, None, :, cut] - expected[0][None, :, :, cut], axis=(2, 3)
    )
    order = linear_sum_assignment(cost)[1].argsort()  # got's head i is expected's
    attention, projection = attention[order], projection[order]
    assert relative(attention[:, :, cut], expected[0][:, :, cut]) <= TOLERANCE
    prediction = forward(X, attention, projection)
    assert relative(prediction, forward(X, *expected)) <= TOLERANCE
    if not intercept:
        assert relative(projection, expected[1]) <= TOLERANCE


def _search_case(weighted):
    """``(X, Y, start, par, weights, fixed)`` of the minibatch search compared."""
    X, Y, truth = search_data(300, 3, 5, 2, 2, 6, seed=1)
    par = FactoredHeads(2, 5, 2)
    rng = np.random.default_rng(0)
    start = truth + 0.3 * rng.normal(size=par.size)
    weights = rng.uniform(0.5, 2.0, size=300) if weighted else None
    fixed = rng.normal(size=(300, 3, 2)) if weighted else None
    return X, Y, start, par, weights, fixed


def _both_searches(to_array, weighted, **options):
    """numpy's search and the namespace's (halves of each batch in threads)."""
    X, Y, start, par, weights, fixed = _search_case(weighted)
    expected = minibatch_search(
        X,
        Y,
        start,
        par,
        sample_weight=weights,
        fixed_columns=fixed,
        random_state=0,
        **options,
    )
    found = minibatch_search(
        to_array(X),
        to_array(Y),
        to_array(start),
        par,
        sample_weight=None if weights is None else to_array(weights),
        fixed_columns=None if fixed is None else to_array(fixed),
        random_state=0,
        n_jobs=2,  # the halves of each batch in threads (torch on the CPU too)
        **options,
    )
    assert_in_namespace(to_array(X), found[0])
    assert_python_numbers(found[1])
    return expected, found


@pytest.mark.parametrize("weighted", [False, True])
def test_one_minibatch_search_step_is_numpys(to_array, weighted):
    # one Adam step on the same batch, in float64: the same arithmetic to rounding
    options = dict(batch_size=64, max_steps=1, check_every=1, dtype=np.float64)
    (expected, expected_info), (found, info) = _both_searches(
        to_array, weighted, **options
    )
    assert info["n_steps"] == expected_info["n_steps"] == 1
    assert relative(to_numpy(found), expected) <= 1e-12
    np.testing.assert_allclose(
        info["residuals"], expected_info["residuals"], rtol=1e-12
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_minibatch_search_gets_as_far_as_numpys(to_array, weighted):
    # sixty steps compared by where they get, not step by step: both cut the
    # residual by ten and end at the same level (1 %)
    options = dict(batch_size=64, max_steps=60, check_every=10, dtype=np.float64)
    (_, expected_info), (_, info) = _both_searches(to_array, weighted, **options)
    for record in (info, expected_info):
        assert record["residuals"][-1] <= 0.1 * record["residuals"][0]
    assert info["residuals"][-1] == pytest.approx(
        expected_info["residuals"][-1], rel=1e-2
    )


def test_minibatch_search_replaces_a_head_and_computes_in_float32(
    to_array, monkeypatch
):
    # a third head that explains nothing is replaced (its search alone cut short
    # here); the products stay single precision in the namespace, the parameters
    # double
    X, Y, truth = search_data(300, 3, 5, 2, 2, 6, seed=2)
    par = FactoredHeads(3, 5, 2)
    rng = np.random.default_rng(2)
    start = np.concatenate(
        [
            np.concatenate([f.reshape(2, 5, 2), rng.normal(size=(1, 5, 2))]).ravel()
            for f in np.split(truth, 3)
        ]
    )
    start += 0.2 * rng.normal(size=par.size)
    seen = set()
    forward_part, alone = search_module._part_forward, search_module._search_alone

    def recording(X_part, *args, **kwargs):
        seen.add(str(X_part.dtype))
        return forward_part(X_part, *args, **kwargs)

    def quick(*args, **options):
        return alone(*args, max_steps=50, **options)

    monkeypatch.setattr(search_module, "_part_forward", recording)
    monkeypatch.setattr(search_module, "_search_alone", quick)
    found, info = minibatch_search(
        to_array(X),
        to_array(Y),
        to_array(start),
        par,
        batch_size=64,
        max_steps=200,
        check_every=10,
        patience=1,
        n_decays=0,
        n_replacements=1,
        stop_residual=1e-6,
        random_state=2,
    )
    assert len(info["replacements"]) == 1
    assert_in_namespace(to_array(X), found)
    assert seen and all("float32" in dtype for dtype in seen)
    assert "float64" in str(found.dtype)
    assert_python_numbers(info)
    residual, without = head_contributions(
        to_array(X[:100]), to_array(Y[:100]), to_array(start), par
    )
    expected_residual, expected_without = head_contributions(
        X[:100], Y[:100], start, par
    )
    assert_in_namespace(to_array(X), without)
    assert abs(residual - expected_residual) <= TOLERANCE * expected_residual
    assert relative(to_numpy(without), expected_without) <= TOLERANCE


def test_decoupled_refine(to_array):
    X, Y, truth, _ = refine_planted(250, 4, 5, 2, 2, 5, seed=4)
    par = FactoredHeads(2, 6, 2)
    start = truth + 0.05 * np.random.default_rng(5).normal(size=truth.size)
    direction = _intercept_direction(X)
    expected, expected_info = decoupled_refine(
        X, Y, start, par, intercept_direction=direction
    )
    refined, info = decoupled_refine(
        to_array(X), to_array(Y), to_array(start), par, intercept_direction=direction
    )
    assert_in_namespace(to_array(X), refined)
    assert info["residual"] < 1e-10 and expected_info["residual"] < 1e-10
    cut = (slice(None), slice(None), slice(None, -1))
    attention = par.attention(to_numpy(refined))
    assert relative(attention[cut], par.attention(expected)[cut]) <= TOLERANCE
    assert_python_numbers(info)


def test_refine_heads_with_a_head_searched_afresh(to_array, monkeypatch):
    # head 1's problem "fails" once: it is searched afresh on its own problem and
    # refined again, in the namespace
    X, Y, truth, _ = refine_planted(300, 4, 5, 2, 2, 5, seed=6, intercept=False)
    par = FactoredHeads(2, 5, 2)
    start = truth + 0.05 * np.random.default_rng(7).normal(size=truth.size)
    results = []
    for arrays in (lambda a: a, to_array):
        left = [1]  # head 1's first problem fails

        def fails(head, left=left):
            if head == 1 and left[0]:
                left[0] -= 1
                return True
            return False

        fail_problems(monkeypatch, fails)
        results.append(
            refine_heads(
                arrays(X),
                arrays(Y),
                arrays(start),
                par,
                None,
                None,
                np.random.RandomState(0),
                0,
            )
        )
        monkeypatch.undo()
    (expected, expected_info), (refined, info) = results
    assert info["replacements"] == expected_info["replacements"] != []
    assert_in_namespace(to_array(X), refined)
    assert relative(par.attention(to_numpy(refined)), par.attention(expected)) <= (
        TOLERANCE
    )
    assert_python_numbers(info)


@pytest.mark.parametrize(
    "case",
    ["dense", "low rank, principal outputs", "factored values with an intercept"],
)
def test_staged_polish(to_array, case):
    intercept = case == "factored values with an intercept"
    if case == "dense":
        X, Y, attention, _ = planted(200, 3, 3, 2, 4, seed=1)
        options = {}
    elif case == "low rank, principal outputs":
        X, Y, attention, _ = planted(300, 3, 6, 2, 30, rank=2, seed=8)
        options = {"head_rank": 2}  # 2 (2 + 9) <= 30: the warm-up's output basis
    else:
        X, Y, truth = factored_planted(300, 3, 4, 2, 2, 8, seed=3, intercept=True)
        attention = FactoredHeads(2, 5, 2).attention(truth)
        options = {"head_rank": 2, "factor_values": True, "intercept": True}
    start = attention + 0.01 * np.random.default_rng(0).normal(size=attention.shape)
    expected = staged_polish(
        X, Y, start, n_warmup_samples=120, random_state=0, **options
    )
    got = staged_polish(
        to_array(X),
        to_array(Y),
        to_array(start),
        n_warmup_samples=120,
        random_state=0,
        **options,
    )
    assert_in_namespace(to_array(X), *got[:2])
    assert got[2]["relative_residual"] < 1e-10
    assert got[2]["final_stage"] == expected[2]["final_stage"]
    assert_same_layer(X, got[:2], expected[:2], intercept)
    assert_python_numbers(got[2])


def test_polish_by_lbfgs_runs_on_host_copies(to_array):
    # scipy's L-BFGS-B: the polish on host copies, the layer moved back
    X, Y, attention, _ = planted(100, 3, 3, 1, seed=2)
    start = attention + 0.01
    expected = polish(X, Y, start, method="lbfgs", solver="dense", max_iter=20)
    got = polish(
        to_array(X),
        to_array(Y),
        to_array(start),
        method="lbfgs",
        solver="dense",
        max_iter=20,
    )
    assert got[2]["host_copy"] and "host_copy" not in expected[2]
    assert_in_namespace(to_array(X), *got[:2])
    np.testing.assert_array_equal(to_numpy(got[0]), expected[0])


def fits():
    """``(X, Y, n_heads, options, intercept)`` of the planted fits compared."""
    full = planted(200, 3, 3, 2, seed=2)
    low = planted(300, 3, 6, 2, 6, rank=2, seed=8)
    factored = factored_planted(250, 3, 4, 2, 2, 8, seed=3, intercept=True)
    searched = search_data(200, 3, 5, 2, 2, 5, seed=1)
    return {
        "full rank": (*full[:2], 2, {}, False),
        "low rank": (
            *low[:2],
            2,
            {"polish": PolishOptions(head_rank=2), "n_warmup_samples": 150},
            False,
        ),
        "factored values, intercept": (
            *factored[:2],
            2,
            {"polish": PolishOptions(head_rank=2, factor_values=True, intercept=True)},
            True,
        ),
        "search and decoupled heads": (
            *searched[:2],
            2,
            {
                "polish": PolishOptions(head_rank=2, factor_values=True),
                "starts": RandomStartOptions(start_search="minibatch"),
            },
            False,
        ),
    }


@functools.cache
def numpy_fit(case):
    """numpy's fit of ``case`` (once for all namespaces)."""
    X, Y, n_heads, options, _ = fits()[case]
    return fit_from_random_starts(X, Y, n_heads, random_state=0, **options)


@pytest.mark.parametrize("case", list(fits()))
def test_fit_from_random_starts(to_array, case):
    X, Y, n_heads, options, intercept = fits()[case]
    expected = numpy_fit(case)
    got = fit_from_random_starts(
        to_array(X), to_array(Y), n_heads, random_state=0, **options
    )
    assert_in_namespace(to_array(X), *got[:2])
    # both exact: the same layer (how many starts it took is the path, not the
    # outcome)
    assert got[2]["relative_residual"] < 1e-10
    assert expected[2]["relative_residual"] < 1e-10
    assert_same_layer(X, got[:2], expected[:2], intercept)
    assert_python_numbers(got[2])
