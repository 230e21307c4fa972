"""write_attention_regression: planted datasets written to disk in chunks."""

import numpy as np
import pytest

from skattn.datasets import (
    make_attention_regression,
    open_attention_regression,
    write_attention_regression,
)

FORMATS = {"npy": None, "zarr": "zarr", "h5": "h5py"}


@pytest.mark.parametrize("suffix", list(FORMATS))
@pytest.mark.parametrize("noise", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 97, 1000])
def test_written_data_equal_the_in_memory_generator(
    tmp_path, suffix, noise, chunk_size
):
    if FORMATS[suffix]:
        pytest.importorskip(FORMATS[suffix])
    path = tmp_path / f"data.{suffix}"
    X, y, layer = write_attention_regression(
        path,
        300,
        3,
        4,
        2,
        n_outputs=5,
        noise=noise,
        distribution="gaussian",
        chunk_size=chunk_size,
        random_state=7,
        return_layer=True,
    )
    X_mem, y_mem, layer_mem = make_attention_regression(
        300,
        3,
        4,
        2,
        n_outputs=5,
        noise=noise,
        distribution="gaussian",
        random_state=7,
        return_layer=True,
    )
    np.testing.assert_array_equal(X[:], X_mem)
    # the forward pass over other batches: equal up to rounding
    np.testing.assert_allclose(y[:], y_mem, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(layer.attention, layer_mem.attention)
    X2, y2 = open_attention_regression(path)
    assert X2.shape == (300, 12) and y2.shape == (300, 15)
    np.testing.assert_array_equal(y2[:], y[:])


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.zarr"):
        write_attention_regression(tmp_path / "data.csv", 10, 2, 2, 1)
    with pytest.raises(ValueError, match="does not exist; create it first"):
        write_attention_regression(tmp_path / "missing" / "data.npy", 10, 2, 2, 1)
    with pytest.raises(ValueError, match="does not exist"):
        open_attention_regression(tmp_path / "absent.zarr")


def _make(path, what):
    """A file or folder at ``path`` that is not a dataset of
    write_attention_regression."""
    if what == "empty folder":
        path.mkdir()
    elif what == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(2000))
    elif what == "other zarr group":
        group = pytest.importorskip("zarr").open_group(str(path), mode="w")
        group.create_array("Z", shape=(3, 2), dtype="f8")
    elif what == "other h5":
        with pytest.importorskip("h5py").File(path, "w") as file:
            file["Z"] = np.ones(3)
    elif what == "X only":
        path.mkdir()
        np.save(path / "X.npy", np.ones((3, 2)))
    elif what == "1-D y":
        with pytest.importorskip("h5py").File(path, "w") as file:
            file["X"], file["y"] = np.ones((3, 2)), np.ones(3)


@pytest.mark.parametrize(
    ("name", "what", "match"),
    [
        (
            "data.zarr",
            "empty folder",
            "is an empty folder, not a zarr group: the arrays X and y are missing",
        ),
        ("data.zarr", "random bytes", "cannot be opened as a zarr group"),
        (
            "data.zarr",
            "other zarr group",
            r"is a zarr group without the array\(s\) \['X', 'y'\] \(it holds "
            r"\['Z'\]\)",
        ),
        (
            "data.h5",
            "random bytes",
            r"cannot be opened as an HDF5 file \(OSError: .*expected the arrays X and "
            r"y",
        ),
        ("data.h5", "empty folder", "cannot be opened as an HDF5 file"),
        (
            "data.hdf5",
            "other h5",
            r"is an HDF5 file without the array\(s\) \['X', 'y'\]",
        ),
        ("data.h5", "1-D y", r"y must be a 2-D array \(n_samples, width\)"),
        ("data.npy", "empty folder", "lacks X.npy and y.npy; a .npy dataset is a"),
        ("data.npy", "X only", "lacks y.npy"),
        ("data.npy", "random bytes", "is a file, but a .npy dataset is a folder"),
    ],
)
def test_what_is_not_a_dataset_is_named(tmp_path, name, what, match):
    if name.endswith(".zarr"):
        pytest.importorskip("zarr")
    if name.endswith((".h5", ".hdf5")):
        pytest.importorskip("h5py")
    path = tmp_path / name
    _make(path, what)
    with pytest.raises(ValueError, match=match) as info:
        open_attention_regression(path)
    assert f"path={str(path)!r}" in str(info.value)


def test_missing_zarr_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "zarr", None)
    with pytest.raises(ImportError, match=r"skattn\[ooc\]"):
        write_attention_regression(tmp_path / "data.zarr", 10, 2, 2, 1)


@pytest.mark.parametrize("head_rank", [None, 1, 3])
def test_written_low_rank_heads_equal_the_in_memory_generator(tmp_path, head_rank):
    # one drawing of the planted layer: same layer, inputs and targets
    kwargs = dict(n_outputs=5, head_rank=head_rank, noise=0.1, random_state=3)
    X, y, layer = write_attention_regression(
        tmp_path / "data.npy", 200, 3, 4, 2, chunk_size=64, return_layer=True, **kwargs
    )
    X_mem, y_mem, layer_mem = make_attention_regression(
        200, 3, 4, 2, return_layer=True, **kwargs
    )
    assert layer.head_rank == layer_mem.head_rank == head_rank
    assert layer.n_tokens == layer_mem.n_tokens == 3
    np.testing.assert_array_equal(layer.attention, layer_mem.attention)
    np.testing.assert_array_equal(layer.projection, layer_mem.projection)
    np.testing.assert_array_equal(X[:], X_mem)
    np.testing.assert_allclose(y[:], y_mem, rtol=1e-12, atol=1e-14)
    if head_rank is not None:
        assert all(np.linalg.matrix_rank(t) == head_rank for t in layer.attention)
        assert all(np.linalg.matrix_rank(w) == head_rank for w in layer.projection)


def test_head_rank_is_validated(tmp_path):
    path = tmp_path / "data.npy"
    with pytest.raises(ValueError, match="'head_rank' parameter"):
        write_attention_regression(path, 10, 2, 4, 1, head_rank=0)
    with pytest.raises(ValueError, match=r"head_rank=5 exceeds min\(n_features"):
        write_attention_regression(path, 10, 2, 4, 1, head_rank=5)
    with pytest.raises(ValueError, match="cannot be combined with structure"):
        write_attention_regression(path, 10, 2, 4, 1, head_rank=2, structure="diagonal")
    assert not path.exists()  # refused before anything is written
