"""Sharp heads: a head restarted from its patterns, fitted in logit space.

A head whose one-head problem (:func:`~._rounds.decoupled_refine`) stalls is most
often a sharp one: its rows put nearly all their weight on one token, the outputs'
derivatives in its small weights are proportional to those weights, and
Gauss-Newton steps do not move them (see :mod:`~..kernels._logits`).
:func:`logit_start` restarts such a head where the softmax does not saturate:

1. its attention patterns are read off its share of the outputs
   (:func:`read_patterns`, by :func:`~..kernels._patterns.invert_patterns`; needs
   ``head_rank >= k``);
2. its ``Q_i, K_i`` are fitted to their logarithms by trust-region least squares
   on the residual of :func:`~..kernels._logits.logit_residual`, from the head's
   current factors (:func:`fit_logits`);

and the caller solves the head's one-head problem again from there.

Runs in the namespace and on the device of the arrays (torch on a GPU
included), without host copies of them: the host reads only what decides (how
many rows the patterns split, each pattern round's residual, the active-set
rows left, the trust-region steps' scalars).
"""

import math
import time

from ...utils._array_api import namespace
from ..kernels._logits import (
    SPLIT_THRESHOLD,
    logit_jacobian,
    logit_residual,
    logit_targets,
)
from ..kernels._patterns import invert_patterns
from ..optimizers._trf import trf

# Rounds of invert_patterns (value map <-> simplex rows) at most, until a round
# lowers the residual by less than _PATTERN_STALL of it: on MiniLM layer 0's
# previous-token head (the head alone, 3384 sequences of random tokens, from a
# start 1.6 times too sharp) ten rounds read to 4.6e-7 and thirty to 6.9e-9, the
# small weights' logarithms to 0.008 and 1e-4 nats, and the logit fit on the
# latter left a held-out pattern error of 1.9e-6 against 1.1e-4
# (benchmarks/HISTORY.md).
_PATTERN_ROUNDS = 50
_PATTERN_STALL = 0.01
# Residual evaluations of the logit fit, its tolerances and its inner products a
# step (on MiniLM layer 0's previous-token head, 1128 sequences, with LSMR's
# steps: about 3 minutes on one thread with the patterns read, against 10 with
# 50 and 200).
_LOGIT_NFEV = 20
_LOGIT_TOL = 1e-12
_STEP_MAXITER = 100


def can_read_patterns(head_rank, n_tokens):
    """Whether a head's patterns can be read off its share of the outputs: each
    row needs as many value features as tokens (``head_rank >= k``).

    Examples
    --------
    >>> can_read_patterns(32, 16), can_read_patterns(8, 16)
    (True, False)
    """
    return head_rank is not None and head_rank >= n_tokens


def logit_start(
    X,
    Y,
    params,
    parametrization,
    head,
    *,
    sample_weight=None,
    intercept_direction=None,
    n_rounds=_PATTERN_ROUNDS,
    max_nfev=_LOGIT_NFEV,
):
    """``params`` with head ``head``'s ``Q, K`` fitted in logit space to the
    patterns that the outputs imply.

    Parameters
    ----------
    X : array of shape (n, k, d)
    Y : array of shape (n, k, d_out)
    params : array of shape (3 m d r,)
        :class:`FactoredHeads` parameters.
    parametrization : FactoredHeads
        With ``m r <= d_out`` and ``r >= k``.
    head : int
    sample_weight : array of shape (n,) or None
    intercept_direction : array of shape (d,) or None
        As in :func:`~._rounds.decoupled_refine`.
    n_rounds : int
        Rounds of :func:`~..kernels._patterns.invert_patterns` at most (fewer
        once a round lowers its residual by less than 1 %).
    max_nfev : int
        Residual evaluations of the logit fit.

    Returns
    -------
    params : array of shape (3 m d r,)
        In the namespace and on the device of ``params``.
    info : dict
        ``pattern_residuals`` (of the pattern reading), ``n_split_rows`` (rows
        of the read-off patterns whose largest weight is at most 0.99),
        ``logit_cost_start``,
        ``logit_cost`` (``1/2 ||r||^2`` of the logit fit), ``nfev``,
        ``status`` (the trust-region solver's), ``seconds``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers import FactoredHeads
    >>> rng = np.random.default_rng(0)
    >>> par = FactoredHeads(1, 6, 6)
    >>> truth = rng.normal(size=par.size)
    >>> X = rng.normal(size=(300, 4, 6))
    >>> Y = forward(X, par.attention(truth), par.factors(truth)[2])
    >>> Q, K, V = par.factors(truth)
    >>> start = np.concatenate([(3 * Q).ravel(), K.ravel(), V.ravel()])  # too sharp
    >>> found, info = logit_start(X, Y, start, par, 0, n_rounds=30)
    >>> error = np.abs(par.attention(found) - par.attention(truth)).max()
    >>> bool(error < 1e-3 * np.abs(par.attention(truth)).max())
    True
    """
    patterns, read = read_patterns(
        X,
        Y,
        params,
        parametrization,
        head,
        sample_weight=sample_weight,
        intercept_direction=intercept_direction,
        n_rounds=n_rounds,
    )
    found, fit = fit_logits(
        X,
        patterns,
        params,
        parametrization,
        head,
        sample_weight=sample_weight,
        max_nfev=max_nfev,
    )
    fit["seconds"] += read.pop("seconds")
    return found, {**read, **fit}


