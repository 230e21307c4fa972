"""Planted layers, sweep settings and fault injections shared by several test
modules.

Each test module imports what it needs (``from _helpers import planted``); a
helper used by one module only stays in that module.
"""

import numpy as np

from skattn import (
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    make_attention_regression,
)
from skattn.layer._math import forward
from skattn.solvers import PolishOptions, RandomStartOptions, fit_from_random_starts


def planted(
    n, k, d, m, d_out=None, scale=2.0, seed=0, gaussian=False, rank=None, noise=0.0
):
    """Data from a random layer: ``||Theta_i||_F = scale``, ``W ~ N(0, 1/d)``.

    Boolean tokens (Gaussian with ``gaussian=True``); heads of rank ``rank``
    (full rank when None); outputs noise-free, or with Gaussian noise of standard
    deviation ``noise``.  Returns ``(X, Y, attention, projection)``.
    """
    rng = np.random.default_rng(seed)
    d_out = d if d_out is None else d_out
    if rank is None:
        attention = rng.normal(size=(m, d, d))
    else:
        attention = rng.normal(size=(m, d, rank)) @ rng.normal(size=(m, rank, d))
    attention *= scale / np.linalg.norm(attention, axis=(1, 2), keepdims=True)
    projection = rng.normal(size=(m, d, d_out)) / np.sqrt(d)
    if gaussian:
        X = rng.normal(size=(n, k, d))
    else:
        X = rng.choice([-1.0, 1.0], size=(n, k, d))
    Y = forward(X, attention, projection)
    if noise:
        Y = Y + noise * rng.normal(size=(n, k, d_out))
    return X, Y, attention, projection


def phased_planted(
    n, k, d, m, *, d_out=None, distribution="boolean", scale=2.0, seed=0
):
    """A planted layer, same convention as ``make_attention_regression``.

    ``||Theta_i||_F = scale`` (the std of the logit between two independent tokens),
    ``W`` entries ~ N(0, 1/d).
    """
    rng = np.random.default_rng(seed)
    d_out = d if d_out is None else d_out
    G = rng.normal(size=(m, d, d))
    theta = scale * G / np.linalg.norm(G, axis=(1, 2), keepdims=True)
    W = rng.normal(size=(m, d, d_out)) / np.sqrt(d)
    if distribution == "boolean":
        X = rng.choice([-1.0, 1.0], size=(n, k, d))
    else:
        X = rng.normal(size=(n, k, d))
    return X, forward(X, theta, W), theta, W


def relative(a, b):
    """The relative error ``||a - b|| / ||b||``."""
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def factored_planted(n, k, d, m, r, d_out, seed=0, intercept=False):
    """Planted low-rank heads with W_i = V_i O_i on tokens [x, 1] (with an
    intercept that no rank-r W_i holds) or on Boolean x."""
    rng = np.random.default_rng(seed)
    X = rng.choice([-1.0, 1.0], size=(n, k, d))
    if intercept:
        X = np.concatenate([X, np.ones((n, k, 1))], axis=2)
        d += 1
    Q, K, V = (rng.normal(size=(m, d, r)) / np.sqrt(d) for _ in range(3))
    out = rng.normal(size=(m, r, d_out))
    projection = V @ out
    if intercept:
        projection[0, -1] += rng.normal(size=d_out)
    Y = forward(X, Q @ np.swapaxes(K, 1, 2), projection)
    return X, Y, np.concatenate([Q.ravel(), K.ravel(), V.ravel()])


def search_planted(n, k, d, m, r, d_out, seed=0, intercept=False):
    """Low-rank heads with W_i = V_i O_i (and an intercept on tokens [x, 1]), for
    the minibatch search: Gaussian tokens, parameters of ``FactoredHeads``."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, k, d))
    if intercept:
        X = np.concatenate([X, np.ones((n, k, 1))], axis=2)
        d += 1
    Q, K, V = (rng.normal(size=(m, d, r)) / np.sqrt(d) for _ in range(3))
    projection = V @ rng.normal(size=(m, r, d_out))
    if intercept:
        projection[0, -1] += rng.normal(size=d_out)
    Y = forward(X, 2 * Q @ np.swapaxes(K, 1, 2), projection)
    scale = np.sqrt(2)
    return X, Y, np.concatenate([scale * Q.ravel(), scale * K.ravel(), V.ravel()])


def refine_planted(n, k, d, m, r, d_out, seed=0, intercept=True, scale=1.0):
    """Low-rank heads ``W_i = V_i O_i`` on Gaussian tokens ``[x, 1]`` (with an
    output intercept) or on ``x``, for the per-head refinement: tokens, outputs,
    parameters, output factors."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, k, d))
    if intercept:
        X = np.concatenate([X, np.ones((n, k, 1))], axis=2)
        d += 1
    Q, K = (scale * rng.normal(size=(m, d, r)) / d**0.25 for _ in range(2))
    V = rng.normal(size=(m, d, r))
    factors = rng.normal(size=(m, r, d_out))
    projection = V @ factors
    if intercept:
        projection[0, -1] += rng.normal(size=d_out)
    Y = forward(X, Q @ np.swapaxes(K, 1, 2), projection)
    return X, Y, np.concatenate([Q.ravel(), K.ravel(), V.ravel()]), factors


