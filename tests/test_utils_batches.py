"""Out-of-core X and y: batch access, chunked validation, fits equal to in memory."""

import warnings

import numpy as np
import pytest
from sklearn.base import clone

from skattn import (
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
)
from skattn.phased import (
    _affine_hull,
    _pipeline,
    _projection_sum,
    refine_projection_sum,
    sculpt_hull,
)
from skattn.phased._affine_hull import fit_affine_hull, hull_constraints
from skattn.utils import _batches
from skattn.utils._batches import (
    TokenBatches,
    is_out_of_core,
    token_sum_moments,
    validate_batches,
)

SOURCES = ["memmap", "zarr", "hdf5", "dask"]


def _store(array, kind, tmp_path, name, chunks=250):
    """``array`` written to an out-of-core store of the given kind."""
    if kind == "memmap":
        out = np.lib.format.open_memmap(
            tmp_path / f"{name}.npy", "w+", "f8", array.shape
        )
        out[:] = array
        out.flush()
        return np.load(tmp_path / f"{name}.npy", mmap_mode="r")
    if kind == "zarr":
        zarr = pytest.importorskip("zarr")
        out = zarr.open_array(
            str(tmp_path / f"{name}.zarr"),
            mode="w",
            shape=array.shape,
            chunks=(chunks, array.shape[1]),
            dtype="f8",
        )
        out[:] = array
        return out
    if kind == "hdf5":
        h5py = pytest.importorskip("h5py")
        file = h5py.File(tmp_path / f"{name}.h5", "w")
        return file.create_dataset(name, data=array, chunks=(chunks, array.shape[1]))
    da = pytest.importorskip("dask.array")
    return da.from_array(array, chunks=(chunks, array.shape[1]))


@pytest.mark.parametrize("kind", SOURCES)
def test_token_batches_read_the_rows_asked_for(tmp_path, kind):
    rng = np.random.default_rng(0)
    array = rng.standard_normal((1000, 12))
    view = TokenBatches(_store(array, kind, tmp_path, "A"), 3, batch_size=64)
    assert is_out_of_core(view.source)
    assert view.shape == (1000, 3, 4) and len(view) == 1000
    expected = array.reshape(1000, 3, 4)
    np.testing.assert_array_equal(view[10:200], expected[10:200])
    dense = np.arange(300, 340)
    sparse = np.array([999, 3, 500, 3, 0])  # unsorted, repeated, spread out
    np.testing.assert_array_equal(view[dense], expected[dense])
    np.testing.assert_array_equal(view[sparse], expected[sparse])
    starts = [start for start, _ in view.iter_batches()]
    assert starts == list(range(0, 1000, 64))
    np.testing.assert_array_equal(
        np.concatenate([rows for _, rows in view.iter_batches()]), expected
    )
    with pytest.raises(TypeError, match="a slice or a 1-D integer array"):
        view[0.5]


def test_validation_refuses_bad_arrays_before_reading_them_all(tmp_path):
    X = _store(np.ones((100, 6)), "memmap", tmp_path, "X")
    with pytest.raises(ValueError, match="X has 100 rows, y has 99"):
        validate_batches(X, np.ones((99, 6)), 3, 16)
    with pytest.raises(ValueError, match="not divisible by n_tokens=4"):
        validate_batches(X, np.ones((100, 6)), 4, 16)
    with pytest.raises(ValueError, match=r"y has 5 columns.*n_tokens=3"):
        validate_batches(X, np.ones((100, 5)), 3, 16)
    bad = np.ones((100, 6))
    bad[77, 2], bad[3, 0] = np.nan, np.inf
    with pytest.raises(ValueError, match=r"y contains 2 NaN or infinite"):
        validate_batches(X, _store(bad, "memmap", tmp_path, "bad"), 3, 16)
    zarr = pytest.importorskip("zarr")
    text = zarr.open_array(
        str(tmp_path / "t.zarr"), mode="w", shape=(100, 6), dtype="c16"
    )
    with pytest.raises(TypeError, match="X must hold numbers"):
        validate_batches(text, np.ones((100, 6)), 3, 16)
    one = zarr.open_array(str(tmp_path / "1.zarr"), mode="w", shape=(100,))
    with pytest.raises(ValueError, match=r"y must be 2-D.*shape \(100,\)"):
        validate_batches(X, one, 1, 16)
    X3, Y3 = validate_batches(X, [[1.0] * 3] * 100, 3, 16)  # a list y: in memory
    assert Y3.shape == (100, 3, 1)
    three = zarr.open_array(str(tmp_path / "3.zarr"), mode="w", shape=(100, 3, 2))
    with pytest.raises(ValueError, match="3-D out-of-core array"):
        validate_batches(three, np.ones((100, 6)), 3, 16)


