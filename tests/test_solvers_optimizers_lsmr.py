"""LSMR in any array namespace (``optimizers/_lsmr.py``): scipy's solution and
documented stopping behaviour on numpy, the same solution on torch and
array-api-strict."""

import math

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


def _lsmr_in(to_array, A, b, **options):
    """:func:`lsmr` of ``A x = b`` with the arrays of ``to_array``'s namespace."""
    A_x, b_x = to_array(A), to_array(b)
    xp = namespace(b_x)
    return lsmr(
        xp,
        lambda v: A_x @ v,
        lambda u: xp.linalg.matrix_transpose(A_x) @ u,
        b_x,
        **options,
    )


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


# LSMR's stopping reasons (scipy.sparse.linalg.lsmr's ``istop``) that say the
# solution meets a tolerance: 1 (Ax = b to atol, btol), 2 (least squares to atol)
_SOLVED = (1, 2)


@pytest.mark.parametrize("case", CASES)
def test_numpy_solves_what_scipy_solves(case):
    # the same stopping reason and solution as scipy's lsmr, and the documented
    # behaviour checked on the result itself: the norms it reports are those of
    # its x, the stopping test it names holds, maxiter stops at maxiter.  Not
    # one scipy version's iterates: the iteration count may differ by one (a
    # test at its tolerance), the x by what that tolerance allows
    args, options = CASES[case]
    A, b = _problem(*args)
    expected = scipy_lsmr(A, b, **options)
    result = lsmr(namespace(b), *_products(A), b, **options)
    assert all(type(value) is float for value in result[3:])
    assert result.istop == expected[1] and abs(result.itn - expected[2]) <= 1
    if case == "maxiter":
        assert result.istop == 7 and result.itn == 5
    damp = options.get("damp", 0.0)
    x = result.x
    r = b - A @ x
    normr = np.sqrt(r @ r + damp**2 * x @ x)
    normar = np.linalg.norm(A.T @ r - damp**2 * x)
    norm_a = np.sqrt(np.linalg.norm(A) ** 2 + damp**2 * A.shape[1])  # Frobenius
    assert result.normr == pytest.approx(normr, rel=1e-8)
    assert result.normx == pytest.approx(np.linalg.norm(x), rel=1e-8)
    assert abs(result.normar - normar) <= 1e-6 * norm_a * normr
    atol, btol = options.get("atol", 1e-6), options.get("btol", 1e-6)
    if result.istop == 1:
        assert normr <= btol * np.linalg.norm(b) + atol * norm_a * np.linalg.norm(x)
    if result.istop == 2:
        assert normar <= 1.01 * atol * norm_a * normr
    if result.istop in _SOLVED:  # both meet the tolerance: the same solution
        np.testing.assert_allclose(x, expected[0], rtol=1e-8 * np.linalg.cond(A))
    else:  # stopped on a budget or a condition: the same residual
        assert normr == pytest.approx(expected[3], rel=1e-8)


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
    result = _lsmr_in(to_array, A, b, **options)
    assert namespace(result.x) is namespace(to_array(b))
    # (a stopping test at its tolerance may hold an iteration earlier or later)
    assert result.istop == expected.istop and abs(result.itn - expected.itn) <= 1
    np.testing.assert_allclose(to_numpy(result.x), expected.x, rtol=1e-10, atol=0)


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("check_every", [1, 3])  # 3: the scalars on the device
def test_zero_right_hand_side_gives_zero_in_other_namespaces(to_array, check_every):
    A, _ = _problem(0, 10, 4)
    result = _lsmr_in(to_array, A, np.zeros(10), shape=A.shape, check_every=check_every)
    np.testing.assert_array_equal(to_numpy(result.x), np.zeros(4))
    assert (result.istop, result.itn) == (0, 0)


@pytest.mark.parametrize("case", CASES)
def test_off_numpy_the_host_reads_once_an_iteration(case):
    # ||u|| and ||v|| stay on the device and come to the host in one read an
    # iteration, with the previous iteration's ||x|| (whose stopping tests wait
    # for it): one read for the start, one an iteration, one to end (three an
    # iteration before); the run is the host-scaled one's (to rounding: torch's
    # square root of a 0-d tensor is not always numpy's)
    torch = pytest.importorskip("torch")
    from skattn.utils._device_work import DeviceWork

    args, options = CASES[case]
    A, b = _problem(*args)
    A_t, b_t = torch.asarray(A), torch.asarray(b)
    expected = lsmr(namespace(b), *_products(A), b, **options)
    with DeviceWork() as work:
        result = lsmr(
            namespace(b_t), lambda v: A_t @ v, lambda u: A_t.T @ u, b_t, **options
        )
    assert work.host_reads["other"] == result.itn + 2
    assert result.istop == expected.istop and abs(result.itn - expected.itn) <= 1
    if case in ("well", "wide", "maxiter", "loose", "tight", "tight_damped"):
        np.testing.assert_allclose(to_numpy(result.x), expected.x, rtol=1e-9)


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("case", ["well", "tight", "tight_damped", "maxiter"])
def test_scalars_on_the_device_give_numpys_solution_read_at_the_checks(to_array, case):
    # check_every > 1: the recurrences on the device, the stopping tests at the
    # checks only, so a run stops at the first check at or after its own stop,
    # which is numpy's to rounding: at machine-precision tolerances ("tight") a
    # library's rounding may meet the test an iteration before numpy's (torch
    # with AVX2 kernels stopped "tight" at 40 where numpy stopped at 41)
    args, options = CASES[case]
    A, b = _problem(*args)
    expected = lsmr(namespace(b), *_products(A), b, **options)
    result = _lsmr_in(to_array, A, b, check_every=4, **options)
    assert namespace(result.x) is namespace(to_array(b))
    assert result.istop == expected.istop
    assert result.itn % 4 == 0 or result.itn == options.get("maxiter")
    assert expected.itn - 1 <= result.itn <= expected.itn + 4
    # numpy's run to the same iteration (its tolerances off; at machine
    # precision it may stop one before): the same x
    options = {**options, "atol": 0.0, "btol": 0.0, "conlim": 0.0}
    same = lsmr(namespace(b), *_products(A), b, **{**options, "maxiter": result.itn})
    assert result.itn - 1 <= same.itn <= result.itn
    np.testing.assert_allclose(to_numpy(result.x), same.x, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("check_every, maxiter", [(4, 30), (40, 40), (7, 20)])
def test_scalars_on_the_device_are_read_only_at_the_checks(check_every, maxiter):
    torch = pytest.importorskip("torch")
    from skattn.utils._device_work import DeviceWork

    A, b = _problem(4, 80, 50, 8)
    A_t, b_t = torch.asarray(A), torch.asarray(b)
    with DeviceWork() as work:
        result = lsmr(
            namespace(b_t),
            lambda v: A_t @ v,
            lambda u: A_t.T @ u,
            b_t,
            maxiter=maxiter,
            check_every=check_every,
        )
    assert result.itn == maxiter  # an ill-conditioned problem: runs to maxiter
    assert work.host_reads["other"] == math.ceil(maxiter / check_every)
    assert work.round_trips()["other"] == work.host_reads["other"]
