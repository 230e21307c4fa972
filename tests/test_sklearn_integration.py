"""skattn's estimators inside scikit-learn's machinery.

GridSearchCV (in parallel, with the default R^2 and with skattn's scorers),
cross_val_score, Pipelines, clone/get_params/set_params, pickling, pandas input
with column names, and 3-D input through model selection.
"""

import inspect
import pickle

import numpy as np
import pandas as pd
import pytest
from _helpers import one_head_regression, two_heads_regression
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.base import clone
from sklearn.metrics import make_scorer, r2_score
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer

from skattn import (
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    RandomAttentionFeatures,
    RandomFeatureAttentionRegressor,
    make_attention_layer,
    make_attention_regression,
)
from skattn.metrics import (
    make_recovery_scorer,
    parameter_error,
    relative_prediction_error,
)
from skattn.utils.discovery import all_estimators

K, D = 3, 4  # tokens per sequence, features per token

# At these sample sizes the phased learner may warn that its hull is weakly
# determined; the statistics are tested elsewhere, the machinery here.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Weak spectral evidence:UserWarning"),
    pytest.mark.filterwarnings("ignore:Phases 2-4 stopped:UserWarning"),
]


@pytest.fixture(scope="module")
def two_heads():
    """A planted 2-head layer the phased learner can fit in a fraction of a second."""
    return two_heads_regression(K, D)


@pytest.fixture(scope="module")
def one_head():
    """A planted 1-head layer the gradient learner recovers exactly."""
    return one_head_regression(K, D)


def _phased(**params):
    return MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=K, polish=False, random_state=0, **params
    )


def _half(X):
    """Module level (not a lambda), so that a FunctionTransformer pickles."""
    return 0.5 * np.asarray(X)


PHASED_GRID = {"certify_tol_final": [0.02, 0.2], "net_resolution": [3, 11]}


# -- GridSearchCV over the phased learner ------------------------------------------


def test_grid_search_default_score_in_parallel(two_heads):
    X, y, _ = two_heads
    cv = KFold(2, shuffle=True, random_state=0)
    search = GridSearchCV(_phased(), PHASED_GRID, cv=cv, n_jobs=2).fit(X, y)
    serial = GridSearchCV(_phased(), PHASED_GRID, cv=cv, n_jobs=1).fit(X, y)

    scores = search.cv_results_["mean_test_score"]
    assert len(scores) == 4
    assert np.all(scores > 0.8)  # R^2 of the unpolished phased estimate
    # Workers and the main process compute the same thing (random_state=0).
    assert_allclose(scores, serial.cv_results_["mean_test_score"], rtol=1e-10)
    assert search.best_score_ == scores.max()
    best = search.best_estimator_
    assert {k: best.get_params()[k] for k in PHASED_GRID} == search.best_params_
    # The default score is R^2 of the refitted best estimator.
    assert search.score(X, y) == pytest.approx(r2_score(y, best.predict(X)))


def test_grid_search_recovery_scorer(two_heads):
    X, y, true = two_heads
    scorer = make_recovery_scorer(true)
    assert "on='both'" in repr(scorer) and "2 head(s)" in repr(scorer)
    search = GridSearchCV(
        _phased(net_resolution=5),
        {"polish": [False, True]},
        scoring=scorer,
        cv=2,
        n_jobs=2,  # the scorer travels to the workers
    ).fit(X, y)
    scores = search.cv_results_["mean_test_score"]
    assert np.all(scores <= 0)
    # Only the polish recovers the parameters: the scorer must see it.
    assert search.best_params_ == {"polish": True}
    assert search.best_score_ > -1e-4 and scores[0] < -0.05
    err = parameter_error(true, search.best_estimator_)
    expected = -np.hypot(err.attention_error, err.projection_error)
    assert search.score(X, y) == pytest.approx(expected)


