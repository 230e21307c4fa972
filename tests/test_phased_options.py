"""skattn.phased._options: one frozen options object per stage, defaults written
once, every option of phased_fit either reaching its stage or rejected."""

import ast
import dataclasses
import inspect
import re

import numpy as np
import pytest

from skattn import MultiHeadAttentionRegressor
from skattn.phased import (
    PARAMETERS,
    CertificationError,
    PhasedOptions,
    _pipeline,
    fit_from_hull,
    phased_fit,
    sculpt_hull,
    select_n_heads,
)
from skattn.phased._options import default_of
from skattn.solvers import PolishOptions, RandomStartOptions, fit_from_random_starts


def test_every_learner_parameter_of_the_estimator_is_mapped():
    # the estimator's parameters that the learner does not read, and why
    not_the_learner = {
        "n_heads": "an argument of phased_fit",
        "n_tokens": "data layout, resolved by the estimator",
        "input_distribution": "validated by the estimator",
        "certificate": "computed by the estimator after the fit",
        "random_state": "an argument of phased_fit",
        "memory": "an argument of phased_fit (where stages are kept, not how)",
        # a decoder layer is learned on its own path, not by phased_fit
        "causal": "the decoder path (fit_decoder_from_random_starts)",
        "rope": "the decoder path (fit_decoder_from_random_starts)",
        "rope_theta": "the decoder path (fit_decoder_from_random_starts)",
        "rope_layout": "the decoder path (fit_decoder_from_random_starts)",
        "n_kv_heads": "the decoder path (fit_decoder_from_random_starts)",
    }
    params = set(MultiHeadAttentionRegressor().get_params())
    assert params - set(not_the_learner) == set(PARAMETERS)


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_estimator_signature_default_is_the_options(name):
    assert MultiHeadAttentionRegressor().get_params()[name] == default_of(name)


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_estimator_docstring_default_is_the_options(name):
    doc = MultiHeadAttentionRegressor.__doc__
    match = re.search(rf"^    {name} : .*default=(.+)$", doc, flags=re.MULTILINE)
    assert match, f"{name} has no 'default=' in the docstring"
    written = ast.literal_eval(match.group(1).strip())
    assert written == default_of(name), f"{name}: the docstring says {written!r}"


@pytest.mark.parametrize(
    "function, owner, only",
    [
        (sculpt_hull, "hull", None),
        (select_n_heads, "hull", {"max_heads"}),  # its tol is the polish's
        (select_n_heads, "heads", None),
        (fit_from_hull, "net", None),
        (fit_from_hull, "polish", None),
    ],
)
def test_phase_functions_take_their_defaults_from_the_options(function, owner, only):
    # each keyword of a phase function that an option sets has that option's
    # default (the mapping phased_fit uses when it calls the function)
    keyword = {
        ("hull", "tol"): "tol",
        ("hull", "tol_final"): "tol_final",
        ("hull", "n_rounds"): "n_rounds",
        ("hull", "refine_iter"): "refine_iter",
        ("hull", "p_min"): "p_min",
        ("hull", "confidence_floor"): "confidence_floor",
        ("hull", "max_rows"): "max_rows",
        ("hull", "method"): "method",
        ("hull", "solver"): "solver",
        ("hull", "batch_size"): "batch_size",
        ("hull", "max_heads"): "max_heads",
        ("heads", "validation_fraction"): "validation_fraction",
        ("heads", "n_fit_samples"): "n_fit_samples",
        ("net", "resolution"): "resolution",
        ("net", "radius"): "radius",
        ("net", "n_samples"): "n_net_samples",
        ("net", "max_candidates"): "max_candidates",
        ("polish", "enabled"): "polish",
        ("polish", "n_samples"): "n_polish_samples",
        ("polish", "max_iter"): "max_iter",
        ("polish", "tol"): "tol",
        ("polish", "solver"): "solver",
        ("polish", "head_rank"): "head_rank",
        ("polish", "intercept"): "intercept",
        ("polish", "verbose"): "verbose",
        ("polish", "factor_values"): "factor_values",
    }
    signature = inspect.signature(function).parameters
    options = getattr(PhasedOptions(), owner)
    checked = 0
    for field in dataclasses.fields(options):
        name = keyword.get((owner, field.name))
        if only is not None and field.name not in only:
            continue
        if name in signature:
            assert signature[name].default == getattr(options, field.name), name
            checked += 1
    assert checked >= (1 if only else 2)


def test_options_are_frozen():
    options = PhasedOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.hull.tol = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.init = "random"


def _data(n=300, k=3, d=4, d_out=8):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, k, d))
    X[:, :, -1] = 1.0  # a constant coordinate, so fit_intercept=True is valid
    return X, rng.normal(size=(n, k, d_out))


def test_unknown_options_are_rejected():
    X, Y = _data()
    with pytest.raises(TypeError, match=r"Unknown option\(s\) \['polish_tolerance'\]"):
        phased_fit(X, Y, 2, polish_tolerance=1e-8)
    with pytest.raises(TypeError, match="either options or the parameters"):
        phased_fit(X, Y, 2, options=PhasedOptions(), polish_tol=1e-8)
    with pytest.raises(TypeError, match="options must be a PhasedOptions"):
        phased_fit(X, Y, 2, options={"polish_tol": 1e-8})


class _Reached(Exception):
    """Raised by a recording stage: the run got there, with these arguments."""


def _record(calls, name, result=None):
    def stage(*args, **kwargs):
        calls[name] = {**kwargs, "args": args}
        if result is None:
            raise _Reached(name)
        if isinstance(result, Exception):
            raise result
        return result

    return stage


