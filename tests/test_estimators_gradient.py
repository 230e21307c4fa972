import warnings

import numpy as np
import pytest
import scipy.sparse
from sklearn.exceptions import ConvergenceWarning

import skattn.solvers.kernels._loss as optimize
from skattn.datasets import make_attention_regression
from skattn.estimators import GradientAttentionRegressor
from skattn.layer._math import forward
from skattn.metrics import parameter_error
from skattn.solvers.kernels._loss import _penalized_loss_gradient
from skattn.solvers.kernels._parametrization import _Unknowns


def plant(n, *, d=8, k=4, m=2, d_out=8, scale=2.0, noise=0.0, seed=0):
    """Boolean tokens and a planted layer with ||Theta_i||_F = scale, W ~ N(0, 1/d)."""
    rng = np.random.default_rng(seed)
    attention = rng.normal(size=(m, d, d))
    attention *= scale / np.linalg.norm(attention, axis=(1, 2), keepdims=True)
    projection = rng.normal(size=(m, d, d_out)) / np.sqrt(d)
    X = rng.choice([-1.0, 1.0], size=(n, k, d))
    Y = forward(X, attention, projection) + noise * rng.normal(size=(n, k, d_out))
    return X, Y.reshape(n, k * d_out), attention, projection


def test_exact_recovery_of_planted_benign_layer():
    # d=8, k=4, m=2, Boolean tokens, ||Theta_i||_F = 2, W ~ N(0, 1/d), no noise.
    X, y, layer = make_attention_regression(
        2000, 4, 8, 2, attention_scale=2.0, random_state=0, return_layer=True
    )
    reg = GradientAttentionRegressor(
        n_heads=2, n_tokens=4, tol=1e-10, max_iter=2000, random_state=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        reg.fit(X, y)
    errors = parameter_error(layer, reg)  # Hungarian head matching
    assert errors.attention_error <= 1e-6
    assert errors.projection_error <= 1e-6
    assert reg.loss_ < 1e-12
    assert reg.loss_ == pytest.approx(reg.loss_curve_[-1])
    assert len(reg.loss_curve_) == reg.n_iter_
    # the curve of a line-search method never goes up
    assert np.all(np.diff(reg.loss_curve_) <= 1e-15)


@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_objective_gradient_matches_finite_differences(alpha):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(7, 3, 4))
    Y = rng.normal(size=(7, 3, 2))
    weight = rng.uniform(0.0, 2.0, size=7)
    attention = rng.normal(size=(2, 4, 4))
    projection = rng.normal(size=(2, 4, 2))
    # chunk_size=3 also exercises the chunked accumulation
    loss, g_att, g_proj = _penalized_loss_gradient(
        X, Y, attention, projection, weight, alpha, 3
    )
    unknowns = _Unknowns(2, 4, 2)
    params = unknowns.pack(attention, projection)

    def value(p):
        return _penalized_loss_gradient(X, Y, *unknowns.unpack(p), weight, alpha, 3)[0]

    step = 1e-6
    numeric = np.array(
        [
            (value(params + step * e) - value(params - step * e)) / (2 * step)
            for e in np.eye(params.size)
        ]
    )
    analytic = unknowns.gradient(params, g_att, g_proj)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    assert loss == pytest.approx(value(params), rel=1e-14)