def test_grid_search_multimetric_with_recovery_scorer(two_heads):
    X, y, true = two_heads
    scoring = {
        "r2": "r2",
        "attention": make_recovery_scorer(true, on="attention"),
        "projection": make_recovery_scorer(true, on="projection"),
    }
    search = GridSearchCV(
        _phased(), PHASED_GRID, scoring=scoring, refit="attention", cv=2
    ).fit(X, y)
    res = search.cv_results_
    assert np.all(res["mean_test_r2"] > 0.8)
    for name in ("attention", "projection"):
        assert np.all(res[f"mean_test_{name}"] <= 0)
        assert np.all(res[f"mean_test_{name}"] > -1.0)  # in the right basin
    best = np.argmax(res["mean_test_attention"])
    assert search.best_index_ == best
    assert res["rank_test_attention"][best] == 1


def test_grid_search_relative_prediction_error_scorer(one_head):
    X, y, _ = one_head
    scorer = make_scorer(relative_prediction_error, greater_is_better=False)
    search = GridSearchCV(
        GradientAttentionRegressor(n_tokens=K, random_state=0),
        {"alpha": [0.0, 1.0]},
        scoring=scorer,
        cv=2,
    ).fit(X, y)
    scores = search.cv_results_["mean_test_score"]
    assert search.best_params_ == {"alpha": 0.0}  # the ridge penalty only biases
    assert -1e-3 < scores[0] <= 0 and scores[1] < -0.05
    assert search.score(X, y) == pytest.approx(
        -relative_prediction_error(y, search.predict(X))
    )


def test_grid_search_passes_sample_weight_to_fit(one_head):
    """Zero weights on corrupted examples: the refitted model ignores them."""
    X, y, true = one_head
    y_bad = y.copy()
    y_bad[::3] += np.random.default_rng(0).normal(size=y_bad[::3].shape)
    weights = np.ones(len(X))
    weights[::3] = 0.0
    search = GridSearchCV(
        GradientAttentionRegressor(n_tokens=K, random_state=0),
        {"alpha": [0.0, 1.0]},
        scoring=make_recovery_scorer(true),
        cv=2,
    ).fit(X, y_bad, sample_weight=weights)
    assert search.best_params_ == {"alpha": 0.0}
    assert search.score(X, y) > -1e-3
    unweighted = clone(search.best_estimator_).fit(X, y_bad)
    assert make_recovery_scorer(true)(unweighted) < -0.01


# -- cross-validation and Pipelines -------------------------------------------------


def test_cross_val_score(one_head):
    X, y, _ = one_head
    scores = cross_val_score(
        GradientAttentionRegressor(n_tokens=K, random_state=0), X, y, cv=3
    )
    assert scores.shape == (3,)
    assert np.all(scores > 0.9999)  # a 1-head planted layer is learned exactly


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_pipeline_after_a_planted_teacher(one_head):
    """Learn the second layer of a two-layer stack whose first layer is known.

    The teacher's outputs are not +-1 tokens, so the second layer's attention is
    only weakly identified: the test checks the fit of the function (R^2).
    """
    X, _, teacher = one_head
    second = make_attention_layer(1, D, random_state=1)
    y = second.transform(teacher.transform(X))
    student = GradientAttentionRegressor(n_tokens=K, max_iter=100, random_state=0)
    pipe = Pipeline([("teacher", teacher), ("student", student)]).fit(X, y)
    assert pipe.score(X, y) > 0.999
    assert pipe["student"].n_features_in_ == K * D
    # The teacher is a fixed function: fitting the pipeline does not change it.
    assert_array_equal(pipe["teacher"].attention, teacher.attention)
    # The pipeline's parameters reach the student.
    search = GridSearchCV(pipe, {"student__alpha": [0.0, 1.0]}, cv=2).fit(X, y)
    assert search.best_params_ == {"student__alpha": 0.0}


def test_pipeline_after_function_transformer(one_head):
    X, _, true = one_head
    y = true.transform(0.5 * X)
    pipe = Pipeline(
        [
            ("half", FunctionTransformer(_half)),
            ("reg", GradientAttentionRegressor(n_tokens=K, random_state=0)),
        ]
    )
    scores = cross_val_score(pipe, X, y, cv=2, n_jobs=2)
    assert np.all(scores > 0.9999)
    pipe.fit(X, y)
    err = parameter_error(true, pipe["reg"])
    assert err.attention_error < 1e-3 and err.projection_error < 1e-3
    # The recovery scorer scores a Pipeline through its last step.
    assert make_recovery_scorer(true)(pipe, X, y) > -1e-3


