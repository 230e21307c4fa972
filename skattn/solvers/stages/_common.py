"""The array and thread helpers that the random-start stages share, and the
refinement's helpers on sets of sequences: rows taken from and copied in any
array-API namespace, one BLAS thread or the GPU's own scheduling, the jobs at once,
and the sequences a stage grows, is judged on and takes heads from.  The lowest
module of ``stages/``: the search, the refinement's stages, the polish and the
driver import from it, it imports none of them.
"""

import numpy as np
from sklearn.externals import array_api_compat as _compat
from threadpoolctl import threadpool_info

from ...utils._array_api import device, is_numpy, namespace, to_namespace
from ..kernels._decoupling import _output_factors
from ..kernels._varpro import _blas_limits  # noqa: F401 (the stages' one BLAS thread)

# The array namespace's small helpers of the random-start stages (_search, the
# refinement's stages, _polish and the driver): each keeps the numpy route of the
# code it replaced (so that numpy's results keep their bits) and is written against
# the array API standard for the other namespaces.


def _device_rows(xp, rows, on):
    """Integer indices ``rows`` for ``xp.take`` on device ``on``: host indices
    copied there (a copy that blocks a GPU's host: make it once for every array
    it indexes), an array of ``xp`` as it is; numpy's as they are."""
    if is_numpy(xp) or not isinstance(rows, np.ndarray | list | range):
        return rows
    return to_namespace(np.asarray(rows), xp, on)


def _take(xp, A, rows):
    """The entries ``rows`` (integer indices: on the host, or an array of ``A``'s
    namespace on its device) of ``A`` along its first axis, in ``A``'s namespace
    and on its device (``None`` for ``A=None``)."""
    if A is None:
        return None
    if is_numpy(xp):
        return A[rows]
    return xp.take(A, _device_rows(xp, rows, device(A)), axis=0)


def _copy(xp, a):
    """A copy of ``a`` (numpy: ``a.copy()``, C order as before)."""
    return a.copy() if is_numpy(xp) else xp.asarray(a, copy=True)


def _on_accelerator(x):
    """Whether ``x`` lives on a GPU (torch CUDA/MPS or CuPy): there the stages run
    their independent pieces one after another rather than in host threads."""
    if _compat.is_cupy_array(x):
        return True
    return _compat.is_torch_array(x) and x.device.type != "cpu"


def _threads(n_jobs, size):
    """Jobs at once: ``n_jobs``, or (``None``) the BLAS threads, at most ``size``."""
    if n_jobs is None:
        n_jobs = max(
            [1]
            + [
                pool["num_threads"]
                for pool in threadpool_info()
                if pool["user_api"] == "blas"
            ]
        )
    return max(1, min(size, n_jobs))


# The refinement's stages' helpers on sets of sequences (sorted host indices of
# the training set's sequences): the layer's fit on a set, the set a restart is
# judged on, a set grown, and heads taken from another point.


def _fit_on(X, Y, params, par, sample_weight, direction, rows):
    """The layer's relative residual at ``params`` on the sequences ``rows``, the
    output factors eliminated: how the refinement judges a head it takes."""
    xp = namespace(X, Y)
    return _output_factors(
        _take(xp, X, rows),
        _take(xp, Y, rows),
        params,
        par,
        _take(xp, sample_weight, rows),
        direction is not None,
    )[1]


def _judged_on(rng, n, used, rows):
    """The sequences a restart fitted on the sequences ``used`` is judged on: as
    many others as it used, drawn at random (all others if fewer), or, when it
    used all ``n``, the refinement's ``rows``.  A head the data do not pin fits
    the sequences it sees and not the others."""
    unseen = np.setdiff1d(np.arange(n), used)
    if not len(unseen):
        return rows
    return np.sort(rng.choice(unseen, size=min(len(unseen), len(used)), replace=False))


def _on_rows(xp, rows, *arrays):
    """Each of ``arrays`` (None stays None) on the sequences ``rows`` (host
    indices: off numpy copied to the arrays' device once for all of them)."""
    on = next((device(a) for a in arrays if a is not None), None)
    rows = _device_rows(xp, rows, on)
    return tuple(_take(xp, array, rows) for array in arrays)


def _with_more(rng, n, rows, size):
    """``rows`` (sorted indices of ``n`` sequences) and ``size - len(rows)``
    others drawn at random, sorted."""
    extra = np.setdiff1d(np.arange(n), rows)
    drawn = rng.choice(extra, size=size - len(rows), replace=False)
    return np.sort(np.concatenate([rows, drawn]))


def _with_heads(xp, par, params, source, heads):
    """``params`` with the factors of ``heads`` those of ``source`` (a new flat
    vector; the array API leaves writes through views undefined)."""
    factors = [_copy(xp, factor) for factor in par.factors(params)]
    for mine, found in zip(factors, par.factors(source), strict=True):
        for i in heads:
            mine[i, ...] = found[i, ...]
    return xp.concat([xp.reshape(factor, (-1,)) for factor in factors])
