"""The kernels in other array namespaces (array-api-strict, torch on the CPU):
the numpy results, to rounding, in the input's namespace; and the out-of-memory
retries (``layer/_math.py``, ``solvers/kernels/*``)."""

import numpy as np
import pytest
from _helpers import array_namespaces, factored_planted, planted

import skattn.layer._math as layer_math
import skattn.solvers.kernels._loss as loss_module
import skattn.solvers.kernels._varpro as varpro
from skattn.solvers.kernels._decoupling import (
    _design,
    _one_head_problem,
    _output_factors,
    decoupling_map,
)
from skattn.solvers.kernels._parametrization import (
    FactoredHeads,
    FullRank,
    LowRank,
    _initial_parameters,
    _Unknowns,
    random_attention,
)
from skattn.solvers.kernels._varpro import VarproProblem, _intercept_direction
from skattn.solvers.kernels._whitening import _unwhiten, whitening_map
from skattn.utils._array_api import namespace, to_numpy

RTOL = 1e-10


def assert_same(out, expected, to_array, rtol=RTOL):
    """``out`` (of ``to_array``'s namespace) is ``expected`` (numpy) to ``rtol``
    relative; tuples and floats element by element."""
    if isinstance(expected, tuple):
        assert isinstance(out, tuple) and len(out) == len(expected)
        for o, e in zip(out, expected, strict=True):
            assert_same(o, e, to_array, rtol)
        return
    if expected is None:
        assert out is None
        return
    if isinstance(expected, float):
        assert isinstance(out, float)
        assert out == pytest.approx(expected, rel=rtol, abs=1e-300)
        return
    assert namespace(out) is namespace(to_array(np.ones(1))), type(out)
    got = to_numpy(out)
    assert got.shape == expected.shape
    scale = max(np.linalg.norm(expected), np.finfo(float).tiny)
    assert np.linalg.norm(got - expected) <= rtol * scale


@pytest.fixture(scope="module")
def data():
    X, Y, attention, projection = planted(40, 3, 4, 2, 3, noise=0.1, seed=3)
    weights = np.random.default_rng(0).uniform(0.5, 2.0, 40)
    return X, Y, attention, projection, weights


# -- the layer's math ------------------------------------------------------------


@pytest.mark.parametrize("to_array", array_namespaces())
def test_softmax_and_forward(to_array, data, monkeypatch):
    X, _, attention, projection, _ = data
    rng = np.random.default_rng(1)
    logits = 30 * rng.normal(size=(3, 4, 5))
    assert_same(
        layer_math.softmax(to_array(logits)), layer_math.softmax(logits), to_array
    )
    bias, intercept = rng.normal(size=(2, 4)), rng.normal(size=3)
    expected = layer_math.forward(X, attention, projection, None, bias, intercept)
    out = layer_math.forward(
        *map(to_array, (X, attention, projection)),
        key_bias=to_array(bias),
        intercept=to_array(intercept),
    )
    assert_same(out, expected, to_array)
    # in chunks of samples (a budget of a few samples)
    monkeypatch.setattr(layer_math, "_FORWARD_CHUNK_FLOATS", 200)
    out = layer_math.forward(*map(to_array, (X, attention, projection)))
    assert_same(out, layer_math.forward(X, attention, projection), to_array)


