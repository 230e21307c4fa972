"""skattn.phased.phased_fit and search_n_heads: the learner without the estimator."""

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import Bunch

import skattn.phased._pipeline as pipeline
from skattn import MultiHeadAttentionRegressor, make_attention_regression
from skattn.metrics import sharp_head_pinning
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


def _sharp_and_soft(n=20):
    """Heads of median largest weight 0.9999 and 0.6 (d = 24, k = 8: each needs
    ceil(576 / 7) = 83 split rows); on 20 sequences only the soft one has them."""
    X, y, layer = make_attention_regression(
        n,
        8,
        24,
        2,
        sharpness=[0.9999, 0.6],
        distribution="gaussian",
        random_state=0,
        return_layer=True,
    )
    return X.reshape(n, 8, 24), y.reshape(n, 8, 24), layer


def _ends_unconverged(monkeypatch, attention, heads=(0, 1)):
    """The random-start fit ends at ``attention`` with ``heads`` unconverged."""

    def fake(X, Y, m, **kwargs):
        info = {
            "converged": False,
            "stop_reason": "heads_unconverged",
            "unconverged_heads": list(heads),
            "relative_residual": 1e-3,
            "n_iter": 0,
        }
        return attention, np.zeros((m, X.shape[2], Y.shape[2])), info

    monkeypatch.setattr(pipeline, "fit_from_random_starts", fake)


def _warning_text(record):
    messages = [str(w.message) for w in record if w.category is ConvergenceWarning]
    (message,) = [m for m in messages if "did not converge on their" in m]
    return message


def test_unconverged_heads_warning_says_which_data_would_pin_them(monkeypatch):
    X3, Y3, layer = _sharp_and_soft()
    _ends_unconverged(monkeypatch, layer.attention)
    with pytest.warns(ConvergenceWarning, match="did not converge on their") as rec:
        phased_fit(X3, Y3, 2, init="random", random_state=0)
    message = _warning_text(rec)
    assert message.startswith("Heads [0, 1] did not converge on their one-head")
    expected = sharp_head_pinning(layer.attention, X3)
    split0, split1 = expected.n_split_rows
    assert split0 < 83 <= split1
    wanted = int(expected.sequences_needed[0])
    assert "Head 0: median largest weight" in message
    assert f"{split0} of 160 rows split its attention" in message
    assert f"give about {wanted} sequences (now 20)" in message
    assert "Head 1: median largest weight" in message
    assert f"{split1} of 160 rows split its attention" in message
    assert "the data should suffice; try more random starts" in message


def test_unconverged_heads_with_an_intercept_count_the_key_bias(monkeypatch):
    # tokens [x, 1]: Theta's last row is the key bias, its last column a
    # per-query constant that the softmax ignores
    X3, Y3, layer = _sharp_and_soft()
    rng = np.random.default_rng(0)
    key_bias = rng.normal(size=(2, 24))
    augmented = np.zeros((2, 25, 25))
    augmented[:, :24, :24] = layer.attention
    augmented[:, 24, :24] = key_bias
    augmented[:, :24, 24] = rng.normal(size=(2, 24))
    X_aug = np.concatenate([X3, np.ones((20, 8, 1))], axis=2)
    _ends_unconverged(monkeypatch, augmented, heads=(1,))
    with pytest.warns(ConvergenceWarning) as rec:
        phased_fit(X_aug, Y3, 2, init="random", fit_intercept=True, random_state=0)
    message = _warning_text(rec)
    expected = sharp_head_pinning(layer.attention[1:], X3, key_bias[1:])
    assert expected.n_unknowns[0] == 24 * 24 + 24  # 600 / 7 -> 86 rows
    assert message.startswith("Heads [1] did not converge")
    assert (
        f"{expected.n_split_rows[0]} of 160 rows split its attention (largest "
        f"weight <= 0.99), 86 needed" in message
    )
    assert "Head 0" not in message


def test_unconverged_heads_counted_on_a_subset_are_scaled(monkeypatch):
    X3, Y3, layer = _sharp_and_soft()
    _ends_unconverged(monkeypatch, layer.attention, heads=(0,))
    monkeypatch.setattr(pipeline, "_PINNING_SAMPLES", 10)
    with pytest.warns(ConvergenceWarning) as rec:
        phased_fit(X3, Y3, 2, init="random", random_state=0)
    message = _warning_text(rec)
    sub = sharp_head_pinning(
        layer.attention[:1], X3[np.linspace(0, 19, 10).round().astype(int)]
    )
    split = int(np.round(sub.n_split_rows[0] * 2))
    assert "Rows counted on 10 of the 20 training sequences and scaled" in message
    assert f"{split} of 160 rows split its attention" in message


def test_unconverged_heads_message_per_verdict():
    pinning = Bunch(
        median_largest_weight=np.array([0.9999, 0.62, 1.0]),
        n_split_rows=np.array([49, 158, 0]),
        n_rows=160,
        n_needed=np.array([83, 83, 83]),
        pinned=np.array([False, True, False]),
        sequences_needed=np.array([34.0, 11.0, np.nan]),
        n_sequences=20,
        threshold=0.99,
    )
    message = pipeline._unconverged_heads_message(
        [3, 5, 7], 0.0123, pinning, n_polish_samples=10
    )
    assert message.startswith("Heads [3, 5, 7] did not converge on their")
    assert "relative residual 0.0123 on the polish set" in message
    assert (
        "Head 3: median largest weight 0.9999, 49 of 160 rows split its attention "
        "(largest weight <= 0.99), 83 needed to pin its logits (a counting bound): "
        "give about 34 sequences (now 20) of inputs whose rows split this head's "
        "attention." in message
    )
    assert (
        "Head 5: median largest weight 0.62, 158 of 160 rows split its attention"
        in message
    )
    assert "try more random starts (raise n_restarts)" in message
    assert "Head 7: median largest weight 1, 0 of 160 rows" in message
    assert "no training row splits its attention" in message
    assert "The polish used 10 of them (polish_samples)" in message
    # without the data, the old warning
    bare = pipeline._unconverged_heads_message([1], 0.5)
    # a page that pip installs (the user guide), not a file of the repository
    assert bare.endswith(
        "pin their logits weakly (the user guide, 'Learn a layer of your own "
        "model', 'How long, how good')."
    )
    assert "benchmarks/" not in bare
    assert "Head 1:" not in bare


def test_polish_warning_counts_iterations_per_stage(monkeypatch):
    # polish_max_iter bounds the warm-up and the polish each: 198 iterations in
    # all is no broken bound of 100, and the warning says so (issue 52, point 3)
    X3, Y3, layer = _sharp_and_soft()

    def fake(X, Y, m, **kwargs):
        info = {
            "converged": False,
            "stop_reason": "max_iter",
            "relative_residual": 1e-3,
            "n_iter": 198,
            "warmup": {"n_iter": 100},
            "final_stage": "ran",
        }
        return layer.attention, np.zeros((m, X.shape[2], Y.shape[2])), info

    monkeypatch.setattr(pipeline, "fit_from_random_starts", fake)
    with pytest.warns(ConvergenceWarning, match="The polish did not converge") as rec:
        phased_fit(X3, Y3, 2, init="random", random_state=0, polish_max_iter=100)
    (message,) = [str(w.message) for w in rec if "polish did not" in str(w.message)]
    assert (
        "after 198 iterations in all (warm-up 100, polish 98; polish_max_iter=100 "
        "bounds each) with polish_tol=" in message
    )
    assert message.endswith("raise polish_max_iter.")
