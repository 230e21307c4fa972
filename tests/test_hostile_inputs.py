"""Hostile and unusual inputs across the public surface, counted per surface.

Each case must end in a clear error of a documented type whose message names
what was wrong (a fragment is matched), never a deep traceback, a silent result,
a hang or a modified input.  The surfaces: the estimators, the layer, the data
readers, the checkpoint reader, the command line and the sweep.  The cases of
issue 41 are here, with more of each kind; module tests cover their details.
"""

import contextlib
import io
import json
import signal

import numpy as np
import pytest
import scipy.sparse as sp

from skattn import (
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    RandomFeatureAttentionRegressor,
)
from skattn.cli import main
from skattn.datasets import load_bert_attention, open_attention_regression

RNG = np.random.default_rng(0)
X = RNG.normal(size=(60, 12))  # 3 tokens of 4 features
Y = RNG.normal(size=(60, 12))


def _mha(**params):
    return MultiHeadAttentionRegressor(n_tokens=3, random_state=0, **params)


def _ga(**params):
    return GradientAttentionRegressor(n_tokens=3, max_iter=5, random_state=0, **params)


def _rf(**params):
    return RandomFeatureAttentionRegressor(
        n_heads=4, n_tokens=3, random_state=0, **params
    )


def _checkpoint(tmp, config):
    """A tiny, valid BERT-style checkpoint beside the given config.json."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    d, rng = 8, np.random.default_rng(0)
    tensors = {}
    for name in ("self.query", "self.key", "self.value", "output.dense"):
        key = f"bert.encoder.layer.0.attention.{name}"
        tensors[key + ".weight"] = rng.normal(size=(d, d)).astype(np.float32)
        tensors[key + ".bias"] = rng.normal(size=d).astype(np.float32)
    safetensors_numpy.save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(config)
    return tmp / "model.safetensors"


def _cli(*argv):
    """Run the command line; return (status, stderr) without raising."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(list(argv))
        except SystemExit as exc:
            status = exc.code
            if isinstance(status, str):
                err.write(status)
                status = 1
    return status, err.getvalue()


# (surface, case) -> (call(tmp), expected exception, message fragment)
CASES = {
    ("estimators", "ragged list X"): (
        lambda tmp: _mha().fit([[1.0, 2.0, 3.0], [1.0, 2.0]], [[1.0], [2.0]]),
        ValueError,
        "ragged list",
    ),
    ("estimators", "ragged list y"): (
        lambda tmp: _ga().fit(X[:2], [[1.0, 2.0], [1.0]]),
        ValueError,
        "ragged list",
    ),
    ("estimators", "sparse y"): (
        lambda tmp: _ga().fit(X, sp.csr_matrix(Y)),
        TypeError,
        "sparse",
    ),
    ("estimators", "X of 1e200 (phased)"): (
        lambda tmp: _mha().fit(X * 1e200, Y),
        ValueError,
        "Rescale X",
    ),
    ("estimators", "y of 1e200 (phased)"): (
        lambda tmp: _mha().fit(X, Y * 1e200),
        ValueError,
        "Rescale y",
    ),
    ("estimators", "y of 1e200 (random features)"): (
        lambda tmp: _rf().fit(X, Y[:, 0] * 1e200),
        ValueError,
        "Rescale y",
    ),
    ("estimators", "NaN in X"): (
        lambda tmp: _ga().fit(np.where(X > 2, np.nan, X), Y),
        ValueError,
        "NaN",
    ),
    ("estimators", "width not divisible by n_tokens"): (
        lambda tmp: _mha().fit(X[:, :10], Y),
        ValueError,
        "n_tokens",
    ),
    ("estimators", "bad sample_weight"): (
        lambda tmp: _mha().fit(X, Y, sample_weight=np.ones(5)),
        ValueError,
        "sample_weight",
    ),
    ("estimators", "partial_fit with L-BFGS"): (
        lambda tmp: _ga().partial_fit(X, Y),
        AttributeError,
        "optimizer='adam'",
    ),
    ("estimators", "n_heads='auto' on 3 samples"): (
        lambda tmp: _mha(n_heads="auto").fit(X[:3], Y[:3]),
        ValueError,
        "held out",
    ),
    ("estimators", "random features on 1 sample"): (
        lambda tmp: _rf().fit(X[:1], Y[:1, 0]),
        ValueError,
        "leave-one-out",
    ),
    ("estimators", "random features, per-token 3-D y"): (
        lambda tmp: _rf().fit(X, Y.reshape(60, 3, 4)),
        ValueError,
        "per token",
    ),
    ("estimators", "polish=False with init='random'"): (
        lambda tmp: _mha(init="random", polish=False).fit(X, Y),
        ValueError,
        "needs polish=True",
    ),
    ("estimators", "unknown option of phased_fit"): (
        lambda tmp: __import__("skattn.phased", fromlist=["phased_fit"]).phased_fit(
            X.reshape(60, 3, 4), Y.reshape(60, 3, 4), 1, polish_tolerance=1.0
        ),
        TypeError,
        "Unknown option",
    ),
    ("layer", "head_rank below the heads' rank"): (
        lambda tmp: AttentionLayer(
            RNG.normal(size=(2, 4, 4)), RNG.normal(size=(2, 4, 4)), head_rank=1
        ).factors(),
        ValueError,
        "head_rank=1",
    ),
    ("layer", "heads of attention and projection disagree"): (
        lambda tmp: AttentionLayer(np.ones((1, 4, 4)), np.ones((2, 4, 4))).transform(X),
        ValueError,
        "head",
    ),
    ("data readers", "empty zarr folder"): (
        lambda tmp: (
            (tmp / "empty.zarr").mkdir(),
            open_attention_regression(tmp / "empty.zarr"),
        ),
        ValueError,
        "X and y",
    ),
    ("data readers", "random bytes as .h5"): (
        lambda tmp: (
            (tmp / "junk.h5").write_bytes(b"not hdf5" * 64),
            open_attention_regression(tmp / "junk.h5"),
        ),
        ValueError,
        "HDF5",
    ),
    ("data readers", "a path that does not exist"): (
        lambda tmp: open_attention_regression(tmp / "missing.zarr"),
        (FileNotFoundError, ValueError),
        "missing.zarr",
    ),
    ("checkpoint", "a folder where the file is expected"): (
        lambda tmp: load_bert_attention(tmp),
        ValueError,
        "folder",
    ),
    ("checkpoint", "malformed config.json"): (
        lambda tmp: load_bert_attention(_checkpoint(tmp, "{not json")),
        ValueError,
        "config.json",
    ),
    ("checkpoint", "num_attention_heads='two'"): (
        lambda tmp: load_bert_attention(
            _checkpoint(
                tmp,
                json.dumps({"num_attention_heads": "two", "hidden_size": 8}),
            )
        ),
        ValueError,
        "num_attention_heads",
    ),
}

