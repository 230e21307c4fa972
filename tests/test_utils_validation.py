"""Token layout of X and y: flatten, unflatten, the number of tokens; ragged and
sparse input, magnitudes, a fit's transaction (``utils/_validation.py``)."""

import numpy as np
import pytest
import scipy.sparse

from skattn.utils._validation import (
    _normalized_weights,
    all_or_nothing,
    as_array,
    check_finite,
    check_fitted_tokens,
    check_largest_magnitude,
    check_magnitude,
    check_no_overflow,
    check_target,
    flatten_tokens,
    layer_sequences,
    ragged_description,
    resolve_n_tokens,
    restore_on_error,
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


def test_ragged_lists_are_described_where_they_differ():
    assert ragged_description([[1.0, 2.0], [3.0, 4.0]]) is None
    assert ragged_description([[1.0, 2.0, 3.0], [1.0], [2.0, 3.0]], "y") == (
        "its rows have lengths 3 (y[0]), 1 (y[1]) and 2 (y[2])"
    )
    tokens = [[[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0], [3.0]]]
    assert ragged_description(tokens) == (
        "its tokens have lengths 2 (X[0][0]) and 1 (X[1][1])"
    )
    assert ragged_description([[1.0], 2.0]) == "X[0] is a sequence but X[1] is a number"
    rows = [np.zeros(n) for n in range(2, 8)]  # more than 4 lengths: the first 4
    assert ragged_description(rows).endswith("4 (X[2]), 5 (X[3]), ...")


def test_as_array_names_the_ragged_rows_and_the_fix():
    np.testing.assert_array_equal(as_array([[1, 2], [3, 4]], "X", ""), [[1, 2], [3, 4]])
    with pytest.raises(
        ValueError,
        match=r"X is a ragged list: its rows have lengths 3 \(X\[0\]\) and 2 "
        r"\(X\[1\]\); pass a 2-D array",
    ):
        as_array([[1.0, 2.0, 3.0], [1.0, 2.0]], "X", "a 2-D array")
    # flatten_tokens, the entry of every X, says the shapes it accepts
    with pytest.raises(ValueError, match=r"ragged list.*\(n_samples, n_tokens \* n_"):
        flatten_tokens([[1.0, 2.0, 3.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match=r"its tokens have lengths 2"):
        flatten_tokens([[[1.0, 2.0]], [[1.0]]])


def test_check_target_rejects_sparse_and_ragged_y():
    y = np.ones((3, 2))
    assert check_target(y, "Est", "") is y
    np.testing.assert_array_equal(check_target([[1.0], [2.0]], "Est", ""), [[1], [2]])
    with pytest.raises(TypeError, match=r"y is a sparse csr_matrix, but Est needs a "):
        check_target(scipy.sparse.csr_matrix(y), "Est", "a 2-D array")
    with pytest.raises(ValueError, match=r"y is a ragged list: its rows have lengths"):
        check_target([[1.0, 2.0], [1.0]], "Est", "a 2-D array")


def test_check_magnitude_rejects_sums_that_overflow_float64():
    X = np.ones((10, 10))
    assert check_magnitude(X, "X", 4, "Est") is X
    assert check_magnitude(np.empty((0, 3)), "X", 2, "Est").size == 0
    # the largest allowed value: (max / size) ** (1 / degree)
    limit = (np.finfo(np.float64).max / 100) ** 0.25
    check_magnitude(np.full((10, 10), limit * 0.99), "X", 4, "Est")
    with pytest.raises(ValueError, match=r"X has entries up to 1e\+100 .*Est sums "):
        check_magnitude(X * 1e100, "X", 4, "Est")
    check_magnitude(X * 1e100, "X", 2, "Est")  # squares of 1e100 do not overflow
    with pytest.raises(ValueError, match=r"Rescale y \(with a scaler\) first"):
        check_magnitude(-X * 1e200, "y", 2, "Est", fix="with a scaler")


def test_a_measured_largest_value_gets_the_same_limit_and_message():
    # out-of-core values are measured in batches, then checked by their maximum
    X = np.ones((10, 10))
    X[3, 4] = -1e100
    check_largest_magnitude(1e100, 100, "X", 2, "Est")  # squares do not overflow
    check_largest_magnitude(1e300, 0, "X", 4, "Est")  # no entry, no product
    with pytest.raises(ValueError) as in_memory:
        check_magnitude(X, "X", 4, "Est", what="the logits")
    with pytest.raises(ValueError) as measured:
        check_largest_magnitude(1e100, 100, "X", 4, "Est", what="the logits")
    assert str(measured.value) == str(in_memory.value)


class _Fitted:
    def __init__(self):
        self.coef_ = np.ones(2)
        self.n_features_in_ = 2

    @all_or_nothing
    def fit(self, exc):
        self.coef_ = np.zeros(5)
        self.n_features_in_ = 5
        self.new_ = True
        raise exc


@pytest.mark.parametrize("exc", [ValueError("bad"), KeyboardInterrupt()])
def test_a_failed_fit_restores_every_attribute(exc):
    est = _Fitted()
    before = dict(vars(est))
    with pytest.raises(type(exc)):
        est.fit(exc)
    assert vars(est).keys() == before.keys()
    assert all(vars(est)[name] is value for name, value in before.items())
    with restore_on_error(est):  # no exception: the block's changes stay
        est.coef_ = None
    assert est.coef_ is None
