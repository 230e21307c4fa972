"""Estimator checks for attention estimators: scikit-learn's own checks plus skattn's.

Use :func:`check_estimator` in a script or :func:`parametrize_with_checks` in pytest,
exactly as their scikit-learn namesakes (which run first, unchanged).  skattn adds
checks that only make sense for estimators of token sequences:

* estimators with an ``n_tokens`` parameter (sequence estimators): a 3-D input gives
  the result of its flattened form; ``n_tokens`` mismatches raise a clear
  ``ValueError``; refits under the same ``random_state`` are bit-identical; a pickle
  round-trip keeps predictions;
* attention regressors (per-token outputs, fitted ``attention_`` and ``projection_``):
  a small planted layer is recovered; predictions are invariant when the learned heads
  are permuted and equivariant when the tokens of X are permuted;
* a fixed :class:`~skattn.AttentionLayer` gets the checks that make sense for a fixed
  function of fixed widths (clone, get/set_params, pickle, Pipeline use, clear errors on
  wrong widths) instead of scikit-learn's generic ones, which feed it random widths.
"""

import pickle
import warnings
from functools import partial

import numpy as np
from sklearn.base import clone
from sklearn.pipeline import make_pipeline
from sklearn.utils.estimator_checks import (
    check_estimator as _sklearn_check_estimator,
)
from sklearn.utils.estimator_checks import estimator_checks_generator

from ..layer import AttentionLayer
from ..layer._math import forward

__all__ = [
    "check_estimator",
    "parametrize_with_checks",
    "skattn_checks_generator",
]

# The planted problem every skattn check uses: Boolean tokens, one head, d_out > m * k.
_N_TOKENS, _N_FEATURES, _N_OUTPUTS = 3, 5, 5


def _planted_problem(n_samples=600, n_heads=1, random_state=0):
    """Boolean sequences (3-D) and the labels of a fixed planted layer.

    The layer depends on ``n_heads`` only; ``random_state`` draws the sequences.
    """
    rng = np.random.default_rng(12345 + n_heads)
    attention = rng.normal(size=(n_heads, _N_FEATURES, _N_FEATURES))
    attention *= 2.0 / np.linalg.norm(attention, axis=(1, 2), keepdims=True)
    projection = rng.normal(size=(n_heads, _N_FEATURES, _N_OUTPUTS)) / np.sqrt(
        _N_FEATURES
    )
    X = np.random.default_rng(random_state).choice(
        [-1.0, 1.0], size=(n_samples, _N_TOKENS, _N_FEATURES)
    )
    return X, forward(X, attention, projection), attention, projection


def _flat(A):
    return A.reshape(A.shape[0], -1)


def _outputs(estimator, X):
    """What a fitted estimator produces: predictions, or a transformer's output."""
    if hasattr(estimator, "predict"):
        return estimator.predict(X)
    return estimator.transform(X)


def _with_params(estimator, **params):
    """A clone with those of ``params`` that the estimator has."""
    estimator = clone(estimator)
    names = estimator.get_params()
    return estimator.set_params(**{k: v for k, v in params.items() if k in names})


def _fit_sequence_estimator(estimator, n_samples=600):
    X, Y, _, _ = _planted_problem(n_samples)
    est = _with_params(estimator, n_tokens=_N_TOKENS, random_state=0)
    return est.fit(_flat(X), _sequence_target(est, Y)), X, Y


def _is_attention_regressor(estimator):
    """Per-token regressor whose fitted model is an attention layer."""
    return getattr(estimator, "_skattn_per_token_outputs", False) is True


def _sequence_target(estimator, Y):
    """Per-token targets for attention regressors; the first token's otherwise."""
    return _flat(Y) if _is_attention_regressor(estimator) else Y[:, 0, :]


