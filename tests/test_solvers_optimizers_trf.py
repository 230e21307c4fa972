"""Trust-region reflective least squares in any array namespace
(``optimizers/_trf.py``): scipy's ``least_squares``' outcome on numpy, the same
minimum on torch and array-api-strict."""

import math
import warnings

import numpy as np
import pytest
from _helpers import array_namespaces, planted
from scipy import linalg
from scipy.optimize import least_squares
from scipy.sparse.linalg import LinearOperator

from skattn.solvers import FullRank, LowRank, VarproProblem
from skattn.solvers.optimizers._trf import _solve_trust_region_2d_batch, trf
from skattn.utils._array_api import namespace, to_numpy


def _rosenbrock():
    """The extended Rosenbrock residuals: ``(fun, jacobian matrix, x0)``."""

    def fun(x):
        return np.concatenate([10 * (x[1:] - x[:-1] ** 2), 1 - x[:-1]])

    def matrix(x):
        n = x.size
        J = np.zeros((2 * (n - 1), n))
        i = np.arange(n - 1)
        J[i, i] = -20 * x[:-1]
        J[i, i + 1] = 10
        J[n - 1 + i, i] = -1
        return J

    return fun, matrix, np.array([-1.2, 1.0, -0.5, 0.3, 0.8])


_T = np.linspace(0.0, 3.0, 40)
_Y = (
    2.5 * np.exp(-1.3 * _T)
    + 0.7 * np.exp(-0.2 * _T)
    + 0.01 * np.random.default_rng(1).normal(size=_T.size)
)


def _exponentials():
    """A sum of two exponentials fitted to noisy data."""

    def fun(x):
        return x[0] * np.exp(x[1] * _T) + x[2] * np.exp(x[3] * _T) - _Y

    def matrix(x):
        e1, e2 = np.exp(x[1] * _T), np.exp(x[3] * _T)
        return np.stack([e1, x[0] * _T * e1, e2, x[2] * _T * e2], axis=1)

    return fun, matrix, np.array([1.0, -1.0, 1.0, -0.1])


def _varpro(parametrization):
    """A tiny planted layer's reduced problem: ``(fun, products, x0)``."""
    rank = getattr(parametrization, "rank", None)
    X, Y, attention, _ = planted(120, 3, 4, 2, 3, seed=5, rank=rank)
    problem = VarproProblem(X, Y, None, parametrization)
    rng = np.random.default_rng(2)
    x0 = parametrization.from_attention(attention + 0.2 * rng.normal(size=(2, 4, 4)))

    def products(x):
        p = np.array(x, copy=True)
        return (
            lambda v: problem.matvec(p, v),
            lambda u: problem.rmatvec(p, u, orthogonal=True),
        )

    return problem.residual, products, x0


def _with_matrix(matrix):
    """``jac`` for :func:`trf` from a function returning a dense Jacobian."""

    def jac(x):
        J = matrix(x)
        xp = namespace(J)
        return (lambda v: J @ v), (lambda u: xp.linalg.matrix_transpose(J) @ u)

    return jac


def _scipy(fun, products, x0, **options):
    """scipy's ``least_squares`` on the same products."""

    def jac(x):
        matvec, rmatvec = products(x)
        shape = (fun(x).size, x.size)
        return LinearOperator(shape, matvec=matvec, rmatvec=rmatvec, dtype=float)

    return least_squares(
        fun, x0, jac=jac, method="trf", tr_solver="lsmr", x_scale=1.0, **options
    )


