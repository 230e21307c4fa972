"""The random-start path for decoder heads: causal masks, rotary positions,
grouped-query heads.

The path of :mod:`._driver` hands the heads from stage to stage as matrices
``Theta_i``; a rotary head has none (its logits depend on the tokens'
positions) and grouped key heads are no per-head factors of one.  Here the
stages pass the factors themselves, in the decoder parametrizations of
:mod:`.kernels._parametrization` (``FactoredHeads`` / ``LowRank`` with
``causal``, ``rope_theta``, ``rope_layout``, ``n_kv_heads``).  The starts go
through the driver's loop (:func:`~._driver.random_starts`: kept stages and
resume, whitening, the best start, progress) and the polish through the
encoder's subsets (:func:`~.stages._polish.polish_rows`); what a start runs
(:func:`decoder_stages`) is:

1. **search** (:func:`~skattn.solvers.minibatch_search`): Adam on minibatches,
   the output factors eliminated on each batch; no weakest-head replacement (it
   searches position-free single heads).  Grouped key heads are searched with a
   key head per query head first, then grouped by their key maps
   (:func:`tie_key_heads`) and searched grouped: from a random grouping the
   search stalls when query heads sit in the wrong groups;
2. no per-head refinement: grouped heads share their key maps, so the heads do
   not decouple (and a rotary head's one-head problem is not written yet);
3. **joint polish**: matrix-free Levenberg-Marquardt on the variable-projection
   problem (:func:`~skattn.solvers.optimizers._lm_matrix_free.
   varpro_least_squares`), first on a random subset (the warm-up), then on all
   examples unless the warm-up's fit is realisable on them already.  Rotary
   heads' steps are solved closely from the start (no loose stage), with the
   slow rotary pairs' mixings as variables of their own
   (:mod:`.kernels._near_gauge`);
4. **reorientation** of rotary heads whose polish stopped short: each set of
   key groups with its slow block reflected, polished briefly, the best kept
   (:func:`_reorient`): the lifted mixings cannot change the block's
   orientation.

The tokens may be of any array-API namespace: every stage runs in it, the factors
come back in it, the record holds Python numbers.
"""

import functools
import itertools
import math
import time

import numpy as np
from sklearn.utils import check_random_state

from ..layer._positions import rotary_pairs
from ..utils._array_api import device, einsum, namespace, to_namespace, to_numpy
from ..utils._progress import stage_bar
from ..utils._validation import _normalized_weights
from ._checkpoints import kept
from ._driver import random_starts
from .kernels._loss import REALISABLE_RESIDUAL
from .kernels._near_gauge import reflect_slow_dims, slow_rotary_dims
from .kernels._parametrization import FactoredHeads, LowRank
from .kernels._varpro import VarproProblem, _intercept_direction
from .optimizers._lm_matrix_free import settled, varpro_least_squares
from .stages._common import _blas_limits, _on_accelerator, _on_rows, _threads
from .stages._polish import choose_factor_values, polish_rows, warmup_size
from .stages._search import minibatch_search

# The polish of rotary heads solves every step to LSMR's default tolerance, at
# most this many LSMR iterations a step: loose steps (the coarse stage's) crawl
# there, and so do steps cut short where most pairs are slow.  On a planted
# layer of the tiny checkpoints' shape (4 query heads sharing 2 key heads,
# d = 64, head dimension 16, k = 32, 256 sequences, from the decoder path's
# search at 1.8 %, 150 evaluations): at Llama 3's base (5e5; 12 of the 16
# dimensions slow) 40 iterations a step crawled to 9.0e-3, 200 reached 2.6e-15
# in 40 evaluations; at base 1e4 both stopped at the same 9.5e-4 (a slow block
# of the wrong orientation, :func:`_reorient`), 200 in 1.3 times the time (its
# steps end at LSMR's tolerance before the cap); benchmarks/HISTORY.md.
ROTARY_LSMR_PRODUCTS = 200

