"""Scorers built from skattn's metrics, for ``GridSearchCV(scoring=...)``.

* :func:`make_recovery_scorer`: minus the head-matched parameter error of a fitted
  estimator against a known (planted) layer; it ignores the test data.
* :func:`relative_prediction_error`: ``||y_pred - y_true||_F / ||y_true||_F``, a
  regression metric on targets; wrap it with
  ``sklearn.metrics.make_scorer(..., greater_is_better=False)``.
"""

import numpy as np
from sklearn.utils import check_array, check_consistent_length
from sklearn.utils._param_validation import StrOptions, validate_params
from sklearn.utils.validation import _check_sample_weight

from ..layer import as_layer
from ._recovery import _ratio, parameter_error

_ON = ("attention", "projection", "both")


class _RecoveryScorer:
    """``scorer(estimator, X, y)``: minus the parameter error against a layer."""

    def __init__(self, true_layer, on):
        self.true_layer = true_layer
        self.on = on

    def __call__(self, estimator, X=None, y_true=None, sample_weight=None):
        """Score a fitted estimator; ``X``, ``y_true`` and weights are ignored.

        Parameters
        ----------
        estimator : fitted estimator or Pipeline
            Must expose ``attention_`` and ``projection_`` (a Pipeline is scored
            through its last step).
        X, y_true, sample_weight : ignored
            Accepted for the scikit-learn scorer signature.

        Returns
        -------
        score : float
            ``-error`` (greater is better; 0 is exact recovery).
        """
        learned = estimator
        if not hasattr(learned, "attention_") and hasattr(learned, "steps"):
            learned = learned.steps[-1][1]  # a Pipeline: its final estimator
        err = parameter_error(self.true_layer, learned)
        if self.on == "attention":
            return -err.attention_error
        if self.on == "projection":
            return -err.projection_error
        return -float(np.hypot(err.attention_error, err.projection_error))

    def __repr__(self):
        return f"make_recovery_scorer(<{self._truth_repr()}>, on={self.on!r})"

    def _truth_repr(self):
        attention, projection = as_layer(self.true_layer, "true_layer")._arrays()[:2]
        return (
            f"true layer with {attention.shape[0]} head(s), {attention.shape[1]} "
            f"features, {projection.shape[2]} outputs"
        )


@validate_params(
    {"true_layer": "no_validation", "on": [StrOptions(set(_ON))]},
    prefer_skip_nested_validation=True,
)
def make_recovery_scorer(true_layer, *, on="both"):
    """Scorer rewarding recovery of a known layer's parameters (greater is better).

    The returned callable ``scorer(estimator, X, y)`` computes
    :func:`~skattn.metrics.parameter_error` between ``true_layer`` and the fitted
    ``estimator`` (heads matched by the Hungarian algorithm) and returns minus the
    chosen error, so it can be passed as ``scoring=`` to
    :class:`~sklearn.model_selection.GridSearchCV` or
    :func:`~sklearn.model_selection.cross_val_score` when the truth is planted.
    The test data ``X, y`` are ignored: the score measures the parameters, not
    the predictions.

    Parameters
    ----------
    true_layer : AttentionLayer or fitted estimator
        The planted truth (e.g. from ``make_attention_regression(...,
        return_layer=True)``), or anything :func:`skattn.layer.as_layer` accepts.
    on : {"attention", "projection", "both"}, default="both"
        Which error to negate: ``attention_error`` (the Theta_i),
        ``projection_error`` (the W_i), or ``sqrt(attention_error^2 +
        projection_error^2)``, the quantity the head matching minimises.

    Returns
    -------
    scorer : callable
        ``scorer(estimator, X=None, y_true=None, sample_weight=None) -> float``,
        at most 0, equal to 0 when the matched parameters are exact. The estimator
        (or a Pipeline's last step) must be fitted, with ``layer_`` or
        ``attention_`` and ``projection_`` of at least as many heads as
        ``true_layer``; otherwise it raises the NotFittedError, TypeError or
        ValueError of ``parameter_error``.

    Raises
    ------
    sklearn.exceptions.NotFittedError
        If ``true_layer`` is an estimator that is not fitted.
    TypeError
        If ``true_layer`` is none of what :func:`skattn.layer.as_layer` accepts.
    ValueError
        If ``true_layer``'s parameters are invalid.

    See Also
    --------
    skattn.metrics.parameter_error : the head-matched errors themselves.
    relative_prediction_error : a score on the predictions instead.

    Examples
    --------
    >>> from sklearn.model_selection import GridSearchCV
    >>> from skattn import GradientAttentionRegressor, make_attention_regression
    >>> from skattn.metrics import make_recovery_scorer
    >>> X, y, true = make_attention_regression(
    ...     200, 3, 4, 1, random_state=0, return_layer=True)
    >>> scorer = make_recovery_scorer(true, on="attention")
    >>> search = GridSearchCV(
    ...     GradientAttentionRegressor(n_tokens=3, random_state=0),
    ...     {"alpha": [0.0, 1.0]}, scoring=scorer, cv=2).fit(X, y)
    >>> search.best_params_
    {'alpha': 0.0}
    >>> bool(search.best_score_ > -0.01)
    True
    """
    as_layer(true_layer, "true_layer")  # fail early on a bad truth
    return _RecoveryScorer(true_layer, on)