PROBLEMS = {
    "rosenbrock": lambda: (lambda f, m, x: (f, _with_matrix(m), x))(*_rosenbrock()),
    "exponentials": lambda: (lambda f, m, x: (f, _with_matrix(m), x))(*_exponentials()),
    "varpro_full": lambda: _varpro(FullRank(2, 4)),
    "varpro_low_rank": lambda: _varpro(LowRank(2, 4, 2)),
}
# options whose runs crawl (see test_numpy_runs_end_where_scipys_do)
CRAWLS = {"short_lsmr"}
OPTIONS = {
    "default": {},
    "short_lsmr": {"tr_options": {"maxiter": 2}},
    "loose_lsmr": {"tr_options": {"atol": 1e-2, "btol": 1e-2}},
    "tight": {"ftol": 2.3e-16, "xtol": 1e-12, "gtol": 2.3e-16},
    "budget": {"max_nfev": 5},
}


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_numpy_runs_end_where_scipys_do(problem, options):
    # scipy's least_squares' documented outcome, not its iterates or counts
    # (its steps are LSMR's, these CGLS's, stopped by LSMR's tests): where
    # scipy converges, converged too (at an exact minimum the last step may
    # stop on xtol where scipy's gradient there, one Jacobian more, stops on
    # gtol) at the same minimum; where this run spends its budget, scipy's
    # does too, and ends no lower (the budget cuts a crawl at an arbitrary
    # point: to 1e-4 of its cost)
    fun, products, x0 = PROBLEMS[problem]()
    name, options = options, OPTIONS[options]
    expected = _scipy(fun, products, x0, **options)
    result = trf(namespace(x0), fun, products, x0, **options)
    assert type(result.cost) is float and result.success == (result.status > 0)
    assert result.cost == pytest.approx(0.5 * fun(result.x) @ fun(result.x), rel=1e-12)
    assert result.cost <= 0.5 * fun(x0) @ fun(x0)
    if name in CRAWLS:
        # steps of two inner iterations crawl for hundreds of evaluations: on
        # which side of the budget a run's tests fall is rounding (with
        # OPENBLAS_CORETYPE=Prescott scipy's own exponentials converge at 322,
        # with AVX2 kernels they spend the 400): both end near the minimum
        assert result.nfev <= options.get("max_nfev", 100 * x0.size)
        assert result.cost <= expected.cost * (1 + 1e-2)
        return
    if result.status == 0:  # the budget (by default 100 n evaluations) spent
        budget = options.get("max_nfev", 100 * x0.size)
        assert expected.status == 0 and budget - 1 <= result.nfev <= budget
        assert result.cost <= expected.cost * (1 + 1e-4)
    if expected.success:  # the same minimum, as far as the tolerances pin it
        assert result.success
        assert result.cost == pytest.approx(expected.cost, rel=1e-8, abs=1e-14)
        if not problem.startswith("varpro"):  # (a layer's Theta is not pinned
            # by 3-token sequences: its minimum is a set, reached by both)
            np.testing.assert_allclose(
                result.x, expected.x, rtol=0, atol=1e-5 * abs(expected.x).max()
            )
    else:  # scipy's budget spent: this run converged lower, or spent it too
        assert result.cost <= expected.cost * (1 + 1e-4)


def test_a_callback_that_raises_stop_iteration_stops_the_run():
    fun, products, x0 = PROBLEMS["rosenbrock"]()
    costs = []

    def callback(intermediate_result):
        costs.append(intermediate_result.cost)
        if intermediate_result.nit == 3:
            raise StopIteration

    expected = _scipy(fun, products, x0, callback=callback)
    seen, costs[:] = list(costs), []
    result = trf(namespace(x0), fun, products, x0, callback=callback)
    assert result.status == expected.status == -2 and not result.success
    # the same first three steps, to rounding (CGLS's steps, not LSMR's)
    assert len(costs) == len(seen) == 3
    np.testing.assert_allclose(costs, seen, rtol=1e-6)


def test_non_finite_start_is_refused():
    fun, products, x0 = PROBLEMS["exponentials"]()
    with pytest.raises(ValueError, match="not finite"):
        trf(namespace(x0), lambda x: fun(x) * np.nan, products, x0)