@pytest.mark.parametrize("to_array", array_namespaces())
def test_loss_and_gradient(to_array, data):
    X, Y, attention, projection, weights = data
    args = (X, Y, attention, projection, weights)
    moved = tuple(map(to_array, args))
    assert_same(
        layer_math.squared_loss_gradient(*moved),
        layer_math.squared_loss_gradient(*args),
        to_array,
    )
    for kwargs in (
        {"alpha": 0.3, "alpha_attention": 0.1},
        {"alpha": 0.3, "chunk_size": 7},
        {"gradient": False},
    ):
        assert_same(
            loss_module._loss_gradient(*moved, **kwargs),
            loss_module._loss_gradient(*args, **kwargs),
            to_array,
        )
    assert_same(
        loss_module.relative_residual(*moved),
        loss_module.relative_residual(*args),
        to_array,
    )


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("singular", [False, True])
def test_projections(to_array, data, singular):
    X, Y, attention, _, weights = data
    if singular:  # tokens on a proper subspace: the pseudo-inverse's route
        X = X.copy()
        X[..., 3] = X[..., 2]
    args = (X, Y, attention, weights)
    moved = tuple(map(to_array, args))
    assert_same(
        loss_module.projection_normal_equations(*moved),
        loss_module.projection_normal_equations(*args),
        to_array,
    )
    alpha = 0.0 if singular else 0.01
    expected = loss_module.solve_projections(*args, alpha)
    out = loss_module.solve_projections(*moved, alpha)
    if singular:
        # W is not identified (Cholesky succeeds on one side by rounding and
        # not on the other): the outputs are, to rounding amplified
        expected = layer_math.forward(X, attention, expected)
        out = layer_math.forward(moved[0], moved[2], out)
    assert_same(out, expected, to_array, 1e-8 if singular else RTOL)
    expected = loss_module.reduced_loss_gradient(*args)
    out = loss_module.reduced_loss_gradient(*moved)
    assert_same(out[:2], expected[:2], to_array, 1e-8 if singular else RTOL)


# -- parametrizations --------------------------------------------------------------


PARAMETRIZATIONS = [FullRank(2, 4), LowRank(2, 4, 2), FactoredHeads(2, 4, 2)]


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("par", PARAMETRIZATIONS, ids=lambda p: type(p).__name__)
def test_parametrization_products(to_array, par, data):
    X, _, attention, projection, _ = data
    rng = np.random.default_rng(2)
    p, v = rng.normal(size=par.size), rng.normal(size=par.size)
    Xa, pa, va = map(to_array, (X, p, v))
    assert_same(par.attention(pa), par.attention(p), to_array)
    assert_same(par.logits(Xa, pa), par.logits(X, p), to_array)
    cotangent = rng.normal(size=(40, 2, 3, 3))
    if isinstance(par, FactoredHeads):
        values = rng.normal(size=(40, 2, 3, 2))
        assert_same(par.jvp(Xa, pa, va), par.jvp(X, p, v), to_array)
        assert_same(
            par.vjp(Xa, pa, to_array(cotangent), to_array(values)),
            par.vjp(X, p, cotangent, values),
            to_array,
        )
        assert_same(par.values(Xa, pa), par.values(X, p), to_array)
        # singular vectors are defined up to sign: Q K^T and V V^T are not
        start = par.from_attention(to_array(attention), to_array(projection))
        expected = par.from_attention(attention, projection)
        assert_same(par.attention(start), par.attention(expected), to_array)
        V, V_expected = par.factors(start)[2], par.factors(expected)[2]
        assert_same(V @ V.mT, V_expected @ V_expected.mT, to_array)
        factors = rng.normal(size=(2, 2, 3))
        assert_same(
            par.regauge(pa, to_array(factors)), par.regauge(p, factors), to_array
        )
    else:
        assert_same(par.logits_jvp(Xa, pa, va), par.logits_jvp(X, p, v), to_array)
        assert_same(
            par.logits_vjp(Xa, pa, to_array(cotangent)),
            par.logits_vjp(X, p, cotangent),
            to_array,
        )
        # low rank: singular vectors are defined up to sign, Q K^T is not
        assert_same(
            par.attention(par.from_attention(to_array(attention))),
            par.attention(par.from_attention(attention)),
            to_array,
        )
        grad = rng.normal(size=(2, 4, 4))
        assert_same(
            par.attention_vjp(pa, to_array(grad)), par.attention_vjp(p, grad), to_array
        )
    preconditioner = par.preconditioner(pa)
    if preconditioner is None:
        assert par.preconditioner(p) is None
        return
    for moved, plain in zip(preconditioner, par.preconditioner(p), strict=True):
        assert_same(moved(va), plain(v), to_array)


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("rank", [None, 2])
def test_unknowns_and_random_starts(to_array, rank, data):
    X, Y, attention, projection, weights = data
    unknowns = _Unknowns(2, 4, 3, rank)
    params = unknowns.pack(attention, projection)
    # low rank: singular vectors are defined up to sign, their products are not
    packed = unknowns.pack(to_array(attention), to_array(projection))
    assert_same(unknowns.unpack(packed), unknowns.unpack(params), to_array)
    moved = to_array(params)
    assert_same(unknowns.unpack(moved), unknowns.unpack(params), to_array)
    rng = np.random.default_rng(3)
    ga, gp = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 3))
    assert_same(
        unknowns.gradient(moved, to_array(ga), to_array(gp)),
        unknowns.gradient(params, ga, gp),
        to_array,
    )
    # a seed gives the same start in every namespace
    assert_same(
        random_attention(2, 4, 5, like=to_array(X)), random_attention(2, 4, 5), to_array
    )
    assert_same(
        _initial_parameters(*map(to_array, (X, Y, weights)), 2, 1.0, 0.01, 4),
        _initial_parameters(X, Y, weights, 2, 1.0, 0.01, 4),
        to_array,
    )


