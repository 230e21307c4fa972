"""Rotary heads' near-gauge mixings and their lift
(``solvers/kernels/_near_gauge.py``)."""

import numpy as np
import pytest
import scipy.linalg

from skattn.datasets import make_attention_regression
from skattn.layer._positions import key_head_index, rotary_frequencies, rotary_pairs
from skattn.solvers.kernels._near_gauge import (
    SlowMixing,
    lift_near_gauge,
    reflect_slow_dims,
    slow_rotary_dims,
)
from skattn.solvers.kernels._parametrization import LowRank, _group_index
from skattn.solvers.kernels._varpro import VarproProblem
from skattn.solvers.optimizers import _lm_matrix_free
from skattn.solvers.optimizers._lm_matrix_free import varpro_least_squares


def _planted(n=40, m=4, m_kv=2, d=12, k=32, r=8, seed=0):
    """A planted causal rotary layer (base 10 000) with grouped heads, its
    ``LowRank`` parametrization and the planted parameters."""
    X, y, layer = make_attention_regression(
        n, k, d, m, head_rank=r, causal=True, rope=True, n_kv_heads=m_kv,
        distribution="gaussian", random_state=seed, return_layer=True,
    )  # fmt: skip
    par = LowRank(m, d, r, n_kv_heads=m_kv, causal=True, rope_theta=layer.rope_theta)
    truth = np.concatenate([layer.rotary_query.ravel(), layer.rotary_key.ravel()])
    return X.reshape(n, k, d), y.reshape(n, k, -1), par, truth


def _lift(problem, par, p, orbit):
    """The lifted variables of ``problem`` at ``p``."""
    return lift_near_gauge(
        lambda v: problem.matvec(p, v),
        lambda u: problem.rmatvec(p, u, orthogonal=True),
        p,
        par.preconditioner(p),
        orbit,
        random_state=0,
    )


def _equal_position_forms(par, p):
    Q, K = par.factors(p)
    return Q @ np.swapaxes(K[key_head_index(par.n_heads, par.n_kv_heads)], 1, 2)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_slow_dims_are_the_pairs_that_turn_little_over_the_window(layout):
    r, base, k = 16, 10000.0, 32
    dims = slow_rotary_dims(r, base, layout, k)
    slow = rotary_frequencies(r, base) * (k - 1) <= np.pi / 2
    assert slow.sum() == 5  # pairs 3-7 at base 10 000, k = 32
    assert dims.tolist() == sorted(rotary_pairs(r, layout)[slow].ravel().tolist())


def test_mixings_keep_the_logits_at_equal_positions_and_have_exact_derivatives():
    rng = np.random.default_rng(0)
    m, m_kv, d, r = 4, 2, 5, 6
    par = LowRank(m, d, r, n_kv_heads=m_kv, rope_theta=100.0)
    p = rng.normal(size=par.size)
    dims = np.array([1, 2, 4, 5])
    orbit = SlowMixing(m, m_kv, d, r, dims, _group_index(par), p)
    E = rng.normal(size=(m_kv, 4, 4))
    G, H = scipy.linalg.expm(E), scipy.linalg.expm(-np.swapaxes(E, 1, 2))
    moved = orbit.act(p, G, H)
    assert not np.allclose(moved, p)
    np.testing.assert_allclose(
        _equal_position_forms(par, moved), _equal_position_forms(par, p), atol=1e-12
    )
    # derivative by central differences (act is linear in G and H), transpose exact
    dG, dH = rng.normal(size=(2, m_kv, 4, 4))
    step = orbit.act(p, G + dG, H + dH) - orbit.act(p, G - dG, H - dH)
    np.testing.assert_allclose(orbit.derivative(p, dG, dH), step / 2, atol=1e-12)
    g = rng.normal(size=par.size)
    A_G, A_H = orbit.derivative_transpose(p, g)
    assert np.isclose(
        orbit.derivative(p, dG, dH) @ g, np.sum(A_G * dG) + np.sum(A_H * dH)
    )


@pytest.fixture(scope="module")
def lifted():
    X, Y, par, truth = _planted()
    p = truth + 0.01 * np.random.default_rng(1).normal(size=truth.size)
    problem = VarproProblem(X, Y, None, par)
    dims = slow_rotary_dims(par.rank, par.rope_theta, "half", X.shape[1])
    orbit = SlowMixing(par.n_heads, 2, par.n_features, par.rank, dims, [0, 0, 1, 1], p)
    lift = _lift(problem, par, p, orbit)
    return problem, par, p, dims, lift