def sharp_layer(n=300, k=4, d=6, m=2, r=4, d_out=8, sharpen=6.0, seed=3):
    """Two planted low-rank heads (``r >= k``), head 0 made sharp: tokens,
    outputs, parameters and their :class:`FactoredHeads`."""
    from skattn.solvers import FactoredHeads

    X, Y, truth, factors = refine_planted(
        n, k, d, m, r, d_out, seed=seed, intercept=False
    )
    par = FactoredHeads(m, d, r)
    Q, K, V = (f.copy() for f in par.factors(truth))
    Q[0] *= sharpen
    truth = np.concatenate([Q.ravel(), K.ravel(), V.ravel()])
    Y = forward(X, par.attention(truth), V @ factors)
    return X, Y, truth, par


def too_sharp_start(par, truth, seed=4):
    """``truth`` with head 0's ``Q`` three times too sharp and nudged: a start
    whose small weights are wrong by nats (the restart's case)."""
    Q, K, V = (f.copy() for f in par.factors(truth))
    Q[0] = 3 * Q[0] + 0.05 * np.random.default_rng(seed).normal(size=Q[0].shape)
    return np.concatenate([Q.ravel(), K.ravel(), V.ravel()])


def patch_head_solves(monkeypatch, modify):
    """Pass every one-head solve's result ``(q, k, values, info)`` through
    ``modify(X, head, result)``, whichever route solved it: one head at a time
    (``_rounds._solve_head``) or batched (``_rounds._solve_batch``)."""
    import skattn.solvers.stages._rounds as rounds

    solve, batch = rounds._solve_head, rounds._solve_batch

    def one(X, shares, head, *args, **kwargs):
        return modify(X, head, solve(X, shares, head, *args, **kwargs))

    def batched(X, shares, heads, *args, **kwargs):
        results = batch(X, shares, heads, *args, **kwargs)
        return [
            modify(X, head, result) for head, result in zip(heads, results, strict=True)
        ]

    monkeypatch.setattr(rounds, "_solve_head", one)
    monkeypatch.setattr(rounds, "_solve_batch", batched)


def fail_problems(monkeypatch, fails, residual=1.0, end=None):
    """Make the problems of the heads for which ``fails(head)`` is true report a
    relative residual of ``residual`` (not converged; 1: far, 1e-5: near); they
    are solved as usual, and with ``end(q, k, v)`` their ends replaced."""

    def solve_or_fail(X, head, result):
        q, kk, values, info = result
        if fails(head):
            info["relative_residual"] = residual
            if end is not None:
                q, kk, values = end(q, kk, values)
        return q, kk, values, info

    patch_head_solves(monkeypatch, solve_or_fail)


def nudged(scale, seed):
    """An ``end`` for :func:`fail_problems`: ``Q`` moved by ``scale`` noise."""
    rng = np.random.default_rng(seed)
    return lambda q, k, v: (q + scale * rng.normal(size=q.shape), k, v)


def head_one_once(times=1):
    """A ``fails`` for :func:`fail_problems`: head 1's first ``times`` problems."""
    left = {"head 1": times}

    def fails(head):
        if head == 1 and left["head 1"]:
            left["head 1"] -= 1
            return True
        return False

    return fails


def decoupled_after_the_search():
    """The decoupled record and the fit's residual of a minibatch search's fit."""
    X, Y, _, _ = refine_planted(600, 6, 6, 3, 2, 6, seed=9)
    _, _, info = fit_from_random_starts(
        X,
        Y,
        3,
        random_state=0,
        polish=PolishOptions(head_rank=2, intercept=True),
        starts=RandomStartOptions(start_search="minibatch"),
    )
    return info["start_search"]["decoupled"], info["relative_residual"]


def stall_head_one_below(monkeypatch, times):
    """Head 1's problem ends near (1e-5) and stops improving on fewer than
    ``times`` times the refinement's own sequences (as sharp heads do); returns
    the list that receives that number of sequences."""
    small = []

    def stalled(X, head, result):
        q, kk, values, info = result
        if not small:  # the first problem is on the refinement's own sequences
            small.append(len(X))
        if head == 1 and len(X) < times * small[0]:
            info["relative_residual"] = 1e-5
            q = nudged(1e-6, 19)(q, kk, values)[0]
        return q, kk, values, info

    patch_head_solves(monkeypatch, stalled)
    return small


def two_heads_regression(k, d):
    """``(X, y, layer)`` of a planted 2-head layer on ``k`` tokens of ``d``
    features, eight outputs per token, that the phased learner fits in a fraction
    of a second (the scikit-learn machinery and the scorers)."""
    return make_attention_regression(
        1500, k, d, 2, n_outputs=8, random_state=0, return_layer=True
    )