def check_3d_input_matches_flat(name, estimator_orig):
    """Fitting and predicting on (n, k, d) equals doing so on its flattening."""
    X, Y, _, _ = _planted_problem(300)
    flat = _with_params(estimator_orig, n_tokens=_N_TOKENS, random_state=0)
    cube = _with_params(estimator_orig, n_tokens=None, random_state=0)
    y = _sequence_target(flat, Y)
    pred_flat = _outputs(flat.fit(_flat(X), y), _flat(X))
    pred_cube = _outputs(cube.fit(X, y), X)
    np.testing.assert_allclose(
        pred_cube,
        pred_flat,
        rtol=1e-10,
        atol=1e-10,
        err_msg=f"{name}: 3-D input does not give the result of its flattened form",
    )


def check_n_tokens_mismatch(name, estimator_orig):
    """Widths not divisible by n_tokens, or a 3-D X against n_tokens, raise clearly."""
    X, Y, _, _ = _planted_problem(50)
    y = _sequence_target(_with_params(estimator_orig), Y)
    est = _with_params(estimator_orig, n_tokens=_N_TOKENS + 1, random_state=0)
    for bad_X in (_flat(X), X):
        try:
            est.fit(bad_X, y)
        except ValueError as exc:
            if "n_tokens" not in str(exc):
                raise AssertionError(
                    f"{name}: the error for an n_tokens mismatch should name "
                    f"n_tokens, got: {exc}"
                ) from exc
        else:
            raise AssertionError(
                f"{name} accepted X of shape {bad_X.shape} with "
                f"n_tokens={_N_TOKENS + 1}"
            )


def check_refit_bit_identical(name, estimator_orig):
    """Two fits under the same random_state give bit-identical predictions."""
    first, X, _ = _fit_sequence_estimator(estimator_orig, 300)
    second, _, _ = _fit_sequence_estimator(estimator_orig, 300)
    if not np.array_equal(_outputs(first, _flat(X)), _outputs(second, _flat(X))):
        raise AssertionError(f"{name}: refits under the same random_state differ")


def check_pickle_keeps_predictions(name, estimator_orig):
    """A pickle round-trip of a fitted sequence estimator keeps its predictions."""
    est, X, _ = _fit_sequence_estimator(estimator_orig, 300)
    restored = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(_outputs(restored, _flat(X)), _outputs(est, _flat(X)))


def check_recovers_planted_layer(name, estimator_orig):
    """A small planted one-head layer is learned to relative test error <= 1e-3."""
    est, _, _ = _fit_sequence_estimator(estimator_orig, 1000)
    X_test, Y_test, _, _ = _planted_problem(500, random_state=1)
    error = np.linalg.norm(est.predict(_flat(X_test)) - _flat(Y_test)) / (
        np.linalg.norm(Y_test)
    )
    if not error <= 1e-3:
        raise AssertionError(
            f"{name} did not recover a planted one-head layer (k={_N_TOKENS}, "
            f"d={_N_FEATURES}, d_out={_N_OUTPUTS}, 1000 Boolean examples): relative "
            f"test error {error:.3g} > 1e-3"
        )


class SkattnCheckSkipped(UserWarning):
    """An expected-to-fail skattn check that :func:`check_estimator` skipped."""


def check_head_permutation_invariance(name, estimator_orig):
    """Permuting the learned heads (Theta_i and W_i together) keeps predictions.

    This checks ``predict``: that it depends on the learned heads only through
    the layer they form (no state tied to the order of the heads).  Whether the
    heads were learned correctly is :func:`check_recovers_planted_layer`'s job.
    """
    X, Y, _, _ = _planted_problem(300, n_heads=2)
    est = _with_params(estimator_orig, n_tokens=_N_TOKENS, n_heads=2, random_state=0)
    est.fit(_flat(X), _flat(Y))
    before = est.predict(_flat(X))
    perm = np.arange(est.attention_.shape[0])[::-1]
    est.attention_ = est.attention_[perm]
    est.projection_ = est.projection_[perm]
    if hasattr(est, "layer_"):
        est.layer_ = AttentionLayer(est.attention_, est.projection_)
    np.testing.assert_allclose(est.predict(_flat(X)), before, rtol=1e-10, atol=1e-12)


