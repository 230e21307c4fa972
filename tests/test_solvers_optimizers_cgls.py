"""CGLS for a batch of damped least-squares problems (``optimizers/_cgls.py``):
each problem's solution, a problem with nothing to solve frozen, the host's
looks every few iterations."""

import numpy as np

from skattn.solvers.optimizers._cgls import batched_cgls


def _operators(A):
    return (
        lambda v: np.einsum("hij,hj->hi", A, v),
        lambda u: np.einsum("hij,hi->hj", A, u),
    )


def test_cgls_solves_each_damped_problem():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(3, 30, 8))
    b = rng.normal(size=(3, 30))
    damp = np.array([0.0, 0.5, 2.0])
    matvec, rmatvec = _operators(A)
    x, converged, itn = batched_cgls(np, matvec, rmatvec, b, damp, rtol=1e-12)
    assert converged.all() and itn <= 3 * 8
    for i in range(3):
        stacked = np.vstack([A[i], damp[i] * np.eye(8)])
        rhs = np.concatenate([b[i], np.zeros(8)])
        expected = np.linalg.lstsq(stacked, rhs, rcond=None)[0]
        np.testing.assert_allclose(x[i], expected, rtol=1e-9, atol=1e-12)


def test_cgls_freezes_a_head_with_nothing_to_solve_and_counts_its_reads():
    rng = np.random.default_rng(1)
    A = rng.normal(size=(2, 20, 6))
    b = rng.normal(size=(2, 20))
    b[1] = 0.0
    counter = {}
    x, converged, itn = batched_cgls(
        np, *_operators(A), b, np.zeros(2), rtol=1e-10, check_every=4, counter=counter
    )
    assert (x[1] == 0).all() and converged.all()
    # one look at iteration 4, 8, ...: never one an iteration
    assert counter["reads"] == -(-itn // 4)
