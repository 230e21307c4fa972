"""Bad input, case by case: a clear error and no side effect.

Every public estimator, AttentionLayer, the dataset functions and the scorers are
fed each kind of bad input; each call must raise the documented exception with a
message naming the parameter (or the fix), and must leave the caller's arrays
exactly as they were.
"""

import numpy as np
import pytest
from sklearn.exceptions import NotFittedError

from skattn import (
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    RandomAttentionFeatures,
    RandomFeatureAttentionRegressor,
    make_attention_layer,
    make_attention_regression,
)
from skattn.datasets import (
    BooleanTokens,
    GaussianTokens,
    TokenizedMixture,
    sample_inputs,
)
from skattn.metrics import make_recovery_scorer, relative_prediction_error
from skattn.utils.discovery import all_estimators

K, D, D_OUT, N = 3, 4, 8, 60  # tokens, features, outputs per token, samples


def _layer(n_heads=1, **params):
    planted = make_attention_layer(n_heads, D, n_outputs=D_OUT, random_state=0)
    return AttentionLayer(planted.attention, planted.projection, **params)


# name -> (factory with n_tokens=K, whether fit takes y, target per token?)
FACTORIES = {
    "AttentionLayer": lambda: _layer(n_tokens=K),
    "GradientAttentionRegressor": lambda: GradientAttentionRegressor(
        n_tokens=K, random_state=0
    ),
    "MultiHeadAttentionRegressor": lambda: MultiHeadAttentionRegressor(
        n_tokens=K, polish=False, random_state=0
    ),
    "RandomAttentionFeatures": lambda: RandomAttentionFeatures(
        n_heads=5, n_tokens=K, random_state=0
    ),
    "RandomFeatureAttentionRegressor": lambda: RandomFeatureAttentionRegressor(
        n_heads=5, n_tokens=K, random_state=0
    ),
}
SUPERVISED = {
    "GradientAttentionRegressor",
    "MultiHeadAttentionRegressor",
    "RandomFeatureAttentionRegressor",
}
PER_TOKEN = ["GradientAttentionRegressor", "MultiHeadAttentionRegressor"]
NAMES = sorted(FACTORIES)
REGRESSORS = sorted(SUPERVISED)


def test_every_public_estimator_is_covered():
    assert NAMES == [name for name, _ in all_estimators()]


@pytest.fixture(scope="module")
def data():
    X, y = make_attention_regression(N, K, D, 1, n_outputs=D_OUT, random_state=0)
    return X, y


def _target(name, y):
    """Per-token targets, or one output vector per sequence for the RF baseline."""
    return y if name in PER_TOKEN else y[:, :D_OUT]


def _fit(name, X, y, **fit_params):
    est = FACTORIES[name]()
    if name in SUPERVISED:
        return est.fit(X, _target(name, y) if y is not None else y, **fit_params)
    return est.fit(X)


def _apply(est, X):
    return est.predict(X) if hasattr(est, "predict") else est.transform(X)


def _raises(exc, match, func, *arrays, **kwarrays):
    """``func(*arrays, **kwarrays)`` raises ``exc`` (``match``), arrays untouched."""
    copies = [np.array(a, copy=True) for a in arrays]
    kwcopies = {k: np.array(v, copy=True) for k, v in kwarrays.items()}
    with pytest.raises(exc, match=match):
        func(*arrays, **kwarrays)
    for before, after in zip(copies, arrays, strict=True):
        np.testing.assert_array_equal(after, before, strict=True)
    for key, before in kwcopies.items():
        np.testing.assert_array_equal(kwarrays[key], before, strict=True)


def _fit_call(name):
    """``call(X, y, **fit_params)`` for the estimator, whatever its fit signature."""

    def call(X, y=None, **fit_params):
        return _fit(name, X, y, **fit_params)

    return call


def _with(X, index, value):
    X = X.copy()
    X[index] = value
    return X


