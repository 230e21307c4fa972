"""Tests of the Display classes in skattn.metrics._plot (Agg backend)."""

import itertools

import matplotlib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from sklearn.base import BaseEstimator, RegressorMixin  # noqa: E402
from sklearn.exceptions import NotFittedError  # noqa: E402

from skattn import AttentionLayer  # noqa: E402
from skattn.layer._math import attention_patterns  # noqa: E402
from skattn.metrics import AttentionPatternDisplay, RecoveryCurveDisplay  # noqa: E402
from skattn.metrics._plot import _match_heads, _pattern_distances  # noqa: E402

N_HEADS, N_TOKENS, N_FEATURES = 3, 4, 5


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _layer(n_heads=N_HEADS, seed=0, n_outputs=2):
    rng = np.random.default_rng(seed)
    attention = rng.normal(size=(n_heads, N_FEATURES, N_FEATURES))
    return AttentionLayer(attention, rng.normal(size=(n_heads, N_FEATURES, n_outputs)))


def _inputs(n=30, seed=1):
    return np.random.default_rng(seed).choice([-1.0, 1.0], (n, N_TOKENS, N_FEATURES))


class _Fitted(RegressorMixin, BaseEstimator):
    """A stand-in for a fitted skattn regressor: stores given parameters."""

    def __init__(self, attention=None, projection=None):
        self.attention = attention
        self.projection = projection

    def fit(self, X, y=None):
        self.attention_ = np.asarray(self.attention)
        self.projection_ = np.asarray(self.projection)
        self.n_tokens_ = N_TOKENS
        return self


def test_pattern_distances_total_variation():
    P = attention_patterns(_inputs(), _layer().attention)
    D = _pattern_distances(P, P)
    assert D.shape == (N_HEADS, N_HEADS)
    np.testing.assert_allclose(np.diag(D), 0.0)
    assert np.all((D >= 0) & (D <= 1))
    # One head vs the same head on shifted rows: explicit TV formula.
    i, j = 0, 1
    expected = 0.5 * np.abs(P[:, i] - P[:, j]).sum(axis=-1).mean()
    np.testing.assert_allclose(D[i, j], expected)


@pytest.mark.parametrize("perm", list(itertools.permutations(range(N_HEADS))))
def test_match_heads_recovers_any_permutation(perm):
    P = attention_patterns(_inputs(), _layer().attention)
    matched, distances = _match_heads(P, P[:, list(perm)])
    # true head i sits at position perm.index(i) of the learned layer
    np.testing.assert_array_equal(matched, np.argsort(perm))
    np.testing.assert_allclose(distances, 0.0)


