"""Decoupled heads: each head's share of the outputs, through the output factors'
inverse.

A layer of low-rank heads with factored values writes its outputs as
``Y_s = sum_j S_j(X_s) X_s V_j O_j (+ 1 c^T)``.  When the stacked output factors
``O = [O_1; ...; O_m]`` have full row rank (``m r <= d_out``), ``D = O^+`` maps the
outputs to every head's share, ``Y_s D_i = S_i(X_s) X_s V_i (+ 1 c^T D_i)``, which
depends on head i's parameters alone (the derivation is in
:mod:`skattn.solvers.stages._refine`, which solves the one-head problems).
Arrays in, arrays out.
"""

import math

import numpy as np

from ...layer._math import softmax
from ...utils._validation import _normalized_weights


def decoupling_map(output_factors):
    """``D = O^+`` of the stacked output factors, and the stack's condition number.

    Parameters
    ----------
    output_factors : ndarray of shape (m, r, d_out)

    Returns
    -------
    D : ndarray of shape (d_out, m r)
        ``O D = I``; columns ``[i r, (i + 1) r)`` are head i's ``D_i``.
    condition : float

    Examples
    --------
    >>> import numpy as np
    >>> O = np.random.default_rng(0).normal(size=(2, 3, 7))
    >>> D, condition = decoupling_map(O)
    >>> bool(np.allclose(O.reshape(6, 7) @ D, np.eye(6)))
    True
    """
    m, r, o = output_factors.shape
    stacked = np.asarray(output_factors, dtype=float).reshape(m * r, o)
    singular = np.linalg.svd(stacked, compute_uv=False)
    condition = float(singular[0] / singular[-1]) if singular[-1] > 0 else math.inf
    return np.linalg.pinv(stacked), condition


def _output_factors(X, Y, params, parametrization, sample_weight, intercept):
    """Least-squares ``O_i`` (and intercept) at ``params``; the relative residual."""
    cache = parametrization.cache(X, params)
    patterns = softmax(parametrization.logits(X, params, cache), axis=-1)
    design = _design(patterns, parametrization.values(X, params, cache), intercept)
    n, k = X.shape[:2]
    root = np.repeat(np.sqrt(_normalized_weights(n, sample_weight)), k)[:, None]
    design *= root
    target = Y.reshape(n * k, -1) * root
    coef = np.linalg.lstsq(design, target, rcond=None)[0]
    residual = np.linalg.norm(design @ coef - target) / max(
        float(np.linalg.norm(target)), np.finfo(float).tiny
    )
    m, r = parametrization.n_heads, parametrization.rank
    return coef[: m * r].reshape(m, r, -1), float(residual)


def _shares(X, Y, params, parametrization, sample_weight, intercept, dtype=float):
    """Every head's share ``Y D`` of the outputs at ``params``, ``(n, k, m, r)``,
    in ``dtype`` (``D`` the decoupling map of the least-squares output factors)."""
    m, r = parametrization.n_heads, parametrization.rank
    n, k, o = Y.shape
    output_factors = _output_factors(
        X, Y, params, parametrization, sample_weight, intercept
    )[0]
    D = decoupling_map(output_factors)[0]
    return (Y.reshape(n * k, o) @ D).astype(dtype, copy=False).reshape(n, k, m, r)


def _one_head_problem(
    X, Y, params, parametrization, head, sample_weight, intercept, dtype=float
):
    """Head ``head``'s one-head problem at ``params``: its targets ``Y D_i`` and
    the other heads' shares ``Y D_{-i}`` (None for one head), in ``dtype``."""
    m, r = parametrization.n_heads, parametrization.rank
    n, k = Y.shape[:2]
    shares = _shares(X, Y, params, parametrization, sample_weight, intercept, dtype)
    target = np.ascontiguousarray(shares[:, :, head])
    fixed = None
    if m > 1:
        fixed = np.delete(shares, head, axis=2).reshape(n, k, (m - 1) * r)
    return target, fixed


def _design(patterns, values, intercept):
    """The batch's design ``[S_1 X V_1, ..., S_m X V_m, (1)]``: ``(b k, m r [+ 1])``."""
    b, m, k, r = values.shape
    design = np.empty((b * k, m * r + intercept), dtype=values.dtype)
    design[:, : m * r] = (
        np.matmul(patterns, values).transpose(0, 2, 1, 3).reshape(b * k, m * r)
    )
    if intercept:
        design[:, -1] = 1.0
    return design
