"""LSMR in any array namespace (``optimizers/_lsmr.py``): scipy's iterates on
numpy, the same solution on torch and array-api-strict."""

import numpy as np
import pytest
from _helpers import array_namespaces
from scipy.sparse.linalg import lsmr as scipy_lsmr

from skattn.solvers.optimizers._lsmr import lsmr
from skattn.utils._array_api import namespace, to_numpy


def _problem(seed, m, n, condition=None):
    """A random ``(A, b)``; singular values spread over ``condition`` decades."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(m, n))
    if condition is not None:
        U, _, Vt = np.linalg.svd(A, full_matrices=False)
        A = (U * np.logspace(0, -condition, min(m, n))) @ Vt
    return A, rng.normal(size=m)


def _products(A):
    """``A``'s products as scipy's ``aslinearoperator(A)`` takes them."""
    return (lambda v: A.dot(v)), (lambda u: A.T.dot(u))


CASES = {
    "well": ((0, 60, 20, None), {}),
    "wide": ((1, 15, 40, None), {}),
    "ill": ((2, 50, 30, 10), {"atol": 1e-10, "btol": 1e-10}),
    "damped": ((3, 40, 25, 6), {"damp": 0.1}),
    "maxiter": ((4, 80, 50, 8), {"maxiter": 5}),
    "loose": ((5, 60, 40, 3), {"atol": 1e-2, "btol": 1e-2, "damp": 1e-3}),
    "conlim": ((6, 50, 30, 12), {"conlim": 1e4}),
    "tight": ((7, 50, 30, 1), {"atol": 1e-13, "btol": 1e-13, "maxiter": 500}),
    "tight_damped": (
        (8, 50, 30, 1),
        {"atol": 1e-13, "btol": 1e-13, "damp": 0.3, "maxiter": 500},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_numpy_iterates_are_scipys(case):
    args, options = CASES[case]
    A, b = _problem(*args)
    expected = scipy_lsmr(A, b, **options)
    result = lsmr(namespace(b), *_products(A), b, **options)
    assert (result.istop, result.itn) == (expected[1], expected[2])
    if case == "maxiter":
        assert result.istop == 7 and result.itn == 5
    np.testing.assert_allclose(result.x, expected[0], rtol=1e-14, atol=0)
    np.testing.assert_allclose(result[3:], expected[3:], rtol=1e-14, atol=0)
    assert all(type(value) is float for value in result[3:])


def test_zero_right_hand_side_gives_zero():
    A, _ = _problem(0, 10, 4)
    result = lsmr(namespace(A), *_products(A), np.zeros(10), shape=A.shape)
    np.testing.assert_array_equal(result.x, np.zeros(4))
    assert (result.istop, result.itn) == (0, 0)


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("case", ["well", "tight", "tight_damped", "maxiter"])
def test_other_namespaces_give_numpys_solution(to_array, case):
    # LSMR does not reorthogonalize: on an ill-conditioned problem its iterates
    # soon depend on the BLAS's rounding, so the comparison is on problems that
    # converge in a few iterations (or stop after a few)
    args, options = CASES[case]
    A, b = _problem(*args)
    expected = lsmr(namespace(b), *_products(A), b, **options)
    A_x, b_x = to_array(A), to_array(b)
    xp = namespace(b_x)
    result = lsmr(
        xp,
        lambda v: A_x @ v,
        lambda u: xp.linalg.matrix_transpose(A_x) @ u,
        b_x,
        **options,
    )
    assert namespace(result.x) is xp
    # (a stopping test at its tolerance may hold an iteration earlier or later)
    assert result.istop == expected.istop and abs(result.itn - expected.itn) <= 1
    np.testing.assert_allclose(to_numpy(result.x), expected.x, rtol=1e-10, atol=0)