@settings(max_examples=25, deadline=None)
@given(
    n_heads=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_match_heads_inverts_a_random_head_permutation(n_heads, seed, data):
    rng = np.random.default_rng(seed)
    attention = 2.0 * rng.normal(size=(n_heads, N_FEATURES, N_FEATURES))
    X = rng.choice([-1.0, 1.0], (20, N_TOKENS, N_FEATURES))
    perm = data.draw(st.permutations(range(n_heads)))
    P = attention_patterns(X, attention)
    P_learned = attention_patterns(X, attention[list(perm)])
    matched, distances = _match_heads(P, P_learned)
    np.testing.assert_array_equal(np.asarray(perm)[matched], np.arange(n_heads))
    np.testing.assert_allclose(distances, 0.0, atol=1e-12)
    # The distances are symmetric and invariant under relabelling the heads.
    D = _pattern_distances(P, P_learned)
    np.testing.assert_allclose(_pattern_distances(P_learned, P), D.T)
    np.testing.assert_allclose(D[:, matched], _pattern_distances(P, P))


def test_match_heads_fewer_and_more_learned_heads():
    P = attention_patterns(_inputs(), _layer().attention)
    matched, distances = _match_heads(P, P[:, [2]])
    np.testing.assert_array_equal(matched, [-1, -1, 0])
    assert np.isnan(distances[:2]).all() and distances[2] == 0.0
    extra = attention_patterns(_inputs(), _layer(n_heads=2, seed=5).attention)
    matched, _ = _match_heads(P, np.concatenate([extra, P[:, ::-1]], axis=1))
    np.testing.assert_array_equal(matched, [4, 3, 2])


def test_from_layers_draws_matched_heads():
    true = _layer()
    perm = [2, 0, 1]
    learned = AttentionLayer(true.attention[perm], true.projection[perm])
    X = _inputs()
    display = AttentionPatternDisplay.from_layers(true, learned, X, sample=3)
    assert display.ax_.shape == (2, N_HEADS)
    assert display.images_.shape == (2, N_HEADS)
    assert all(isinstance(im, AxesImage) for im in display.images_.ravel())
    assert display.colorbar_ is not None
    assert display.figure_ is display.ax_[0, 0].figure
    np.testing.assert_array_equal(display.heads_true, np.arange(N_HEADS))
    np.testing.assert_array_equal(display.heads_learned, np.argsort(perm))
    np.testing.assert_allclose(display.distances, 0.0)
    expected = true.attention_patterns(X)[3]
    for c in range(N_HEADS):
        np.testing.assert_allclose(display.images_[0, c].get_array(), expected[c])
        np.testing.assert_allclose(display.images_[1, c].get_array(), expected[c])
        assert display.images_[0, c].get_clim() == (0.0, 1.0)
    assert display.ax_[0, 1].get_title() == "true head 1"
    assert display.ax_[1, 1].get_title().startswith(f"learned head {perm.index(1)}")


def test_from_layers_2d_and_3d_inputs_agree():
    true, learned = _layer(), _layer(seed=3)
    X = _inputs()
    d3 = AttentionPatternDisplay.from_layers(true, learned, X)
    d2 = AttentionPatternDisplay.from_layers(true, learned, X.reshape(len(X), -1))
    np.testing.assert_array_equal(d3.heads_learned, d2.heads_learned)
    np.testing.assert_allclose(d3.patterns_learned, d2.patterns_learned)
    np.testing.assert_allclose(d3.distances, d2.distances)
    assert np.all(d3.distances > 0)


def test_from_layers_heads_subset_and_ax():
    true = _layer()
    fig, ax = plt.subplots(2, 2)
    display = AttentionPatternDisplay.from_layers(
        true, true, _inputs(), heads=[2, 0], ax=ax, colorbar=False
    )
    assert display.figure_ is fig
    assert display.colorbar_ is None
    np.testing.assert_array_equal(display.heads_true, [2, 0])
    np.testing.assert_array_equal(display.heads_learned, [2, 0])
    assert display.patterns_true.shape == (2, N_TOKENS, N_TOKENS)


def test_from_layers_fewer_learned_heads_leaves_panels_empty():
    true = _layer()
    learned = AttentionLayer(true.attention[[1]], true.projection[[1]])
    display = AttentionPatternDisplay.from_layers(true, learned, _inputs())
    np.testing.assert_array_equal(display.heads_learned, [-1, 0, -1])
    assert display.images_[1, 0] is None and display.images_[1, 2] is None
    assert isinstance(display.images_[1, 1], AxesImage)
    assert not display.ax_[1, 0].axison
    assert display.ax_[1, 0].get_title() == "unmatched"


def test_from_estimator_with_and_without_truth():
    true = _layer()
    X = _inputs()
    est = _Fitted(true.attention[::-1], true.projection[::-1]).fit(X)
    display = AttentionPatternDisplay.from_estimator(est, X, true_layer=true)
    np.testing.assert_array_equal(display.heads_learned, [2, 1, 0])
    alone = AttentionPatternDisplay.from_estimator(est, X, heads=1, sample=2)
    assert alone.patterns_true is None and alone.ax_.shape == (1, 1)
    np.testing.assert_allclose(
        alone.images_[0, 0].get_array(), true.attention_patterns(X)[2, 1]
    )
    # An estimator with layer_ is read through it.
    est.layer_ = AttentionLayer(true.attention, true.projection, n_tokens=N_TOKENS)
    flat = AttentionPatternDisplay.from_estimator(est, X.reshape(len(X), -1))
    np.testing.assert_array_equal(flat.heads_learned, np.arange(N_HEADS))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sample": 30}, "sample must be an integer in"),
        ({"sample": -1}, "sample must be an integer in"),
        ({"sample": 1.0}, "sample must be an integer in"),
        ({"heads": [0, 0]}, "heads must be distinct head indices"),
        ({"heads": [3]}, "heads must be distinct head indices"),
        ({"heads": []}, "heads must be distinct head indices"),
        ({"heads": [0.5]}, "heads must be distinct head indices"),
        ({"ax": "three axes"}, "ax must hold 6 axes"),
    ],
)
def test_from_layers_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionPatternDisplay.from_layers(_layer(), _layer(), _inputs(), **kwargs)