def check_token_permutation_equivariance(name, estimator_orig):
    """Permuting the tokens of X permutes the predicted tokens the same way."""
    est, X, _ = _fit_sequence_estimator(estimator_orig, 300)
    perm = np.array([2, 0, 1])
    pred = est.predict(_flat(X)).reshape(len(X), _N_TOKENS, -1)
    pred_perm = est.predict(_flat(X[:, perm])).reshape(len(X), _N_TOKENS, -1)
    np.testing.assert_allclose(pred_perm, pred[:, perm], rtol=1e-9, atol=1e-12)


def _planted_layer():
    _, _, attention, projection = _planted_problem(1)
    return AttentionLayer(attention, projection)


def check_layer_clone_and_params(name, layer):
    """clone and get/set_params round-trip a fixed layer's parameters."""
    cloned = clone(layer)
    for key, value in layer.get_params().items():
        np.testing.assert_array_equal(cloned.get_params()[key], value)
    cloned.set_params(n_tokens=_N_TOKENS)
    assert cloned.get_params()["n_tokens"] == _N_TOKENS


def check_layer_pickle(name, layer):
    """A pickle round-trip keeps the layer's outputs."""
    X, _, _, _ = _planted_problem(20)
    fitted = clone(layer).fit(_flat(X))
    restored = pickle.loads(pickle.dumps(fitted))
    np.testing.assert_array_equal(restored.transform(X), fitted.transform(X))


def check_layer_in_pipeline(name, layer):
    """The layer works as the first step of a Pipeline (as a planted teacher)."""
    from sklearn.linear_model import Ridge

    X, _, _, _ = _planted_problem(100)
    features = clone(layer).fit_transform(_flat(X))
    y = features[:, 0]
    pipe = make_pipeline(clone(layer), Ridge(alpha=1e-8)).fit(_flat(X), y)
    np.testing.assert_allclose(
        pipe.predict(_flat(X)), Ridge(alpha=1e-8).fit(features, y).predict(features)
    )


def check_layer_wrong_width(name, layer):
    """Inputs whose width does not fit the layer raise a ValueError naming widths."""
    d = layer.n_features
    layer = clone(layer)
    for bad in (np.ones((4, d + 1)), np.ones((4, 3, d + 1))):
        try:
            layer.transform(bad)
        except ValueError as exc:
            if "features" not in str(exc) and "columns" not in str(exc):
                raise AssertionError(f"{name}: unclear width error: {exc}") from exc
        else:
            raise AssertionError(f"{name} accepted input of shape {bad.shape}")
    fitted = clone(layer).fit(np.ones((4, 2 * d)))
    try:
        fitted.transform(np.ones((4, 3 * d)))
    except ValueError:
        pass
    else:
        raise AssertionError(f"{name}: transform accepted a width not seen in fit")


_SEQUENCE_CHECKS = (
    check_3d_input_matches_flat,
    check_n_tokens_mismatch,
    check_refit_bit_identical,
    check_pickle_keeps_predictions,
)
_ATTENTION_REGRESSOR_CHECKS = (
    check_recovers_planted_layer,
    check_head_permutation_invariance,
    check_token_permutation_equivariance,
)
_LAYER_CHECKS = (
    check_layer_clone_and_params,
    check_layer_pickle,
    check_layer_in_pipeline,
    check_layer_wrong_width,
)