def test_an_overflowing_trial_is_rejected_counted_and_silent():
    # the first trust region (the start's norm, 1000) lets the Gauss-Newton step
    # of exp(x) = e^20 from 0 reach exp(1000): that trial overflows, is rejected
    # and counted, and no numpy RuntimeWarning reaches the caller
    def fun(x):
        return np.array([np.exp(x[0]) - np.exp(20.0), 1e-3 * (x[1] - 1000.0)])

    def products(x):
        J = np.array([[np.exp(x[0]), 0.0], [0.0, 1e-3]])
        return (lambda v: J @ v), (lambda u: J.T @ u)

    x0 = np.array([0.0, 1000.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = trf(namespace(x0), fun, products, x0)
    assert result.success and result.n_nonfinite_trials >= 1
    np.testing.assert_allclose(result.x, [20.0, 1000.0], rtol=1e-12)


def _rosenbrock_products(xp=np, to_array=np.asarray):
    """The extended Rosenbrock residuals with their Jacobian products, in ``xp``
    (no matrix: the products as sums of shifted vectors)."""

    def fun(x):
        return xp.concat([10 * (x[1:] - x[:-1] ** 2), 1 - x[:-1]])

    def products(x):
        head = x[:-1]
        zero = xp.zeros(1, dtype=x.dtype)

        def matvec(v):
            return xp.concat([10 * v[1:] - 20 * head * v[:-1], -v[:-1]])

        def rmatvec(u):
            a, b = u[: head.shape[0]], u[head.shape[0] :]
            return xp.concat([zero, 10 * a]) + xp.concat([-20 * head * a - b, zero])

        return matvec, rmatvec

    return fun, products, to_array(np.array([-1.2, 1.0, -0.5, 0.3, 0.8, -0.9]))


def test_rosenbrock_products_are_the_jacobians():
    fun, products, x0 = _rosenbrock_products()
    matvec, rmatvec = products(x0)
    J = _rosenbrock()[1](x0)
    eye = np.eye(x0.size)
    np.testing.assert_allclose(np.stack([matvec(e) for e in eye], axis=1), J)
    np.testing.assert_allclose(
        np.stack([rmatvec(e) for e in np.eye(J.shape[0])], axis=1), J.T
    )


@pytest.mark.parametrize("to_array", array_namespaces())
def test_other_namespaces_give_numpys_run(to_array):
    fun, products, x0 = _rosenbrock_products()
    expected = trf(namespace(x0), fun, products, x0)
    xp = namespace(to_array(x0))
    fun, products, x0 = _rosenbrock_products(xp, to_array)
    result = trf(xp, fun, products, x0)
    assert namespace(result.x) is xp and namespace(result.fun) is xp
    # both runs converge to Rosenbrock's minimum, (1, ..., 1): compared there,
    # not step by step
    assert result.status == expected.status and result.status > 0
    np.testing.assert_allclose(to_numpy(result.x), np.ones(x0.shape[0]), rtol=1e-10)
    np.testing.assert_allclose(expected.x, np.ones(x0.shape[0]), rtol=1e-10)


def test_resume_from_any_iterate_gives_the_uninterrupted_run():
    # an interrupted run, resumed from a kept iterate, ends where the
    # uninterrupted run ends, bit for bit, with the same counts
    t = np.linspace(0.0, 1.0, 30)
    y = 2.0 * np.exp(-1.5 * t) + 0.5 * np.exp(-4.0 * t)

    def fun(x):
        return x[0] * np.exp(x[1] * t) + x[2] * np.exp(x[3] * t) - y

    def jac(x):
        e1, e2 = np.exp(x[1] * t), np.exp(x[3] * t)
        J = np.stack([e1, x[0] * t * e1, e2, x[2] * t * e2], axis=1)
        return (lambda v: J @ v), (lambda u: J.T @ u)

    x0 = np.array([1.0, -1.0, 1.0, -3.0])
    states = []
    whole = trf(
        namespace(x0), fun, jac, x0, callback=lambda r: states.append(r["state"])
    )
    assert len(states) > 3
    for state in states[:-1]:
        resumed = trf(namespace(x0), fun, jac, x0, resume=state)
        assert resumed.x.tobytes() == whole.x.tobytes()
        assert (resumed.nfev, resumed.njev, resumed.status) == (
            whole.nfev,
            whole.njev,
            whole.status,
        )


def _solve_trust_region_2d(B, g, Delta):
    """The reference: scipy's ``solve_trust_region_2d`` (minimise ``1/2 p^T B p +
    g^T p`` subject to ``||p|| <= Delta`` in 2-D): the Newton step when ``B`` is
    positive definite and the step is inside, else the minimum on the circle,
    ``p = Delta (2 t, 1 - t^2) / (1 + t^2)`` at a real root ``t`` of a quartic."""
    try:
        factor = linalg.cho_factor(B)
        p = -linalg.cho_solve(factor, g)
        if np.dot(p, p) <= Delta**2:
            return p
    except linalg.LinAlgError:
        pass
    a = B[0, 0] * Delta**2
    b = B[0, 1] * Delta**2
    c = B[1, 1] * Delta**2
    d = g[0] * Delta
    f = g[1] * Delta
    coeffs = np.array([-b + d, 2 * (a - c + f), 6 * b, 2 * (-a + c + f), -b - d])
    t = np.roots(coeffs)  # leading zeros are fine
    t = np.real(t[np.isreal(t)])
    p = Delta * np.vstack((2 * t / (1 + t**2), (1 - t**2) / (1 + t**2)))
    value = 0.5 * np.sum(p * B.dot(p), axis=0) + np.dot(g, p)
    return p[:, np.argmin(value)]


def _subproblems(seed=0, count=400):
    """2-D trust-region problems ``(B, g, Delta)``: positive definite (steps
    inside and outside), indefinite, singular, nearly singular, ``g`` along an
    axis, over six orders of magnitude."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        A = rng.normal(size=(2, 2)) * 10 ** rng.uniform(-3, 3)
        B = [
            A @ A.T,
            A + A.T,
            np.outer(A[0], A[0]),
            A @ A.T * [[1, 1 - 1e-9], [1 - 1e-9, 1]],
        ]
        g = rng.normal(size=2) * 10 ** rng.uniform(-3, 3)
        if trial % 7 == 0:
            g[1] = 0.0
        yield B[trial % 4], g, 10 ** rng.uniform(-3, 3)
    yield np.diag([1.0, -1.0]), np.zeros(2), 2.0  # the hard case: g = 0


@pytest.mark.parametrize("to_array", array_namespaces())
def test_the_2d_subproblem_in_the_namespace_is_scipys(to_array):
    # off numpy the subproblem is solved on the device (no host read): the same
    # minimum as scipy's roots of the quartic, to rounding of its value (the
    # step itself is not pinned where the minimum is flat)
    for B, g, Delta in _subproblems():
        expected = _solve_trust_region_2d(B, g, Delta)
        xp = namespace(to_array(B))
        out = _solve_trust_region_2d_batch(
            xp, to_array(B[None]), to_array(g[None]), to_array(np.array([Delta]))
        )
        assert namespace(out) is xp
        p = to_numpy(out)[0]
        assert p @ p <= Delta**2 * (1 + 1e-12)
        value = 0.5 * p @ B @ p + g @ p
        best = 0.5 * expected @ B @ expected + g @ expected
        scale = Delta * np.linalg.norm(g) + Delta**2 * np.linalg.norm(B, 2)
        assert value <= best + 1e-14 * scale


def test_trf_reads_the_host_once_a_step_tried_and_every_few_inner_iterations():
    # the start's costs, one read a trial (its flags, cost and norms), and
    # CGLS's look every check_every iterations: nothing once an iteration
    # (LSMR, before the one core, read the host at each of its iterations)
    torch = pytest.importorskip("torch")
    from skattn.utils._device_work import DeviceWork

    xp = namespace(torch.ones(1))
    fun, products, x0 = _rosenbrock_products(xp, torch.asarray)
    work = DeviceWork()
    with work, work.stage("trf"):
        result = trf(xp, fun, products, x0, tr_options={"check_every": 4})
    assert result.status > 0 and result.njev > 5
    trials = result.nfev - 1
    assert work.host_reads["trf"] == result.host_reads
    assert result.host_reads <= 1 + trials + result.njev * math.ceil(6 / 4)
    assert work.host_reads["trf"] < 3 * result.nfev