def test_from_layers_bad_layers():
    X = _inputs()
    other = AttentionLayer(np.zeros((1, 3, 3)), np.zeros((1, 3, 3)))
    with pytest.raises(ValueError, match="features per token"):
        AttentionPatternDisplay.from_layers(_layer(), other, X)
    with pytest.raises(TypeError, match="learned must be an AttentionLayer"):
        AttentionPatternDisplay.from_layers(_layer(), np.zeros((3, 5, 5)), X)
    with pytest.raises(NotFittedError):
        AttentionPatternDisplay.from_estimator(_Fitted(), X)
    no_attention = _Fitted(None, None).fit(X)
    del no_attention.attention_
    with pytest.raises(TypeError, match="estimator must be an AttentionLayer"):
        AttentionPatternDisplay.from_estimator(no_attention, X)
    tokens2 = AttentionLayer(_layer().attention, _layer().projection, n_tokens=2)
    with pytest.raises(ValueError, match="expects 5 features per token"):
        AttentionPatternDisplay.from_layers(_layer(), tokens2, X.reshape(30, -1))


def test_recovery_curves_lines_and_bands():
    n = np.array([1000, 100, 10000])  # unsorted on purpose
    repeats = np.array([[0.3, 0.5, 0.1], [0.1, 0.7, 0.2], [0.2, np.nan, 0.3]])
    display = RecoveryCurveDisplay.from_results(
        n, {"phased": [0.1, 0.2, 0.05], "gradient": repeats}
    )
    assert set(display.lines_) == {"phased", "gradient"}
    assert all(isinstance(line, Line2D) for line in display.lines_.values())
    np.testing.assert_array_equal(
        display.lines_["phased"].get_xdata(), [100, 1000, 1e4]
    )
    np.testing.assert_allclose(display.lines_["phased"].get_ydata(), [0.2, 0.1, 0.05])
    # median over repeats (NaN ignored), sorted by x
    np.testing.assert_allclose(display.lines_["gradient"].get_ydata(), [0.6, 0.2, 0.2])
    assert display.bands_["phased"] is None
    assert isinstance(display.bands_["gradient"], PolyCollection)
    assert display.ax_.get_xscale() == "log" and display.ax_.get_yscale() == "log"
    assert display.ax_.get_xlabel() == "number of examples"
    labels = [t.get_text() for t in display.ax_.get_legend().get_texts()]
    assert labels == ["phased", "gradient"]


def test_recovery_curves_missing_points_and_given_ax():
    fig, ax = plt.subplots()
    display = RecoveryCurveDisplay.from_results(
        [0.0, 1.0, 2.0],
        {"a": [np.nan, 1.0, 2.0]},
        xscale="linear",
        yscale="linear",
        ylabel="pattern error",
        ax=ax,
        line_kwargs={"color": "k", "marker": "s"},
    )
    assert display.ax_ is ax and display.figure_ is fig
    np.testing.assert_array_equal(display.lines_["a"].get_xdata(), [1.0, 2.0])
    assert display.lines_["a"].get_marker() == "s"
    assert ax.get_ylabel() == "pattern error"


@pytest.mark.parametrize(
    "x, errors, kwargs, exc, match",
    [
        ([1, 2], {"a": [1.0, 2.0, 3.0]}, {}, ValueError, r"shape \(2,\)"),
        ([1, 2], {"a": [[[1.0, 2.0]]]}, {}, ValueError, r"shape \(2,\)"),
        ([1, 2], {"a": [1.0, -2.0]}, {}, ValueError, "non-negative"),
        ([1, 2], {"a": [1.0, np.inf]}, {}, ValueError, "non-negative"),
        ([[1, 2]], {"a": [1.0, 2.0]}, {}, ValueError, "x must be a non-empty 1-D"),
        ([1, np.nan], {"a": [1.0, 2.0]}, {}, ValueError, "x must be a non-empty 1-D"),
        ([1, 2], [1.0, 2.0], {}, TypeError, "errors must be a non-empty dict"),
        ([1, 2], {}, {}, TypeError, "errors must be a non-empty dict"),
        ([0, 2], {"a": [1.0, 2.0]}, {}, ValueError, "positive on a log scale"),
        ([1, 2], {"a": [1.0, 2.0]}, {"yscale": "symlog"}, ValueError, "yscale"),
    ],
)
def test_recovery_curves_bad_input(x, errors, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        RecoveryCurveDisplay.from_results(x, errors, **kwargs)