@pytest.mark.parametrize("name", NAMES)
def test_valid_calls_leave_inputs_untouched(name, data):
    """The no-side-effect half of the contract, on calls that succeed."""
    X, y = data
    weights = np.linspace(0.5, 1.5, N)
    for X_in in (X, X.reshape(N, K, D)):
        copies = X_in.copy(), y.copy(), weights.copy()
        fit_params = {"sample_weight": weights} if name in SUPERVISED else {}
        _apply(_fit(name, X_in, y, **fit_params), X_in)
        for before, after in zip(copies, (X_in, y, weights), strict=True):
            np.testing.assert_array_equal(after, before, strict=True)


# -- NaN and infinity ---------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "value, match", [(np.nan, "Input X contains NaN"), (np.inf, "Input X contains inf")]
)
def test_non_finite_X_in_fit_and_apply(name, value, match, data):
    X, y = data
    bad = _with(X, (3, 5), value)
    _raises(ValueError, match, _fit_call(name), bad, y)
    fitted = _fit(name, X, y)
    _raises(ValueError, match, lambda Z: _apply(fitted, Z), bad)


@pytest.mark.parametrize("name", REGRESSORS)
@pytest.mark.parametrize(
    "value, match", [(np.nan, "Input y contains NaN"), (np.inf, "Input y contains inf")]
)
def test_non_finite_y(name, value, match, data):
    X, y = data
    _raises(ValueError, match, _fit_call(name), X, _with(y, (0, 1), value))


@pytest.mark.parametrize("name", NAMES)
def test_apply_before_fit(name, data):
    X, _ = data
    bad = _with(X, (0, 0), np.nan)
    if name == "AttentionLayer":  # usable unfitted, so it validates on its own
        _raises(ValueError, "Input X contains NaN", _layer().transform, bad)
        assert _layer().transform(X).shape == (N, K * D_OUT)
    else:
        unfitted = FACTORIES[name]()
        _raises(NotFittedError, "not fitted yet", lambda Z: _apply(unfitted, Z), bad)


# -- wrong rank -----------------------------------------------------------------------

RANK_MATCH = r"X must be 2-D \(n_samples, n_tokens \* n_features\) or 3-D"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(N * K * D,), (N, K, 2, 2)], ids=["1d", "4d"])
def test_wrong_rank_X(name, shape, data):
    X, y = data
    _raises(ValueError, RANK_MATCH, _fit_call(name), X.reshape(shape), y)
    fitted = _fit(name, X, y)
    one_sequence = X[0] if len(shape) == 1 else X.reshape(shape)
    match = RANK_MATCH + ".*Reshape your data"
    _raises(ValueError, match, lambda Z: _apply(fitted, Z), one_sequence)


@pytest.mark.parametrize("name", PER_TOKEN)
def test_3d_y_is_rejected_with_the_fix(name, data):
    X, y = data
    _raises(
        ValueError,
        r"y must be 2-D .*y.reshape\(len\(y\), -1\)",
        _fit_call(name),
        X,
        y.reshape(N, K, D_OUT),
    )


# -- widths and token counts -----------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_width_not_divisible_by_n_tokens(name, data):
    X, y = data
    _raises(
        ValueError,
        r"X has 11 columns, which is not divisible by n_tokens=3",
        _fit_call(name),
        X[:, :11],
        y,
    )


@pytest.mark.parametrize("name", PER_TOKEN)
def test_y_width_not_divisible_by_n_tokens(name, data):
    X, y = data
    _raises(
        ValueError,
        r"y has 23 columns, which is not divisible by n_tokens=3",
        _fit_call(name),
        X,
        y[:, :23],
    )
    _raises(ValueError, r"y is 1-D but n_tokens=3", _fit_call(name), X, y[:, 0])


