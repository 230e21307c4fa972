"""The solvers' arrays in any array-API namespace: numpy, torch (CPU or CUDA), CuPy.

The random-start path is written once against the array namespace of its inputs
(scikit-learn's vendored ``array_api_compat``): numpy arrays get the numpy
namespace and the results of plain numpy, torch tensors and CuPy arrays stay in
their namespace and on their device.  The few operations that the array API
standard lacks, or whose numpy route must stay bit-identical to the scipy code it
replaced, live here, each with a branch per library and a portable fallback:

=========================  ==============================================
:func:`einsum`             numpy / torch / CuPy ``einsum``; else broadcasting
:func:`cholesky_solve`     scipy ``cho_factor``/``cho_solve`` on numpy; else
                           ``linalg.cholesky`` and two triangular solves
:func:`solve_triangular`   scipy / torch / CuPy; else ``linalg.solve``
:func:`lstsq`              scipy ``lstsq`` on numpy; else an SVD
:func:`expm`               scipy / torch ``matrix_exp`` / CuPy; else the host
:func:`to_numpy`           a host copy of any of them
:func:`free_memory`        bytes free on the array's device (None on the host)
=========================  ==============================================

Random draws stay on the host (numpy ``Generator``) and are moved to the device, so
that a seed gives the same start in every namespace.
"""

import os
import sys
import threading
import warnings

import numpy as np
from sklearn.externals import array_api_compat as _compat

# Prefixes of the wrapper namespaces that messages leave out: users know "torch".
_WRAPPER_PREFIXES = ("sklearn.externals.array_api_compat.", "array_api_compat.")
# Whether the warning of warn_if_scipy_array_api_ignored was given (once a process).
_WARNED = {"scipy_array_api": False}

__all__ = [
    "namespace",
    "namespace_name",
    "scipy_array_api_ignored",
    "warn_if_scipy_array_api_ignored",
    "is_numpy",
    "device",
    "to_numpy",
    "to_namespace",
    "device_constant",
    "causal_keep",
    "einsum",
    "cholesky_solve",
    "solve_triangular",
    "lstsq",
    "expm",
    "free_memory",
    "is_out_of_memory",
    "synchronize",
]


def namespace(*arrays):
    """The array namespace of ``arrays`` (``None``, Python scalars and objects
    that are no arrays ignored).

    numpy arrays (and no arrays at all) give the numpy namespace.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import namespace, is_numpy
    >>> is_numpy(namespace(np.ones(2), None, 1.0))
    True
    """
    # what is no array (tokens read in batches from disk, TokenBatches) yields
    # numpy arrays
    arrays = [a for a in arrays if _compat.is_array_api_obj(a)]
    if not arrays:
        return _compat.array_namespace(np.empty(0))
    return _compat.array_namespace(*arrays)


def namespace_name(xp):
    """The short name of an array namespace for messages: ``torch``, not
    ``sklearn.externals.array_api_compat.torch``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import namespace, namespace_name
    >>> namespace(np.ones(2)).__name__
    'sklearn.externals.array_api_compat.numpy'
    >>> namespace_name(namespace(np.ones(2)))
    'numpy'
    """
    name = getattr(xp, "__name__", None) or type(xp).__name__
    for prefix in _WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def scipy_array_api_ignored():
    """Whether ``SCIPY_ARRAY_API=1`` is set now but scipy was imported before it
    was: scipy reads the variable once, when imported, so its array API support
    is off in this process whatever the variable says now."""
    if os.environ.get("SCIPY_ARRAY_API") != "1" or "scipy" not in sys.modules:
        return False
    for name in ("scipy._lib._array_api_override", "scipy._lib._array_api"):
        module = sys.modules.get(name)
        if module is None:
            continue
        if hasattr(module, "SCIPY_ARRAY_API"):
            return not module.SCIPY_ARRAY_API
        config = getattr(module, "_GLOBAL_CONFIG", None)  # scipy < 1.15
        if isinstance(config, dict) and "SCIPY_ARRAY_API" in config:
            return not config["SCIPY_ARRAY_API"]
    return False