@pytest.mark.parametrize(
    "regressor",
    [
        GradientAttentionRegressor(n_tokens=K, random_state=0),
        MultiHeadAttentionRegressor(n_tokens=K, random_state=0),
    ],
    ids=["gradient", "phased"],
)
def test_pipeline_with_3d_passthrough(regressor):
    """A 3-D X passes a validate=False FunctionTransformer into the regressor."""
    X, y = make_attention_regression(400, K, D, 1, n_outputs=6, random_state=2)
    X3 = X.reshape(len(X), K, D)
    pipe = Pipeline([("identity", FunctionTransformer()), ("reg", regressor)])
    pipe.fit(X3, y)
    assert pipe["reg"].n_tokens_ == K
    assert_allclose(pipe.predict(X3), pipe.predict(X))
    assert pipe.score(X3, y) > 0.999


def test_pipeline_with_random_features():
    X, y = make_attention_regression(300, K, D, 1, random_state=3)
    target = y[:, :D]  # the first token's output: one vector per sequence
    pipe = Pipeline(
        [
            (
                "features",
                RandomAttentionFeatures(n_heads=60, n_tokens=K, random_state=0),
            ),
            ("ridge", RandomFeatureAttentionRegressor(n_heads=5, alpha=1e-3)),
        ]
    )
    # The second step sees the flat features (k = 1) and still fits.
    pipe.fit(X[:200], target[:200])
    assert pipe.predict(X[200:]).shape == (100, D)


# -- 3-D input through model selection ------------------------------------------------


def test_grid_search_on_3d_input(one_head):
    X, y, _ = one_head
    X3 = X.reshape(len(X), K, D)
    search = GridSearchCV(
        GradientAttentionRegressor(random_state=0),  # n_tokens from the 3-D X
        {"alpha": [0.0, 1.0]},
        cv=2,
    ).fit(X3, y)
    assert search.best_estimator_.n_tokens_ == K
    assert search.best_score_ > 0.999
    assert_allclose(search.predict(X3), search.predict(X))
    # The same folds on the flat X (with n_tokens given) score the same.
    flat = GridSearchCV(
        GradientAttentionRegressor(n_tokens=K, random_state=0),
        {"alpha": [0.0, 1.0]},
        cv=2,
    ).fit(X, y)
    assert_allclose(
        search.cv_results_["mean_test_score"], flat.cv_results_["mean_test_score"]
    )


def test_cross_val_score_on_3d_input(two_heads):
    X, y, _ = two_heads
    X3 = X.reshape(len(X), K, D)
    est = MultiHeadAttentionRegressor(n_heads=2, polish=False, random_state=0)
    assert_allclose(
        cross_val_score(est, X3, y, cv=2), cross_val_score(_phased(), X, y, cv=2)
    )


# -- parameters, cloning and pickling ------------------------------------------------

NON_DEFAULT = {
    "AttentionLayer": {"n_tokens": 2},
    "GradientAttentionRegressor": {"n_heads": 2, "alpha": 0.5, "optimizer": "adam"},
    "MultiHeadAttentionRegressor": {"n_heads": "auto", "certify_tol_final": 0.05},
    "RandomAttentionFeatures": {"n_heads": 7, "keys": "others"},
    "RandomFeatureAttentionRegressor": {"n_heads": 7, "alpha": 3.0},
}


def _instance(name, cls, **params):
    if cls is AttentionLayer:
        layer = make_attention_layer(2, D, random_state=0)
        return AttentionLayer(layer.attention, layer.projection, **params)
    return cls(**params)


@pytest.mark.parametrize("name, cls", all_estimators())
def test_clone_get_set_params_round_trip(name, cls):
    est = _instance(name, cls, **NON_DEFAULT[name])
    params = est.get_params()
    for key, value in NON_DEFAULT[name].items():
        assert params[key] == value
    cloned = clone(est)
    assert cloned is not est
    assert type(cloned) is type(est)
    for key, value in cloned.get_params().items():
        assert value is params[key] or np.array_equal(value, params[key])
    # set_params(**get_params()) is the identity; set_params changes one value.
    other = _instance(name, cls).set_params(**params)
    assert repr(other) == repr(est)
    first = next(iter(NON_DEFAULT[name]))
    default = inspect.signature(cls).parameters[first].default
    assert est.set_params(**{first: default}) is est
    assert est.get_params()[first] == default
    with pytest.raises(ValueError, match="Invalid parameter"):
        est.set_params(not_a_parameter=1)


