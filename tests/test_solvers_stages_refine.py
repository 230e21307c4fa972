"""The per-head refinement as a whole: its stages run in order, each recording
what it did (``stages/_refine.py``)."""

import numpy as np
from _helpers import refine_planted as planted
from _helpers import stall_head_one_below

import skattn.solvers.stages._refine as refine_module
from skattn.solvers import FactoredHeads
from skattn.solvers.kernels._varpro import _intercept_direction
from skattn.solvers.stages._refine import refine_heads

STAGES = (
    "decoupled_refine",
    "_on_enough_sequences",
    "_on_more_sequences",
    "_searched_afresh",
    "_from_patterns",
)


def test_refine_heads_runs_its_stages_in_order(monkeypatch):
    # head 1 stops near (1e-5) on the refinement's own sequences: the rounds, the
    # stage on enough sequences (nothing to pin: planted heads split their
    # attention on most rows), the stage on more sequences (where head 1
    # converges), the searches afresh (no head far) and the restarts from
    # patterns (no head left) run in that order, each once, and record so
    X, Y, truth, _ = planted(600, 6, 6, 3, 2, 6, seed=9)
    par = FactoredHeads(3, X.shape[2], 2)
    start = truth + 0.03 * np.random.default_rng(10).normal(size=truth.size)
    calls = []
    for name in STAGES:
        stage = getattr(refine_module, name)

        def recorded(*args, stage=stage, name=name, **kwargs):
            calls.append(name)
            return stage(*args, **kwargs)

        monkeypatch.setattr(refine_module, name, recorded)
    small = stall_head_one_below(monkeypatch, 2)
    refined, info = refine_heads(
        X, Y, start, par, _intercept_direction(X), None, np.random.RandomState(0), 0
    )
    assert calls == list(STAGES)
    assert small == [200]  # the rounds on decoupled_size sequences
    assert "pinning" not in info
    assert info["stuck"] == [
        {"heads": [1], "n_sequences": 600, "converged": [1], "crawling": []}
    ]
    assert info["replacements"] == [] and info["from_patterns"] == []
    assert all(head["converged"] for head in info["heads"])
    assert info["kept"] and info["residual"] < 1e-10
    assert refined.shape == start.shape