@pytest.mark.parametrize("name", NAMES)
def test_3d_X_with_another_n_tokens(name, data):
    X, y = data
    X3 = X.reshape(N, 2, K * D // 2)  # 2 tokens of 6 features, estimator says 3
    _raises(
        ValueError, r"n_tokens=3 but X is 3-D with 2 tokens", _fit_call(name), X3, y
    )
    fitted = _fit(name, X, y)
    _raises(ValueError, r"3-D with 2 tokens", lambda Z: _apply(fitted, Z), X3)


@pytest.mark.parametrize("name", NAMES)
def test_apply_with_another_width_than_fit(name, data):
    X, y = data
    fitted = _fit(name, X, y)
    match = rf"X has 8 features, but {name} is expecting 12 features"
    _raises(ValueError, match, lambda Z: _apply(fitted, Z), X[:, :8])


def test_unfitted_layer_checks_widths_against_its_parameters(data):
    X, _ = data
    _raises(
        ValueError,
        r"X has 10 columns, not a multiple of the layer's n_features=4",
        _layer().transform,
        X[:, :10],
    )
    _raises(
        ValueError,
        r"2 tokens x 6 features, but the layer expects 4 features per token",
        _layer(n_tokens=2).transform,
        X,
    )


@pytest.mark.parametrize("name", NAMES)
def test_invalid_n_tokens_parameter(name, data):
    X, y = data
    est = FACTORIES[name]().set_params(n_tokens=0)
    fit = (
        est.fit if name not in SUPERVISED else (lambda Z: est.fit(Z, _target(name, y)))
    )
    _raises(ValueError, r"'n_tokens' parameter", fit, X)


# -- AttentionLayer parameters --------------------------------------------------------


@pytest.mark.parametrize(
    "attention_shape, projection_shape, match",
    [
        ((2, D, D), (3, D, D_OUT), "attention has 2 heads but projection has 3"),
        ((2, D, 3), (2, D, D_OUT), r"attention must have shape \(n_heads, n_features"),
        ((D,), (1, D, D_OUT), r"attention must have shape \(n_heads, n_features"),
        ((1, 1, D, D), (1, D, D_OUT), r"attention must have shape"),
        ((1, D, D), (D_OUT,), r"projection must have shape \(n_heads, n_features"),
        ((1, D, D), (1, 3, D_OUT), r"attention acts on 4 features .* projection"),
    ],
)
@pytest.mark.parametrize("method", ["fit", "transform", "attention_patterns"])
def test_layer_parameter_shapes(attention_shape, projection_shape, match, method, data):
    X, _ = data
    attention, projection = np.ones(attention_shape), np.ones(projection_shape)
    layer = AttentionLayer(attention, projection, n_tokens=K)
    _raises(ValueError, match, getattr(layer, method), X)
    # The parameters are the caller's arrays too: never modified, never copied in.
    assert layer.attention is attention and np.all(attention == 1)


@pytest.mark.parametrize("which", ["attention", "projection"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_layer_non_finite_parameters(which, value, data):
    X, _ = data
    params = {"attention": np.zeros((1, D, D)), "projection": np.zeros((1, D, D_OUT))}
    params[which][0, 0, 0] = value
    _raises(
        ValueError,
        rf"{which} contains 1 NaN or infinite value",
        AttentionLayer(**params).transform,
        X,
    )


# -- the phased learner's own requirements --------------------------------------------


def test_boolean_distribution_rejects_real_tokens():
    X, y = make_attention_regression(
        N, K, D, 1, n_outputs=D_OUT, distribution="gaussian", random_state=0
    )
    est = MultiHeadAttentionRegressor(n_tokens=K, input_distribution="boolean")
    _raises(
        ValueError,
        r"X must have entries in \{-1, \+1\}.*use input_distribution=\"gaussian\"",
        est.fit,
        X,
        y,
    )
    X_sign = np.sign(X)
    _raises(
        ValueError,
        r"found 0\.0 at row 0, column 1",
        est.fit,
        _with(X_sign, (0, 1), 0.0),
        y,
    )


def test_boolean_distribution_accepts_sign_tokens(data):
    X, y = data
    est = MultiHeadAttentionRegressor(n_tokens=K, input_distribution="boolean")
    assert est.set_params(polish=False, random_state=0).fit(X, y).score(X, y) > 0.99


def test_phased_learner_needs_d_out_at_least_k():
    X, y = make_attention_regression(N, K, D, 1, n_outputs=K - 1, random_state=0)
    _raises(
        ValueError,
        r"needs n_outputs_per_token >= n_tokens .* got 2 outputs per token and "
        r"n_tokens=3\. Use init='random' .* or GradientAttentionRegressor",
        MultiHeadAttentionRegressor(n_tokens=K, init="phased").fit,
        X,
        y,
    )


# (one sample is refused before the phases: "needs at least 2", test_hostile_inputs)
@pytest.mark.parametrize("n_samples", [2, 3, 5])
def test_phased_learner_on_too_few_samples(n_samples):
    X, y = make_attention_regression(
        n_samples, K, D, 1, n_outputs=D_OUT, random_state=0
    )
    _raises(
        ValueError,
        r"certified only \d+ of \d+ rows .*\(need at least \d+\); pass more "
        r"samples: at least \d+ sequences",
        MultiHeadAttentionRegressor(n_tokens=K, init="phased", random_state=0).fit,
        X,
        y,
    )
    # the default init="auto" says the same in a warning, then polishes anyway
    with pytest.warns(UserWarning, match=r"pass more samples: at least \d+ sequences"):
        MultiHeadAttentionRegressor(n_tokens=K, random_state=0).fit(X, y)


# -- sample weights --------------------------------------------------------------------


@pytest.mark.parametrize("name", REGRESSORS)
def test_negative_sample_weight(name, data):
    X, y = data
    weights = np.ones(N)
    weights[[2, 7]] = -1.0
    _raises(
        ValueError,
        r"sample_weight.*negative",
        _fit_call(name),
        X,
        y,
        sample_weight=weights,
    )


@pytest.mark.parametrize("name", REGRESSORS)
@pytest.mark.parametrize(
    "weights, match",
    [
        (np.ones(5), r"sample_weight.shape == \(5,\), expected \(60,\)"),
        (np.full(N, np.nan), "Input sample_weight contains NaN"),
        (np.zeros(N), "at least one non-zero"),
    ],
    ids=["length", "nan", "zero"],
)
def test_other_bad_sample_weight(name, weights, match, data):
    X, y = data
    _raises(ValueError, match, _fit_call(name), X, y, sample_weight=weights)


def test_partial_fit_later_batches_are_checked_against_the_first(data):
    X, y = data
    est = GradientAttentionRegressor(n_tokens=K, optimizer="adam", random_state=0)
    est.partial_fit(X, y)
    _raises(ValueError, "X has 8 features, but", est.partial_fit, X[:, :8], y)
    _raises(
        ValueError,
        r"y has 12 columns but the estimator was fitted with n_tokens_ \* "
        r"n_outputs_per_token_ = 24",
        est.partial_fit,
        X,
        y[:, :12],
    )
    _raises(
        ValueError,
        "sample_weight has 60 negative",
        est.partial_fit,
        X,
        y,
        sample_weight=-np.ones(N),
    )
    _raises(
        ValueError, "Input X contains NaN", est.partial_fit, _with(X, (1, 1), np.nan), y
    )
    match = "X is 3-D with 2 tokens per sequence but the estimator was fitted"
    _raises(ValueError, match, est.partial_fit, X.reshape(N, 2, K * D // 2), y)


# -- the dataset functions -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_samples": 0}, "'n_samples' parameter"),
        ({"n_tokens": 0}, "'n_tokens' parameter"),
        ({"noise": -1.0}, "'noise' parameter"),
        ({"distribution": "cauchy"}, "'distribution' parameter"),
        (
            {"distribution": GaussianTokens(2, D)},
            r"draws 2 tokens of 4 features, expected n_tokens=3",
        ),
        ({"attention_scale": -1.0}, "'attention_scale' parameter"),
        ({"structure": "sparse"}, "'structure' parameter"),
    ],
)
def test_make_attention_regression_bad_parameters(kwargs, match):
    params = {"n_samples": 10, "n_tokens": K, "n_features": D, "n_heads": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_attention_regression(**params)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((3, 1), {}, r"n_heads=3 distinct heads cannot be planted with n_features=1"),
        ((2, D), {"structure": "low_rank", "rank": 5}, r"rank=5 exceeds n_features=4"),
        ((0, D), {}, "'n_heads' parameter"),
        ((2, D), {"n_outputs": 0}, "'n_outputs' parameter"),
    ],
)
def test_make_attention_layer_bad_parameters(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_attention_layer(*args, **kwargs)


def test_distribution_check_and_sampling_errors():
    dist = BooleanTokens(K, D)
    X = dist.sample(4, random_state=0)
    _raises(
        ValueError,
        r"X has 11 columns, expected n_tokens \* n_features",
        dist.check,
        X[:, :11],
    )
    _raises(ValueError, "NaN or infinite", dist.check, _with(X, (0, 0), np.nan))
    _raises(ValueError, r"expected \(n_samples, 3, 4\)", dist.check, X.reshape(4, 2, 6))
    with pytest.raises(ValueError, match="distribution must be one of"):
        sample_inputs("cauchy", 2, K, D)
    with pytest.raises(ValueError, match="n_samples must be a positive integer"):
        dist.sample(0)
    with pytest.raises(ValueError, match="n_classes must be a positive integer"):
        TokenizedMixture(K, D, n_classes=0)


# -- the scorers ---------------------------------------------------------------------


def test_relative_prediction_error_bad_input():
    y = np.ones((4, 6))
    _raises(
        ValueError,
        r"y_true has shape \(4, 6\) but y_pred has shape \(4, 5\)",
        relative_prediction_error,
        y,
        y[:, :5],
    )
    _raises(
        ValueError,
        "Input y_pred contains NaN",
        relative_prediction_error,
        y,
        _with(y, (0, 0), np.nan),
    )
    _raises(
        ValueError,
        "inconsistent numbers of samples",
        relative_prediction_error,
        y,
        y[:3],
    )
    _raises(
        ValueError,
        r"sample_weight has 1 negative",
        relative_prediction_error,
        y,
        y,
        sample_weight=np.array([1.0, -1.0, 1.0, 1.0]),
    )


def test_recovery_scorer_bad_input(data):
    X, y = data
    true = _layer(n_heads=2)
    with pytest.raises(ValueError, match="'on' parameter"):
        make_recovery_scorer(true, on="heads")
    with pytest.raises(TypeError, match="true_layer must be an AttentionLayer"):
        make_recovery_scorer(true.attention)
    one_head = _fit("GradientAttentionRegressor", X, y)
    with pytest.raises(ValueError, match="learned has 1 head.* but true_layer has 2"):
        make_recovery_scorer(true)(one_head, X, y)


def test_negative_sample_weight_with_one_token():
    """The one-token (linear) path of the phased learner validates weights too."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(50, 3)), rng.normal(size=(50, 2))
    weights = -np.ones(50)
    for estimator in (MultiHeadAttentionRegressor(), GradientAttentionRegressor()):
        _raises(ValueError, r"sample_weight.*negative", estimator.fit, X, y, weights)


def test_certify_tol_final_above_certify_tol_is_an_error():
    X, y = make_attention_regression(500, K, D, 1, n_outputs=D_OUT, random_state=0)
    est = MultiHeadAttentionRegressor(
        n_tokens=K, certify_tol=0.1, certify_tol_final=0.2
    )
    _raises(
        ValueError,
        r"certify_tol_final=0.2 is larger than certify_tol=0.1",
        est.fit,
        X,
        y,
    )


def test_net_resolution_too_fine_fails_before_the_phases():
    X, y = make_attention_regression(500, K, D, 2, n_outputs=D_OUT, random_state=0)
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=K, net_resolution=5000)
    _raises(ValueError, r"lower net_resolution", est.fit, X, y)
