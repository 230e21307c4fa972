"""The array-namespace shim of the solvers: each operation equals numpy's."""

import warnings

import numpy as np
import pytest
from _helpers import array_namespaces

from skattn.utils._array_api import (
    causal_keep,
    cholesky_solve,
    device_constant,
    einsum,
    free_memory,
    is_numpy,
    is_out_of_memory,
    lstsq,
    namespace,
    solve_triangular,
    to_namespace,
    to_numpy,
)


def test_numpy_namespace_for_numpy_and_no_arrays():
    assert is_numpy(namespace(np.ones(2)))
    assert is_numpy(namespace())
    assert is_numpy(namespace(None, 1.0, np.ones(1)))
    assert to_numpy(np.ones(2)) is not None
    assert free_memory(np.ones(2)) is None


@pytest.mark.parametrize("to_array", array_namespaces())
@pytest.mark.parametrize(
    "subscripts, shapes",
    [
        ("nij,njk->nik", [(3, 4, 5), (3, 5, 2)]),
        ("nij,nij->n", [(3, 4, 5), (3, 4, 5)]),
        ("nkj,mj->nkm", [(2, 3, 4), (5, 4)]),
        ("ij->ji", [(3, 4)]),
    ],
)
def test_einsum_matches_numpy(to_array, subscripts, shapes):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s) for s in shapes]
    expected = np.einsum(subscripts, *arrays)
    converted = [to_array(a) for a in arrays]
    xp = namespace(*converted)
    got = einsum(xp, subscripts, *converted)
    assert namespace(got) is xp
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("to_array", [None, *array_namespaces()])
def test_linear_solves_match_numpy(to_array):
    rng = np.random.default_rng(1)
    A = rng.normal(size=(6, 6))
    gram = A @ A.T + np.eye(6)
    rhs = rng.normal(size=(6, 2))
    tall = rng.normal(size=(9, 4))
    convert = np.asarray if to_array is None else to_array
    xp = namespace(convert(gram))
    for b in (rhs, rhs[:, 0]):
        got = to_numpy(cholesky_solve(xp, convert(gram), convert(b)))
        np.testing.assert_allclose(got, np.linalg.solve(gram, b), rtol=1e-12)
    lower = np.tril(A) + 3 * np.eye(6)
    got = to_numpy(solve_triangular(xp, convert(lower), convert(rhs), lower=True))
    np.testing.assert_allclose(got, np.linalg.solve(lower, rhs), rtol=1e-12)
    y = rng.normal(size=(9, 2))
    got = to_numpy(lstsq(xp, convert(tall), convert(y)))
    np.testing.assert_allclose(got, np.linalg.lstsq(tall, y, rcond=None)[0], rtol=1e-11)


@pytest.mark.parametrize("to_array", [None, *array_namespaces()])
def test_cholesky_solve_raises_linalg_error_when_not_definite(to_array):
    convert = np.asarray if to_array is None else to_array
    gram = convert(-np.eye(3))
    with pytest.raises(np.linalg.LinAlgError):
        cholesky_solve(namespace(gram), gram, convert(np.ones(3)))


@pytest.mark.parametrize("to_array", array_namespaces())
def test_to_namespace_round_trip(to_array):
    reference = to_array(np.zeros(1))
    xp = namespace(reference)
    moved = to_namespace(np.arange(3.0), xp)
    assert namespace(moved) is xp
    assert to_numpy(moved).tolist() == [0.0, 1.0, 2.0]
    assert to_namespace(moved, xp) is moved
    assert isinstance(to_namespace(moved, namespace(np.ones(1))), np.ndarray)


@pytest.mark.parametrize("to_array", array_namespaces())
def test_a_device_constant_is_copied_once_and_causal_masks_are_numpys(to_array):
    reference = to_array(np.zeros(1))
    xp = namespace(reference)
    made = []

    def make():
        made.append(1)
        return np.arange(4.0)

    key = ("test table", 4)
    first = device_constant(key, make, xp, reference.device, xp.float64)
    again = device_constant(key, make, xp, reference.device, xp.float64)
    assert to_numpy(first).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert namespace(first) is xp
    # kept off numpy (one copy from the host); numpy makes it again, no copy
    assert (again is first) != is_numpy(xp) and len(made) == (2 if is_numpy(xp) else 1)
    for k in (1, 5):
        keep = to_numpy(causal_keep(xp, k, reference.device))
        np.testing.assert_array_equal(keep, np.tril(np.ones((k, k), dtype=bool)))


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate"))
    assert not is_out_of_memory(ValueError("shapes do not match"))


# -- the names and the SCIPY_ARRAY_API switch in messages (issue 52, point 8) ------


def test_namespace_name_is_the_library_users_know():
    from skattn.utils._array_api import namespace, namespace_name

    assert namespace_name(namespace(np.ones(2))) == "numpy"
    assert namespace_name(np) == "numpy"
    torch = pytest.importorskip("torch")
    xp = namespace(torch.ones(2))
    assert xp.__name__ == "sklearn.externals.array_api_compat.torch"
    assert namespace_name(xp) == "torch"


def _scipy_read(monkeypatch, value):
    """Pretend scipy read SCIPY_ARRAY_API as ``value`` when it was imported."""
    import scipy  # noqa: F401

    for name in ("scipy._lib._array_api_override", "scipy._lib._array_api"):
        module = pytest.importorskip(name)
        if hasattr(module, "SCIPY_ARRAY_API"):
            monkeypatch.setattr(module, "SCIPY_ARRAY_API", value)
            return
    pytest.skip("this scipy keeps SCIPY_ARRAY_API elsewhere")


def test_scipy_array_api_set_after_import_scipy_is_detected(monkeypatch):
    from skattn.utils import _array_api

    monkeypatch.setenv("SCIPY_ARRAY_API", "1")
    _scipy_read(monkeypatch, "1")
    assert not _array_api.scipy_array_api_ignored()  # set in time
    _scipy_read(monkeypatch, False)
    assert _array_api.scipy_array_api_ignored()  # set after import scipy
    monkeypatch.delenv("SCIPY_ARRAY_API")
    assert not _array_api.scipy_array_api_ignored()  # not asked for at all


def test_a_fit_under_the_dispatch_warns_when_scipy_ignored_the_switch(monkeypatch):
    from sklearn import config_context

    from skattn import MultiHeadAttentionRegressor, make_attention_regression
    from skattn.utils import _array_api

    X, y = make_attention_regression(300, 2, 3, 1, random_state=0)
    monkeypatch.setenv("SCIPY_ARRAY_API", "1")
    _scipy_read(monkeypatch, False)
    monkeypatch.setitem(_array_api._WARNED, "scipy_array_api", False)
    est = MultiHeadAttentionRegressor(n_tokens=2, random_state=0)
    with config_context(array_api_dispatch=True):
        with pytest.warns(UserWarning, match="scipy was imported before it was set"):
            est.fit(X, y)
        with warnings.catch_warnings():  # once a process, not at every call
            warnings.simplefilter("error")
            est.predict(X)