def test_dask_nan_is_found_by_dask(tmp_path):
    pytest.importorskip("dask")
    bad = np.ones((100, 6))
    bad[50, 1] = np.nan
    X = _store(bad, "dask", tmp_path, "X", chunks=30)
    with pytest.raises(ValueError, match="X contains 1 NaN"):
        validate_batches(X, np.ones((100, 6)), 3, 16)


@pytest.mark.parametrize("kind", SOURCES)
def test_validation_measures_the_largest_magnitude(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(_batches, "_VALIDATION_ROWS", 16)  # many batches
    rng = np.random.default_rng(2)
    X, y = rng.standard_normal((100, 6)), rng.standard_normal((100, 3))
    X[77, 4], y[3, 0] = -1e200, 7.0  # a negative extreme, in a later batch
    X3, Y3 = validate_batches(
        _store(X, kind, tmp_path, "X", chunks=30),
        _store(y, kind, tmp_path, "y", chunks=30),
        3,
        16,
    )
    assert X3.max_abs == 1e200 and Y3.max_abs == np.abs(y).max() == 7.0


@pytest.mark.parametrize("kind", SOURCES)
def test_token_sum_moments_match_the_in_memory_sums(tmp_path, kind):
    rng = np.random.default_rng(1)
    X, Y, w = (
        rng.standard_normal((500, 12)),
        rng.standard_normal((500, 9)),
        rng.random(500),
    )
    view_x = TokenBatches(_store(X, kind, tmp_path, "X", chunks=70), 3, 64)
    view_y = TokenBatches(_store(Y, kind, tmp_path, "Y", chunks=70), 3, 64)
    gram, cross, v_sq = token_sum_moments(view_x, view_y, w)
    u, v = X.reshape(500, 3, 4).sum(1), Y.reshape(500, 3, 3).sum(1)
    np.testing.assert_allclose(gram, (u * w[:, None]).T @ u, rtol=1e-12)
    np.testing.assert_allclose(cross, (u * w[:, None]).T @ v, rtol=1e-12)
    np.testing.assert_allclose(v_sq, np.sum(w * np.sum(v**2, 1)), rtol=1e-12)


def _fit(est, X, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return est.fit(X, y)


@pytest.fixture(scope="module")
def planted():
    return make_attention_regression(
        4000, 3, 4, 2, n_outputs=8, random_state=0, return_layer=True
    )


PARAMS = dict(n_heads=2, n_tokens=3, random_state=0)


@pytest.fixture(scope="module")
def in_memory(planted):
    X, y, _ = planted
    return _fit(MultiHeadAttentionRegressor(batch_size=4096, **PARAMS), X, y)


def _hull_rounds(est):
    return [
        (r["certified_fraction"], r["n_rows_used"])
        for r in est.phase_report_
        if r.phase == "2-4-certify-refine-hull"
    ]


# The in-memory fit uses batch_size=4096: the out-of-core ones differ in the batch
# and the chunks, which must change the result only by rounding.
@pytest.mark.parametrize(
    "kind, batch_size", [(k, 512) for k in SOURCES] + [("memmap", 1500)]
)
def test_phased_fit_out_of_core_equals_in_memory(
    tmp_path, planted, in_memory, kind, batch_size
):
    X, y, layer = planted
    est = _fit(
        MultiHeadAttentionRegressor(batch_size=batch_size, **PARAMS),
        _store(X, kind, tmp_path, "X", chunks=700),
        _store(y, kind, tmp_path, "y", chunks=700),
    )
    assert parameter_error(layer, est).attention_error < 1e-10
    np.testing.assert_allclose(est.attention_, in_memory.attention_, atol=1e-10)
    np.testing.assert_allclose(est.projection_, in_memory.projection_, atol=1e-10)
    assert est.n_features_in_ == 12 and est.n_outputs_per_token_ == 8
    assert _hull_rounds(est) == _hull_rounds(in_memory)
    np.testing.assert_allclose(est.predict(X[:50]), y[:50], atol=1e-10)


def test_out_of_core_fit_reads_batches_not_the_whole_array(
    tmp_path, planted, monkeypatch
):
    X, y, layer = planted
    # Twice the examples: more than the 4000 certified rows phase 3's curvature
    # subsample reads at most, the largest read of a fit (whatever n).
    X, y = np.concatenate([X, X]), np.concatenate([y, y])
    sizes = []
    for name in ("_read", "_read_sorted_rows"):
        original = getattr(_batches, name)

        def spy(source, key, original=original):
            rows = original(source, key)
            sizes.append(len(rows))
            return rows

        monkeypatch.setattr(_batches, name, spy)
    monkeypatch.setattr(_batches, "_VALIDATION_ROWS", 256)
    monkeypatch.setattr(_batches, "_DENSE_FACTOR", 1)  # no read beyond the rows
    monkeypatch.setattr(_pipeline, "_OUT_OF_CORE_POLISH_SAMPLES", 400)
    est = _fit(
        MultiHeadAttentionRegressor(batch_size=256, net_samples=300, **PARAMS),
        _store(X, "memmap", tmp_path, "X"),
        _store(y, "memmap", tmp_path, "y"),
    )
    assert parameter_error(layer, est).attention_error < 1e-10
    polish = [r for r in est.phase_report_ if r.phase == "6-polish"][0]
    assert polish["n_polish_samples"] == 400
    assert sizes and max(sizes) <= 4000 < len(X)


def test_gradient_fit_out_of_core_equals_in_memory(tmp_path, planted):
    X, y, _ = planted
    X, y = X[:1500], y[:1500]
    params = dict(n_heads=2, n_tokens=3, random_state=0, max_iter=20)
    in_memory = _fit(GradientAttentionRegressor(**params), X, y)
    est = _fit(
        GradientAttentionRegressor(**params),
        _store(X, "zarr", tmp_path, "X", chunks=100),
        _store(y, "zarr", tmp_path, "y", chunks=100),
    )
    np.testing.assert_allclose(est.attention_, in_memory.attention_, atol=1e-10)
    np.testing.assert_allclose(est.loss_, in_memory.loss_, rtol=1e-10)


def test_one_token_out_of_core_is_the_least_squares_fit(tmp_path):
    X, y = make_attention_regression(400, 1, 3, 1, n_outputs=2, random_state=0)
    in_memory = MultiHeadAttentionRegressor(n_tokens=1).fit(X, y)
    est = MultiHeadAttentionRegressor(n_tokens=1).fit(
        _store(X, "memmap", tmp_path, "X"), _store(y, "memmap", tmp_path, "y")
    )
    np.testing.assert_allclose(est.projection_, in_memory.projection_, atol=1e-10)


@pytest.mark.parametrize("kind", ["memmap", "dask"])
def test_boolean_check_runs_in_chunks(tmp_path, kind):
    X, y = make_attention_regression(400, 2, 3, 1, n_outputs=4, random_state=0)
    X = X.copy()
    X[399, 0] = 0.5
    X[250, 4] = 2.0
    est = MultiHeadAttentionRegressor(
        n_tokens=2, input_distribution="boolean", batch_size=100
    )
    # the first offending value by its global row, and the count of all
    with pytest.raises(ValueError, match=r"2\.0 at row 250, column 4 \(2 such"):
        est.fit(
            _store(X, kind, tmp_path, "X", chunks=120),
            _store(y, kind, tmp_path, "y", chunks=120),
        )


@pytest.mark.parametrize("kind", ["memmap", "dask"])
@pytest.mark.parametrize("estimator", ["phased", "gradient"])
def test_out_of_core_magnitudes_are_checked_as_in_memory(tmp_path, kind, estimator):
    X, y = make_attention_regression(300, 3, 4, 1, n_outputs=2, random_state=0)
    if estimator == "phased":
        est = MultiHeadAttentionRegressor(n_tokens=3, batch_size=64, random_state=0)
    else:
        est = GradientAttentionRegressor(n_tokens=3, max_iter=5, random_state=0)
    big_x, big_y = X.copy(), y.copy()
    big_x[250, 5], big_y[10, 0] = 1e200, -1e200  # one entry each, batch 4 and 1
    for big, name in ((dict(X=big_x, y=y), "X"), (dict(X=X, y=big_y), "y")):
        with pytest.raises(ValueError, match=f"Rescale {name}") as in_memory:
            clone(est).fit(big["X"], big["y"])
        with pytest.raises(ValueError, match=f"Rescale {name}") as out_of_core:
            clone(est).fit(
                _store(big["X"], kind, tmp_path, f"X{name}", chunks=70),
                _store(big["y"], kind, tmp_path, f"y{name}", chunks=70),
            )
        assert str(out_of_core.value) == str(in_memory.value)  # the same message
    # data of a normal size fit out of core as in memory
    fitted = _fit(
        clone(est),
        _store(X, kind, tmp_path, "X", chunks=70),
        _store(y, kind, tmp_path, "y", chunks=70),
    )
    reference = _fit(clone(est), X, y)
    np.testing.assert_allclose(fitted.attention_, reference.attention_, atol=1e-8)


# ----------------------------------------------- phases 1-4 on dask workers


@pytest.fixture(scope="module")
def dask_client():
    """A client of a local cluster of two worker processes (not this one)."""
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("dask.array")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


def _dask_views(X, y, chunks, batch_size, k=3):
    import dask.array as da

    return (
        TokenBatches(da.from_array(X, chunks=(chunks, X.shape[1])), k, batch_size),
        TokenBatches(da.from_array(y, chunks=(chunks, y.shape[1])), k, batch_size),
    )


def _spy_certify(monkeypatch):
    """Samples certified in this process (the workers are other processes), by
    module: ``"hull"`` (phase 2's scan) and ``"refine"`` (phase 3)."""
    sizes = {"hull": [], "refine": []}
    for name, module in (("hull", _affine_hull), ("refine", _projection_sum)):
        original = module._certify_batch

        def spy(X, *args, original=original, name=name):
            sizes[name].append(len(X))
            return original(X, *args)

        monkeypatch.setattr(module, "_certify_batch", spy)
    return sizes


def _tasks(stream, prefix):
    """The tasks of a task stream whose key starts with ``prefix``, by worker."""
    from dask.utils import key_split

    return [t["worker"] for t in stream if key_split(t["key"]) == prefix]


@pytest.fixture(scope="module")
def planted_tokens(planted):
    X, y, _ = planted
    n = len(X)
    weights = np.random.default_rng(3).random(n) + 0.5
    W0, _ = _projection_sum.crude_projection_sum(
        X.reshape(n, 3, 4), y.reshape(n, 3, 8), weights
    )
    return X.reshape(n, 3, 4), y.reshape(n, 3, 8), weights, W0


# 4000 samples: 27 chunks (partials first merged on the workers, 16 at a time) or
# 3 uneven ones, batches of 256 or 1024 within a chunk; in memory: batches of 4096.
CHUNKINGS = [(150, 256), (1500, 1024)]


def _workers(client):
    return set(client.scheduler_info()["workers"])


@pytest.mark.parametrize("chunks, batch_size", CHUNKINGS)
def test_phase_2_scan_on_dask_workers_equals_in_memory(
    dask_client, planted, planted_tokens, monkeypatch, chunks, batch_size
):
    from distributed import get_task_stream

    X, y, _ = planted
    X3, Y3, weights, W0 = planted_tokens
    n_chunks = -(-len(X) // chunks)
    # max_rows cuts the 4296 certified rows: the kept ones must not depend on chunks
    options = dict(
        tol=0.3, sample_weight=weights, max_rows=1500, keep_rows=True, random_state=0
    )
    here = _spy_certify(monkeypatch)
    stats_mem, info_mem = hull_constraints(X3, Y3, W0, **options)
    assert sum(here["hull"]) == len(X)  # in memory: every sample certified here
    assert info_mem["n_certified"] > 2 * options["max_rows"]
    here["hull"].clear()
    Xd, Yd = _dask_views(X, y, chunks, batch_size)
    with get_task_stream(dask_client) as stream:
        stats, info = hull_constraints(Xd, Yd, W0, batch_size=batch_size, **options)
    assert here["hull"] == []  # on dask: none here, ...
    workers = _tasks(stream.data, "skattn-certify")
    assert len(workers) == n_chunks  # ... one task per chunk, on both workers
    assert set(workers) == _workers(dask_client)
    merges = _tasks(stream.data, "skattn-certify-merge")
    assert len(merges) == (-(-n_chunks // 16) if n_chunks > 16 else 0)
    assert info == info_mem
    for name in ("normal", "rhs", "equations", "targets"):
        np.testing.assert_allclose(stats[name], stats_mem[name], rtol=0, atol=1e-10)
    assert stats["rhs_norm2"] == pytest.approx(stats_mem["rhs_norm2"], rel=1e-12)
    for name, rows in stats_mem["rows"].items():
        np.testing.assert_allclose(stats["rows"][name], rows, rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunks, batch_size", CHUNKINGS)
@pytest.mark.parametrize("solver", ["als", "gauss-newton"])
def test_phase_3_scans_on_dask_workers_equal_in_memory(
    dask_client, planted, planted_tokens, monkeypatch, chunks, batch_size, solver
):
    from distributed import get_task_stream

    X, y, _ = planted
    X3, Y3, weights, W0 = planted_tokens
    n_chunks = -(-len(X) // chunks)
    options = dict(tol=0.3, sample_weight=weights, max_iter=3, optimizer=solver)
    here = _spy_certify(monkeypatch)
    W_mem, info_mem = refine_projection_sum(X3, Y3, W0, **options)
    assert sum(here["refine"]) >= len(X)  # in memory: the first pass is here
    here["refine"].clear()
    Xd, Yd = _dask_views(X, y, chunks, batch_size)
    with get_task_stream(dask_client) as stream:
        W_dask, info = refine_projection_sum(
            Xd, Yd, W0, batch_size=batch_size, **options
        )
    np.testing.assert_allclose(W_dask, W_mem, rtol=0, atol=1e-10)
    assert info["n_iter"] == info_mem["n_iter"] == 3
    assert info["n_certified"] == info_mem["n_certified"]
    assert info["mean_residual"] == pytest.approx(info_mem["mean_residual"], 1e-12)
    # The passes ran on the workers: all chunks first, then those with samples
    # near the tolerance.  Here: only the Gauss-Newton safeguard, on its
    # subsample of at most hessian_rows=4000 certified rows (3 trials a pass).
    workers = _tasks(stream.data, "skattn-refine")
    assert n_chunks <= len(workers) <= 3 * n_chunks
    assert set(workers) == _workers(dask_client)
    if solver == "als":
        assert here["refine"] == []
    else:
        subsample = [min(4000, n_cert) for n_cert in info["n_certified"]]
        assert here["refine"] == [rows for rows in subsample for _ in range(3)]


def test_kept_rows_do_not_depend_on_the_batch_size(planted_tokens):
    # Boolean tokens at k=3, d=4 repeat (4096 distinct samples): rows of repeated
    # samples tie up to rounding, which must not decide which rows are kept.
    X3, Y3, weights, W0 = planted_tokens
    assert len(np.unique(X3.reshape(len(X3), -1), axis=0)) < len(X3)
    options = dict(W_sum=W0, tol_final=0.1, n_rounds=3, max_rows=1000)
    _, point, _, info = sculpt_hull(X3, Y3, 2, batch_size=4096, **options)
    _, point_b, _, info_b = sculpt_hull(X3, Y3, 2, batch_size=256, **options)
    assert [r["n_rows_used"] for r in info["rounds"]] == [1000] * 3
    np.testing.assert_allclose(point_b, point, rtol=0, atol=1e-12)
    for r, r_b in zip(info["rounds"], info_b["rounds"], strict=True):
        assert r_b["augmented_gap_ratio"] == pytest.approx(
            r["augmented_gap_ratio"], rel=1e-10
        )


@pytest.mark.parametrize("chunks, batch_size", [(700, 512), (1500, 1024)])
def test_phases_2_4_on_dask_workers_equal_in_memory(
    dask_client, planted, planted_tokens, chunks, batch_size
):
    X, y, _ = planted
    X3, Y3, weights, W0 = planted_tokens
    options = dict(
        W_sum=W0,
        tol=0.3,
        tol_final=0.1,
        n_rounds=3,
        refine_iter=2,
        sample_weight=weights,
        max_rows=1000,
        random_state=0,
    )
    W_mem, point_mem, dirs_mem, info_mem = sculpt_hull(X3, Y3, 2, **options)
    Xd, Yd = _dask_views(X, y, chunks, batch_size)
    W_sum, point, dirs, info = sculpt_hull(Xd, Yd, 2, batch_size=batch_size, **options)
    assert info["n_rounds"] == info_mem["n_rounds"] == 3
    np.testing.assert_allclose(W_sum, W_mem, rtol=0, atol=1e-10)
    np.testing.assert_allclose(point, point_mem, rtol=0, atol=1e-10)
    flat, flat_mem = dirs.reshape(len(dirs), -1), dirs_mem.reshape(len(dirs), -1)
    np.testing.assert_allclose(flat.T @ flat, flat_mem.T @ flat_mem, atol=1e-10)
    for r, r_mem in zip(info["rounds"], info_mem["rounds"], strict=True):
        assert r["n_rows_used"] == r_mem["n_rows_used"]
        assert r["n_equations"] == r_mem["n_equations"]


@pytest.mark.parametrize("chunks", [700, 1500])
def test_dask_fit_on_a_local_cluster_equals_in_memory(
    dask_client, planted, in_memory, monkeypatch, chunks
):
    from distributed import get_task_stream

    da = pytest.importorskip("dask.array")
    X, y, layer = planted
    here = _spy_certify(monkeypatch)
    with get_task_stream(dask_client) as stream:
        est = _fit(
            MultiHeadAttentionRegressor(batch_size=512, **PARAMS),
            da.from_array(X, chunks=(chunks, 12)),
            da.from_array(y, chunks=(chunks, 24)),
        )
    np.testing.assert_allclose(est.attention_, in_memory.attention_, atol=1e-10)
    np.testing.assert_allclose(est.projection_, in_memory.projection_, atol=1e-10)
    assert parameter_error(layer, est).attention_error < 1e-10
    # the polish makes any start exact: phases 1-4's own estimates must agree too
    assert _hull_rounds(est) == _hull_rounds(in_memory)
    for name in ("projection_sum_", "hull_point_", "hull_directions_"):
        np.testing.assert_allclose(
            np.abs(getattr(est, name)), np.abs(getattr(in_memory, name)), atol=1e-10
        )
    # Phases 1-4 scanned the data in tasks on the workers: one per chunk for the
    # token sums and for each round's certification, more for phase 3.
    # (A round that stops the loop early may have scanned before it failed.)
    n_chunks, n_rounds = -(-len(X) // chunks), est.n_iter_
    assert len(_tasks(stream.data, "skattn-token-sums")) == n_chunks
    certify = len(_tasks(stream.data, "skattn-certify"))
    assert certify in (n_rounds * n_chunks, (n_rounds + 1) * n_chunks)
    refine = _tasks(stream.data, "skattn-refine")
    assert n_rounds * n_chunks <= len(refine) <= 2 * (n_rounds + 1) * n_chunks
    assert set(refine) == _workers(dask_client)
    # Here: no certification scan, only phase 3's safeguard (3 trials in each of
    # at most 2 iterations per round) on its subsample.
    assert here["hull"] == []
    assert len(here["refine"]) % 3 == 0
    assert 0 < len(here["refine"]) <= 6 * (n_rounds + 1)


# ------------------------- the matrix-free hull (hull_solver="matrix-free")
# At d = 8 the matrix-free hull runs LOBPCG and CG on 64 unknowns (at d = 4 it
# forms the 16 x 16 matrix): the iterative path, fed from every kind of source.

MF_PARAMS = dict(PARAMS, init="phased", hull_solver="matrix-free")


@pytest.fixture(scope="module")
def planted_d8():
    return make_attention_regression(
        3000, 3, 8, 2, n_outputs=16, random_state=0, return_layer=True
    )


@pytest.fixture(scope="module")
def mf_in_memory(planted_d8):
    X, y, _ = planted_d8
    return _fit(MultiHeadAttentionRegressor(batch_size=4096, **MF_PARAMS), X, y)


def _spy_iterative_hull(monkeypatch):
    """LOBPCG iterations of each matrix-free hull fit (in this process)."""
    calls = []
    original = _affine_hull.iterative_hull

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out[4]["lobpcg_iter"])
        return out

    monkeypatch.setattr(_affine_hull, "iterative_hull", spy)
    return calls


@pytest.mark.parametrize("kind", ["memmap", "zarr", "dask"])
def test_matrix_free_hull_from_out_of_core_sources_equals_in_memory(
    request, tmp_path, planted_d8, kind
):
    X, y, _ = planted_d8
    n = len(X)
    X3, Y3 = X.reshape(n, 3, 8), y.reshape(n, 3, 16)
    W0, _ = _projection_sum.crude_projection_sum(X3, Y3)
    options = dict(tol=0.3, solver="matrix-free", random_state=0, batch_size=512)
    stats_mem, info_mem = hull_constraints(X3, Y3, W0, **options)
    # chunks of 700 samples, batches of 512: neither divides the other
    views = (
        TokenBatches(_store(X, kind, tmp_path, "X", chunks=700), 3, 512),
        TokenBatches(_store(y, kind, tmp_path, "y", chunks=700), 3, 512),
    )
    if kind == "dask":  # the scan runs on a LocalCluster's workers
        client = request.getfixturevalue("dask_client")
        from distributed import get_task_stream

        with get_task_stream(client) as stream:
            stats, info = hull_constraints(*views, W0, **options)
        assert len(_tasks(stream.data, "skattn-certify")) == -(-n // 700)
    else:
        stats, info = hull_constraints(*views, W0, **options)
    assert info == info_mem
    assert stats["normal"] is None  # the system stayed factored
    for name in ("x_row", "v", "mask"):
        np.testing.assert_allclose(
            stats["constraints"][name],
            stats_mem["constraints"][name],
            rtol=0,
            atol=1e-10,
        )
    np.testing.assert_allclose(stats["rhs"], stats_mem["rhs"], rtol=0, atol=1e-10)
    assert stats["rhs_norm2"] == pytest.approx(stats_mem["rhs_norm2"], rel=1e-12)
    (point, dirs), hinfo = fit_affine_hull(stats, 2)
    (point_mem, dirs_mem), hinfo_mem = fit_affine_hull(stats_mem, 2)
    assert hinfo["solver"] == "matrix-free"
    assert hinfo["iterative"]["lobpcg_iter"][0] > 0  # LOBPCG, not a dense eigh
    np.testing.assert_allclose(point, point_mem, rtol=0, atol=1e-10)
    flat, flat_mem = dirs.reshape(1, -1), dirs_mem.reshape(1, -1)
    np.testing.assert_allclose(flat.T @ flat, flat_mem.T @ flat_mem, atol=1e-10)
    for name in ("spectrum", "augmented_spectrum"):
        np.testing.assert_allclose(hinfo[name], hinfo_mem[name], rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["memmap", "zarr", "dask"])
def test_matrix_free_phases_out_of_core_equal_in_memory(
    request, tmp_path, planted_d8, mf_in_memory, monkeypatch, kind
):
    X, y, layer = planted_d8
    if kind == "dask":
        request.getfixturevalue("dask_client")
    lobpcg = _spy_iterative_hull(monkeypatch)
    est = _fit(
        MultiHeadAttentionRegressor(batch_size=512, **MF_PARAMS),
        _store(X, kind, tmp_path, "X", chunks=700),
        _store(y, kind, tmp_path, "y", chunks=700),
    )
    assert len(lobpcg) == est.n_iter_ and all(its[0] > 0 for its in lobpcg)
    np.testing.assert_allclose(est.attention_, mf_in_memory.attention_, atol=1e-10)
    np.testing.assert_allclose(est.projection_, mf_in_memory.projection_, atol=1e-10)
    assert parameter_error(layer, est).attention_error < 1e-10
    assert _hull_rounds(est) == _hull_rounds(mf_in_memory)
    np.testing.assert_allclose(
        est.projection_sum_, mf_in_memory.projection_sum_, rtol=0, atol=1e-10
    )
    # Batches (512 against 4096) and chunks change W_sum's sums by rounding
    # (2e-15 here); the hull solved from it by LOBPCG and CG (to rtol 1e-8) moves
    # within the solvers' tolerance (measured: 5e-9 and 7e-9 relative for the
    # point, 2e-10 for the directions); the same statistics give the same hull
    # to 1e-10 (the test above).
    scale = np.linalg.norm(mf_in_memory.hull_point_)
    assert np.linalg.norm(est.hull_point_ - mf_in_memory.hull_point_) < 1e-7 * scale
    flat = est.hull_directions_.reshape(1, -1)
    flat_mem = mf_in_memory.hull_directions_.reshape(1, -1)
    np.testing.assert_allclose(flat.T @ flat, flat_mem.T @ flat_mem, atol=1e-8)
