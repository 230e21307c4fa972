"""The random-start path for decoder heads: causal masks, rotary positions,
grouped-query heads.

The path of :mod:`._driver` hands the heads from stage to stage as matrices
``Theta_i``; a rotary head has none (its logits depend on the tokens'
positions) and grouped key heads are no per-head factors of one.  Here the
stages pass the factors themselves, in the decoder parametrizations of
:mod:`.kernels._parametrization` (``FactoredHeads`` / ``LowRank`` with
``causal``, ``rope_theta``, ``rope_layout``, ``n_kv_heads``).  For each random
start:

1. **search** (:func:`~skattn.solvers.minibatch_search`): Adam on minibatches,
   the output factors eliminated on each batch; no weakest-head replacement (it
   searches position-free single heads);
2. no per-head refinement: grouped heads share their key maps, so the heads do
   not decouple (and a rotary head's one-head problem is not written yet);
3. **joint polish**: matrix-free Levenberg-Marquardt on the variable-projection
   problem (:func:`~skattn.solvers.optimizers._lm_matrix_free.
   varpro_least_squares`), first on a random subset (the warm-up), then on all
   examples unless the warm-up's fit is realisable on them already.  Rotary
   heads' steps are solved closely from the start (no loose stage).

The tokens may be of any array-API namespace: every stage runs in it, the factors
come back in it, the record holds Python numbers.
"""

import math
import time

import numpy as np
from sklearn.utils import check_random_state

from ..utils._array_api import device, einsum, namespace, to_namespace, to_numpy
from ..utils._validation import _normalized_weights
from .kernels._loss import REALISABLE_RESIDUAL
from .kernels._parametrization import FactoredHeads, LowRank
from .kernels._varpro import VarproProblem, _intercept_direction
from .optimizers._lm_matrix_free import varpro_least_squares
from .stages._common import _blas_limits, _on_accelerator, _take, _threads
from .stages._polish import choose_factor_values, warmup_size
from .stages._search import minibatch_search

# The polish of rotary heads solves every step to LSMR's default tolerance, at
# most this many LSMR iterations a step: loose steps (the coarse stage's) crawl
# there.  On a planted layer of the tiny checkpoints' shape (4 query heads
# sharing 2 key heads, d = 64, head dimension 16, k = 32, 160 sequences, from
# the search's end at 2 %), 60 evaluations took the cost from 0.58 to 0.20
# with loose steps (22 s), to 7.2e-3 with at most 40 iterations a step (130 s)
# and to 2.0e-3 with at most 200 (over 400 s); benchmarks/HISTORY.md.
ROTARY_LSMR_PRODUCTS = 40


def random_decoder_start(parametrization, random_state=None):
    """A random start of decoder factors, drawn on the host: flat ``(p,)``.

    ``Q_i`` and ``K_g`` with i.i.d. ``N(0, s^2)`` entries, ``s = (d^2 r)^{-1/4}``,
    so that ``E ||Q_i K_g^T||_F^2 = 1`` (the scale of
    :func:`~skattn.solvers.kernels._parametrization.random_attention`: soft,
    informative patterns); with :class:`FactoredHeads` the values ``V_i`` have
    orthonormal columns (random).

    Examples
    --------
    >>> par = FactoredHeads(4, 6, 2, n_kv_heads=2, rope_theta=10.0)
    >>> random_decoder_start(par, 0).shape == (par.size,)
    True
    """
    rng = check_random_state(random_state)
    m, d, r, m_kv = (
        parametrization.n_heads,
        parametrization.n_features,
        parametrization.rank,
        parametrization.n_kv_heads,
    )
    scale = (d * d * r) ** -0.25
    parts = [
        rng.normal(scale=scale, size=(m, d, r)),
        rng.normal(scale=scale, size=(m_kv, d, r)),
    ]
    if isinstance(parametrization, FactoredHeads):
        parts.append(np.linalg.qr(rng.normal(size=(m, d, r)))[0])
    return np.concatenate([part.ravel() for part in parts])