# Residual evaluations of the polish of a key group's reflected slow block
# (:func:`_reorient`): on the planted layer of ROTARY_LSMR_PRODUCTS' note, the
# right reflection reached 8e-17 in 6, the wrong one stayed above the start.
ORIENTATION_EVALUATIONS = 16
# ... of which every reflection first gets this many, the screen that orders
# the longer polishes: on the random tiny Llama (base 10^4, layer 1, 92
# windows of 32 tokens) after 2-3 evaluations the right reflection (both key
# groups) was the lowest, 1.1e-3 against 1.7e-3 and 3.3e-3 (in cost), and the
# wrong ones stopped at 5.5e-4 and 5.7e-4 relative after 16 (benchmarks/
# HISTORY.md, twelfth session).
ORIENTATION_SCREEN = 3
# ... and kept when it divides the residual by more than this (the wrong one,
# polished as long, can end a little below the start: 6.5e-5 against 7.0e-5).
ORIENTATION_GAIN = 0.5
# Up to this many key heads every set of them is tried reflected (2^m_kv - 1
# sets: an orientation can be wrong in several groups at once); beyond, each
# key head alone.
ORIENTATION_ALL_SETS = 3


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


def key_gauge(K_from, K_to, pairs=None, free=None):
    """The map ``M`` minimising ``||K_from M - K_to||_F`` among the gauges of a
    key head, and the relative misfit ``||K_from M - K_to||^2 / ||K_to||^2``.

    Without rotary positions a key map ``K`` and ``K M`` (with queries ``Q M^-T``)
    give the same logits for any invertible ``M``; with them, for ``M`` a scaled
    rotation of each rotary pair (it commutes with the position's rotation).
    The slow pairs' dimensions (``free``) turn so little over a window that any
    map of them nearly commutes with it: there ``M`` is any map of those
    dimensions (their near-gauge, :mod:`.kernels._near_gauge`).  At Llama 3's
    base (5e5; head dimension 16, 32 tokens: 12 slow dimensions) query heads
    searched apart had key maps a misfit of 0.54-0.59 apart by scaled rotations,
    1.2e-4 apart with the slow block free, and the tied start's relative
    residual was 0.58 against 0.031 (the heads apart: 0.019).

    Parameters
    ----------
    K_from, K_to : ndarray of shape (d, r)
    pairs : ndarray of shape (r / 2, 2) or None
        The rotary pairs' dimensions
        (:func:`~skattn.layer._positions.rotary_pairs`); None: any ``M``.
    free : array of int or None
        Dimensions whose pairs are slow (:func:`~.kernels._near_gauge.
        slow_rotary_dims`): mapped among themselves by any map.

    Returns
    -------
    M : ndarray of shape (r, r)
    misfit : float

    Examples
    --------
    >>> import numpy as np
    >>> K = np.random.default_rng(0).normal(size=(5, 2))
    >>> turn = np.array([[0.0, -2.0], [2.0, 0.0]])  # a quarter turn, scaled by 2
    >>> M, misfit = key_gauge(K, K @ turn, np.array([[0, 1]]))
    >>> bool(np.allclose(M, turn)), misfit < 1e-24
    (True, True)
    >>> shear = np.array([[1.0, 3.0], [0.0, 1.0]])  # no rotation: free dims only
    >>> key_gauge(K, K @ shear, np.array([[0, 1]]))[1] > 0.1
    True
    >>> M, misfit = key_gauge(K, K @ shear, np.array([[0, 1]]), free=[0, 1])
    >>> bool(np.allclose(M, shear)), misfit < 1e-24
    (True, True)
    """
    K_from, K_to = np.asarray(K_from, float), np.asarray(K_to, float)
    r = K_to.shape[1]
    if pairs is None:
        M = np.linalg.lstsq(K_from, K_to, rcond=None)[0]
    else:
        M = np.zeros((r, r))
        turn = np.array([[0.0, -1.0], [1.0, 0.0]])
        free = np.asarray([] if free is None else free, dtype=int)
        if len(free):  # M block-diagonal: the free block fits on its own
            block = np.linalg.lstsq(K_from[:, free], K_to[:, free], rcond=None)[0]
            M[np.ix_(free, free)] = block
        for pair in pairs:
            if np.isin(pair, free).any():
                continue
            A, B = K_from[:, pair], K_to[:, pair]
            basis = np.stack([A.ravel(), (A @ turn).ravel()], axis=1)
            a, b = np.linalg.lstsq(basis, B.ravel(), rcond=None)[0]
            M[np.ix_(pair, pair)] = a * np.eye(2) + b * turn
    scale = float(np.sum(K_to**2))
    misfit = float(np.sum((K_from @ M - K_to) ** 2)) / (scale if scale > 0 else 1.0)
    return M, misfit


