"""The memory a decoder layer's fit needs, computed from the shapes
(``solvers/_memory.py``), against peaks measured by ``tracemalloc``."""

import tracemalloc

import numpy as np
import pytest

from skattn import make_attention_regression
from skattn.solvers._decoder import random_decoder_start
from skattn.solvers._memory import available_memory, decoder_fit_memory
from skattn.solvers.kernels._parametrization import FactoredHeads, LowRank
from skattn.solvers.optimizers._lm_matrix_free import varpro_least_squares
from skattn.solvers.stages._search import minibatch_search


def _peak(run):
    """Bytes ``run()`` allocated at its peak beyond what was held before."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# (n, k, d, m, m_kv, r, base): a layer whose polish outweighs the lift, and one
# whose slow rotary pairs' lift (18 of 24 dimensions) outweighs the polish
SHAPES = [(32, 16, 16, 4, 2, 4, 5e5), (8, 32, 32, 2, 1, 24, 1e6)]


@pytest.mark.parametrize("shape", SHAPES)
def test_each_stage_is_within_a_third_of_its_measured_peak(shape):
    n, k, d, m, m_kv, r, base = shape
    X, y, layer = make_attention_regression(
        n, k, d, m, head_rank=r, causal=True, rope=True, n_kv_heads=m_kv,
        rope_theta=base, distribution="gaussian", random_state=0, return_layer=True,
    )  # fmt: skip
    X, Y = X.reshape(n, k, d), y.reshape(n, k, -1)
    need = decoder_fit_memory(n, k, d, d, m, r, n_kv_heads=m_kv, rope_theta=base)
    decoder = {"causal": True, "rope_theta": base, "n_kv_heads": m_kv}
    searched = FactoredHeads(m, d, r, **decoder)
    start = random_decoder_start(searched, 0)
    par = LowRank(m, d, r, **decoder)
    near = 1.01 * np.concatenate([layer.rotary_query.ravel(), layer.rotary_key.ravel()])
    polish = {"max_iter": 3, "coarse": False, "head_blocks": False}
    measured = {
        "search": _peak(
            lambda: minibatch_search(
                X,
                Y,
                start,
                searched,
                max_steps=20,
                check_every=10,
                n_replacements=0,
                random_state=0,
            )  # fmt: skip
        ),
        "polish": _peak(
            lambda: varpro_least_squares(X, Y, near, par, near_gauge=False, **polish)
        ),
        "polish and lift": _peak(
            lambda: varpro_least_squares(X, Y, near, par, **polish)
        ),
    }
    computed = {
        "search": need["search"],
        "polish": need["polish"],
        "polish and lift": need["polish"] + need["lift"],
    }
    for stage, peak in measured.items():
        assert 0.75 * peak <= computed[stage] <= 1.33 * peak, (stage, measured)
    assert need["peak"] == need["examples"] + max(
        need["search"], need["polish"] + need["lift"]
    )


def test_the_lift_grows_with_the_key_groups_not_their_square():
    # 64 windows: the lift whitened on all of them for both (its Gram blocks)
    one, eight = (
        decoder_fit_memory(
            64, 32, 4096, 4096, 4 * g, 128, n_kv_heads=g, rope_theta=5e5
        )["lift"]
        for g in (1, 8)
    )
    assert 7.5 * one < eight < 8.5 * one
    # nor with the windows beyond the share it is whitened on (193 of them)
    more = [
        decoder_fit_memory(n, 32, 4096, 4096, 4, 128, n_kv_heads=1, rope_theta=5e5)
        for n in (64, 1000, 2000)
    ]
    assert more[0]["lift"] < more[1]["lift"] == more[2]["lift"]
    assert more[1]["polish"] < more[2]["polish"]
    assert decoder_fit_memory(320, 32, 64, 64, 4, 16, n_kv_heads=2)["lift"] == 0


def test_available_memory_is_a_positive_count_or_unknown():
    available = available_memory()
    assert available is None or available > 0
