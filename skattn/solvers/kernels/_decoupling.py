"""Decoupled heads: each head's share of the outputs, through the output factors'
inverse.

A layer of low-rank heads with factored values writes its outputs as
``Y_s = sum_j S_j(X_s) X_s V_j O_j (+ 1 c^T)``.  When the stacked output factors
``O = [O_1; ...; O_m]`` have full row rank (``m r <= d_out``), ``D = O^+`` maps the
outputs to every head's share, ``Y_s D_i = S_i(X_s) X_s V_i (+ 1 c^T D_i)``, which
depends on head i's parameters alone (the derivation is in
:mod:`skattn.solvers.stages._rounds`, which solves the one-head problems).
Arrays in, arrays out, of any array-API namespace (numpy arrays get the numpy
results of before).
"""

import math

import numpy as np

from ...layer._math import _namespace, softmax
from ...utils._array_api import device, is_numpy, lstsq, to_numpy
from ._loss import _device_weights


def decoupling_map(output_factors, condition=True):
    """``D = O^+`` of the stacked output factors, and the stack's condition number.

    Parameters
    ----------
    output_factors : ndarray of shape (m, r, d_out)
    condition : bool, default=True
        Whether to compute the condition number (off numpy, a host read).

    Returns
    -------
    D : ndarray of shape (d_out, m r)
        ``O D = I``; columns ``[i r, (i + 1) r)`` are head i's ``D_i``.
    condition : float or None

    Examples
    --------
    >>> import numpy as np
    >>> O = np.random.default_rng(0).normal(size=(2, 3, 7))
    >>> D, condition = decoupling_map(O)
    >>> bool(np.allclose(O.reshape(6, 7) @ D, np.eye(6)))
    True
    """
    m, r, o = output_factors.shape
    if isinstance(output_factors, np.ndarray) or not hasattr(output_factors, "shape"):
        output_factors = np.asarray(output_factors, dtype=float)
    xp = _namespace(output_factors)
    stacked = xp.reshape(xp.astype(output_factors, xp.float64, copy=False), (m * r, o))
    if is_numpy(xp):  # numpy's own (its pinv's cutoff is not the standard's)
        pinv = np.linalg.pinv(stacked)
    else:
        pinv = xp.linalg.pinv(stacked, rtol=1e-15)  # numpy's rcond
    if not condition:
        return pinv, None
    if is_numpy(xp):
        singular = np.linalg.svd(stacked, compute_uv=False)
    else:
        singular = xp.linalg.svdvals(stacked)
    # one host read for both
    largest, smallest = (
        float(v) for v in to_numpy(xp.stack([singular[0], singular[-1]]))
    )
    ratio = largest / smallest if smallest > 0 else math.inf
    return pinv, ratio


def _output_factors(
    X, Y, params, parametrization, sample_weight, intercept, residual=True
):
    """Least-squares ``O_i`` (and intercept) at ``params``; the relative residual
    (None with ``residual=False``: off numpy, no host read)."""
    xp = _namespace(X, Y)
    cache = parametrization.cache(X, params)
    patterns = softmax(parametrization.logits(X, params, cache), axis=-1)
    design = _design(patterns, parametrization.values(X, params, cache), intercept)
    n, k = X.shape[:2]
    omega = _device_weights(n, sample_weight, X)
    root = xp.repeat(xp.sqrt(omega), k)[:, None]
    design *= root
    target = xp.reshape(Y, (n * k, -1)) * root
    m, r = parametrization.n_heads, parametrization.rank
    if is_numpy(xp):  # numpy's own (bits of before)
        coef = np.linalg.lstsq(design, target, rcond=None)[0]
    else:
        coef = lstsq(xp, design, target)
    factors = xp.reshape(coef[: m * r, ...], (m, r, -1))
    if not residual:
        return factors, None
    if is_numpy(xp):
        misfit = np.linalg.norm(design @ coef - target)
        scale = float(np.linalg.norm(target))
    else:  # one host read for both norms
        norms = xp.stack(
            [
                xp.linalg.vector_norm(design @ coef - target),
                xp.linalg.vector_norm(target),
            ]
        )
        misfit, scale = (float(v) for v in to_numpy(norms))
    return factors, float(misfit / max(scale, float(np.finfo(float).tiny)))


def _shares(X, Y, params, parametrization, sample_weight, intercept, dtype=float):
    """Every head's share ``Y D`` of the outputs at ``params``, ``(n, k, m, r)``,
    in ``dtype`` (``D`` the decoupling map of the least-squares output factors)."""
    m, r = parametrization.n_heads, parametrization.rank
    n, k, o = Y.shape
    xp = _namespace(X, Y)
    output_factors = _output_factors(
        X, Y, params, parametrization, sample_weight, intercept, residual=False
    )[0]
    D = decoupling_map(output_factors, condition=False)[0]
    shares = xp.reshape(Y, (n * k, o)) @ D
    shares = xp.astype(shares, getattr(xp, np.dtype(dtype).name), copy=False)
    return xp.reshape(shares, (n, k, m, r))


def _one_head_problem(
    X, Y, params, parametrization, head, sample_weight, intercept, dtype=float
):
    """Head ``head``'s one-head problem at ``params``: its targets ``Y D_i`` and
    the other heads' shares ``Y D_{-i}`` (None for one head), in ``dtype``."""
    xp = _namespace(X, Y)
    m, r = parametrization.n_heads, parametrization.rank
    n, k = Y.shape[:2]
    shares = _shares(X, Y, params, parametrization, sample_weight, intercept, dtype)
    target = shares[:, :, head, :]
    # a copy, not a strided view (as the other heads' shares below)
    target = (
        np.ascontiguousarray(target) if is_numpy(xp) else xp.asarray(target, copy=True)
    )
    fixed = None
    if m > 1:
        others = xp.concat(
            [shares[:, :, :head, :], shares[:, :, head + 1 :, :]], axis=2
        )
        fixed = xp.reshape(others, (n, k, (m - 1) * r))
    return target, fixed


def _design(patterns, values, intercept):
    """The batch's design ``[S_1 X V_1, ..., S_m X V_m, (1)]``: ``(b k, m r [+ 1])``."""
    xp = _namespace(patterns, values)
    b, m, k, r = values.shape
    design = xp.empty(
        (b * k, m * r + intercept), dtype=values.dtype, device=device(values)
    )
    features = xp.permute_dims(xp.matmul(patterns, values), (0, 2, 1, 3))
    design[:, : m * r] = xp.reshape(features, (b * k, m * r))
    if intercept:
        design[:, -1] = 1.0
    return design