def test_the_lift_leaves_out_the_exact_gauge_and_whitens_the_rest(lifted):
    problem, par, p, dims, lift = lifted
    s = len(dims)
    # each pair's scaled rotations commute with every R(t): s of s^2 per key head
    assert lift.n_lifted == 2 * (s * s - s)
    z = lift.start(p)
    np.testing.assert_allclose(lift.point(z), p, atol=1e-12)
    columns = np.stack(
        [
            problem.matvec(p, lift.push(z, np.eye(z.size)[par.size + i]))
            for i in range(lift.n_lifted)
        ],
        axis=1,
    )
    gram = columns.T @ columns
    # one block a key head, each whitened (the blocks of two key heads'
    # mixings together are left out: memory linear in the key heads)
    q = lift.n_lifted // 2
    for g in range(2):
        block = gram[g * q : (g + 1) * q, g * q : (g + 1) * q]
        np.testing.assert_allclose(
            block, gram[0, 0] * np.eye(q), atol=1e-8 * gram[0, 0]
        )


def test_the_lift_moves_along_the_exact_orbit_with_exact_derivatives(lifted):
    problem, par, p, dims, lift = lifted
    rng = np.random.default_rng(2)
    z = lift.start(p)
    z[par.size :] = 1e-3 * rng.normal(size=lift.n_lifted)
    z[: par.size] += 1e-3 * rng.normal(size=par.size)
    moved_only = lift.start(p)
    moved_only[par.size :] = z[par.size :]
    # a mixing alone leaves the logits at equal positions as they were
    np.testing.assert_allclose(
        _equal_position_forms(par, lift.point(moved_only)),
        _equal_position_forms(par, p),
        atol=1e-10,
    )
    v, g = rng.normal(size=z.size), rng.normal(size=par.size)
    h = 1e-5
    central = (lift.point(z + h * v) - lift.point(z - h * v)) / (2 * h)
    pushed = lift.push(z, v)
    np.testing.assert_allclose(pushed, central, atol=1e-6 * np.abs(pushed).max())
    assert np.isclose(pushed @ g, v @ lift.pull(z, g), rtol=1e-10)


def test_lifted_polish_converges_where_truncated_steps_crawl():
    # 1 % noise in the slow pairs of a planted layer: the steps at 40 LSMR
    # iterations miss the slow mixings without the lift
    X, Y, par, truth = _planted()
    dims = slow_rotary_dims(par.rank, par.rope_theta, "half", X.shape[1])
    noise = np.zeros((par.n_heads + par.n_kv_heads, par.n_features, par.rank))
    noise[..., dims] = np.random.default_rng(1).normal(size=noise[..., dims].shape)
    start = truth + 0.01 * np.sqrt(np.mean(truth**2)) * noise.ravel()
    scale = np.linalg.norm(Y)
    ends = {}
    for near_gauge in ("auto", False):
        _, _, info = varpro_least_squares(
            X, Y, start, par, max_iter=16, coarse=False, max_products=40,
            near_gauge=near_gauge,
        )  # fmt: skip
        ends[near_gauge] = np.sqrt(2 * info["loss"]) / scale
    assert ends["auto"] < 1e-10
    assert ends[False] > 1e3 * ends["auto"]


def test_the_lift_is_whitened_on_a_share_of_the_sequences(monkeypatch):
    # 160 sequences, the Gram matrices of the lift from 18 of them (their
    # tokens 12 times the design's 48 columns): converged as with all
    X, Y, par, truth = _planted(n=160)
    dims = slow_rotary_dims(par.rank, par.rope_theta, "half", X.shape[1])
    noise = np.zeros((par.n_heads + par.n_kv_heads, par.n_features, par.rank))
    noise[..., dims] = np.random.default_rng(1).normal(size=noise[..., dims].shape)
    start = truth + 0.01 * np.sqrt(np.mean(truth**2)) * noise.ravel()
    seen = []
    lift = _lm_matrix_free.lift_near_gauge

    def counted(jvp, vjp, *args, **kwargs):
        if kwargs.get("scale") is None:
            seen.append(jvp(np.zeros(par.size)).shape[0])
        return lift(jvp, vjp, *args, **kwargs)

    monkeypatch.setattr(_lm_matrix_free, "lift_near_gauge", counted)
    _, _, info = varpro_least_squares(
        X, Y, start, par, max_iter=16, coarse=False, max_products=40
    )
    k, d_out = X.shape[1], Y.shape[2]
    width = VarproProblem(X, Y, None, par).width
    assert _lm_matrix_free.lift_sequences(160, k, width) == 18
    assert seen == [18 * k * d_out]  # whitened once, on 18 sequences
    assert np.sqrt(2 * info["loss"]) / np.linalg.norm(Y) < 1e-10


