"""Fuzzed inputs on the public surface (hypothesis).

Every case must end in one of two ways: a result that is finite and of the
documented shape, or an exception of the documented type (``ValueError`` or
``TypeError``; ``KeyError`` for a missing checkpoint tensor, ``FileNotFoundError``
for a missing file) whose message is not empty.  The inputs are never modified
and no case may take longer than ``_CASE_SECONDS``.  The number of cases tried per
surface is printed at the end of the module (run with ``-s``) and written to the
file named by ``$SKATTN_FUZZ_COUNTS`` when set.
"""

import contextlib
import json
import os
import pickle
import signal
import struct
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from skattn import (  # noqa: E402
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    RandomAttentionFeatures,
    RandomFeatureAttentionRegressor,
)

COUNTS = Counter()  # cases tried per surface
ACCEPTED = Counter()  # of which returned a (finite, well-shaped) result
DOCUMENTED = (ValueError, TypeError)
_CASE_SECONDS = 30
FUZZ = settings(
    max_examples=int(os.environ.get("SKATTN_FUZZ_EXAMPLES", 60)),
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    counts = {s: [COUNTS[s], ACCEPTED[s]] for s in sorted(COUNTS)}
    print(f"\nfuzz cases per surface [tried, accepted]: {counts}")
    target = os.environ.get("SKATTN_FUZZ_COUNTS")
    if target:
        Path(target).write_text(json.dumps(counts, indent=1))


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _no_hang(seconds=_CASE_SECONDS):
    """Fail a case that runs longer than ``seconds`` (SIGALRM, main thread)."""

    def alarm(signum, frame):
        raise _Hang(f"a fuzz case ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _snapshot(value):
    if isinstance(value, np.ndarray):
        return (value.dtype, value.shape, value.flags.writeable, value.tobytes())
    return repr(value)


def _outcome(surface, call, *inputs, allowed=DOCUMENTED):
    """Run ``call()``: it returns or raises an allowed exception with a message;
    the inputs are unchanged.  Returns the result, or None when it raised."""
    COUNTS[surface] += 1
    before = [_snapshot(v) for v in inputs]
    result = None
    with _no_hang(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = call()
            ACCEPTED[surface] += 1
        except allowed as exc:
            assert str(exc).strip(), f"{type(exc).__name__} without a message"
    assert [_snapshot(v) for v in inputs] == before, "an input was modified"
    return result


# -- arrays: shapes, dtypes, NaN/inf, empty, huge, non-contiguous, read-only -------

DTYPES = st.sampled_from(
    [np.float64, np.float32, np.float16, np.int64, np.int8, np.bool_, np.complex128]
)
ELEMENTS = st.one_of(
    st.floats(-3, 3),
    st.sampled_from([0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 1e308, -1e308, 1e-308]),
)


@st.composite
def arrays(draw, n=None, width=None, ndim=None):
    """An array of a random dtype and layout, possibly hostile."""
    ndim = draw(st.sampled_from([1, 2, 2, 2, 3, 0])) if ndim is None else ndim
    shape = []
    for axis in range(ndim):
        if axis == 0 and n is not None:
            shape.append(n)
        elif axis == ndim - 1 and width is not None and ndim == 2:
            shape.append(width)
        else:
            shape.append(draw(st.integers(0, 6)))
    dtype = draw(DTYPES)
    values = draw(hnp.arrays(np.float64, tuple(shape), elements=ELEMENTS))
    with np.errstate(all="ignore"):
        array = values.astype(dtype)
    layout = draw(st.sampled_from(["C", "F", "strided", "read-only"]))
    if layout == "F":
        array = np.asfortranarray(array)
    elif layout == "strided" and array.ndim:
        array = np.repeat(array, 2, axis=0)[::2]  # a non-contiguous view
    elif layout == "read-only":
        array.setflags(write=False)
    return array


MUTATIONS = [
    "dtype",
    "nan",
    "inf",
    "huge",
    "tiny",
    "empty",
    "y length",
    "y rank",
    "X rank",
    "new width",
    "strided",
    "fortran",
    "read-only",
    "list",
]


def _mutate(draw, array, mutation):
    array = np.array(array)
    if mutation == "dtype":
        dtype = draw(DTYPES)
        with np.errstate(all="ignore"):
            return array.astype(dtype)
    if mutation in ("nan", "inf", "huge", "tiny") and array.size:
        value = {"nan": np.nan, "inf": -np.inf, "huge": 1e300, "tiny": 1e-300}
        flat = array.reshape(-1).astype(float)
        index = draw(st.integers(0, flat.size - 1))
        flat[index if mutation in ("nan", "inf") else slice(None)] *= 0
        flat[index if mutation in ("nan", "inf") else slice(None)] += value[mutation]
        return flat.reshape(array.shape)
    if mutation == "strided" and array.ndim:
        return np.repeat(array, 2, axis=0)[::2]
    if mutation == "fortran":
        return np.asfortranarray(array)
    if mutation == "read-only":
        array.setflags(write=False)
    return array


@st.composite
def regression_data(draw):
    """X, y and new X: valid data with up to two hostile mutations, or anything."""
    if draw(st.integers(0, 4)) == 0:
        return draw(arrays()), draw(arrays()), draw(arrays())
    n = draw(st.integers(1, 12))
    k, d, d_out = (draw(st.integers(1, 3)) for _ in range(3))
    X = draw(hnp.arrays(np.float64, (n, k, d), elements=st.floats(-2, 2)))
    y = draw(hnp.arrays(np.float64, (n, k * d_out), elements=st.floats(-2, 2)))
    X_new = X[: draw(st.integers(1, n))]
    if draw(st.booleans()):
        X, X_new = X.reshape(n, k * d), X_new.reshape(len(X_new), k * d)
    if draw(st.booleans()):
        y = y[:, 0]
    mutations = draw(st.lists(st.sampled_from(MUTATIONS), max_size=2))
    for mutation in mutations:
        target = draw(st.sampled_from(["X", "y", "X_new"]))
        if mutation == "empty":
            X, y = X[:0], y[:0]
        elif mutation == "y length":
            y = y[:-1]
        elif mutation == "y rank":
            y = y[..., None, None]
        elif mutation == "X rank":
            X = X[..., None]
        elif mutation == "new width":
            X_new = np.concatenate([X_new, X_new], axis=-1)
        elif mutation != "list":
            value = {"X": X, "y": y, "X_new": X_new}[target]
            value = _mutate(draw, value, mutation)
            X, y, X_new = (
                value if name == target else old
                for name, old in (("X", X), ("y", y), ("X_new", X_new))
            )
    if "list" in mutations:
        X = X.tolist()
    return X, y, X_new


ESTIMATORS = {
    "MultiHeadAttentionRegressor": lambda: MultiHeadAttentionRegressor(
        n_heads=1, random_state=0
    ),
    "GradientAttentionRegressor": lambda: GradientAttentionRegressor(
        n_heads=1, max_iter=5, random_state=0
    ),
    "RandomFeatureAttentionRegressor": lambda: RandomFeatureAttentionRegressor(
        n_heads=3, random_state=0
    ),
    "RandomAttentionFeatures": lambda: RandomAttentionFeatures(
        n_heads=3, random_state=0
    ),
    "GradientAttentionRegressor.partial_fit": lambda: GradientAttentionRegressor(
        n_heads=1, optimizer="adam", random_state=0
    ),
}


def _fit_and_predict(est, X, y, X_new, partial=False):
    if partial:
        est.partial_fit(X, y).partial_fit(X, y)
    else:
        est.fit(X, y)
    method = est.transform if hasattr(est, "transform") else est.predict
    out = np.asarray(method(X_new))
    assert len(out) == len(X_new)
    assert np.all(np.isfinite(out)), "a fit on accepted input predicts non-finite"
    return out


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@FUZZ
@given(data=regression_data())
def test_fit_predict_of_every_estimator(name, data):
    X, y, X_new = data
    est = ESTIMATORS[name]()
    _outcome(
        f"fit/predict {name}",
        lambda: _fit_and_predict(est, X, y, X_new, name.endswith("partial_fit")),
        X,
        y,
        X_new,
    )


# -- AttentionLayer: constructor, from_projections, from_torch ---------------------


def _mutated(draw, values, extra=()):
    """``values`` (a dict of arrays) with up to two hostile mutations."""
    values = dict(values)
    for mutation in draw(st.lists(st.sampled_from([*MUTATIONS, *extra]), max_size=2)):
        name = draw(st.sampled_from(sorted(values)))
        value = values[name]
        if value is None or mutation in ("y length", "y rank", "new width"):
            continue
        if mutation == "empty":
            values[name] = np.asarray(value)[:0]
        elif mutation == "X rank":
            values[name] = np.asarray(value)[..., None]
        elif mutation == "list":
            values[name] = np.asarray(value).tolist()
        elif mutation == "other object":
            values[name] = draw(st.sampled_from([None, "abc", {"a": 1}, 3, object()]))
        elif mutation == "other shape":
            values[name] = draw(arrays())
        else:
            values[name] = _mutate(draw, value, mutation)
    return values


@st.composite
def layer_parameters(draw):
    m, d, d_out, k, n = (draw(st.integers(1, 3)) for _ in range(5))
    floats = st.floats(-2, 2)
    values = {
        "attention": draw(hnp.arrays(np.float64, (m, d, d), elements=floats)),
        "projection": draw(hnp.arrays(np.float64, (m, d, d_out), elements=floats)),
        "key_bias": draw(st.none() | hnp.arrays(np.float64, (m, d), elements=floats)),
        "intercept": draw(st.none() | hnp.arrays(np.float64, d_out, elements=floats)),
        "X": draw(hnp.arrays(np.float64, (n, k, d), elements=floats)),
    }
    return _mutated(draw, values, extra=("other object", "other shape"))


@FUZZ
@given(values=layer_parameters())
def test_attention_layer_constructor_and_transform(values):
    def call():
        layer = AttentionLayer(
            values["attention"],
            values["projection"],
            key_bias=values["key_bias"],
            intercept=values["intercept"],
        )
        out = layer.fit(values["X"]).transform(values["X"])
        assert np.all(np.isfinite(out)), "transform of accepted input is not finite"

    _outcome("AttentionLayer(...).fit/transform", call, *values.values())


@st.composite
def projection_weights(draw):
    heads = draw(st.integers(1, 3))
    e = heads * draw(st.integers(1, 2))
    floats = st.floats(-2, 2)
    values = {
        role: draw(hnp.arrays(np.float64, (e, e), elements=floats))
        for role in ("query", "key", "value", "output")
    }
    if draw(st.booleans()):
        for role in ("query", "key", "value", "output"):
            values[f"{role} bias"] = draw(hnp.arrays(np.float64, e, elements=floats))
    values = _mutated(draw, values, extra=("other object", "other shape"))
    n_heads = draw(st.sampled_from([heads, heads, heads, 0, -1, 2.5, "2", None, True]))
    biases = {
        role: values.pop(f"{role} bias")
        for role in ("query", "key", "value", "output")
        if f"{role} bias" in values
    } or None
    if biases is not None and draw(st.integers(0, 4)) == 0:
        biases["other"] = np.zeros(e)
    return [values[r] for r in ("query", "key", "value", "output")], n_heads, biases


@FUZZ
@given(spec=projection_weights(), n_tokens=st.sampled_from([None, 1, 2, 0, -1]))
def test_from_projections(spec, n_tokens):
    weights, n_heads, biases = spec

    def call():
        layer = AttentionLayer.from_projections(
            *weights, n_heads, biases=biases, n_tokens=n_tokens
        )
        X = np.random.default_rng(0).normal(size=(2, 2, layer.n_features))
        assert np.all(np.isfinite(layer.transform(X)))

    _outcome("AttentionLayer.from_projections", call, *weights)


@st.composite
def torch_modules(draw):
    torch = pytest.importorskip("torch")
    if draw(st.integers(0, 5)) == 0:
        return draw(st.sampled_from([None, 3, "mha", torch.nn.Linear(2, 2)]))
    heads = draw(st.integers(1, 3))
    embed = heads * draw(st.integers(1, 3))
    kwargs = dict(
        bias=draw(st.booleans()),
        add_bias_kv=draw(st.integers(0, 4)) == 0,
        add_zero_attn=draw(st.integers(0, 4)) == 0,
        batch_first=draw(st.booleans()),
    )
    if draw(st.integers(0, 4)) == 0:
        kwargs["kdim"] = embed + 1
    torch.manual_seed(draw(st.integers(0, 100)))
    module = torch.nn.MultiheadAttention(embed, heads, **kwargs)
    module = module.to(draw(st.sampled_from([torch.float32, torch.float64])))
    poison = draw(st.sampled_from([None, np.nan, np.inf, 1e30]))
    if poison is not None:
        with torch.no_grad():
            module.out_proj.weight[0, 0] = poison
    return module


@FUZZ
@given(module=torch_modules(), n_tokens=st.sampled_from([None, 1, 3, 0]))
def test_from_torch(module, n_tokens):
    def call():
        layer = AttentionLayer.from_torch(module, n_tokens=n_tokens)
        X = np.random.default_rng(0).normal(size=(2, 3, layer.n_features))
        assert np.all(np.isfinite(layer.transform(X)))

    _outcome("AttentionLayer.from_torch", call)


# -- checkpoint loaders: random bytes, truncated safetensors, wrong dtypes ---------


def _safetensors_bytes(tensors):
    from safetensors.numpy import save

    return save(tensors)


def _bert_tensors(e=4, vocab=5, positions=6, dtype=np.float32, drop=None):
    rng = np.random.default_rng(0)
    names = {
        "encoder.layer.0.attention.self.query": (e, e),
        "encoder.layer.0.attention.self.key": (e, e),
        "encoder.layer.0.attention.self.value": (e, e),
        "encoder.layer.0.attention.output.dense": (e, e),
    }
    tensors = {}
    for name, shape in names.items():
        tensors[name + ".weight"] = rng.normal(size=shape).astype(dtype)
        tensors[name + ".bias"] = rng.normal(size=shape[0]).astype(dtype)
    tensors["embeddings.word_embeddings.weight"] = rng.normal(size=(vocab, e))
    tensors["embeddings.position_embeddings.weight"] = rng.normal(size=(positions, e))
    tensors["embeddings.token_type_embeddings.weight"] = rng.normal(size=(2, e))
    tensors["embeddings.LayerNorm.weight"] = np.ones(e)
    tensors["embeddings.LayerNorm.bias"] = np.zeros(e)
    tensors = {k: np.asarray(v).astype(dtype) for k, v in tensors.items()}
    if drop is not None:
        tensors.pop(sorted(tensors)[drop % len(tensors)])
    return tensors


CHECKPOINT_KINDS = ["random", "header", "truncated", "dtype", "missing", "valid"]


@st.composite
def checkpoint_bytes(draw, kind):
    if kind == "random":
        return kind, draw(st.binary(min_size=0, max_size=300))
    if kind == "header":  # a length prefix pointing far past the end
        size = draw(st.sampled_from([0, 7, 2**40, 2**64 - 1]))
        return kind, struct.pack("<Q", size) + draw(st.binary(max_size=40))
    dtype = np.float32
    if kind == "dtype":
        dtype = draw(
            st.sampled_from([np.int32, np.int8, np.uint8, np.float16, np.bool_])
        )
    drop = draw(st.integers(0, 100)) if kind == "missing" else None
    data = _safetensors_bytes(_bert_tensors(dtype=dtype, drop=drop))
    if kind == "truncated":
        data = data[: draw(st.integers(0, len(data) - 1))]
    return kind, data


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
@settings(FUZZ, max_examples=max(FUZZ.max_examples // 3, 5))
@given(data=st.data(), n_tokens=st.sampled_from([2, 4]))
def test_checkpoint_loader(tmp_path_factory, kind, data, n_tokens):
    from skattn.datasets import load_bert_attention

    kind, data = data.draw(checkpoint_bytes(kind))
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    path.write_bytes(data)

    def call():
        layer, dist = load_bert_attention(path, n_heads=2, n_tokens=n_tokens)
        X = dist.sample(3, random_state=0)
        assert np.all(np.isfinite(layer.transform(X)))

    _outcome(
        f"load_bert_attention ({kind})",
        call,
        allowed=(ValueError, TypeError, KeyError),
    )
    assert path.read_bytes() == data


class _Payload:
    """Unpickling this runs ``Path(marker).touch()``: code execution."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_disguised_as_a_checkpoint_is_refused(tmp_path):
    from skattn.cli import main
    from skattn.datasets import load_bert_attention, open_attention_regression

    marker = tmp_path / "code-was-executed"
    payload = pickle.dumps({"X": _Payload(marker)})
    # a .safetensors checkpoint
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(payload)
    with pytest.raises(ValueError, match="model.safetensors.*not a .safetensors"):
        load_bert_attention(checkpoint, n_heads=1)
    # .npy files: an object array pickles its items, and a bare pickle
    folder = tmp_path / "data.npy"
    folder.mkdir()
    np.save(folder / "X.npy", np.array([_Payload(marker)], dtype=object))
    (folder / "y.npy").write_bytes(payload)
    with pytest.raises(ValueError, match="pickle"):
        open_attention_regression(folder)
    with pytest.raises(SystemExit, match="pickle"):
        main(["fit", str(folder / "X.npy"), str(folder / "y.npy"), "--n-tokens", "1"])
    npz = tmp_path / "data.npz"
    np.savez(npz, X=np.array([_Payload(marker)], dtype=object), y=np.zeros(1))
    with pytest.raises(SystemExit, match="pickle"):
        main(["fit", str(npz), "--n-tokens", "1"])
    assert not marker.exists()  # no code ran
    pickle.loads(payload)  # the payload does run code when unpickled
    assert marker.exists()


# -- sweep configuration files ------------------------------------------------------

TOML_SCALARS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, 2, 10**9, 10**18, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=8),
    st.sampled_from(["planted", "MultiHeadAttentionRegressor", "out.csv", "x.txt"]),
)
TOML_VALUES = st.one_of(TOML_SCALARS, st.lists(TOML_SCALARS, max_size=3))
KEYS = {
    "top": ["output", "scheduler", "n_jobs", "n_test", "success_tol", "retry_failed"],
    "planted": ["n_heads", "n_tokens", "n_features", "n_outputs", "attention_scale"]
    + ["distribution", "structure"],
    "grid": ["n_samples", "noise", "seeds"],
    "learner": ["estimator", "n_heads", "max_iter", "random_state", "alpha"],
}


def _table(keys):
    return st.dictionaries(
        st.sampled_from(keys) | st.text(min_size=1, max_size=5), TOML_VALUES, max_size=5
    )


ABSURD = [10**12, 10**18, 2**63 - 1, -(2**63), 0, -1, 1e300, float("nan"), ""]


@st.composite
def sweep_configs(draw):
    """A valid config, then up to three hostile edits: a value of a wrong type or
    an absurd size, an unknown key, a missing key or table."""
    config = {
        "output": "results.csv",
        "n_jobs": 1,
        "n_test": 20,
        "planted": {"n_heads": [1, 2], "n_tokens": 2, "n_features": 3},
        "grid": {"n_samples": [50, 100], "noise": [0.0], "seeds": 2},
        "learners": {
            "a": {"estimator": "GradientAttentionRegressor", "n_heads": "planted"}
        },
    }
    sections = {
        "top": config,
        "planted": config["planted"],
        "grid": config["grid"],
        "learner": config["learners"]["a"],
    }
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(sorted(sections)))
        table = sections[where]
        edit = draw(st.sampled_from(["value", "absurd", "unknown key", "drop"]))
        key = draw(st.sampled_from(KEYS[where]))
        if edit == "value":
            table[key] = draw(TOML_VALUES)
        elif edit == "absurd":
            table[key] = draw(st.sampled_from(ABSURD))
        elif edit == "unknown key":
            table[draw(st.text(min_size=1, max_size=5))] = draw(TOML_VALUES)
        elif key in table:
            del table[key]
        if where == "top" and draw(st.integers(0, 9)) == 0:
            config.pop(draw(st.sampled_from(["planted", "grid", "learners"])), None)
    return config


def _toml(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(str(value), repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else str(value)


def _write_toml(config):
    lines, tables = [], []
    for key, value in config.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{json.dumps(key)} = {_toml(value)}")
    for name, table in tables:
        if name == "learners":
            for learner, spec in table.items():
                lines.append(f"[learners.{learner}]")
                lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in spec.items()]
        else:
            lines.append(f"[{name}]")
            lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


class _Validated(Exception):
    """Raised where the sweep would start its fits: every check passed."""


def _validated(*args):
    raise _Validated


@FUZZ
@given(config=sweep_configs())
def test_sweep_config_files(tmp_path_factory, monkeypatch_module, config):
    from skattn.experiments import _sweep, load_sweep_config, recovery_sweep

    folder = tmp_path_factory.mktemp("config")
    path = folder / "sweep.toml"
    text = _write_toml(config)
    path.write_text(text)

    def call():
        kwargs = load_sweep_config(path)
        with monkeypatch_module.context() as patch:
            # validation only: no scheduler is contacted, no fit runs
            patch.setattr(_sweep, "_connect", lambda scheduler: None)
            patch.setattr(_sweep, "_run", _validated)
            with contextlib.suppress(_Validated):
                recovery_sweep(**{**kwargs, "progress": False})

    _outcome("sweep config file", call)
    assert path.read_text() == text


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


# -- regressions: each bug the fuzzer found, as a plain test -------------------------


def test_gradient_fit_that_overflows_is_an_error_not_a_nan_layer():
    # Found: X = 1e300 gave a fit with NaN parameters and NaN predictions.
    with pytest.raises(ValueError, match="too large for float64.*Rescale X"):
        GradientAttentionRegressor(n_heads=1, max_iter=5, random_state=0).fit(
            np.array([[[1e300]]]), np.array([[0.0]])
        )


def test_phased_fit_on_overflowing_input_ends_with_an_error():
    # Found: X = 1e300 made the polish's damping NaN, and its Levenberg-Marquardt
    # loop (stop when damping > limit: never, for NaN) ran forever.
    X = np.full((12, 3, 1), 1e300)
    y = np.random.default_rng(0).normal(size=(12, 9))
    with (
        _no_hang(20),
        pytest.raises(ValueError, match="too large for float64.*Rescale X"),
    ):
        MultiHeadAttentionRegressor(n_heads=1, random_state=0).fit(X, y)


def test_partial_fit_that_overflows_is_an_error_and_keeps_the_model():
    # Found after the fuzz, by the same input: partial_fit returned NaN parameters.
    est = GradientAttentionRegressor(n_heads=1, optimizer="adam", random_state=0)
    with pytest.raises(ValueError, match="too large for float64"):
        est.partial_fit(np.array([[[1e300]]]), np.array([[0.0]]))
    rng = np.random.default_rng(0)
    est.partial_fit(rng.normal(size=(20, 2, 2)), rng.normal(size=(20, 4)))
    before = est.attention_.copy(), est.projection_.copy(), dict(est._adam)
    with pytest.raises(ValueError, match="too large for float64"):
        est.partial_fit(np.full((20, 2, 2), 1e300), np.zeros((20, 4)))
    np.testing.assert_array_equal(est.attention_, before[0])
    np.testing.assert_array_equal(est.projection_, before[1])
    assert est._adam["step"] == before[2]["step"]
    assert np.all(np.isfinite(est._adam["first"]))


def test_transforms_that_overflow_are_an_error_not_inf():
    # Found: finite inputs of 1e300 gave infinite features / NaN outputs.
    huge = np.array([[[1e300]]])
    features = RandomAttentionFeatures(n_heads=3, random_state=0).fit(np.zeros((1, 1)))
    with pytest.raises(ValueError, match="features overflowed.*X up to 1e\\+300"):
        features.transform(huge)
    layer = AttentionLayer(np.ones((1, 1, 1)), np.zeros((1, 1, 1)))
    with pytest.raises(ValueError, match="transform overflowed.*X up to 1e\\+300"):
        layer.transform(huge)
    with pytest.raises(ValueError, match="attention_patterns overflowed"):
        layer.attention_patterns(huge)
    regressor = RandomFeatureAttentionRegressor(n_heads=3, random_state=0)
    with pytest.raises(ValueError, match="too large for float64"):
        regressor.fit(huge, np.zeros(1))


def test_absurd_seed_count_in_a_config_is_refused(tmp_path):
    # Found: seeds = 10**12 built a list of 10**12 seeds (MemoryError after a wait).
    from skattn.experiments import load_sweep_config

    path = tmp_path / "sweep.toml"
    path.write_text(
        'output = "r.csv"\n[grid]\nn_samples = 10\nseeds = 1_000_000_000_000\n'
        '[learners.a]\nestimator = "GradientAttentionRegressor"\n'
    )
    with (
        _no_hang(5),
        pytest.raises(ValueError, match=r"\[grid\] seeds=1000000000000 asks for"),
    ):
        load_sweep_config(path)


@pytest.mark.parametrize("data", [b"", b"\x00" * 7, b"not a checkpoint at all"])
def test_unreadable_checkpoint_is_a_value_error_naming_it(tmp_path, data):
    # Found: safetensors' own SafetensorError, not a ValueError naming the file.
    from skattn.datasets import load_bert_attention

    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"{path} is not a .safetensors checkpoint"):
        load_bert_attention(path, n_heads=1)
