"""estimator_to_numpy: a fitted estimator's arrays as numpy copies on the host."""

import numpy as np
import pytest
from _helpers import array_namespaces, planted

import skattn
from skattn import AttentionLayer, MultiHeadAttentionRegressor
from skattn.utils import estimator_to_numpy
from skattn.utils._array_api import to_numpy


def _fitted():
    X, Y = planted(200, 3, 4, 1, d_out=5, seed=0)[:2]
    X, Y = X.reshape(200, -1), Y.reshape(200, -1)
    est = MultiHeadAttentionRegressor(n_tokens=3, init="random", random_state=0)
    return est.fit(X, Y), X


def test_a_numpy_fit_gives_an_independent_equal_copy():
    est, X = _fitted()
    moved = estimator_to_numpy(est)
    assert type(moved) is type(est) and moved.get_params() == est.get_params()
    for name in ("attention_", "projection_", "key_bias_", "intercept_"):
        np.testing.assert_array_equal(getattr(moved, name), getattr(est, name))
        assert not np.shares_memory(getattr(moved, name), getattr(est, name))
    np.testing.assert_array_equal(moved.predict(X), est.predict(X))
    assert moved.layer_ is not est.layer_
    assert moved.phase_report_ is not est.phase_report_
    moved.attention_[0, 0, 0] += 1.0  # the original is left as it was
    assert moved.attention_[0, 0, 0] != est.attention_[0, 0, 0]


@pytest.mark.parametrize("to_array", array_namespaces())
def test_arrays_of_any_namespace_become_numpy_everywhere(to_array):
    est = MultiHeadAttentionRegressor()
    values = np.arange(6.0).reshape(2, 3)
    est.attention_ = to_array(values)
    est.factors_ = (to_array(values), to_array(values[0]))
    est.model_selection_ = {"candidates": [{"error": to_array(values[1])}], "n": 2}
    est.layer_ = AttentionLayer(to_array(np.ones((1, 2, 2))), np.ones((1, 2, 3)))
    moved = estimator_to_numpy(est)
    assert isinstance(moved.attention_, np.ndarray)
    np.testing.assert_array_equal(moved.attention_, values)
    assert type(moved.factors_) is tuple
    assert all(isinstance(factor, np.ndarray) for factor in moved.factors_)
    error = moved.model_selection_["candidates"][0]["error"]
    np.testing.assert_array_equal(error, values[1])
    assert moved.model_selection_["n"] == 2
    assert isinstance(moved.layer_, AttentionLayer)
    assert isinstance(moved.layer_.attention, np.ndarray)
    # the source keeps its arrays
    assert not isinstance(est.attention_, np.ndarray)
    np.testing.assert_array_equal(to_numpy(est.attention_), values)


def test_torch_memory_is_not_shared():
    torch = pytest.importorskip("torch")
    est = MultiHeadAttentionRegressor()
    est.attention_ = torch.zeros(2, 2, dtype=torch.float64)
    moved = estimator_to_numpy(est)
    moved.attention_[0, 0] = 5.0
    assert float(est.attention_[0, 0]) == 0.0


def test_an_unfitted_estimator_and_shared_objects():
    moved = estimator_to_numpy(MultiHeadAttentionRegressor(n_heads=2))
    assert moved.get_params()["n_heads"] == 2
    est = MultiHeadAttentionRegressor()
    shared = np.ones(3)
    est.a_, est.b_ = shared, [shared]
    moved = estimator_to_numpy(est)
    assert moved.b_[0] is moved.a_  # shared stays shared (one copy)


def test_the_helper_is_public():
    assert skattn.estimator_to_numpy is estimator_to_numpy
    assert "estimator_to_numpy" in skattn.__all__
