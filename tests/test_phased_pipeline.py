"""skattn.phased.phased_fit and search_n_heads: the learner without the estimator."""

import numpy as np
import pytest

from skattn import MultiHeadAttentionRegressor, make_attention_regression
from skattn.phased import CertificationError, phased_fit, search_n_heads


def _data(n=4000, k=4, d=6, m=2, d_out=12, seed=0):
    X, y = make_attention_regression(
        n, k, d, m, n_outputs=d_out, distribution="boolean", random_state=seed
    )
    return X, y, X.reshape(n, k, d), y.reshape(n, k, d_out)


@pytest.mark.parametrize("init", ["phased", "random"])
def test_phased_fit_is_the_estimators_fit(init):
    X, y, X3, Y3 = _data()
    est = MultiHeadAttentionRegressor(n_heads=2, n_tokens=4, init=init, random_state=0)
    with _no_check():
        est.fit(X, y)
        attention, projection, info = phased_fit(X3, Y3, 2, init=init, random_state=0)
    np.testing.assert_array_equal(attention, est.attention_)
    np.testing.assert_array_equal(projection, est.projection_)
    assert [r.phase for r in info["reports"]] == [r.phase for r in est.phase_report_]
    assert info["n_heads"] == est.n_heads_ and info["n_iter"] == est.n_iter_


def test_search_n_heads_is_the_estimators_auto_fit():
    X, y, X3, Y3 = _data(n=2000, k=3, d=5, m=2, d_out=10)
    est = MultiHeadAttentionRegressor(n_heads="auto", n_tokens=3, random_state=0)
    with _no_check():
        est.fit(X, y)
        attention, projection, info = search_n_heads(X3, Y3, random_state=0)
    np.testing.assert_array_equal(attention, est.attention_)
    assert info["model_selection"]["n_heads"] == est.model_selection_["n_heads"]


def test_one_token_is_linear():
    X, y, X3, Y3 = _data(n=300, k=1, d=3, m=1, d_out=3)
    attention, projection, info = phased_fit(X3, Y3, 1)
    assert not attention.any() and info["reports"][0].phase == "linear-one-token"


def test_phased_init_raises_when_phases_fail():
    X, y, X3, Y3 = _data(n=300)
    with pytest.raises(CertificationError):
        phased_fit(X3, Y3, 2, init="phased", certify_tol=1e-6, certify_tol_final=1e-6)


def test_unknown_option_is_a_type_error():
    X, y, X3, Y3 = _data(n=50)
    with pytest.raises(TypeError, match="certify_tol"):
        phased_fit(X3, Y3, 2, certify_tolerance=0.1)


class _no_check:
    """Let warnings through unchecked (both calls warn alike)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
