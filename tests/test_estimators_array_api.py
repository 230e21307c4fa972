"""MultiHeadAttentionRegressor on scikit-learn's array API route.

Under ``sklearn.config_context(array_api_dispatch=True)`` the estimator fits,
predicts and scores torch tensors and array-api-strict arrays in their own
namespace (the random-start path on their device, the numpy-only phases on host
copies), and gives numpy's fitted layer.

scikit-learn refuses the dispatch unless ``SCIPY_ARRAY_API=1`` was set before
scipy was imported: the root ``conftest.py`` sets it first thing, so that these
tests (and scikit-learn's array-API estimator checks in ``test_common.py``) run;
with the variable unset or set otherwise the in-process tests are skipped, and
:func:`test_the_route_works_in_a_fresh_interpreter` still runs the route in a
subprocess that sets it.
"""

import os
import subprocess
import sys
import warnings
from functools import partial
from unittest import SkipTest

import numpy as np
import pytest
from _helpers import array_namespaces, planted, refine_planted
from sklearn import config_context
from sklearn.utils.estimator_checks import check_array_api_input_and_values

from skattn import (
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
)
from skattn.layer._math import forward
from skattn.utils import estimator_to_numpy
from skattn.utils._array_api import device, namespace, to_numpy

DISPATCH = os.environ.get("SCIPY_ARRAY_API") == "1"
needs_dispatch = pytest.mark.skipif(
    not DISPATCH,
    reason="array_api_dispatch needs SCIPY_ARRAY_API=1 before scipy is imported "
    "(the root conftest.py sets it; see the subprocess test)",
)

# The fitted arrays, in the model's coordinates and beyond.
LAYER = ("attention_", "projection_", "key_bias_", "intercept_")