def _fake_hull(d):
    rng = np.random.default_rng(1)
    info = {
        "rounds": [],
        "best_round": 0,
        "n_rounds": 1,
        "n_heads": 2,
        "augmented_gap_ratio": 10.0,
    }
    return np.zeros((d, 8)), np.zeros((d, d)), rng.normal(size=(1, d, d)), info


def _run(monkeypatch, path, **params):
    """Run phased_fit with the stages of ``path`` recording their arguments."""
    X, Y = _data()
    d = X.shape[2]
    calls = {}
    if path == "hull":
        monkeypatch.setattr(_pipeline, "sculpt_hull", _record(calls, "hull"))
        params.setdefault("init", "phased")
    elif path == "net":
        fake = _fake_hull(d)
        monkeypatch.setattr(_pipeline, "sculpt_hull", _record(calls, "hull", fake))
        monkeypatch.setattr(_pipeline, "fit_from_hull", _record(calls, "net"))
        params.setdefault("init", "phased")
    elif path == "random":
        monkeypatch.setattr(
            _pipeline, "fit_from_random_starts", _record(calls, "random")
        )
        params.setdefault("init", "random")
    elif path == "heads":
        failed = CertificationError("no hull")
        monkeypatch.setattr(_pipeline, "sculpt_hull", _record(calls, "hull", failed))
        monkeypatch.setattr(_pipeline, "select_n_heads", _record(calls, "heads"))
    n_heads = "auto" if path == "heads" else 2
    with pytest.raises(_Reached), _quiet():
        phased_fit(X, Y, n_heads, random_state=0, **params)
    return calls


class _quiet:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


# parameter -> (a value other than the default, the path that reads it, where the
# value must arrive: (recorded stage, keyword) or a function of the calls)
REACHES = {
    "certify_tol": (0.4, "hull", ("hull", "tol")),
    "certify_tol_final": (0.03, "hull", ("hull", "tol_final")),
    "n_rounds": (3, "hull", ("hull", "n_rounds")),
    "refine_iter": (1, "hull", ("hull", "refine_iter")),
    "min_pattern_prob": (0.1, "hull", ("hull", "p_min")),
    "confidence_floor": (0.5, "hull", ("hull", "confidence_floor")),
    "max_rows": (123, "hull", ("hull", "max_rows")),
    "hull_method": ("huber", "hull", ("hull", "method")),
    "hull_solver": ("dense", "hull", ("hull", "solver")),
    "batch_size": (77, "hull", ("hull", "batch_size")),
    "max_heads": (3, "heads", ("heads", "max_heads")),
    "validation_fraction": (0.3, "heads", ("heads", "validation_fraction")),
    "selection_samples": (111, "heads", ("heads", "n_fit_samples")),
    "net_resolution": (5, "net", ("net", "resolution")),
    "net_radius": (2.5, "net", ("net", "radius")),
    "net_samples": (222, "net", ("net", "n_net_samples")),
    "max_net_candidates": (333, "net", ("net", "max_candidates")),
    "polish": (False, "net", ("net", "polish")),
    "polish_samples": (150, "net", ("net", "n_polish_samples")),
    "polish_max_iter": (7, "net", ("net", "max_iter")),
    "polish_tol": (1e-7, "net", ("net", "tol")),
    "polish_solver": ("dense", "net", ("net", "solver")),
    "head_rank": (2, "net", ("net", "head_rank")),
    "n_restarts": (5, "random", lambda c: c["random"]["starts"].n_starts),
    "whiten": (False, "random", lambda c: c["random"]["starts"].whiten),
    "start_search": ("none", "random", lambda c: c["random"]["starts"].start_search),
    "init": ("random", "random", lambda c: "random" if "random" in c else None),
    "fit_intercept": (True, "hull", lambda c: c["hull"]["gauge_features"] == (3,)),
    "verbose": (2, "net", ("net", "verbose")),
}
EXPECTED = {"fit_intercept": True, "verbose": 2}


def test_the_reach_table_covers_every_option():
    assert set(REACHES) == set(PARAMETERS)


@pytest.mark.parametrize("name", sorted(REACHES))
def test_every_option_reaches_its_stage(monkeypatch, name):
    value, path, where = REACHES[name]
    assert value != default_of(name)
    calls = _run(monkeypatch, path, **{name: value})
    if callable(where):
        arrived = where(calls)
    else:
        stage, keyword = where
        arrived = calls[stage][keyword]
    assert arrived == EXPECTED.get(name, value)
    if name == "fit_intercept":  # the polish's intercept too
        assert PhasedOptions.from_params(fit_intercept=True).polish.intercept


def test_the_random_start_path_reads_the_polish_options(monkeypatch):
    calls = _run(monkeypatch, "random", polish_max_iter=9, polish_tol=1e-6, head_rank=2)
    polish = calls["random"]["polish"]
    assert isinstance(polish, PolishOptions)
    assert (polish.max_iter, polish.tol, polish.head_rank) == (9, 1e-6, 2)
    assert isinstance(calls["random"]["starts"], RandomStartOptions)


def test_options_object_gives_the_same_fit_as_the_parameters():
    X, Y = _data(n=200, d_out=6)
    Y = np.asarray(Y)
    kwargs = dict(init="random", n_restarts=1, polish_max_iter=5)
    with _quiet():
        a = phased_fit(X, Y, 1, random_state=0, **kwargs)
        b = phased_fit(
            X, Y, 1, random_state=0, options=PhasedOptions.from_params(**kwargs)
        )
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert fit_from_random_starts is _pipeline.fit_from_random_starts