def group_query_heads(key, n_kv_heads, pairs=None, free=None):
    """Query heads searched with a key head each, put into ``n_kv_heads`` groups
    of heads whose key maps agree up to the gauge (:func:`key_gauge`).

    Greedy: while heads are left, the head whose ``s - 1`` nearest other heads
    (``s = m / n_kv_heads``; by the symmetric misfit) are nearest in sum leads a
    group of them.

    Parameters
    ----------
    key : ndarray of shape (m, d, r)
        Each query head's own key map.
    n_kv_heads : int
    pairs : ndarray of shape (r / 2, 2) or None
    free : array of int or None
        The slow pairs' dimensions (:func:`key_gauge`).

    Returns
    -------
    groups : list of lists of int
        ``n_kv_heads`` groups, each led by its first head.
    misfit : ndarray of shape (m, m)
        ``misfit[i, j]``: of head ``j``'s key mapped onto head ``i``'s.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> K = rng.normal(size=(2, 6, 2))
    >>> key = np.stack([K[0], K[1], 3 * K[0], -K[1]])
    >>> sorted(sorted(group) for group in group_query_heads(key, 2)[0])
    [[0, 2], [1, 3]]
    """
    m = key.shape[0]
    size = m // int(n_kv_heads)
    misfit = np.zeros((m, m))
    for i in range(m):
        for j in range(m):
            if i != j:
                misfit[i, j] = key_gauge(key[j], key[i], pairs, free)[1]
    apart = np.minimum(misfit, misfit.T)
    left, groups = list(range(m)), []
    while left:
        best = None
        for i in left:
            others = sorted((j for j in left if j != i), key=lambda j: apart[i, j])
            chosen = others[: size - 1]
            total = float(sum(apart[i, j] for j in chosen))
            if best is None or total < best[0]:
                best = (total, [i, *sorted(chosen)])
        groups.append(best[1])
        left = [j for j in left if j not in best[1]]
    return groups, misfit