def warn_if_scipy_array_api_ignored():
    """Warn, once a process, when :func:`scipy_array_api_ignored`: setting the
    variable after ``import scipy`` would otherwise do nothing, silently."""
    if _WARNED["scipy_array_api"] or not scipy_array_api_ignored():
        return
    _WARNED["scipy_array_api"] = True
    warnings.warn(
        "SCIPY_ARRAY_API=1 is set, but scipy was imported before it was set and "
        "reads it only when imported: scipy's array API support is off in this "
        "process. Set it before Python starts (SCIPY_ARRAY_API=1 python ...), or "
        "in os.environ before the first import of scipy, scikit-learn or skattn.",
        UserWarning,
        stacklevel=3,
    )


def is_numpy(xp):
    """Whether ``xp`` is numpy (or its array-API wrapper)."""
    return _compat.is_numpy_namespace(xp) or xp is np


def device(x):
    """The device of ``x`` (``"cpu"`` for numpy arrays, and for what is no array:
    tokens read in batches from disk)."""
    if isinstance(x, np.ndarray) or not _compat.is_array_api_obj(x):
        return "cpu"
    return _compat.device(x)


def to_numpy(x):
    """A numpy copy of ``x`` on the host (``x`` itself when it is a numpy array).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import to_numpy
    >>> to_numpy(np.ones(2)).tolist()
    [1.0, 1.0]
    """
    if x is None or isinstance(x, np.ndarray):
        return x
    if _compat.is_torch_array(x):
        return x.detach().cpu().numpy()
    if _compat.is_cupy_array(x):
        return x.get()
    if isinstance(x, (int, float, list, tuple)):
        return np.asarray(x)
    return np.from_dlpack(x)  # array-api-strict and others on the host


def to_namespace(x, xp, device=None, dtype=None):
    """``x`` (a numpy array or any array) as an array of ``xp`` on ``device``."""
    if x is None:
        return None
    if is_numpy(xp):
        return np.asarray(to_numpy(x), dtype=dtype)
    if not isinstance(x, np.ndarray) and _compat.array_namespace(x) is xp:
        out = x if device is None else _compat.to_device(x, device)
        return out if dtype is None else xp.astype(out, dtype)
    return xp.asarray(np.asarray(to_numpy(x)), device=device, dtype=dtype)


# Small constants copied to a device, by (key, namespace, device, dtype): at most
# _MOST_CONSTANTS, the oldest dropped first (a search's parts may ask in threads).
_CONSTANTS = {}
_MOST_CONSTANTS = 64
_CONSTANTS_LOCK = threading.Lock()


def device_constant(key, make, xp, device=None, dtype=None):
    """A small constant (a table, an index) in ``xp`` on ``device``: ``make()``, a
    numpy array, copied there once and kept under ``key`` (hashable; it must name
    everything the array depends on), so that a step does not copy it from the
    host again (on a GPU such a copy blocks the host).  numpy: ``make()``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import device_constant, namespace
    >>> xp = namespace(np.zeros(1))
    >>> device_constant(("twos", 3), lambda: np.full(3, 2.0), xp).tolist()
    [2.0, 2.0, 2.0]
    """
    if is_numpy(xp):
        out = make()
        return out if dtype is None else out.astype(dtype, copy=False)
    full_key = (key, id(xp), str(device), str(dtype))
    with _CONSTANTS_LOCK:
        out = _CONSTANTS.get(full_key)
        if out is None:
            # (a copy: the constant may be a read-only host table, and the
            # device's array must not share its memory)
            out = xp.asarray(np.array(make()), device=device, dtype=dtype)
            while len(_CONSTANTS) >= _MOST_CONSTANTS:
                _CONSTANTS.pop(next(iter(_CONSTANTS)))
            _CONSTANTS[full_key] = out
    return out


def causal_keep(xp, k, device=None):
    """``(k, k)`` booleans, True where a query may see a key (the key at or
    before it): numpy's ``tril`` of ones, made on the device by comparing two
    ranges elsewhere (no copy from the host)."""
    if is_numpy(xp):
        return np.tril(np.ones((k, k), dtype=bool))
    positions = xp.arange(k, device=device)
    return positions[:, None] >= positions[None, :]


