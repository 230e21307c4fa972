"""What the data can pin, counted before a fit (issue 51)."""

import warnings

import numpy as np
import pytest

from skattn import MultiHeadAttentionRegressor, make_attention_regression
from skattn.metrics import IdentifiabilityWarning, data_verdict
from skattn.metrics._identifiability import describe_verdict
from skattn.solvers.kernels._logits import split_rows_needed


def test_the_counts_and_the_sequences_needed():
    # MiniLM's shape (tokens [x, 1], 12 heads of rank 32): 10 windows of 16
    # tokens cannot pin a head, the 62 windows of the 78 neither
    for n in (10, 62):
        verdict = data_verdict(n, 16, 385, 384, 12, head_rank=32)
        assert not verdict["determined"]
        assert verdict["rows"] == 16 * n < verdict["rows_needed"]
        assert verdict["rows_needed"] == split_rows_needed(385, 32, 16)
        assert not any(head["pinned"] for head in verdict["heads"])
    need = verdict["samples_needed"]
    assert data_verdict(need, 16, 385, 384, 12, head_rank=32)["determined"]
    assert not data_verdict(need - 1, 16, 385, 384, 12, head_rank=32)["determined"]
    line = describe_verdict(verdict, "windows")
    assert line.startswith("62 windows cannot determine this layer")
    assert f"give at least {need} windows" in line and "\n" not in line
    assert describe_verdict(data_verdict(5000, 16, 385, 384, 12, head_rank=32)) == ""


