"""The certificate of a fit on cases whose answer is known."""

import numpy as np
import pytest
from sklearn.exceptions import NotFittedError

import skattn.diagnostics._certificate as certificate_module
from skattn import (
    AttentionLayer,
    Certificate,
    MultiHeadAttentionRegressor,
    certify,
    make_attention_layer,
    make_attention_regression,
)
from skattn.diagnostics._jacobian import parameter_basis

M, K, D, D_OUT = 2, 3, 4, 10


@pytest.fixture(scope="module")
def planted():
    return make_attention_regression(
        600, K, D, M, n_outputs=D_OUT, random_state=0, return_layer=True
    )


def test_exact_recovery_is_exact_and_identifiable(planted):
    X, y, layer = planted
    cert = certify(layer, X, y)
    assert isinstance(cert, Certificate)
    assert cert.exact and cert.train_residual < 1e-14
    assert cert.n_parameters == M * (D * D + D * D_OUT)
    assert cert.jacobian_rank == cert.n_parameters and cert.null_dimension == 0
    assert 1e-4 < cert.smallest_singular_value <= 1
    assert cert.locally_unique and cert.redundant_heads == ()
    assert cert.verdict == "exact and identifiable"
    text = str(cert)
    assert "verdict: exact and identifiable" in text
    for item in (
        "1. training residual",
        "2. local identifiability",
        "3. held-out",
        "4. redundancy",
        "5. non-degeneracy",
        "6. sharp heads",
    ):
        assert item in text


def test_two_identical_heads_are_duplicates(planted):
    X, _, layer = planted
    attention = np.stack([layer.attention[0], layer.attention[0]])
    twin = AttentionLayer(attention, layer.projection)
    cert = certify(twin, X, twin.transform(X))
    assert cert.exact
    # the split of W between the twins is free: d * d_out directions at least
    assert cert.null_dimension >= D * D_OUT
    assert cert.verdict == "exact but not identifiable"
    assert cert.redundant_heads == (0, 1)
    assert cert.head_notes == ("duplicate of head 1", "duplicate of head 0")
    assert "duplicate of head 1" in str(cert)


def test_fit_with_too_many_heads_is_redundant(planted):
    X, y, _ = planted
    est = MultiHeadAttentionRegressor(
        n_heads=M + 1, n_tokens=K, certificate=True, random_state=0
    ).fit(X, y)
    cert = est.certificate_
    assert cert.exact and len(cert.redundant_heads) == 1
    assert cert.null_dimension > 0 and not cert.locally_unique
    assert cert.verdict == "exact but not identifiable"
    assert "over-parameterised" in str(cert)


def test_inputs_in_a_subspace_leave_theta_undetermined(planted):
    _, _, layer = planted
    X = np.random.default_rng(0).normal(size=(600, K, D))
    X[..., -1] = 0.0  # tokens confined to a (D - 1)-dimensional subspace
    cert = certify(layer, X, layer.transform(X))
    assert cert.exact
    # Theta_i outside the subspace's square and W_i rows outside it are free
    assert cert.null_dimension == M * (D * D - (D - 1) ** 2) + M * D_OUT
    assert cert.verdict == "exact but not identifiable"
    assert "NOT locally unique" in str(cert)


def test_truncated_fit_is_not_exact(planted):
    X, y, _ = planted
    est = MultiHeadAttentionRegressor(n_heads=1, n_tokens=K, random_state=0)
    cert = certify(est.fit(X, y), X, y)
    assert not cert.exact and cert.train_residual > 0.1
    assert cert.verdict == "not exact"
    assert "verdict: not exact" in str(cert)


def test_held_out_interval_covers_the_noise_level(planted):
    X, _, layer = planted
    X_test = np.random.default_rng(1).choice([-1.0, 1.0], size=(2000, K * D))
    clean = layer.transform(X_test)
    noisy = clean + 0.05 * np.random.default_rng(2).normal(size=clean.shape)
    expected = np.sqrt(np.sum((noisy - clean) ** 2) / np.sum(noisy**2))
    cert = certify(layer, X, layer.transform(X), X_test=X_test, y_test=noisy)
    low, high = cert.held_out_interval
    assert low < expected < high and cert.held_out_error == pytest.approx(expected)
    assert cert.n_held_out == 2000 and "X_test" in cert.held_out_source


def test_low_rank_heads_are_certified_modulo_their_gauge():
    rng = np.random.default_rng(0)
    r, m, d, d_out = 2, 2, 5, 12
    attention = rng.normal(size=(m, d, r)) @ rng.normal(size=(m, r, d))
    projection = rng.normal(size=(m, d, r)) @ rng.normal(size=(m, r, d_out)) / d
    layer = AttentionLayer(attention, projection)
    X = rng.normal(size=(400, 3, d))
    cert = certify(layer, X, layer.transform(X), head_rank=r)
    factors = m * (2 * d * r + d * r + r * d_out)
    assert cert.n_parameters == factors - m * 2 * r**2
    assert cert.null_dimension == 0 and cert.verdict == "exact and identifiable"
    assert "rank-2 heads" in str(cert)