def einsum(xp, subscripts, *operands):
    """``einsum`` in ``xp``: the library's own where it has one (numpy, torch,
    CuPy), else by broadcasting and summing (explicit ``->`` subscripts only).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import einsum, namespace
    >>> a = np.arange(6.0).reshape(2, 3)
    >>> einsum(namespace(a), "ij,ij->i", a, a).tolist()
    [5.0, 50.0]
    """
    if is_numpy(xp):
        return np.einsum(subscripts, *operands)
    if _compat.is_torch_namespace(xp) or _compat.is_cupy_namespace(xp):
        module = __import__("torch" if _compat.is_torch_namespace(xp) else "cupy")
        return module.einsum(subscripts, *operands)
    inputs, output = subscripts.replace(" ", "").split("->")
    inputs = inputs.split(",")
    letters = sorted(set("".join(inputs)) - set(output))
    order = list(output) + letters
    product = None
    for spec, operand in zip(inputs, operands, strict=True):
        # one letter repeated within an operand (a diagonal) is not needed here
        if len(set(spec)) != len(spec):
            raise ValueError(f"einsum fallback: repeated index in {spec!r}")
        perm = sorted(range(len(spec)), key=lambda i: order.index(spec[i]))
        term = xp.permute_dims(operand, tuple(perm))
        present = [spec[i] for i in perm]
        shape = []
        it = iter(term.shape)
        for letter in order:
            shape.append(next(it) if letter in present else 1)
        term = xp.reshape(term, tuple(shape))
        product = term if product is None else product * term
    if letters:
        product = xp.sum(product, axis=tuple(range(len(output), len(order))))
    return product


def solve_triangular(xp, a, b, *, lower):
    """Solve ``a x = b`` for a (batch of) triangular ``a``."""
    if is_numpy(xp):
        from scipy import linalg

        if a.ndim == 2:
            return linalg.solve_triangular(a, b, lower=lower)
        return np.linalg.solve(a, b)
    if _compat.is_torch_namespace(xp):
        import torch

        return torch.linalg.solve_triangular(a, b, upper=not lower)
    if _compat.is_cupy_namespace(xp) and a.ndim == 2:
        from cupyx.scipy import linalg

        return linalg.solve_triangular(a, b, lower=lower)
    return xp.linalg.solve(a, b)


def cholesky_solve(xp, gram, rhs):
    """Solve ``gram x = rhs`` for a positive definite ``gram`` (Cholesky).

    Raises ``numpy.linalg.LinAlgError`` when ``gram`` is not numerically positive
    definite, in every namespace (torch's and CuPy's errors, or a non-finite factor,
    become it).  On numpy it is scipy's ``cho_factor``/``cho_solve``, as before.
    """
    if is_numpy(xp):
        from scipy import linalg

        try:
            factor = linalg.cho_factor(gram)
        except linalg.LinAlgError as exc:
            raise np.linalg.LinAlgError(str(exc)) from exc
        return linalg.cho_solve(factor, rhs)
    try:
        lower = xp.linalg.cholesky(gram)
    except Exception as exc:  # torch: _LinAlgError, CuPy: LinAlgError
        raise np.linalg.LinAlgError(str(exc)) from exc
    # CuPy returns NaN, no error; torch raises (no host read of the factor)
    if not _compat.is_torch_namespace(xp) and not bool(xp.all(xp.isfinite(lower))):
        raise np.linalg.LinAlgError("Matrix is not positive definite.")
    return _solve_with_factor(xp, lower, rhs)


def _solve_with_factor(xp, lower, rhs):
    """``(L L^T)^{-1} rhs`` by two triangular solves (``rhs`` a vector or a
    matrix of right-hand sides, batched as ``lower``)."""
    vector = rhs.ndim == lower.ndim - 1
    if vector:
        rhs = rhs[..., None]
    half = solve_triangular(xp, lower, rhs, lower=True)
    out = solve_triangular(xp, xp.linalg.matrix_transpose(lower), half, lower=False)
    return out[..., 0] if vector else out


def rank_ridge(xp, gram):
    """``w eps max(diag G)`` of each ``(w, w)`` Gram in ``gram`` (shape
    ``gram.shape[:-2]``): the rank tolerance of ``numpy.linalg.matrix_rank``,
    the ridge the unchecked factorizations fall back to.

    Examples
    --------
    >>> import numpy as np
    >>> bool(rank_ridge(np, 2 * np.eye(3)) == 6 * np.finfo(float).eps)
    True
    """
    w = gram.shape[-1]
    return w * float(np.finfo(float).eps) * xp.max(xp.linalg.diagonal(gram), axis=-1)