def test_full_rank_heads_count_d_squared_logits_and_d_dout_values():
    verdict = data_verdict(1, 4, 8, 16, 2)
    assert verdict["unknowns"] == 2 * (8 * 8 + 8 * 16)
    assert verdict["rows_needed"] == -(-64 // 3)
    # the outputs bound: 2 * 192 unknowns over 4 * 16 values a sequence
    assert verdict["samples_needed"] == max(-(-384 // 64), -(-22 // 4))


def test_one_token_has_no_logits_to_pin():
    verdict = data_verdict(100, 1, 4, 4, 1)
    assert verdict["rows_needed"] == 0 and verdict["determined"]


def test_a_fit_on_too_few_sequences_warns_before_its_long_work(monkeypatch):
    X, y = make_attention_regression(
        6, 4, 12, 2, distribution="gaussian", head_rank=4, random_state=0
    )
    import skattn.estimators._phased as phased

    started = []

    def no_fit(*args, **kwargs):  # the warning must come before the fit starts
        started.append(True)
        raise KeyboardInterrupt

    monkeypatch.setattr(phased, "phased_fit", no_fit)
    estimator = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, head_rank=4, init="random", random_state=0
    )
    with pytest.warns(IdentifiabilityWarning, match="give at least") as caught:
        with pytest.raises(KeyboardInterrupt):
            estimator.fit(X, y)
    assert started and len(caught) == 1
    assert caught[0].filename == __file__  # the caller's line


def test_a_fit_records_its_verdict_and_stays_quiet_when_the_data_suffice():
    X, y = make_attention_regression(
        400, 4, 6, 2, distribution="gaussian", head_rank=2, random_state=0
    )
    estimator = MultiHeadAttentionRegressor(
        n_heads=2, n_tokens=4, head_rank=2, init="random", random_state=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdentifiabilityWarning)
        estimator.fit(X, y)
    verdict = estimator.data_verdict_
    assert verdict["determined"] and verdict["n_samples"] == 400
    assert [head["pinned"] for head in verdict["heads"]] == [True, True]
    # weights of zero do not count as sequences
    weights = np.zeros(400)
    weights[:3] = 1.0
    with pytest.warns(IdentifiabilityWarning, match="^3 sequences"):
        MultiHeadAttentionRegressor(
            n_heads=2, n_tokens=4, head_rank=2, init="random", random_state=0
        ).fit(X, y, sample_weight=weights)


def test_rows_read_as_one_token_with_several_heads_are_flagged_before_the_fit():
    # the usual slip: 2-D X of sequences and no n_tokens, so k = 1 and F is linear
    X, y = make_attention_regression(
        200, 4, 6, 2, distribution="gaussian", head_rank=2, random_state=0
    )
    slip = MultiHeadAttentionRegressor(n_heads=2, head_rank=2, random_state=0)
    with pytest.warns(IdentifiabilityWarning, match="pass n_tokens=k") as caught:
        slip.fit(X, y)
    assert slip.n_tokens_ == 1
    assert "n_heads=2, head_rank=2" in str(caught[0].message)
    assert caught[0].filename == __file__
    # one token a row on purpose, or sequences given their length: no such warning
    for estimator, X_fit in [
        (MultiHeadAttentionRegressor(n_heads=2, n_tokens=1, random_state=0), X),
        (MultiHeadAttentionRegressor(random_state=0), X),
        (
            MultiHeadAttentionRegressor(n_heads=2, head_rank=2, random_state=0),
            X.reshape(200, 4, 6),
        ),
    ]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            estimator.fit(X_fit, y)
        assert not [w for w in caught if "n_tokens=k" in str(w.message)]


def test_the_search_margin_is_said_where_the_count_passes_by_little():
    # MiniLM, 12 heads: 96 windows of 64 tokens pass the count (4.2 output
    # values per unknown) and the search stalled there; 400 give it room
    from skattn.metrics._identifiability import SEARCH_MARGIN, describe_margin

    thin = data_verdict(96, 64, 385, 384, 12, head_rank=32)
    assert thin["determined"]
    need = thin["search_samples_needed"]
    assert need * 64 * 384 >= SEARCH_MARGIN * thin["unknowns"]
    assert (need - 1) * 64 * 384 < SEARCH_MARGIN * thin["unknowns"]
    line = describe_margin(thin, "windows")
    assert line.startswith("96 windows pass the count with 4.2 output values")
    assert f"give about {need} windows." in line and "\n" not in line
    assert describe_margin(data_verdict(need, 64, 385, 384, 12, head_rank=32)) == ""
    # data that fail the count get the count's line, not this one
    assert describe_margin(data_verdict(10, 16, 385, 384, 12, head_rank=32)) == ""
    # never fewer than the count asks
    few = data_verdict(1, 4, 8, 16, 2)
    assert few["search_samples_needed"] >= few["samples_needed"]


def test_a_slow_rotary_mixing_changes_the_logits_by_the_slowest_turn():
    # a head of dimension 8 at Llama 3's base over 32 tokens: a mixing of the
    # slowest pair (dimensions 3 and 7, not a scaled rotation) changes the
    # logits by about its size times the pair's turn; the fastest pair's by
    # hundreds of times more: the count's "pinned to about 1e-15 / turn"
    from skattn.layer._positions import Rotary, rotary_logits
    from skattn.metrics._identifiability import slow_mixing_pinning

    rng = np.random.default_rng(0)
    r, k, base, eps = 8, 32, 5e5, 1e-5
    X = rng.normal(size=(64, k, r))
    Q, K = rng.normal(size=(2, 1, r, r))
    logits = rotary_logits(X, Rotary(Q, K, base))

    def change(i, j):
        G = np.eye(r)
        G[i, i], G[j, j] = 1 + eps, 1 - eps
        mixed = rotary_logits(X, Rotary(Q @ G, K @ np.linalg.inv(G).T, base))
        return np.linalg.norm(mixed - logits) / np.linalg.norm(logits) / eps

    pinning = slow_mixing_pinning(r, base, k)
    turn = pinning["smallest_turn"]
    assert turn == pytest.approx(31 * base ** (-6 / 8))
    assert turn / 10 < change(3, 7) < turn
    assert change(0, 4) > 100 * change(3, 7)
    assert pinning["pinned_to"] == pytest.approx(1e-15 / turn)
    assert pinning["slow_pairs"] == 3 and pinning["pinned"]
    # longer windows pin them more, more windows of the same length do not
    assert slow_mixing_pinning(r, base, 64)["smallest_turn"] == pytest.approx(
        63 / 31 * turn
    )
    far = slow_mixing_pinning(r, 1e14, k)
    assert not far["pinned"] and far["pinned_to"] > 1e-6
    assert slow_mixing_pinning(r, 1e14, far["tokens_needed"])["pinned"]
    assert not slow_mixing_pinning(r, 1e14, far["tokens_needed"] - 1)["pinned"]
