"""MultiHeadAttentionRegressor on CuPy arrays, where a GPU and CuPy are at hand.

CI has no GPU, so these tests skip there; ``benchmarks/gpu/run_on_device.sh``
runs this file first on a lent GPU machine.  The claim checked is the user
guide's (*On a GPU*): under ``array_api_dispatch`` a CuPy fit stays on the device
and gives the layer numpy gives, the fit being exact on a planted layer.
"""

import os

import numpy as np
import pytest
from sklearn import config_context

from skattn import (
    MultiHeadAttentionRegressor,
    make_attention_regression,
    parameter_error,
)
from skattn.utils import estimator_to_numpy


def _cupy():
    """CuPy when it is installed and sees a GPU, else skip."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy sees no GPU")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"CuPy sees no GPU ({exc})")
    if os.environ.get("SCIPY_ARRAY_API") != "1":
        pytest.skip("array_api_dispatch needs SCIPY_ARRAY_API=1 before scipy")
    return cupy


@pytest.mark.parametrize("params", [{}, {"head_rank": 2}])
def test_cupy_fit_stays_on_the_device_and_gives_numpys_layer(params):
    cupy = _cupy()
    # the planted heads of the rank the estimator fits (full rank: 5; a rank-2
    # fit of full-rank heads ends at 0.34, on numpy as on the device)
    X, y = make_attention_regression(
        600, 3, 5, 2, n_outputs=6, random_state=0, **params
    )
    options = dict(n_heads=2, n_tokens=3, init="random", random_state=0, **params)
    reference = MultiHeadAttentionRegressor(**options).fit(X, y)
    est = MultiHeadAttentionRegressor(**options)
    X_gpu, y_gpu = cupy.asarray(X), cupy.asarray(y)
    with config_context(array_api_dispatch=True):
        est.fit(X_gpu, y_gpu)
        predicted = est.predict(X_gpu)
        score = est.score(X_gpu, y_gpu)
    assert isinstance(est.attention_, cupy.ndarray)
    assert isinstance(predicted, cupy.ndarray)
    assert est.phase_report_[-1].info["relative_residual"] < 1e-10
    assert score == pytest.approx(1.0, abs=1e-12)
    errors = parameter_error(reference, estimator_to_numpy(est))
    assert errors.attention_error < 1e-8 and errors.projection_error < 1e-8
    np.testing.assert_allclose(
        cupy.asnumpy(predicted), reference.predict(X), rtol=0, atol=1e-8
    )