@validate_params(
    {
        "y_true": ["array-like"],
        "y_pred": ["array-like"],
        "sample_weight": ["array-like", None],
    },
    prefer_skip_nested_validation=True,
)
def relative_prediction_error(y_true, y_pred, *, sample_weight=None):
    """Relative error of predictions, ``||y_pred - y_true||_F / ||y_true||_F``.

    With weights, ``sqrt(sum_n w_n ||y_pred_n - y_true_n||^2 / sum_n w_n
    ||y_true_n||^2)``. It is the target-side counterpart of
    :func:`~skattn.metrics.prediction_error` (which compares two layers on
    inputs) and a scikit-learn metric: ``make_scorer(relative_prediction_error,
    greater_is_better=False)`` gives a scorer for model selection.

    Parameters
    ----------
    y_true : array-like of shape (n_samples,) or (n_samples, n_outputs)
        True targets.
    y_pred : array-like of the same shape as ``y_true``
        Predictions.
    sample_weight : array-like of shape (n_samples,), default=None
        Non-negative weights of the samples.

    Returns
    -------
    error : float
        Non-negative (lower is better); ``0.0`` when both are zero, ``inf`` when
        only ``y_true`` is.

    Raises
    ------
    ValueError
        On NaN/inf, on shapes that differ, or on negative weights.

    See Also
    --------
    skattn.metrics.prediction_error : the same ratio between two layers.
    make_recovery_scorer : a score on the parameters instead.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.metrics import relative_prediction_error
    >>> relative_prediction_error(np.array([[3.0, 4.0]]), np.array([[3.0, 3.0]]))
    0.2

    As a scorer (scikit-learn negates it, so greater is better):

    >>> from sklearn.metrics import make_scorer
    >>> from skattn import GradientAttentionRegressor, make_attention_regression
    >>> X, y = make_attention_regression(200, 3, 4, 1, random_state=0)
    >>> scorer = make_scorer(relative_prediction_error, greater_is_better=False)
    >>> est = GradientAttentionRegressor(n_tokens=3, random_state=0).fit(X, y)
    >>> bool(-0.01 < scorer(est, X, y) <= 0)
    True
    """
    y_true = check_array(y_true, ensure_2d=False, dtype=np.float64, input_name="y_true")
    y_pred = check_array(y_pred, ensure_2d=False, dtype=np.float64, input_name="y_pred")
    check_consistent_length(y_true, y_pred, sample_weight)
    if y_true.shape != y_pred.shape:
        raise ValueError(
            f"y_true has shape {y_true.shape} but y_pred has shape {y_pred.shape}; "
            f"expected the same shape (one prediction per target entry)."
        )
    weights = _check_sample_weight(sample_weight, y_true, dtype=np.float64)
    if np.any(weights < 0):
        raise ValueError(
            f"sample_weight has {int(np.sum(weights < 0))} negative value(s); "
            f"expected non-negative weights."
        )
    diff = (y_pred - y_true).reshape(len(y_true), -1)
    truth = y_true.reshape(len(y_true), -1)
    num = np.sqrt(weights @ (diff**2).sum(axis=1))
    den = np.sqrt(weights @ (truth**2).sum(axis=1))
    return float(_ratio(num, den))