def test_nested_params_in_pipeline(one_head):
    X, y, _ = one_head
    pipe = Pipeline([("reg", GradientAttentionRegressor(n_tokens=K))])
    pipe.set_params(reg__n_heads=2, reg__alpha=0.1)
    assert pipe.get_params()["reg__n_heads"] == 2
    assert clone(pipe).get_params()["reg__alpha"] == 0.1


def _fitted(name, cls, X, y):
    params = {"n_tokens": K}
    if cls is AttentionLayer:
        return _instance(name, cls).fit(X)
    if cls is RandomAttentionFeatures:
        return cls(n_heads=5, random_state=0, **params).fit(X)
    if cls is RandomFeatureAttentionRegressor:
        return cls(n_heads=5, random_state=0, **params).fit(X, y[:, :D])
    return cls(random_state=0, **params).fit(X, y)


def _output(est, X):
    return est.predict(X) if hasattr(est, "predict") else est.transform(X)


@pytest.mark.parametrize("name, cls", all_estimators())
def test_pickle_fitted_estimator(name, cls):
    X, y = make_attention_regression(300, K, D, 1, n_outputs=6, random_state=4)
    est = _fitted(name, cls, X, y)
    restored = pickle.loads(pickle.dumps(est))
    assert_array_equal(_output(restored, X), _output(est, X))
    assert restored.get_params().keys() == est.get_params().keys()
    for attr in ("n_features_in_", "n_tokens_"):
        assert getattr(restored, attr) == getattr(est, attr)


def test_pickle_fitted_grid_search(one_head):
    X, y, _ = one_head
    search = GridSearchCV(
        GradientAttentionRegressor(n_tokens=K, random_state=0), {"alpha": [0.0]}, cv=2
    ).fit(X, y)
    restored = pickle.loads(pickle.dumps(search))
    assert_array_equal(restored.predict(X), search.predict(X))


# -- pandas input ----------------------------------------------------------------------


def _frame(X):
    columns = [f"token{t}_x{j}" for t in range(K) for j in range(D)]
    return pd.DataFrame(X, columns=columns)


@pytest.mark.parametrize("name, cls", all_estimators())
def test_dataframe_input_keeps_feature_names(name, cls):
    X, y = make_attention_regression(300, K, D, 1, n_outputs=6, random_state=5)
    df = _frame(X)
    est = _fitted(name, cls, df, y)
    assert_array_equal(est.feature_names_in_, df.columns.to_numpy(dtype=object))
    assert_allclose(_output(est, df), _output(_fitted(name, cls, X, y), X))
    # Columns renamed after fit: scikit-learn's feature-name check applies.
    with pytest.raises(ValueError, match="feature names should match"):
        _output(est, df.rename(columns={df.columns[0]: "renamed"}))
    # A plain array after a DataFrame fit: a warning, not an error.
    with pytest.warns(UserWarning, match="does not have valid feature names"):
        _output(est, X)


def test_dataframe_target_and_pandas_output():
    X, y, true = make_attention_regression(
        300, K, D, 1, random_state=6, return_layer=True
    )
    df = _frame(X)
    y_df = pd.DataFrame(
        y, columns=[f"token{t}_y{j}" for t in range(K) for j in range(D)]
    )
    reg = GradientAttentionRegressor(n_tokens=K, random_state=0).fit(df, y_df)
    assert reg.score(df, y_df) > 0.9999
    layer = clone(true).set_output(transform="pandas")
    out = layer.fit_transform(df)
    assert isinstance(out, pd.DataFrame)
    assert list(out.columns) == [f"token{t}_out{j}" for t in range(K) for j in range(D)]
    assert_allclose(out.to_numpy(), y)