def cholesky_unchecked(xp, gram, fallback_ridge):
    """The lower Cholesky factor of ``gram`` without a host check, on torch:
    ``torch.linalg.cholesky_ex``, and where ``gram`` is not definite (its
    status, read by no one) the factor of ``gram + fallback_ridge * I``
    instead, chosen on the device (``fallback_ridge`` a 0-d array or a float).
    ``None`` in other namespaces (the caller checks there).

    A checked ``torch.linalg.cholesky`` makes a GPU's host wait at every call
    for its error check (issue 63); both factors cost a ``p x p`` Cholesky each.
    """
    if not _compat.is_torch_namespace(xp):
        return None
    import torch

    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    first, info = torch.linalg.cholesky_ex(gram)
    second, _ = torch.linalg.cholesky_ex(gram + fallback_ridge * eye)
    return torch.where((info == 0)[..., None, None], first, second)


def cholesky_solve_unchecked(xp, gram, rhs, fallback_ridge):
    """``cholesky_solve`` by :func:`cholesky_unchecked`'s factor, on torch;
    ``None`` in other namespaces (the caller checks there)."""
    lower = cholesky_unchecked(xp, gram, fallback_ridge)
    return None if lower is None else _solve_with_factor(xp, lower, rhs)


def lstsq(xp, a, b):
    """Minimum-norm least-squares solution of ``a x = b`` (2-D ``a``)."""
    if is_numpy(xp):
        from scipy import linalg

        return linalg.lstsq(a, b, lapack_driver="gelsd")[0]
    u, s, vt = xp.linalg.svd(a, full_matrices=False)
    cutoff = s[0] * max(a.shape) * xp.finfo(a.dtype).eps if s.shape[0] else 0.0
    inverse = xp.where(s > cutoff, 1.0 / xp.where(s > cutoff, s, 1.0), 0.0)
    coef = xp.linalg.matrix_transpose(u) @ b
    coef = coef * (inverse[:, None] if b.ndim == 2 else inverse)
    return xp.linalg.matrix_transpose(vt) @ coef


def expm(xp, a):
    """The matrix exponential of a stack of square matrices ``a`` (``(..., s,
    s)``) in ``xp`` and on ``a``'s device: scipy on numpy, ``matrix_exp`` on
    torch, CuPy's own where it has one; other namespaces through the host.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import expm, namespace
    >>> a = np.array([[0.0, 1.0], [0.0, 0.0]])
    >>> expm(namespace(a), a).tolist()
    [[1.0, 1.0], [0.0, 1.0]]
    """
    if is_numpy(xp):
        from scipy import linalg

        return linalg.expm(a)
    if _compat.is_torch_namespace(xp):
        import torch

        return torch.linalg.matrix_exp(a)
    if _compat.is_cupy_namespace(xp):
        try:
            from cupyx.scipy.linalg import expm as cupy_expm
        except ImportError:  # older CuPy: through the host
            pass
        else:
            flat = xp.reshape(a, (-1, *a.shape[-2:]))  # one matrix at a time
            return xp.reshape(xp.stack([cupy_expm(b) for b in flat]), a.shape)
    from scipy import linalg

    return to_namespace(linalg.expm(to_numpy(a)), xp, device(a), dtype=a.dtype)


def free_memory(x):
    """Bytes free on the device of ``x``; ``None`` for host arrays."""
    if _compat.is_torch_array(x) and x.device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(x.device)[0])
    if _compat.is_cupy_array(x):
        import cupy

        with x.device:
            free = cupy.cuda.runtime.memGetInfo()[0]
        pool = cupy.get_default_memory_pool()
        return int(free + pool.total_bytes() - pool.used_bytes())
    return None


def is_out_of_memory(exc):
    """Whether ``exc`` is a device's (or the host's) out-of-memory error."""
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    return name in ("OutOfMemoryError", "CUDARuntimeError") or (
        "out of memory" in str(exc).lower()
    )


def synchronize(x):
    """Wait for the device of ``x`` (for timings); nothing on the host."""
    if _compat.is_torch_array(x) and x.device.type == "cuda":
        import torch

        torch.cuda.synchronize(x.device)
    elif _compat.is_cupy_array(x):
        import cupy

        cupy.cuda.get_current_stream().synchronize()