def test_objective_does_not_depend_on_chunking():
    rng = np.random.default_rng(2)
    X = rng.choice([-1.0, 1.0], size=(50, 4, 3))
    Y = rng.normal(size=(50, 4, 2))
    weight = rng.integers(0, 3, size=50).astype(float)
    attention, projection = rng.normal(size=(3, 3, 3)), rng.normal(size=(3, 3, 2))
    whole = _penalized_loss_gradient(X, Y, attention, projection, weight, 0.1, 50)
    chunked = _penalized_loss_gradient(X, Y, attention, projection, weight, 0.1, 7)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_weighted_objective_equals_repeated_samples():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(20, 3, 2))
    Y = rng.normal(size=(20, 3, 2))
    weight = rng.integers(0, 4, size=20)
    attention, projection = rng.normal(size=(2, 2, 2)), rng.normal(size=(2, 2, 2))
    weighted = _penalized_loss_gradient(
        X, Y, attention, projection, weight.astype(float), 0.2
    )
    repeated = _penalized_loss_gradient(
        np.repeat(X, weight, axis=0),
        np.repeat(Y, weight, axis=0),
        attention,
        projection,
        np.ones(weight.sum()),
        0.2,
    )
    for a, b in zip(weighted, repeated, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_sample_weight_equivalent_to_repeated_samples_lbfgs():
    # noisy (not realizable) data, so the weights change the optimum
    X, y, _, _ = plant(60, d=3, k=3, m=1, d_out=2, scale=1.0, noise=0.3, seed=4)
    weight = np.random.default_rng(5).integers(0, 4, size=60)
    params = dict(n_heads=1, n_tokens=3, tol=1e-12, max_iter=3000, random_state=0)
    weighted = GradientAttentionRegressor(**params).fit(X, y, sample_weight=weight)
    repeated = GradientAttentionRegressor(**params).fit(
        np.repeat(X, weight, axis=0), np.repeat(y, weight, axis=0)
    )
    unweighted = GradientAttentionRegressor(**params).fit(X, y)
    np.testing.assert_allclose(weighted.predict(X), repeated.predict(X), atol=1e-7)
    assert weighted.loss_ == pytest.approx(repeated.loss_, rel=1e-9, abs=1e-14)
    assert not np.allclose(weighted.predict(X), unweighted.predict(X), atol=1e-3)


@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
def test_refits_are_bit_identical_under_random_state(optimizer):
    X, y, _, _ = plant(200, d=4, k=3, m=2, d_out=3, seed=6)
    params = dict(
        n_heads=2,
        n_tokens=3,
        optimizer=optimizer,
        max_iter=15,
        n_restarts=2,
        random_state=7,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        first = GradientAttentionRegressor(**params).fit(X, y)
        second = GradientAttentionRegressor(**params).fit(X, y)
        other = GradientAttentionRegressor(**{**params, "random_state": 8}).fit(X, y)
    np.testing.assert_array_equal(first.attention_, second.attention_)
    np.testing.assert_array_equal(first.projection_, second.projection_)
    np.testing.assert_array_equal(first.restart_losses_, second.restart_losses_)
    assert first.loss_curve_ == second.loss_curve_
    assert not np.array_equal(first.attention_, other.attention_)


def test_partial_fit_reaches_the_loss_of_fit_on_the_union():
    X, y, _, _ = plant(800, d=4, k=3, m=1, d_out=4, scale=1.5, seed=8)
    params = dict(
        n_heads=1, n_tokens=3, optimizer="adam", learning_rate=0.01, random_state=0
    )
    epochs = 60
    full = GradientAttentionRegressor(**params, max_iter=epochs, tol=0.0)
    with pytest.warns(ConvergenceWarning):  # tol=0: runs all epochs, then warns
        full.fit(X, y)
    online = GradientAttentionRegressor(**params)
    for _ in range(epochs):
        for batch in np.array_split(np.arange(800), 4):
            online.partial_fit(X[batch], y[batch])
    assert online.n_iter_ == 4 * epochs
    assert len(online.loss_curve_) == 4 * epochs

    def training_loss(reg):
        return np.mean(np.sum((reg.predict(X) - y) ** 2, axis=1)) / 2

    start = GradientAttentionRegressor(**params).partial_fit(X, y)
    initial = training_loss(start)
    # both train the loss down by orders of magnitude and agree to 20 %
    assert training_loss(full) < 1e-3 * initial
    assert training_loss(online) < 1e-3 * initial
    assert training_loss(online) == pytest.approx(training_loss(full), rel=0.2)


def test_partial_fit_only_with_adam_and_checks_widths():
    lbfgs = GradientAttentionRegressor(optimizer="lbfgs")
    assert not hasattr(lbfgs, "partial_fit")
    with pytest.raises(
        AttributeError,
        match=r"partial_fit needs optimizer='adam' .*optimizer='lbfgs'.*"
        r"GradientAttentionRegressor\(optimizer='adam'\)",
    ):
        lbfgs.partial_fit(np.ones((2, 2)), np.ones((2, 2)))
    X, y, _, _ = plant(40, d=3, k=2, m=1, d_out=2, seed=9)
    reg = GradientAttentionRegressor(n_tokens=2, optimizer="adam", random_state=0)
    reg.partial_fit(X, y)
    with pytest.raises(ValueError, match="features"):
        reg.partial_fit(X.reshape(40, -1)[:, :4], y)
    with pytest.raises(ValueError, match="columns"):
        reg.partial_fit(X, y[:, :3])


@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
def test_warm_start_continues_from_previous_solution(optimizer):
    X, y, _, _ = plant(300, d=4, k=3, m=2, d_out=3, seed=10)
    params = dict(
        n_heads=2, n_tokens=3, optimizer=optimizer, max_iter=5, tol=0.0, random_state=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        cold = GradientAttentionRegressor(**params).fit(X, y)
        warm = GradientAttentionRegressor(**params, warm_start=True).fit(X, y)
        first_loss = warm.loss_
        warm.fit(X, y)
        refit_cold = GradientAttentionRegressor(**params).fit(X, y)
    assert cold.loss_ == first_loss
    assert warm.loss_ < first_loss
    assert len(warm.restart_losses_) == 1
    assert refit_cold.loss_ == cold.loss_  # without warm_start: the same start
    with pytest.raises(ValueError, match="warm_start"):
        warm.set_params(n_heads=3).fit(X, y)


@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
def test_convergence_warning_when_max_iter_runs_out(optimizer):
    X, y, _, _ = plant(200, d=4, k=3, m=2, d_out=3, seed=11)
    reg = GradientAttentionRegressor(
        n_heads=2,
        n_tokens=3,
        optimizer=optimizer,
        max_iter=2,
        tol=1e-12,
        random_state=0,
    )
    with pytest.warns(ConvergenceWarning, match="increase max_iter"):
        reg.fit(X, y)
    assert reg.n_iter_ == 2
    assert reg.stop_reason_ == "max_iter"


def test_stop_reason_and_the_precision_each_tolerance_reaches():
    X, y, layer = make_attention_regression(
        300, 4, 4, 1, random_state=0, return_layer=True
    )
    errors, iters = {}, {}
    for tol in (1e-6, 0.0):
        reg = GradientAttentionRegressor(n_tokens=4, tol=tol, random_state=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)
            reg.fit(X, y)
        e = parameter_error(layer, reg)
        errors[tol] = max(e.attention_error, e.projection_error)
        iters[tol] = reg.n_iter_
        # tol met, or (tol=0) no step decreases the loss any more
        assert reg.stop_reason_ == ("gradient" if tol else "no_decrease")
    # the default stops near its gradient tolerance; tol=0 runs to the floor
    assert errors[1e-6] > 1e-9 and errors[0.0] < 1e-13
    assert iters[0.0] > iters[1e-6]
    adam = GradientAttentionRegressor(
        n_tokens=4, optimizer="adam", tol=1e-2, n_iter_no_change=2, random_state=0
    ).fit(X, y)
    assert adam.stop_reason_ == "no_decrease" and adam.n_iter_ < adam.max_iter
    adam.partial_fit(X, y)
    assert adam.stop_reason_ == "partial_fit"


def test_single_token_is_linear_and_converges_at_once():
    rng = np.random.default_rng(12)
    X = rng.normal(size=(100, 5))
    coef = rng.normal(size=(5, 3))
    y = X @ coef
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        reg = GradientAttentionRegressor(n_heads=2, random_state=0).fit(X, y)
    assert reg.n_tokens_ == 1
    assert reg.n_iter_ <= 2
    np.testing.assert_allclose(reg.projection_.sum(axis=0), coef, atol=1e-8)
    np.testing.assert_allclose(reg.predict(X), y, atol=1e-8)
    reg_1d = GradientAttentionRegressor(random_state=0).fit(X, y[:, 0])
    assert reg_1d.predict(X).shape == (100,)


def test_restarts_keep_the_lowest_loss():
    X, y, _, _ = plant(200, d=4, k=3, m=2, d_out=3, noise=0.5, seed=13)
    reg = GradientAttentionRegressor(
        n_heads=2, n_tokens=3, n_restarts=3, max_iter=20, random_state=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        reg.fit(X, y)
    assert reg.restart_losses_.shape == (3,)
    assert reg.loss_ == reg.restart_losses_.min()
    assert len(np.unique(reg.restart_losses_)) == 3


def test_more_heads_than_the_target():
    X, y, _, _ = plant(400, d=4, k=3, m=1, d_out=3, scale=1.5, seed=14)
    reg = GradientAttentionRegressor(
        n_heads=3, n_tokens=3, tol=1e-9, max_iter=1000, random_state=0
    ).fit(X, y)
    assert reg.attention_.shape == (3, 4, 4)
    assert reg.loss_ < 1e-8


def test_ridge_shrinks_parameters():
    X, y, _, _ = plant(200, d=4, k=3, m=1, d_out=3, seed=15)
    params = dict(n_heads=1, n_tokens=3, tol=1e-9, max_iter=500, random_state=0)
    plain = GradientAttentionRegressor(**params).fit(X, y)
    ridge = GradientAttentionRegressor(**params, alpha=1.0).fit(X, y)
    assert np.linalg.norm(ridge.projection_) < np.linalg.norm(plain.projection_)
    assert np.linalg.norm(ridge.attention_) < np.linalg.norm(plain.attention_)


def test_verbose_reports_progress(capsys):
    X, y, _, _ = plant(50, d=3, k=2, m=1, d_out=2, seed=16)
    with pytest.warns(ConvergenceWarning):
        GradientAttentionRegressor(n_tokens=2, max_iter=3, verbose=2).fit(X, y)
    captured = capsys.readouterr()
    assert "loss" in captured.out
    assert "GradientAttentionRegressor" in captured.err


@pytest.mark.parametrize(
    "params, match",
    [
        ({"optimizer": "sgd"}, "optimizer"),
        ({"n_heads": 0}, "n_heads"),
        ({"alpha": -1.0}, "alpha"),
        ({"max_iter": 0}, "max_iter"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"batch_size": 0}, "batch_size"),
        ({"n_tokens": 5}, "divisible"),
    ],
)
def test_bad_parameters_raise(params, match):
    X, y, _, _ = plant(20, d=3, k=2, m=1, d_out=2, seed=17)
    with pytest.raises(ValueError, match=match):
        GradientAttentionRegressor(**params).fit(X.reshape(20, -1), y)


def test_bad_data_raise():
    X, y, _, _ = plant(20, d=3, k=2, m=1, d_out=2, seed=18)
    reg = GradientAttentionRegressor(n_tokens=2)
    with pytest.raises(ValueError, match="negative"):
        reg.fit(X, y, sample_weight=-np.ones(20))
    with pytest.raises(ValueError, match="zero"):
        reg.fit(X, y, sample_weight=np.zeros(20))
    X_nan = X.copy()
    X_nan[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        reg.fit(X_nan, y)
    with pytest.raises(ValueError, match="not divisible"):
        reg.fit(X, y[:, :3])


def test_ragged_sparse_and_huge_data_raise_clear_errors():
    X, y, _, _ = plant(20, d=3, k=2, m=1, d_out=2, seed=18)
    reg = GradientAttentionRegressor(n_tokens=2, max_iter=3)
    rows = [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0]]
    with pytest.raises(ValueError, match=r"X is a ragged list: its rows have lengths"):
        reg.fit(rows, [[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(ValueError, match=r"y is a ragged list: .*\(n_samples, n_tok"):
        reg.fit(np.ones((2, 4)), [[1.0, 2.0], [3.0]])
    with pytest.raises(TypeError, match=r"y is a sparse csr_matrix.*y.toarray\(\)"):
        reg.fit(X, scipy.sparse.csr_matrix(y))
    rescale_x = r"X has entries up to 1e\+200 .*Rescale X \(e.g. with sklearn\."
    with pytest.raises(ValueError, match=rescale_x):
        reg.fit(X * 1e200, y)
    rescale_y = r"y has entries up to .*Rescale y \(e.g. with sklearn.compose.Transf"
    with pytest.raises(ValueError, match=rescale_y):
        reg.fit(X, y * 1e200)
    # the same checks in partial_fit, on the later batches too
    adam = GradientAttentionRegressor(n_tokens=2, optimizer="adam", random_state=0)
    with pytest.raises(ValueError, match=rescale_y):
        adam.partial_fit(X, y * 1e200)
    adam.partial_fit(X, y)
    with pytest.raises(TypeError, match="y is a sparse"):
        adam.partial_fit(X, scipy.sparse.csr_matrix(y))
    with pytest.raises(ValueError, match=rescale_x):
        adam.partial_fit(X * 1e200, y)
    with pytest.raises(ValueError, match="y is a ragged list"):
        adam.partial_fit(X[:2], [[1.0, 2.0, 3.0, 4.0], [1.0]])


def test_fit_in_chunks_matches_fit_in_one_piece(monkeypatch):
    X, y, _, _ = plant(100, d=4, k=3, m=2, d_out=3, seed=19)
    params = dict(n_heads=2, n_tokens=3, max_iter=30, tol=0.0, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        whole = GradientAttentionRegressor(**params).fit(X, y)
        # 2 heads * 3 tokens * 4 features = 24 entries per sample: chunks of 7
        monkeypatch.setattr(optimize, "_CHUNK_FLOATS", 7 * 24)
        assert optimize._loss_chunk_size(100, 3, 4, 3, 2) == 7
        chunked = GradientAttentionRegressor(**params).fit(X, y)
    np.testing.assert_allclose(chunked.attention_, whole.attention_, atol=1e-8)
    np.testing.assert_allclose(chunked.projection_, whole.projection_, atol=1e-8)


def test_low_rank_heads_by_lbfgs_on_the_factors():
    X, y, layer = make_attention_regression(
        2000,
        4,
        8,
        2,
        n_outputs=8,
        distribution="gaussian",
        head_rank=2,
        random_state=0,
        return_layer=True,
    )
    est = GradientAttentionRegressor(
        n_heads=2, n_tokens=4, head_rank=2, max_iter=3000, tol=1e-10, random_state=0
    ).fit(X, y)
    assert max(np.linalg.matrix_rank(t, tol=1e-8) for t in est.attention_) == 2
    assert max(np.linalg.matrix_rank(w, tol=1e-8) for w in est.projection_) == 2
    errors = parameter_error(layer, est)
    assert errors.attention_error < 1e-4 and errors.projection_error < 1e-4


def test_low_rank_factor_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 3, 4))
    Y = rng.normal(size=(20, 3, 5))
    unknowns = _Unknowns(2, 4, 5, head_rank=2)
    assert (
        unknowns.size == 3 * 2 * 4 * 2 + 2 * 2 * 5
    )  # Q, K, V (m, d, r), O (m, r, d_out)
    params = rng.normal(size=unknowns.size)

    def objective(p):
        loss, g_att, g_proj = _penalized_loss_gradient(
            X, Y, *unknowns.unpack(p), None, 0.1, None
        )
        return loss, unknowns.gradient(p, g_att, g_proj)

    _, grad = objective(params)
    eps = 1e-6
    for j in rng.choice(params.size, size=10, replace=False):
        step = np.zeros_like(params)
        step[j] = eps
        up = objective(params + step)[0]
        down = objective(params - step)[0]
        assert grad[j] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)


def test_unknowns_pack_the_layer_and_unpack_it():
    rng = np.random.default_rng(3)
    attention = rng.normal(size=(2, 4, 2)) @ rng.normal(size=(2, 2, 4))
    projection = rng.normal(size=(2, 4, 2)) @ rng.normal(size=(2, 2, 5))
    for head_rank, size in [(None, 2 * 16 + 2 * 20), (2, 2 * 2 * 8 + 2 * 2 * 9)]:
        unknowns = _Unknowns(2, 4, 5, head_rank)
        params = unknowns.pack(attention, projection)
        assert params.shape == (size,)
        back_attention, back_projection = unknowns.unpack(params)
        np.testing.assert_allclose(back_attention, attention, atol=1e-12)
        np.testing.assert_allclose(back_projection, projection, atol=1e-12)


def test_head_rank_needs_lbfgs():
    X, y = make_attention_regression(50, 3, 4, 1, random_state=0)
    est = GradientAttentionRegressor(n_tokens=3, head_rank=2, optimizer="adam")
    with pytest.raises(ValueError, match="head_rank=2 needs optimizer='lbfgs'"):
        est.fit(X, y)
    with pytest.raises(ValueError, match="does not support head_rank=2"):
        est.partial_fit(X, y)