# -- the reduced problem -------------------------------------------------------------


def problems():
    """``(name, X, Y, weights, par, kwargs)`` of every kind of reduced problem."""
    X, Y, _, _ = planted(40, 3, 4, 2, 3, noise=0.1, seed=3)
    weights = np.random.default_rng(0).uniform(0.5, 2.0, 40)
    Xf, Yf, *_ = factored_planted(40, 3, 4, 2, 2, 5, seed=1, intercept=True)
    fixed = np.random.default_rng(4).normal(size=(40, 3, 3))
    return [
        ("full", X, Y, weights, FullRank(2, 4), {}),
        ("low", X, Y, weights, LowRank(2, 4, 2), {}),
        ("factored", X, Y, weights, FactoredHeads(2, 4, 2), {}),
        (
            "factored-intercept",
            Xf,
            Yf,
            None,
            FactoredHeads(2, 5, 2),
            {"intercept": True},
        ),
        ("fixed-columns", X, Y, weights, FullRank(1, 4), {"fixed_columns": fixed}),
    ]


PROBLEMS = problems()


def evaluations(problem, params, direction, vector):
    """What a solver asks of a reduced problem, at a point and another."""
    out = [
        problem.residual(params),
        problem.matvec(params, direction),
        problem.rmatvec(params, vector),
        problem.rmatvec(params, vector, orthogonal=True),
        problem.projection,
    ]
    for name in ("output_factors", "fixed_coefficients"):
        if hasattr(problem, name):
            out.append(getattr(problem, name))
    out.append(problem.residual(params + 0.01))
    return tuple(out)


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize("case", PROBLEMS, ids=[case[0] for case in PROBLEMS])
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_varpro_problem(to_array, case, n_jobs, monkeypatch):
    _, X, Y, weights, par, kwargs = case
    if n_jobs > 1:  # several chunks, in threads
        monkeypatch.setattr(loss_module, "_CHUNK_FLOATS", 300)
    rng = np.random.default_rng(5)
    params, direction = rng.normal(size=par.size), rng.normal(size=par.size)
    vector = rng.normal(size=Y.size)
    expected = evaluations(
        VarproProblem(X, Y, weights, par, n_jobs=n_jobs, **kwargs),
        params,
        direction,
        vector,
    )
    moved_kwargs = {
        key: to_array(value) if key == "fixed_columns" else value
        for key, value in kwargs.items()
    }
    problem = VarproProblem(
        to_array(X),
        to_array(Y),
        None if weights is None else to_array(weights),
        par,
        n_jobs=n_jobs,
        **moved_kwargs,
    )
    out = evaluations(problem, *map(to_array, (params, direction, vector)))
    assert_same(out, expected, to_array)