# command lines: (surface, case) -> (argv(tmp), status, message fragment)
COMMANDS = {
    ("command line", "fit: a missing file"): (
        lambda tmp: ["fit", str(tmp / "nope.npy"), "--n-tokens", "3"],
        1,
        "does not exist",
    ),
    ("command line", "fit: a folder as X"): (
        lambda tmp: ["fit", str(tmp), str(tmp), "--n-tokens", "3"],
        1,
        "folder",
    ),
    ("command line", "fit: --n-heads two"): (
        lambda tmp: ["fit", "x.npy", "y.npy", "--n-tokens", "3", "--n-heads", "two"],
        2,
        "--n-heads",
    ),
    ("command line", "fit: --out in a missing folder"): (
        lambda tmp: [
            "fit",
            str(_arrays(tmp)),
            "--n-tokens",
            "3",
            "--out",
            str(tmp / "missing" / "layer.npz"),
        ],
        1,
        "does not exist",
    ),
    ("command line", "fit: --out not .npz"): (
        lambda tmp: ["fit", str(_arrays(tmp)), "--n-tokens", "3", "--out", "l.bin"],
        2,
        ".npz",
    ),
    ("sweep", "a learner value of the wrong type"): (
        lambda tmp: ["sweep", str(_sweep(tmp, 'max_iter = "many"'))],
        1,
        "max_iter",
    ),
    ("sweep", "an unknown distribution"): (
        lambda tmp: ["sweep", str(_sweep(tmp, "", 'distribution = "uniform"'))],
        1,
        "distribution",
    ),
}


def _arrays(tmp):
    path = tmp / "data.npz"
    np.savez(path, X=X, y=Y)
    return path


def _sweep(tmp, learner_line, planted_line=""):
    path = tmp / "sweep.toml"
    path.write_text(
        f'output = "{tmp / "out.csv"}"\n\n'
        f"[planted]\nn_heads = 1\nn_tokens = 2\nn_features = 3\n{planted_line}\n\n"
        "[grid]\nn_samples = [50]\nseeds = 1\n\n"
        '[learners.g]\nestimator = "GradientAttentionRegressor"\n'
        f'n_heads = "planted"\n{learner_line}\n'
    )
    return path


@contextlib.contextmanager
def _no_hang(seconds=60):
    def alarm(*_):
        raise TimeoutError(f"hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("key", list(CASES), ids=[" / ".join(k) for k in CASES])
def test_hostile_input_gets_a_clear_error(key, tmp_path):
    call, kind, fragment = CASES[key]
    X_before, Y_before = X.copy(), Y.copy()
    with _no_hang(), pytest.raises(kind) as caught:
        call(tmp_path)
    assert fragment in str(caught.value), str(caught.value)
    np.testing.assert_array_equal(X, X_before)  # inputs never modified
    np.testing.assert_array_equal(Y, Y_before)


@pytest.mark.parametrize("key", list(COMMANDS), ids=[" / ".join(k) for k in COMMANDS])
def test_hostile_command_line_gets_one_line(key, tmp_path):
    argv, status, fragment = COMMANDS[key]
    with _no_hang():
        code, err = _cli(*argv(tmp_path))
    assert code == status, err
    assert fragment in err, err
    assert "Traceback" not in err


def test_the_surfaces_are_counted():
    # the counts reported in issue 41's closing note
    surfaces = {}
    for surface, _ in [*CASES, *COMMANDS]:
        surfaces[surface] = surfaces.get(surface, 0) + 1
    assert set(surfaces) == {
        "estimators",
        "layer",
        "data readers",
        "checkpoint",
        "command line",
        "sweep",
    }
    assert sum(surfaces.values()) == len(CASES) + len(COMMANDS)