def fit_decoder_from_random_starts(
    X,
    Y,
    n_heads,
    head_rank,
    *,
    causal=False,
    rope_theta=None,
    rope_layout="half",
    n_kv_heads=None,
    sample_weight=None,
    random_state=None,
    n_starts=3,
    search=True,
    max_iter=100,
    tol=1e-10,
    n_polish_samples=None,
    n_warmup_samples="auto",
    intercept=False,
    verbose=0,
):
    """Learn decoder heads from random starts: search, then joint polish.

    Starts are tried one after another; the loop stops at the first whose fit is
    realisable (relative residual below ``REALISABLE_RESIDUAL``), else keeps the
    lowest residual of ``n_starts``.

    Parameters
    ----------
    X : array of shape (n, k, d)
        numpy, or any array-API namespace (torch, CuPy, ...).
    Y : array of shape (n, k, d_out)
    n_heads : int
        Query heads m.
    head_rank : int
        Head dimension r (even with rotary positions).
    causal, rope_theta, rope_layout, n_kv_heads
        The decoder heads (:class:`~skattn.solvers.LowRank`); ``rope_theta``
        None: no rotary positions.
    sample_weight : array of shape (n,) or None
    random_state : int, RandomState instance or None
    n_starts : int, default=3
    search : bool, default=True
        Run the minibatch search before the polish.
    max_iter, tol : the polish's Levenberg-Marquardt iterations and step tolerance.
    n_polish_samples : int or None
        Examples of the polish (a random subset); None: all.
    n_warmup_samples : int, None or "auto", default="auto"
        Examples of the warm-up stage
        (:func:`~skattn.solvers.stages._polish.warmup_size`).
    intercept : bool, default=False
        The tokens carry a constant coordinate (``[x, 1]``): with factored values
        an intercept column is eliminated too.
    verbose : int, default=0
        1 prints a line per stage, 2 also the search's checks and the polish's
        iterations.

    Returns
    -------
    query : array of shape (m, d, r)
    key : array of shape (m_kv, d, r)
        In the namespace and on the device of ``X``, as ``projection``.
    projection : array of shape (m, d, d_out)
        ``W_i`` (``V_i O_i`` with factored values).
    info : dict
        Python numbers: ``relative_residual``, ``converged``, ``stop_reason``,
        ``n_iter``, ``n_products`` of the best start's polish, ``factored_values``,
        ``start_search`` (the search's info or None), ``warmup`` (the warm-up's
        polish info or None), ``final_stage`` (``"ran"``, ``"skipped:
        realisable"``), ``decoupled`` (None and why in ``decoupled_note``),
        ``n_starts_run``, ``start_residuals``, ``seconds``.

    Examples
    --------
    >>> from skattn.datasets import make_attention_regression
    >>> X, y = make_attention_regression(
    ...     600, 4, 6, 2, head_rank=2, causal=True, rope=True, rope_theta=100.0,
    ...     random_state=0)
    >>> Q, K, W, info = fit_decoder_from_random_starts(
    ...     X.reshape(600, 4, 6), y.reshape(600, 4, 6), 2, 2, causal=True,
    ...     rope_theta=100.0, random_state=0)
    >>> Q.shape, K.shape, W.shape, info["relative_residual"] < 1e-8
    ((2, 6, 2), (2, 6, 2), (2, 6, 6), True)
    """
    began = time.perf_counter()
    xp = namespace(X, Y)
    rng = check_random_state(random_state)
    n, k, d = X.shape
    m, r = int(n_heads), int(head_rank)
    decoder = {
        "causal": causal,
        "rope_theta": rope_theta,
        "rope_layout": rope_layout,
        "n_kv_heads": n_kv_heads,
    }
    searched = FactoredHeads(m, d, r, **decoder)
    factored = choose_factor_values(m, d, r) or not r < d
    polished = searched if factored else LowRank(m, d, r, **decoder)
    if n_warmup_samples == "auto":
        n_warmup_samples = warmup_size(m, k, d, r)
    direction = _intercept_direction(X) if intercept and search else None
    n_jobs = 1 if _on_accelerator(X) else _threads(None, 2)
    say = print if verbose else (lambda *args: None)
    # the polish set, and its warm-up subset, drawn once for all starts
    if n_polish_samples is not None and n > n_polish_samples:
        rows = np.sort(rng.choice(n, size=n_polish_samples, replace=False))
        X, Y, sample_weight = (_take(xp, a, rows) for a in (X, Y, sample_weight))
        n = n_polish_samples
    warm = None
    if n_warmup_samples is not None and n > n_warmup_samples:
        warm = np.sort(rng.choice(n, size=n_warmup_samples, replace=False))
    best, residuals = None, []
    for start in range(1, n_starts + 1):
        params = to_namespace(random_decoder_start(searched, rng), xp, device(X))
        search_info = None
        if search:
            say(f"decoder start {start}: minibatch search")
            with _blas_limits(xp):
                params, search_info = minibatch_search(
                    X,
                    Y,
                    params,
                    searched,
                    intercept_direction=direction,
                    sample_weight=sample_weight,
                    n_replacements=0,
                    n_jobs=n_jobs,
                    random_state=rng,
                    verbose=int(verbose > 1),
                )
        if not factored:  # the polish eliminates whole W_i: Q and K only
            params = params[: polished.size]
        options = {
            "max_iter": max_iter,
            "tol": tol,
            "intercept": intercept and factored,
            "stop_below": REALISABLE_RESIDUAL,
            "verbose": int(verbose > 1),
        }
        if rope_theta is not None:  # steps solved closely, see ROTARY_LSMR_PRODUCTS
            options.update(coarse=False, max_products=ROTARY_LSMR_PRODUCTS)
        warmup_info, final_stage = None, "ran"
        if warm is not None:
            say(f"decoder start {start}: polish on {len(warm)} examples")
            params, _, warmup_info = varpro_least_squares(
                _take(xp, X, warm),
                _take(xp, Y, warm),
                params,
                polished,
                _take(xp, sample_weight, warm),
                **options,
            )
        problem = VarproProblem(
            X, Y, sample_weight, polished, intercept=intercept and factored
        )
        residual = _relative(problem, params, Y, sample_weight)
        if warmup_info is not None and residual <= REALISABLE_RESIDUAL:
            final_stage, info = "skipped: realisable", warmup_info
        else:
            say(f"decoder start {start}: polish on {n} examples")
            params, _, info = varpro_least_squares(
                X, Y, params, polished, sample_weight, **options
            )
            residual = _relative(problem, params, Y, sample_weight)
        projection = problem.projection  # W* on all examples, at params
        info = {key: value for key, value in info.items() if key != "stages"}
        if warmup_info is not None and final_stage == "ran":
            info["n_iter"] += warmup_info["n_iter"]
            info["n_products"] += warmup_info["n_products"]
        info.update(
            relative_residual=residual,
            warmup=warmup_info,
            final_stage=final_stage,
            start_search=search_info,
        )
        residuals.append(residual)
        say(f"decoder start {start}: relative residual {residual:.3g}")
        if best is None or residual < best[2]["relative_residual"]:
            best = (params, projection, info)
        if residual <= REALISABLE_RESIDUAL:
            break
    params, projection, info = best
    query, key = polished.factors(params)[:2]
    info.update(
        factored_values=bool(factored),
        decoupled=None,
        decoupled_note=(
            "no per-head refinement: decoder heads (shared key heads, rotary "
            "positions) are searched and polished jointly"
        ),
        n_starts_run=len(residuals),
        start_residuals=residuals,
        seconds=time.perf_counter() - began,
    )
    return query, key, projection, info


def _relative(problem, params, Y, sample_weight):
    """The relative residual of ``problem`` at ``params`` (the reduced fit's
    ``sqrt(sum w ||F - Y||^2 / sum w ||Y||^2)``, absolute when Y is 0)."""
    xp = namespace(Y)
    residual = problem.residual(params)
    omega = _normalized_weights(Y.shape[0], to_numpy(sample_weight))
    omega = to_namespace(omega, xp, device(Y), dtype=xp.float64)
    target = math.sqrt(float(omega @ einsum(xp, "nkj,nkj->n", Y, Y)))
    return math.sqrt(float(residual @ residual)) / (target if target > 0 else 1.0)