@pytest.mark.parametrize("to_array", array_namespaces())
def test_varpro_single_precision(to_array, data):
    X, Y, _, _, weights = data
    par = LowRank(2, 4, 2)
    rng = np.random.default_rng(6)
    params, direction = rng.normal(size=par.size), rng.normal(size=par.size)
    vector = rng.normal(size=Y.size)
    expected = evaluations(
        VarproProblem(X, Y, weights, par, dtype=np.float32), params, direction, vector
    )
    problem = VarproProblem(*map(to_array, (X, Y, weights)), par, dtype=np.float32)
    assert problem.dtype == np.float32
    out = evaluations(problem, *map(to_array, (params, direction, vector)))
    assert_same(out, expected, to_array, rtol=1e-5)


# -- whitening and decoupling ------------------------------------------------------


@pytest.mark.parametrize("to_array", array_namespaces())
def test_whitening(to_array, data):
    X, _, attention, projection, weights = data
    X = X * np.array([10.0, 0.1, 1.0, 2.0])
    assert_same(
        whitening_map(to_array(X), to_array(weights)),
        whitening_map(X, weights),
        to_array,
    )
    singular = X.copy()
    singular[..., 3] = singular[..., 2]
    assert_same(whitening_map(to_array(singular)), whitening_map(singular), to_array)
    A = whitening_map(X)[0]
    assert_same(
        _unwhiten(*map(to_array, (attention, projection, A))),
        _unwhiten(attention, projection, A),
        to_array,
    )


@pytest.mark.parametrize("to_array", array_namespaces())
def test_decoupling(to_array):
    X, Y, *_ = factored_planted(40, 3, 4, 2, 2, 5, seed=1, intercept=True)
    par = FactoredHeads(2, 5, 2)
    rng = np.random.default_rng(7)
    params = rng.normal(size=par.size)
    factors = rng.normal(size=(2, 2, 5))
    D, condition = decoupling_map(factors)
    D_moved, condition_moved = decoupling_map(to_array(factors))
    assert_same(D_moved, D, to_array)
    assert condition_moved == pytest.approx(condition, rel=RTOL)
    Xa, Ya, pa = map(to_array, (X, Y, params))
    assert_same(
        _output_factors(Xa, Ya, pa, par, None, True),
        _output_factors(X, Y, params, par, None, True),
        to_array,
    )
    for head in (0, 1):
        assert_same(
            _one_head_problem(Xa, Ya, pa, par, head, None, True),
            _one_head_problem(X, Y, params, par, head, None, True),
            to_array,
        )
    patterns, values = rng.uniform(size=(7, 2, 3, 3)), rng.normal(size=(7, 2, 3, 2))
    assert_same(
        _design(to_array(patterns), to_array(values), True),
        _design(patterns, values, True),
        to_array,
    )
    assert_same(_intercept_direction(Xa), _intercept_direction(X), to_array)


# -- out of memory: the chunk halves -------------------------------------------------


