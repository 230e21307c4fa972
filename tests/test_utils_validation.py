"""Token layout of X and y: flatten, unflatten, the number of tokens
(``utils/_validation.py``)."""

import numpy as np
import pytest

from skattn.utils._validation import (
    _normalized_weights,
    check_finite,
    check_fitted_tokens,
    check_no_overflow,
    flatten_tokens,
    layer_sequences,
    resolve_n_tokens,
    unflatten_tokens,
)


def test_flatten_and_unflatten_are_inverse_token_major_maps():
    X = np.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    flat, k = flatten_tokens(X)
    assert k == 3 and flat.shape == (2, 12)
    np.testing.assert_array_equal(flat[1, 4:8], X[1, 1])  # token 1 of sample 1
    np.testing.assert_array_equal(unflatten_tokens(flat, 3), X)
    # nested lists are arrays too; a 2-D X is returned as it is
    assert flatten_tokens(X.tolist())[1] == 3
    assert flatten_tokens(flat) == (flat, None)
    with pytest.raises(ValueError, match="got a 4-D array"):
        flatten_tokens(np.zeros((1, 2, 3, 4)))


def test_resolve_n_tokens_checks_the_width_and_a_3d_count():
    assert resolve_n_tokens(12, None, 3) == 3
    assert resolve_n_tokens(12, None) == 1
    assert type(resolve_n_tokens(12, np.int64(4))) is int
    with pytest.raises(ValueError, match="is 3-D with 3 tokens"):
        resolve_n_tokens(12, 4, 3)
    with pytest.raises(ValueError, match="not divisible by n_tokens=5"):
        resolve_n_tokens(12, 5)
    for bad in (0, 2.0, "4"):
        with pytest.raises(ValueError, match="positive integer"):
            resolve_n_tokens(12, bad)


def test_layer_sequences_infers_the_tokens_from_the_features():
    assert layer_sequences(np.zeros((2, 12)), None, None, 4).shape == (2, 3, 4)
    assert layer_sequences(np.zeros((2, 12)), 2, None, 6).shape == (2, 2, 6)
    with pytest.raises(ValueError, match="not a multiple of the layer's n_features"):
        layer_sequences(np.zeros((2, 10)), None, None, 4)
    with pytest.raises(ValueError, match="expects 4 features per token"):
        layer_sequences(np.zeros((2, 12)), 2, None, 4)


def test_fitted_tokens_finite_values_and_overflow_are_checked():
    check_fitted_tokens(None, 4)
    check_fitted_tokens(4, 4)
    with pytest.raises(ValueError, match="fitted with n_tokens_=4"):
        check_fitted_tokens(3, 4)
    check_finite(np.ones(3), "X")
    with pytest.raises(ValueError, match="y contains 2 NaN or infinite"):
        check_finite(np.array([1.0, np.nan, np.inf]), "y")
    ok = np.ones(2)
    assert check_no_overflow(ok, "y_pred", X=ok) is ok
    with pytest.raises(ValueError, match=r"y_pred overflowed .*X up to 1e\+300"):
        check_no_overflow(np.array([np.nan]), "y_pred", X=np.array([1e300]), W=None)


def test_normalized_weights_sum_to_one():
    np.testing.assert_array_equal(_normalized_weights(4, None), np.full(4, 0.25))
    w = _normalized_weights(3, [2, 0, 6])
    np.testing.assert_allclose(w, [0.25, 0.0, 0.75])
    assert w.dtype == np.float64