def _intercept_data(n=300, k=3, d=4, d_out=5, seed=3):
    """A planted one-head layer with a key bias and an output intercept."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, k, d))
    attention = rng.normal(size=(1, d, d)) / d
    projection = rng.normal(size=(1, d, d_out))
    key_bias, intercept = rng.normal(size=(1, d)), rng.normal(size=d_out)
    Y = forward(X, attention, projection, key_bias=key_bias, intercept=intercept)
    return X, Y


def _search_data():
    """Low-rank heads on Gaussian tokens with an intercept (the minibatch search
    and the per-head refinement): tokens without the constant coordinate."""
    X, Y, _, _ = refine_planted(300, 6, 6, 2, 2, 6, seed=9)
    return X[..., :-1], Y


# name -> (parameters, data): every case is realisable and fits exactly
CASES = {
    "full-rank": (
        {"n_heads": 2, "n_tokens": 3},
        lambda: planted(200, 3, 4, 2, d_out=6, seed=0)[:2],
    ),
    "head-rank": (
        {"n_heads": 2, "n_tokens": 3, "head_rank": 2},
        lambda: planted(300, 3, 6, 2, d_out=6, seed=1, rank=2)[:2],
    ),
    "intercept": (
        {"n_heads": 1, "n_tokens": 3, "fit_intercept": True},
        _intercept_data,
    ),
    "search": (
        {
            "n_heads": 2,
            "n_tokens": 6,
            "head_rank": 2,
            "start_search": "minibatch",
            "fit_intercept": True,
        },
        _search_data,
    ),
}


def _flat(A):
    return A.reshape(A.shape[0], -1)


def _relative(a, b):
    """``||a - b|| / ||b||`` (absolute when b is zero)."""
    scale = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (scale if scale > 0 else 1.0)


_NUMPY_FITS = {}


def _numpy_fit(case):
    """The numpy fit of a case (once per session) and its data."""
    if case not in _NUMPY_FITS:
        params, data = CASES[case]
        X, Y = (_flat(A) for A in data())
        est = MultiHeadAttentionRegressor(init="random", random_state=0, **params)
        _NUMPY_FITS[case] = est.fit(X, Y), X, Y
    return _NUMPY_FITS[case]


def _assert_in(value, like, name):
    """``value`` is in the namespace and on the device of ``like``."""
    assert namespace(value) is namespace(like), name
    assert device(value) == device(like), name


@needs_dispatch
@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("case", list(CASES))
def test_fit_predict_score_give_numpys_layer(case, to_array):
    reference, X, Y = _numpy_fit(case)
    Xa, Ya = to_array(X), to_array(Y)
    est = MultiHeadAttentionRegressor(init="random", random_state=0, **CASES[case][0])
    with config_context(array_api_dispatch=True):
        est.fit(Xa, Ya)
        predicted = est.predict(Xa)
        score = est.score(Xa, Ya)
    # both fits exact: the same layer up to the order of the heads (compared head
    # by head, matched; never the path there, which float32 stages and another
    # BLAS may change)
    for name in LAYER + ("projection_sum_",):
        _assert_in(getattr(est, name), Xa, name)
    assert reference.phase_report_[-1].info["relative_residual"] < 1e-10
    errors = parameter_error(reference, estimator_to_numpy(est))
    for name in ("attention", "projection", "key_bias", "intercept"):
        assert getattr(errors, f"{name}_error") <= 1e-10, name
    assert _relative(to_numpy(est.projection_sum_), reference.projection_sum_) <= 1e-10
    if "head_rank" in CASES[case][0]:
        for factor in est.factors_:
            _assert_in(factor, Xa, "factors_")
    _assert_in(predicted, Xa, "predict")
    assert _relative(to_numpy(predicted), reference.predict(X)) <= 1e-10
    assert isinstance(score, float)
    assert score == pytest.approx(reference.score(X, Y), abs=1e-12)
    # the report is a host record; the layer a numpy AttentionLayer
    assert est.phase_report_[-1].info["relative_residual"] < 1e-10
    assert isinstance(est.layer_.attention, np.ndarray)
    # the helper: numpy copies equal to the fitted arrays
    moved = estimator_to_numpy(est)
    for name in LAYER:
        assert isinstance(getattr(moved, name), np.ndarray), name
        np.testing.assert_array_equal(
            getattr(moved, name), to_numpy(getattr(est, name))
        )
    # numpy's forward against the namespace's: equal up to rounding
    assert _relative(moved.predict(X), to_numpy(predicted)) <= 1e-12


@needs_dispatch
@pytest.mark.parametrize("to_array", array_namespaces())
def test_3d_input_and_weights_stay_in_the_namespace(to_array):
    reference, X, Y = _numpy_fit("full-rank")
    weights = np.linspace(0.5, 1.5, len(X))
    X3 = X.reshape(len(X), 3, -1)
    est = MultiHeadAttentionRegressor(n_heads=2, init="random", random_state=0)
    with config_context(array_api_dispatch=True):
        est.fit(to_array(X3), to_array(Y), sample_weight=to_array(weights))
        predicted = est.predict(to_array(X3))
    _assert_in(est.attention_, to_array(X3), "attention_")
    expected = MultiHeadAttentionRegressor(n_heads=2, init="random", random_state=0)
    expected.fit(X3, Y, sample_weight=weights)
    assert _relative(to_numpy(est.attention_), expected.attention_) <= 1e-10
    assert _relative(to_numpy(predicted), expected.predict(X3)) <= 1e-10


@needs_dispatch
@pytest.mark.parametrize("to_array", array_namespaces())
def test_phases_run_on_host_copies_and_the_fit_says_so(to_array):
    X, y = make_attention_regression(1000, 3, 4, 1, n_outputs=6, random_state=0)
    params = {"n_heads": 1, "n_tokens": 3, "init": "phased", "random_state": 0}
    reference = MultiHeadAttentionRegressor(**params).fit(X, y)
    est = MultiHeadAttentionRegressor(**params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the polish converged: a note, no warning
        with config_context(array_api_dispatch=True):
            est.fit(to_array(X), to_array(y))
    start = est.phase_report_[0]
    assert start.info["init"] == "phased"
    assert "numpy copies" in start.info["host_copies"]
    hull = [r for r in est.phase_report_ if r.phase == "2-4-hull-selected"][0]
    assert any("numpy copies" in note for note in hull.info["notes"])
    for name in LAYER + ("hull_point_", "hull_directions_", "projection_sum_"):
        _assert_in(getattr(est, name), to_array(X), name)
    assert _relative(to_numpy(est.attention_), reference.attention_) <= 1e-10
    assert _relative(to_numpy(est.projection_), reference.projection_) <= 1e-10
    np.testing.assert_array_equal(to_numpy(est.hull_point_), reference.hull_point_)


@needs_dispatch
@pytest.mark.parametrize("to_array", array_namespaces())
def test_the_head_search_runs_on_host_copies(to_array):
    X, y = make_attention_regression(300, 3, 4, 2, n_outputs=8, random_state=0)
    params = {"n_heads": "auto", "n_tokens": 3, "max_heads": 3, "random_state": 0}
    reference = MultiHeadAttentionRegressor(**params).fit(X, y)
    est = MultiHeadAttentionRegressor(**params)
    with config_context(array_api_dispatch=True):
        est.fit(to_array(X), to_array(y))
        predicted = est.predict(to_array(X))
    assert est.n_heads_ == reference.n_heads_ == 2
    assert "head search" in est.phase_report_[0].info["host_copies"]
    for name in LAYER + ("projection_sum_", "hull_point_"):
        _assert_in(getattr(est, name), to_array(X), name)
    # the same host computation: the same bits
    np.testing.assert_array_equal(to_numpy(est.attention_), reference.attention_)
    assert _relative(to_numpy(predicted), reference.predict(X)) <= 1e-12


@needs_dispatch
@pytest.mark.parametrize("to_array", array_namespaces())
def test_predict_wants_the_fits_namespace(to_array):
    _, X, Y = _numpy_fit("full-rank")
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=3, init="random")
    with config_context(array_api_dispatch=True):
        est.set_params(random_state=0).fit(to_array(X), to_array(Y))
        with pytest.raises(ValueError, match=r"predict\(\) must use the same") as info:
            est.predict(X)
    # the namespaces by the names users know: torch, numpy (issue 52, point 8)
    assert "array_api_compat" not in str(info.value)
    assert "got numpy on 'cpu'" in str(info.value)
    with pytest.raises(ValueError, match="array_api_dispatch is off"):
        est.predict(to_array(X))
    # moved to numpy, it predicts numpy without the dispatch
    assert isinstance(estimator_to_numpy(est).predict(X), np.ndarray)


def test_without_dispatch_numpy_is_the_default():
    torch = pytest.importorskip("torch")
    reference, X, Y = _numpy_fit("full-rank")
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=3, init="random")
    est.set_params(random_state=0).fit(torch.asarray(X), torch.asarray(Y))
    assert isinstance(est.attention_, np.ndarray)
    np.testing.assert_array_equal(est.attention_, reference.attention_)
    assert isinstance(est.predict(torch.asarray(X)), np.ndarray)


def test_only_the_phased_learner_advertises_the_array_api():
    assert MultiHeadAttentionRegressor().__sklearn_tags__().array_api_support
    assert not GradientAttentionRegressor().__sklearn_tags__().array_api_support


@needs_dispatch
def test_the_baselines_keep_working_on_numpy_under_dispatch():
    _, X, Y = _numpy_fit("intercept")
    est = GradientAttentionRegressor(n_tokens=3, max_iter=5, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stopped after 5 iterations
        reference = est.fit(X, Y).predict(X)
        with config_context(array_api_dispatch=True):
            np.testing.assert_array_equal(est.fit(X, Y).predict(X), reference)


def _label(value):
    """A namespace, device or dtype of a check's keywords, for its id."""
    if hasattr(value, "xp"):  # scikit-learn's NamespaceAndDevice
        return f"{value.xp}@{value.device}"
    return str(value)