def test_a_reflected_slow_block_is_a_stationary_point_the_lift_cannot_leave():
    X, Y, par, truth = _planted()
    dims = slow_rotary_dims(par.rank, par.rope_theta, "half", X.shape[1])
    reflected = reflect_slow_dims(truth, par, 1, dims)
    np.testing.assert_allclose(
        _equal_position_forms(par, reflected), _equal_position_forms(par, truth)
    )
    np.testing.assert_array_equal(reflect_slow_dims(reflected, par, 1, dims), truth)
    scale = np.linalg.norm(Y)
    _, _, info = varpro_least_squares(
        X, Y, reflected, par, max_iter=12, coarse=False, max_products=40
    )
    assert np.sqrt(2 * info["loss"]) / scale > 1e-4


def test_key_shifts_along_a_constant_coordinate_are_lifted_with_exact_derivatives():
    # tokens [x, 1]: the key maps' shifts along the constant coordinate change
    # the slow block's logits only through the rotation (near-gauge too)
    X, Y, par, truth = _planted(n=20, d=8)
    X[..., -1] = 1.0
    constant = np.zeros(par.n_features)
    constant[-1] = 1.0
    p = truth + 0.01 * np.random.default_rng(1).normal(size=truth.size)
    problem = VarproProblem(X, Y, None, par)
    dims = slow_rotary_dims(par.rank, par.rope_theta, "half", X.shape[1])
    orbit = SlowMixing(
        par.n_heads, 2, par.n_features, par.rank, dims, [0, 0, 1, 1], p, constant
    )
    rng = np.random.default_rng(4)
    raw = rng.normal(size=orbit.n_mixings + orbit.n_shifts)
    g = rng.normal(size=par.size)
    assert orbit.n_shifts == 2 * len(dims)
    assert np.isclose(
        orbit.directions(p, raw) @ g, raw @ orbit.directions_transpose(p, g)
    )
    lift = _lift(problem, par, p, orbit)
    assert lift.n_lifted > orbit.n_mixings - 2 * len(dims)  # the shifts among them
    z = lift.start(p)
    z[par.size :] = 1e-3 * rng.normal(size=lift.n_lifted)
    v = rng.normal(size=z.size)
    h = 1e-7  # the shifts' scale is large: a smaller step
    central = (lift.point(z + h * v) - lift.point(z - h * v)) / (2 * h)
    pushed = lift.push(z, v)
    np.testing.assert_allclose(pushed, central, atol=1e-6 * np.abs(pushed).max())
    assert np.isclose(pushed @ g, v @ lift.pull(z, g), rtol=1e-10)


def test_the_lift_on_torch_equals_numpy_and_stays_there(lifted):
    # the exponential and its derivatives in the parameters' namespace: no host
    torch = pytest.importorskip("torch")
    problem, par, p, dims, lift = lifted
    rng = np.random.default_rng(5)
    z = lift.start(p)
    z[par.size :] = 1e-2 * rng.normal(size=lift.n_lifted)
    v, g = rng.normal(size=z.size), rng.normal(size=par.size)
    orbit = SlowMixing(
        par.n_heads, 2, par.n_features, par.rank, dims, [0, 0, 1, 1], torch.zeros(1)
    )
    moved = lift_near_gauge(None, None, p, None, orbit, scale=lift.scale)
    t = {name: torch.asarray(a) for name, a in (("z", z), ("v", v), ("g", g))}
    plain = lift_near_gauge(None, None, p, None, lift.orbit, scale=lift.scale)
    for method, args, numpy_args in [
        ("point", (t["z"],), (z,)),
        ("push", (t["z"], t["v"]), (z, v)),
        ("pull", (t["z"], t["g"]), (z, g)),
    ]:
        out = getattr(moved, method)(*args)
        assert isinstance(out, torch.Tensor)
        np.testing.assert_allclose(
            out.numpy(), getattr(plain, method)(*numpy_args), rtol=1e-12, atol=1e-12
        )