def skattn_checks_generator(estimator):
    """Yield ``(estimator, check)`` pairs of skattn's own checks for ``estimator``.

    Parameters
    ----------
    estimator : estimator instance
        The estimator to check (or an :class:`~skattn.AttentionLayer`).

    Yields
    ------
    estimator : estimator instance
        The estimator passed in.
    check : callable taking the estimator
        One of skattn's checks, with the estimator's name bound.

    Examples
    --------
    >>> from skattn.estimators import GradientAttentionRegressor
    >>> from skattn.utils.estimator_checks import skattn_checks_generator
    >>> checks = [
    ...     check.func.__name__
    ...     for _, check in skattn_checks_generator(GradientAttentionRegressor())
    ... ]
    >>> "check_recovers_planted_layer" in checks
    True
    """
    name = type(estimator).__name__
    if isinstance(estimator, AttentionLayer):
        checks = _LAYER_CHECKS
    else:
        checks = ()
        if "n_tokens" in estimator.get_params():
            checks += _SEQUENCE_CHECKS
        if _is_attention_regressor(estimator):
            checks += _ATTENTION_REGRESSOR_CHECKS
    for check in checks:
        yield estimator, partial(check, name)


def _all_checks(estimator, expected_failed_checks=None, mark=None):
    if not isinstance(estimator, AttentionLayer):
        yield from estimator_checks_generator(
            estimator, expected_failed_checks=expected_failed_checks, mark=mark
        )
    yield from skattn_checks_generator(estimator)


def check_estimator(estimator, *, expected_failed_checks=None):
    """Run scikit-learn's checks and skattn's checks on ``estimator``; raise on failure.

    Parameters
    ----------
    estimator : estimator instance
        A skattn estimator, a third-party attention estimator, or a fixed
        :class:`~skattn.AttentionLayer` (which gets the layer checks only).
    expected_failed_checks : dict, default=None
        ``{check_name: reason}`` for checks known to fail; they are skipped with
        the reason as a warning.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> from skattn.utils.estimator_checks import check_estimator
    >>> check_estimator(AttentionLayer(np.zeros((1, 5, 5)), np.eye(5)[None]))
    """
    if not isinstance(estimator, AttentionLayer):
        _sklearn_check_estimator(
            estimator, expected_failed_checks=expected_failed_checks
        )
    for est, check in skattn_checks_generator(estimator):
        name = check.func.__name__
        if expected_failed_checks and name in expected_failed_checks:
            warnings.warn(
                f"Skipping {name} for {type(est).__name__}: "
                f"{expected_failed_checks[name]}",
                SkattnCheckSkipped,
                stacklevel=2,
            )
            continue
        check(est)


def parametrize_with_checks(estimators, *, expected_failed_checks=None):
    """``pytest.mark.parametrize`` over scikit-learn's and skattn's checks.

    Parameters
    ----------
    estimators : list of estimator instances
    expected_failed_checks : callable, default=None
        Takes an estimator, returns ``{check_name: reason}``; those checks are
        marked xfail.

    Returns
    -------
    decorator : ``pytest.mark.parametrize("estimator, check", ...)``

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> from skattn.utils.estimator_checks import parametrize_with_checks
    >>> layer = AttentionLayer(np.zeros((1, 5, 5)), np.eye(5)[None])
    >>> @parametrize_with_checks([layer])
    ... def test_layer(estimator, check):
    ...     check(estimator)
    """
    import pytest

    params = []
    for estimator in estimators:
        expected = expected_failed_checks(estimator) if expected_failed_checks else {}
        for item in _all_checks(estimator, expected, mark="xfail"):
            # sklearn yields pytest.param objects (a ParameterSet, itself a
            # 3-tuple of values, marks, id) for its expected failures
            is_param = hasattr(item, "marks")
            est, check = item.values if is_param else item
            marks = item.marks if is_param else ()
            name = getattr(check, "func", check).__name__
            if not marks and name in expected:
                marks = (pytest.mark.xfail(reason=expected[name]),)
            params.append(
                pytest.param(est, check, marks=marks, id=_check_id(est, check))
            )
    return pytest.mark.parametrize("estimator, check", params)


def _check_id(estimator, check):
    name = getattr(check, "func", check).__name__
    keywords = getattr(check, "keywords", {}) or {}
    suffix = ",".join(f"{k}={v}" for k, v in keywords.items())
    return f"{type(estimator).__name__}-{name}" + (f"({suffix})" if suffix else "")