def _array_api_checks():
    """scikit-learn's array-API checks of the estimator, by id."""
    from sklearn.utils.estimator_checks import _yield_array_api_checks

    params = []
    for check in _yield_array_api_checks(MultiHeadAttentionRegressor()):
        keywords = check.keywords if isinstance(check, partial) else {}
        label = "-".join(_label(v) for v in keywords.values() if v is not None)
        params.append(pytest.param(check, id=f"{check.func.__name__}-{label}"))
    return params


@needs_dispatch
@pytest.mark.parametrize("check", _array_api_checks())
def test_sklearn_array_api_checks(check):
    # the default estimator: 1 token per row of make_classification's 10 columns
    try:
        check("MultiHeadAttentionRegressor", MultiHeadAttentionRegressor())
    except SkipTest as exc:  # a namespace or device this machine lacks
        pytest.skip(str(exc))


@needs_dispatch
@pytest.mark.parametrize("namespace_name", ["array_api_strict", "torch"])
def test_sklearn_array_api_values(namespace_name):
    pytest.importorskip(namespace_name)
    check_array_api_input_and_values(
        "MultiHeadAttentionRegressor",
        MultiHeadAttentionRegressor(),
        namespace_name,
        "cpu" if namespace_name == "torch" else None,  # device (named in 1.9)
    )


_SCRIPT = """
import numpy as np, torch
from sklearn import config_context
from skattn import MultiHeadAttentionRegressor, make_attention_regression
X, y = make_attention_regression(300, 2, 3, 1, n_outputs=4, random_state=0)
est = MultiHeadAttentionRegressor(n_tokens=2, init="random", random_state=0)
with config_context(array_api_dispatch=True):
    est.fit(torch.asarray(X), torch.asarray(y))
    print(type(est.predict(torch.asarray(X))).__name__, est.score(torch.asarray(X),
          torch.asarray(y)) > 0.999999)
"""


def test_the_route_works_in_a_fresh_interpreter():
    pytest.importorskip("torch")
    env = dict(os.environ, SCIPY_ARRAY_API="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["Tensor", "True"]