def one_head_regression(k, d):
    """``(X, y, layer)`` of a planted 1-head layer on ``k`` tokens of ``d``
    features that the gradient learner recovers exactly."""
    return make_attention_regression(300, k, d, 1, random_state=0, return_layer=True)


# The sweeps' tiny fits: one head, two tokens of four features, eight outputs per
# token (``planted=SWEEP_PLANTED``).
SWEEP_PLANTED = {"n_heads": 1, "n_tokens": 2, "n_features": 4, "n_outputs": 8}


def sweep_learners():
    """The phased and gradient learners of a sweep, sized by the planted layer (the
    gradient one stopped after ten iterations, so with a ConvergenceWarning)."""
    return {
        "phased": MultiHeadAttentionRegressor(n_heads="planted"),
        "gradient": GradientAttentionRegressor(n_heads="planted", max_iter=10),
    }


def no_fit(*args, **kwargs):
    """A fault injection for ``_sweep._run_cell``: bad input must stop a sweep
    before any fit starts."""
    raise AssertionError("a fit started before the input was checked")


def array_namespaces():
    """``pytest.param``s of the array namespaces other than numpy that the CPU
    tests cover: array-api-strict and torch on the CPU (each skipped when not
    installed).  Each value converts a numpy array: ``to_array(np_array)``."""
    import pytest

    params = []
    for name in ("array_api_strict", "torch"):
        try:
            module = __import__(name)
        except ImportError:  # pragma: no cover - both are in the test extra
            params.append(pytest.param(None, id=name, marks=pytest.mark.skip(name)))
            continue
        params.append(pytest.param(module.asarray, id=name))
    return params


def two_rank_four_heads(X, Y):
    """The fit's record of two heads of rank 4 (as many value features as the
    planted tokens, so that their patterns can be read) from a minibatch search."""
    return fit_from_random_starts(
        X,
        Y,
        2,
        random_state=0,
        polish=PolishOptions(head_rank=4, intercept=True),
        starts=RandomStartOptions(start_search="minibatch"),
    )[2]


# The words of the tiny decoders' texts (tests of decoder checkpoints).
WORDS = (
    "return the number of items in the list open the file and read every line "
    "raise a value error when the argument is negative or not a number the cache "
    "keeps the last result so that the next call is fast"
).split()


def word_text(path, size=1200, seed=0):
    """Write ``size`` random words of ``WORDS`` to ``path``; returns ``path``."""
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(rng.choice(WORDS, size=size)))
    return path


def tiny_bert_tensors(
    d=8,
    d_ff=12,
    n_layers=2,
    vocab=30,
    max_pos=10,
    *,
    prefix="",
    seed=0,
    dtype=np.float32,
    bias_scale=0.1,
    position_ids=False,
):
    """Random tensors of a small BERT in transformers' names (``prefix`` before
    each), drawn in float64 and stored in ``dtype``; with ``position_ids`` also
    the position-ids buffer transformers saves."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=0.5):
        return (scale * rng.normal(size=shape)).astype(dtype)

    t = {
        "embeddings.word_embeddings.weight": normal(vocab, d),
        "embeddings.position_embeddings.weight": normal(max_pos, d),
        "embeddings.token_type_embeddings.weight": normal(2, d),
        "embeddings.LayerNorm.weight": 1 + normal(d, scale=0.1),
        "embeddings.LayerNorm.bias": normal(d, scale=0.1),
    }
    if position_ids:
        t["embeddings.position_ids"] = np.arange(max_pos, dtype=np.int64)[None]
    shapes = {
        "attention.self.query": (d, d),
        "attention.self.key": (d, d),
        "attention.self.value": (d, d),
        "attention.output.dense": (d, d),
        "intermediate.dense": (d_ff, d),
        "output.dense": (d, d_ff),
    }
    for layer in range(n_layers):
        base = f"encoder.layer.{layer}."
        for name, shape in shapes.items():
            t[base + name + ".weight"] = normal(*shape)
            t[base + name + ".bias"] = normal(shape[0], scale=bias_scale)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[base + norm + ".weight"] = 1 + normal(d, scale=0.1)
            t[base + norm + ".bias"] = normal(d, scale=0.1)
    return {prefix + key: value for key, value in t.items()}


def blas_threads():
    """The threads numpy's BLAS runs now (1 for a BLAS built for one)."""
    from threadpoolctl import threadpool_info

    pools = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    return max(pools, default=1)


def record_polish_threads(monkeypatch, module):
    """Record, at each call of ``module.varpro_least_squares``, its ``n_jobs``
    and the BLAS threads it is called with: the list filled as calls come."""
    seen, solve = [], module.varpro_least_squares

    def recorded(*args, **kwargs):
        seen.append((kwargs.get("n_jobs"), blas_threads()))
        return solve(*args, **kwargs)

    monkeypatch.setattr(module, "varpro_least_squares", recorded)
    return seen