def read_patterns(
    X,
    Y,
    params,
    parametrization,
    head,
    *,
    sample_weight=None,
    intercept_direction=None,
    n_rounds=_PATTERN_ROUNDS,
):
    """Head ``head``'s patterns read off its share of the outputs
    (:func:`~..kernels._patterns.invert_patterns`), and how many rows they
    split: the first half of :func:`logit_start`.

    Returns
    -------
    patterns : array of shape (n, k, k)
        In the namespace and on the device of ``X``.
    info : dict
        ``pattern_residuals``, ``n_split_rows`` (as in :func:`logit_start`),
        ``seconds``.
    """
    clock = time.perf_counter()
    patterns, read = invert_patterns(
        X,
        Y,
        params,
        parametrization,
        head,
        sample_weight=sample_weight,
        intercept_direction=intercept_direction,
        n_rounds=n_rounds,
        stall=_PATTERN_STALL,
    )
    xp = namespace(patterns)
    largest = xp.max(patterns, axis=-1)
    return patterns, {
        "pattern_residuals": read["residuals"],
        # rows the read-off patterns split (largest weight <= SPLIT_THRESHOLD):
        # the head's sharpness as the outputs show it, not as its start has it
        "n_split_rows": int(xp.count_nonzero(largest <= SPLIT_THRESHOLD)),
        "seconds": time.perf_counter() - clock,
    }


def fit_logits(
    X,
    patterns,
    params,
    parametrization,
    head,
    *,
    sample_weight=None,
    max_nfev=_LOGIT_NFEV,
):
    """``params`` with head ``head``'s ``Q, K`` fitted to the logarithms of
    ``patterns`` (an ``(n, k, k)`` array, e.g. from :func:`read_patterns`)
    by trust-region least squares from its current factors: the second half of
    :func:`logit_start`.

    Returns
    -------
    params : array of shape (3 m d r,)
        In the namespace and on the device of ``params`` (``params`` itself when
        the fit's cost is not finite).
    info : dict
        ``logit_cost_start``, ``logit_cost``, ``nfev``, ``status``, ``seconds``
        (as in :func:`logit_start`).
    """
    clock = time.perf_counter()
    xp = namespace(X, patterns, params)
    targets, entry_weights = logit_targets(patterns)
    if sample_weight is not None:  # a sequence's weight scales its rows' equations
        entry_weights = entry_weights * sample_weight[:, None, None]
    Q, K, V = parametrization.factors(params)
    r = parametrization.rank
    d = X.shape[2]
    x0 = xp.concat([xp.reshape(Q[head, ...], (-1,)), xp.reshape(K[head, ...], (-1,))])

    def fun(p):
        return logit_residual(X, targets, entry_weights, p, r)

    def jac(p):
        return logit_jacobian(X, entry_weights, p, r)

    start = fun(x0)
    start_cost = 0.5 * float(start @ start)
    result = trf(
        xp,
        fun,
        jac,
        x0,
        ftol=_LOGIT_TOL,
        xtol=_LOGIT_TOL,
        gtol=_LOGIT_TOL,
        max_nfev=max_nfev,
        # the products per step capped (LSMR's default, min(rows, unknowns), let
        # one step take thousands on MiniLM); the fit is a start, not an end
        tr_options={"maxiter": _STEP_MAXITER},
    )
    info = {
        "logit_cost_start": start_cost,
        "logit_cost": float(result.cost),
        "nfev": int(result.nfev),
        "status": int(result.status),
        "seconds": time.perf_counter() - clock,
    }
    if not math.isfinite(info["logit_cost"]):
        return params, info
    # head's Q, K replaced, the rest as it was: [vec Q, vec K, vec V]
    pieces = []
    for factor, fitted in ((Q, result.x[: d * r]), (K, result.x[d * r :])):
        fitted = xp.reshape(fitted, (1, d, r))
        pieces += [factor[:head, ...], fitted, factor[head + 1 :, ...]]
    pieces.append(V)
    return xp.concat([xp.reshape(piece, (-1,)) for piece in pieces]), info