def fail_once(function):
    """``function``, raising ``MemoryError`` (what a device's out-of-memory error
    reads as) on its first call only; the calls are counted."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("simulated: out of memory")
        return function(*args, **kwargs)

    wrapped.calls = calls
    return wrapped


@pytest.mark.parametrize("chunked", [False, True])
def test_forward_halves_its_chunk_when_out_of_memory(data, monkeypatch, chunked):
    X, _, attention, projection, _ = data
    if chunked:
        monkeypatch.setattr(layer_math, "_FORWARD_CHUNK_FLOATS", 1000)
    expected = layer_math.forward(X, attention, projection)
    flaky = fail_once(layer_math.head_features)
    monkeypatch.setattr(layer_math, "head_features", flaky)
    out = layer_math.forward(X, attention, projection)
    assert len(flaky.calls) > 1
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-15)


def test_loss_and_normal_equations_halve_their_chunk_when_out_of_memory(
    data, monkeypatch
):
    X, Y, attention, projection, weights = data
    expected_loss = loss_module._loss_gradient(X, Y, attention, projection, weights)
    expected_normal = loss_module.projection_normal_equations(X, Y, attention, weights)
    flaky = fail_once(loss_module._squared_loss_gradient)
    monkeypatch.setattr(loss_module, "_squared_loss_gradient", flaky)
    out = loss_module._loss_gradient(X, Y, attention, projection, weights)
    assert len(flaky.calls) > 1
    for o, e in zip(out, expected_loss, strict=True):
        np.testing.assert_allclose(o, e, rtol=1e-12)
    flaky = fail_once(loss_module.attention_patterns)
    monkeypatch.setattr(loss_module, "attention_patterns", flaky)
    out = loss_module.projection_normal_equations(X, Y, attention, weights)
    assert len(flaky.calls) > 1
    for o, e in zip(out, expected_normal, strict=True):
        np.testing.assert_allclose(o, e, rtol=1e-12)


@pytest.mark.parametrize("to_array", [None, *array_namespaces()])
def test_varpro_problem_sheds_memory_when_out_of_memory(to_array, data, monkeypatch):
    X, Y, _, _, weights = data
    to_array = (lambda a: a) if to_array is None else to_array
    par = LowRank(2, 4, 2)
    rng = np.random.default_rng(8)
    params, direction = rng.normal(size=par.size), rng.normal(size=par.size)
    vector = rng.normal(size=Y.size)
    args = (to_array(X), to_array(Y), to_array(weights), par)
    moved = tuple(map(to_array, (params, direction, vector)))
    expected = evaluations(VarproProblem(*args), *moved)
    problem = VarproProblem(*args)
    # out of memory while evaluating: the kept states are dropped
    flaky = fail_once(varpro.softmax)
    monkeypatch.setattr(varpro, "softmax", flaky)
    residual = problem.residual(moved[0])
    assert len(flaky.calls) > 1 and not problem._keep
    assert_same(residual, to_numpy(expected[0]), to_array, rtol=1e-12)
    # out of memory in a product, with nothing kept: the chunks halve
    chunks = len(problem.slices)
    flaky = fail_once(varpro._softmax_jvp)
    monkeypatch.setattr(varpro, "_softmax_jvp", flaky)
    out = evaluations(problem, *moved)
    assert len(flaky.calls) > 1 and len(problem.slices) > chunks
    assert_same(out, tuple(to_numpy(e) for e in expected), to_array, rtol=1e-12)


def test_device_chunks_come_from_free_memory(data, monkeypatch):
    """On a device (simulated: ``free_memory`` says how many bytes are free) the
    chunks and the kept states follow the memory free, one thread; the same
    results."""
    X, Y, attention, projection, weights = data
    par = LowRank(2, 4, 2)
    rng = np.random.default_rng(9)
    params, direction = rng.normal(size=par.size), rng.normal(size=par.size)
    vector = rng.normal(size=Y.size)
    expected = evaluations(VarproProblem(X, Y, weights, par), params, direction, vector)
    expected_forward = layer_math.forward(X, attention, projection)
    expected_loss = loss_module._loss_gradient(X, Y, attention, projection, weights)
    free = 16 * 8 * 100  # bytes: chunks of a few samples, no state kept
    monkeypatch.setattr(varpro, "free_memory", lambda x: free)
    monkeypatch.setattr(layer_math, "free_memory", lambda x: free)
    problem = VarproProblem(X, Y, weights, par, n_jobs=4)
    assert problem.n_jobs == 1 and not problem._keep and len(problem.slices) > 1
    out = evaluations(problem, params, direction, vector)
    assert_same(out, expected, lambda a: a)
    assert loss_module._chunk_budget(X) == 100
    np.testing.assert_allclose(
        layer_math.forward(X, attention, projection), expected_forward, rtol=1e-13
    )
    out = loss_module._loss_gradient(X, Y, attention, projection, weights)
    for o, e in zip(out, expected_loss, strict=True):
        np.testing.assert_allclose(o, e, rtol=1e-12)