def test_certify_rejects_bad_input(planted):
    X, y, layer = planted
    with pytest.raises(ValueError, match=r"y must have shape \(600, 30\)"):
        certify(layer, X, y[:, :-1])
    with pytest.raises(ValueError, match="both X_test and y_test"):
        certify(layer, X, y, X_test=X)
    with pytest.raises(ValueError, match="rank_tol must be a positive float"):
        certify(layer, X, y, rank_tol=0)
    with pytest.raises(ValueError, match="X contains 1 NaN"):
        bad = X.copy()
        bad[0, 0] = np.nan
        certify(layer, bad, y)
    with pytest.raises(NotFittedError):
        certify(MultiHeadAttentionRegressor(), X, y)


def test_large_layers_skip_identifiability_and_say_so(planted):
    X, y, layer = planted
    cert = certify(layer, X, y, max_parameters=10)
    assert cert.jacobian_rank is None and cert.locally_unique is None
    assert cert.verdict == "exact (identifiability not computed)"
    assert "not computed" in str(cert)


def test_certificate_reports_conditions_and_a_wrong_layer(planted):
    X, y, layer = planted
    cert = certify(layer, X, y)
    assert cert.conditions.n_heads == M and "all pass" in str(cert)
    layer3 = make_attention_layer(1, D, n_outputs=D_OUT, random_state=3)
    assert certify(layer3, X, y).verdict == "not exact"


def _split_rows_by_hand(X, attention, threshold=0.99):
    """Rows per head whose largest softmax weight is <= threshold, in plain numpy."""
    logits = np.einsum("nld,mde,nae->nmla", X, attention, X)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights.max(axis=-1) <= threshold).sum(axis=(0, 2))


@pytest.mark.parametrize(
    "n_samples, verdicts", [(20, ("not pinned", "pinned")), (300, ("pinned", "pinned"))]
)
def test_sharp_head_verdict_on_planted_heads(n_samples, verdicts):
    # a nearly one-hot head (median largest weight 0.9999) and a soft one (0.6);
    # d = 24, full rank, k = 8: 576 unknowns per head, ceil(576 / 7) = 83 rows
    X, y, layer = make_attention_regression(
        n_samples,
        8,
        24,
        2,
        sharpness=[0.9999, 0.6],
        distribution="gaussian",
        random_state=0,
        return_layer=True,
    )
    cert = certify(layer, X, y)
    split = _split_rows_by_hand(X.reshape(n_samples, 8, 24), layer.attention)
    np.testing.assert_array_equal(cert.sharp_heads.n_split_rows, split)
    np.testing.assert_array_equal(cert.sharp_heads.n_needed, [83, 83])
    np.testing.assert_array_equal(cert.sharp_heads.pinned, split >= 83)
    assert cert.sharp_head_verdicts == verdicts
    assert cert.verdict.startswith("exact")  # the old verdicts are unchanged
    text = str(cert)
    line = next(row for row in text.splitlines() if row.startswith("6. sharp heads"))
    assert "head 0: median largest weight" in line
    assert f"split rows {split[0]} of {8 * n_samples}, needed 83" in line
    if verdicts[0] == "not pinned":
        wanted = int(np.ceil(n_samples * 83 / split[0]))
        assert f"NOT pinned (about {wanted} sequences like these needed" in line
        assert line.endswith("-> pinned")  # head 1
    else:
        assert "NOT pinned" not in line


def test_one_token_has_no_sharp_heads():
    X, y, layer = make_attention_regression(
        50, 1, 3, 1, random_state=0, return_layer=True
    )
    cert = certify(layer, X, y)
    assert cert.sharp_heads is None and cert.sharp_head_verdicts == ()
    assert "6. sharp heads: not measured" in str(cert)


@pytest.mark.parametrize(
    "m, d, d_out, head_rank",
    [(2, 5, 7, None), (2, 5, 7, 2), (1, 4, 3, 3), (1, 4, 3, 4), (2, 3, 6, 5)],
)
def test_parameters_are_counted_as_the_basis_spans_them(m, d, d_out, head_rank):
    rng = np.random.default_rng(0)
    attention, projection = rng.normal(size=(m, d, d)), rng.normal(size=(m, d, d_out))
    basis = parameter_basis(attention, projection, head_rank)
    expected = attention.size + projection.size if basis is None else basis.shape[1]
    assert certificate_module._n_parameters(m, d, d_out, head_rank) == expected


def test_a_large_low_rank_layer_skips_the_basis_and_the_jacobian(monkeypatch):
    # d = 128, rank 8: 8 (256 - 8) + 8 (136 - 8) = 3008 > 2000 parameters; the
    # tangent basis would be a (16384 x 16384) eigenproblem: it must not be built
    def refuse(*args, **kwargs):
        raise AssertionError("the parameter basis was built")

    monkeypatch.setattr(certificate_module, "parameter_basis", refuse)
    monkeypatch.setattr(certificate_module, "jacobian_singular_values", refuse)
    X, y, layer = make_attention_regression(
        20,
        4,
        128,
        1,
        n_outputs=8,
        head_rank=8,
        distribution="gaussian",
        random_state=0,
        return_layer=True,
    )
    cert = certify(layer, X, y, head_rank=8)
    assert cert.n_parameters == 8 * (256 - 8) + 8 * (136 - 8)
    assert cert.jacobian_rank is None and cert.singular_values is None
    assert "3008 parameters > max_parameters" in str(cert)