def tie_key_heads(params, ungrouped, grouped, n_tokens=None):
    """Grouped :class:`FactoredHeads` parameters from ungrouped ones: the query
    heads grouped by :func:`group_query_heads` and reordered group by group, each
    group's key map its first head's, the other heads' queries mapped through
    their keys' gauge onto it (``Q_j M^-T`` where ``K_j M ~ K_i``); host arrays.
    With ``n_tokens`` (the window's), the rotary pairs slow over it are mapped
    as one free block (:func:`key_gauge`'s ``free``).

    Examples
    --------
    >>> import numpy as np
    >>> free = FactoredHeads(4, 6, 2)
    >>> tied = FactoredHeads(4, 6, 2, n_kv_heads=2)
    >>> rng = np.random.default_rng(0)
    >>> Q, K, V = (rng.normal(size=(h, 6, 2)) for h in (4, 2, 4))
    >>> p = np.concatenate([Q.ravel(), K[[0, 1, 0, 1]].ravel(), V.ravel()])
    >>> q, groups = tie_key_heads(p, free, tied)
    >>> sorted(sorted(group) for group in groups)
    [[0, 2], [1, 3]]
    >>> order = [j for group in groups for j in group]
    >>> X = rng.normal(size=(3, 5, 6))
    >>> bool(np.allclose(tied.logits(X, q), free.logits(X, p)[:, order]))
    True
    """
    query, key, value = (np.asarray(f) for f in ungrouped.factors(to_numpy(params)))
    pairs = free = None
    if grouped.rope_theta is not None:
        pairs = rotary_pairs(grouped.rank, grouped.rope_layout)
        if n_tokens is not None:
            free = slow_rotary_dims(
                grouped.rank, grouped.rope_theta, grouped.rope_layout, n_tokens
            )
    groups, _ = group_query_heads(key, grouped.n_kv_heads, pairs, free)
    queries, keys, values = [], [], []
    for group in groups:
        leader = group[0]
        keys.append(key[leader])
        for j in group:
            M = np.eye(grouped.rank)
            if j != leader:
                M = key_gauge(key[j], key[leader], pairs, free)[0]
            queries.append(query[j] @ np.linalg.pinv(M).T)
            values.append(value[j])
    tied = np.concatenate([np.ravel(queries), np.ravel(keys), np.ravel(values)])
    return tied, groups


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
    regroup_keys=True,
    whiten=False,
    verbose=0,
    progress=None,
    memory=None,
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
    regroup_keys : bool, default=True
        With grouped key heads (``n_kv_heads < n_heads``): search each query
        head with a key head of its own first (a search that stalls with a
        head unfound replaces its weakest head, as the encoder's does:
        :func:`~skattn.solvers.minibatch_search`'s ``n_replacements``), then
        group the heads by their key maps (:func:`tie_key_heads`) and search
        grouped from there.  A
        grouped search from a random start stalls when it puts query heads in
        the wrong groups (no step moves a head to another group): on a tiny
        Llama layer, 3 starts of 6 (benchmarks/HISTORY.md).
    whiten : {"auto", True, False}, default=False
        Fit on whitened tokens (:func:`~skattn.solvers.whitening_map`, as the
        encoder's driver does) and map the heads back: ``Q_i = A Q'_i``,
        ``K_g = A K'_g``, ``W_i = A W'_i`` (a linear map of the tokens acts
        before the rotations and groups, so the same function);
        ``"auto"``: when the tokens' second moment has a condition number
        above ``WHITEN_MIN_CONDITION`` or reaches a proper subspace (a trained
        GPT-2's second layer: about 40 on its 64 dimensions).
    verbose : int, default=0
        2 prints the search's checks and the polish's iterations.
    progress : callable or None, default=None
        ``progress(message, done)``, called as each stage of a start begins
        and when a start ends, as :func:`~._driver.fit_from_random_starts`
        calls it: a progress bar's hook.
    memory : str, joblib.Memory, StageMemory or None, default=None
        Where to keep each finished stage (each start's searches, warm-up,
        polish and its iterates at intervals, reorientation;
        :mod:`._checkpoints`), as :func:`~._driver.fit_from_random_starts`
        keeps its own: run again with the same arguments after an
        interruption, the fit reads them back and goes on from the last, to the
        layer of an uninterrupted fit.

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
        ``start_search`` (the search's info or None; its ``regrouped``: the
        groups, the ungrouped search's residual and steps, or None),
        ``warmup`` (the warm-up's polish info or None), ``orientations`` (the
        reflections of key groups' slow rotary blocks tried after a polish
        that stopped short, :func:`_reorient`, or None), ``final_stage``
        (``"ran"``, ``"skipped: realisable"``), ``decoupled`` (None and why in
        ``decoupled_note``),
        ``n_starts_run``, ``start_residuals``, ``seconds``, ``memory`` (None, or
        the ``folder`` of the kept stages and the stages ``reused``,
        ``computed`` and ``stale``, in order).

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
    m, r = int(n_heads), int(head_rank)
    heads = {
        "causal": causal,
        "rope_theta": rope_theta,
        "rope_layout": rope_layout,
        "n_kv_heads": n_kv_heads,
    }
    # what decides the fit besides its data (not verbose)
    key = {
        "path": "decoder",
        "n_heads": m,
        "head_rank": r,
        **{name: repr(value) for name, value in heads.items()},
        "n_starts": int(n_starts),
        "search": bool(search),
        "max_iter": int(max_iter),
        "tol": repr(tol),
        "n_polish_samples": repr(n_polish_samples),
        "n_warmup_samples": repr(n_warmup_samples),
        "intercept": bool(intercept),
        "regroup_keys": bool(regroup_keys),
        "whiten": repr(whiten),
    }
    stages = functools.partial(
        decoder_stages,
        n_heads=m,
        head_rank=r,
        heads=heads,
        search=search,
        regroup_keys=regroup_keys,
        max_iter=max_iter,
        tol=tol,
        n_polish_samples=n_polish_samples,
        n_warmup_samples=n_warmup_samples,
        intercept=intercept,
        verbose=verbose,
    )
    ((query, key), projection, info), whitener, record = random_starts(
        X,
        Y,
        key,
        stages,
        sample_weight=sample_weight,
        random_state=random_state,
        n_starts=n_starts,
        whiten=whiten,
        progress=progress,
        memory=memory,
    )
    if whitener is not None:  # back to the tokens' own coordinates
        query, key, projection = (
            einsum(namespace(X), "ap,mpq->maq", whitener, a)
            for a in (query, key, projection)
        )
    info.update(
        record,
        decoupled=None,
        decoupled_note=(
            "no per-head refinement: decoder heads (shared key heads, rotary "
            "positions) are searched and polished jointly"
        ),
        seconds=time.perf_counter() - began,
    )
    return query, key, projection, info


def decoder_stages(
    X,
    Y,
    sample_weight,
    rng,
    memory,
    report,
    *,
    n_heads,
    head_rank,
    heads,
    search,
    regroup_keys,
    max_iter,
    tol,
    n_polish_samples,
    n_warmup_samples,
    intercept,
    verbose=0,
):
    """:func:`~._driver.random_starts`' stages for decoder heads: ``one_start``
    (the search, ungrouped first where key heads are shared; the polish on its
    warm-up subset and then on the polish set; the slow blocks reoriented; the
    module's docstring), each stage kept in ``memory``.

    ``heads``: ``causal``, ``rope_theta``, ``rope_layout``, ``n_kv_heads``;
    the other keywords as :func:`fit_decoder_from_random_starts`' (on the
    whitened tokens).  The outcome is ``((query, key), projection, info)``.
    """
    xp = namespace(X, Y)
    n, k, d = X.shape
    m, r = n_heads, head_rank
    searched = FactoredHeads(m, d, r, **heads)
    factored = choose_factor_values(m, d, r) or not r < d
    polished = searched if factored else LowRank(m, d, r, **heads)
    if n_warmup_samples == "auto":
        n_warmup_samples = warmup_size(m, k, d, r)
    direction = _intercept_direction(X) if intercept and search else None
    n_jobs = 1 if _on_accelerator(X) else _threads(None, 2)
    search_options = {
        "intercept_direction": direction,
        "sample_weight": sample_weight,
        "n_jobs": n_jobs,
        "random_state": rng,
        "verbose": int(verbose > 1),
    }
    ungrouped = FactoredHeads(m, d, r, **{**heads, "n_kv_heads": None})
    options = {
        "max_iter": max_iter,
        "tol": tol,
        "intercept": intercept and factored,
        "stop_below": REALISABLE_RESIDUAL,
        "verbose": int(verbose > 1),
        # the products' chunks in n_jobs threads of one BLAS thread each: two
        # BLAS threads on a product of 92 windows (d = 64, 4 heads of 16) made
        # 6 polish evaluations 34.5 s (68.6 CPU s) where one took 14.0 s and
        # two jobs of one 10.9 s (HISTORY, thirteenth session)
        "n_jobs": n_jobs,
    }
    if heads["rope_theta"] is not None:  # steps solved closely (ROTARY_LSMR_PRODUCTS)
        options.update(coarse=False, max_products=ROTARY_LSMR_PRODUCTS)

    def one_start(start):
        """Start ``start``'s stages: ``((query, key), projection, info)``, on
        one BLAS thread (the searches' and the polish's products in
        ``n_jobs`` jobs)."""
        with _blas_limits(xp):
            return start_stages(start)

    def start_stages(start):
        search_info = regrouped = None
        if search and regroup_keys and searched.n_kv_heads < m:
            # grouped heads searched from a random grouping can stall with query
            # heads in the wrong key groups: search them ungrouped, then group
            report(f"start {start}: search, a key head per query head", False)

            def search_ungrouped(child):
                free, free_info = minibatch_search(
                    X,
                    Y,
                    to_namespace(random_decoder_start(ungrouped, rng), xp, device(X)),
                    ungrouped,
                    memory=child,
                    **search_options,
                )
                tied, groups = tie_key_heads(free, ungrouped, searched, k)
                return to_namespace(tied, xp, device(X)), {
                    "groups": groups,
                    "residual": free_info["residual"],
                    "n_steps": free_info["n_steps"],
                }

            params, regrouped = kept(
                memory, "decoder-search-ungrouped", search_ungrouped, rng
            )
        else:
            params = to_namespace(random_decoder_start(searched, rng), xp, device(X))
        if search:
            report(f"start {start}: search", False)

            def search_grouped(child, params=params):
                return minibatch_search(
                    X, Y, params, searched, memory=child, **search_options
                )

            params, search_info = kept(memory, "decoder-search", search_grouped, rng)
            search_info["regrouped"] = regrouped
        if not factored:  # the polish eliminates whole W_i: Q and K only
            params = params[: polished.size]
        report(f"start {start}: joint polish", False)
        params, projection, info = _staged_polish(
            (X, Y, sample_weight),
            params,
            polished,
            options,
            n_polish_samples,
            n_warmup_samples,
            rng,
            memory,
            lambda message: report(f"start {start}: {message}", False),
        )
        info.update(start_search=search_info, factored_values=bool(factored))
        return tuple(polished.factors(params)[:2]), projection, info

    return one_start


def _staged_polish(
    data, params, par, options, n_polish_samples, n_warmup_samples, rng, memory, say
):
    """The decoder heads' polish, staged as the encoder's
    (:func:`~.stages._polish.staged_polish`, the same subsets drawn by
    :func:`~.stages._polish.polish_rows`): on the warm-up subset of the polish
    set, then on the polish set unless the warm-up's fit is realisable there;
    then, for rotary heads that stopped short, their slow blocks reoriented
    (:func:`_reorient`).  Returns ``(params, projection, info)``, the
    projections fitted on the polish set."""
    X, Y, sample_weight = data
    xp = namespace(X, Y)
    rows, warm = polish_rows(rng, X.shape[0], n_polish_samples, n_warmup_samples)
    if rows is not None:
        X, Y, sample_weight = _on_rows(xp, rows, X, Y, sample_weight)
    bound = options["max_iter"] * (2 if warm is not None else 1)
    with stage_bar("polish", None, "iter", iterations=True, at_most=bound):
        warmup_info, final_stage = None, "ran"
        if warm is not None:
            say(f"polish on {len(warm)} examples")

            def warm_up(child, params=params):
                X_w, Y_w, w_w = _on_rows(xp, warm, X, Y, sample_weight)
                found, _, found_info = varpro_least_squares(
                    X_w, Y_w, params, par, w_w, memory=child, **options
                )
                return found, found_info

            params, warmup_info = kept(
                memory, "decoder-warmup", warm_up, rng, _settled_under(options)
            )
        problem = VarproProblem(
            X, Y, sample_weight, par, intercept=options["intercept"]
        )
        residual = _relative(problem, params, Y, sample_weight)
        if warmup_info is not None and residual <= REALISABLE_RESIDUAL:
            final_stage, info = "skipped: realisable", warmup_info
        else:
            say(f"polish on {X.shape[0]} examples")

            def polish_all(child, params=params):
                found, _, found_info = varpro_least_squares(
                    X, Y, params, par, sample_weight, memory=child, **options
                )
                return found, found_info

            params, info = kept(
                memory, "decoder-polish", polish_all, rng, _settled_under(options)
            )
            residual = _relative(problem, params, Y, sample_weight)
        orientations = None
        if residual > REALISABLE_RESIDUAL and par.rope_theta is not None:

            def reorient(_, params=params, residual=residual):
                found, _, record = _reorient(
                    (X, Y, sample_weight), params, residual, problem, options, say
                )
                return found, record

            # the reorientations' polish at the cap ran only where one was kept
            params, orientations = kept(
                memory,
                "decoder-reorient",
                reorient,
                rng,
                lambda value: value[1] is None or "stop" not in value[1],
            )
            # the problem's projection at the returned point, read back or not
            residual = _relative(problem, params, Y, sample_weight)
    projection = problem.projection  # W* on the polish set, at params
    info = {key: value for key, value in info.items() if key != "stages"}
    if warmup_info is not None and final_stage == "ran":
        info["n_iter"] += warmup_info["n_iter"]
        info["n_products"] += warmup_info["n_products"]
    if orientations is not None:
        info["n_iter"] += orientations.pop("n_iter")
        info["n_products"] += orientations.pop("n_products")
        if orientations["kept"]:  # the run ends with the kept one's polish
            info["converged"], info["stop_reason"] = orientations.pop("stop")
    info.update(
        orientations=orientations,
        relative_residual=residual,
        warmup=warmup_info,
        final_stage=final_stage,
        n_polish_samples=int(X.shape[0]),
    )
    return params, projection, info


def _settled_under(options):
    """A kept polish stage's test for another iteration cap (:func:`~.optimizers.
    _lm_matrix_free.settled` of its info, under ``options["max_iter"]``)."""
    return lambda value: settled(value[1], options["max_iter"])


def _reorient(data, params, residual, problem, options, say):
    """Try the other orientation of each key group's slow rotary block.

    The polish lifts the slow pairs' mixings as ``expm(E)``, which keeps the
    orientation (the sign of the mixing's determinant) that the search left:
    where it is the wrong one, the polish stops at a stationary point.  Each
    set of key groups (each group alone beyond ``ORIENTATION_ALL_SETS`` groups)
    is reflected (:func:`~skattn.solvers.kernels._near_gauge.
    reflect_slow_dims`) and polished for ``ORIENTATION_SCREEN`` evaluations;
    then, from the lowest residual up, each is polished on to
    ``ORIENTATION_EVALUATIONS`` in all, until one fits to rounding.  The best
    is kept when it takes the residual below ``ORIENTATION_GAIN`` of the
    polish's, and then polished as the polish was.
    ``data``: ``(X, Y, sample_weight)``; ``problem``: their
    :class:`VarproProblem`.  Returns ``(params, residual, record)``, ``record``
    None where no dimension is slow, else a dict of ``screened`` and
    ``tried`` (``(key heads, residual)`` after the screen and after the
    longer polish), ``kept`` (the key heads reflected), ``n_iter``,
    ``n_products`` and, where one was kept, ``stop``: the last polish's
    ``(converged, stop_reason)``.
    """
    X, Y, sample_weight = data
    par = problem.par
    dims = slow_rotary_dims(par.rank, par.rope_theta, par.rope_layout, X.shape[1])
    if not len(dims):
        return params, residual, None
    record = {"screened": [], "tried": [], "kept": [], "n_iter": 0, "n_products": 0}

    def polished(start, evaluations):
        found, _, info = varpro_least_squares(
            X, Y, start, par, sample_weight, **{**options, "max_iter": evaluations}
        )
        record["n_iter"] += info["n_iter"]
        record["n_products"] += info["n_products"]
        return found, _relative(problem, found, Y, sample_weight), info

    groups = range(par.n_kv_heads)
    largest = par.n_kv_heads if par.n_kv_heads <= ORIENTATION_ALL_SETS else 1
    sizes = range(1, largest + 1)
    screened, best = [], None
    for flipped in itertools.chain.from_iterable(
        itertools.combinations(groups, size) for size in sizes
    ):
        say(f"key head(s) {list(flipped)}: slow block reflected, polished")
        trial, trial_residual, info = polished(
            reflect_slow_dims(params, par, flipped, dims), ORIENTATION_SCREEN
        )
        record["screened"].append((list(flipped), trial_residual))
        screened.append((trial_residual, list(flipped), trial, info))
        if trial_residual <= REALISABLE_RESIDUAL:
            best = (trial, trial_residual, list(flipped), info)
            break
    if best is None:  # the most promising first, each to its full polish
        for _, flipped, trial, _ in sorted(screened, key=lambda entry: entry[0]):
            say(f"key head(s) {flipped}: reflected, polished on")
            trial, trial_residual, info = polished(
                trial, ORIENTATION_EVALUATIONS - ORIENTATION_SCREEN
            )
            record["tried"].append((flipped, trial_residual))
            if best is None or trial_residual < best[1]:
                best = (trial, trial_residual, flipped, info)
            if trial_residual <= REALISABLE_RESIDUAL:
                break
    trial, trial_residual, flipped, info = best
    if trial_residual < ORIENTATION_GAIN * residual:
        params, residual, record["kept"] = trial, trial_residual, flipped
        record["stop"] = (info["converged"], info["stop_reason"])
    if record["kept"] and residual > REALISABLE_RESIDUAL:
        params, _, info = polished(params, options["max_iter"])
        record["stop"] = (info["converged"], info["stop_reason"])
    # leave the problem's projection at the returned point
    residual = _relative(problem, params, Y, sample_weight)
    return params, residual, record


def _relative(problem, params, Y, sample_weight):
    """The relative residual of ``problem`` at ``params`` (the reduced fit's
    ``sqrt(sum w ||F - Y||^2 / sum w ||Y||^2)``, absolute when Y is 0)."""
    xp = namespace(Y)
    residual = problem.residual(params)
    omega = _normalized_weights(Y.shape[0], to_numpy(sample_weight))
    omega = to_namespace(omega, xp, device(Y), dtype=xp.float64)
    target = math.sqrt(float(omega @ einsum(xp, "nkj,nkj->n", Y, Y)))
    return math.sqrt(float(residual @ residual)) / (target if target > 0 else 1.0)
