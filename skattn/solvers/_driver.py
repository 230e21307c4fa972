"""The random-start path, as one driver that reads like the algorithm.

:func:`random_starts` is the loop every kind of head goes through: the fit's
stages kept in ``memory`` (an interrupted fit resumes), the tokens whitened
when they are anisotropic, the starts tried one after another (the best of
``n_starts`` kept, the first exact one ending the loop), each stage reported to
a progress hook.  What a start runs is the heads' own: position-free heads
here (:func:`fit_from_random_starts`), decoder heads (causal masks, rotary
positions, shared key heads) in :mod:`._decoder`, both polished on the same
warm-up and polish subsets (:func:`~.stages._polish.polish_rows`).  For each
random start of position-free heads:

0. **rank-free start** (low-rank heads of a small layer): the polish of
   full-rank heads from the start, on a few hundred sequences for at most 15
   iterations; where it fits them, its heads truncated to ``head_rank`` and
   polished, and the start ends there (:func:`_rank_free`);
1. **search** (:mod:`.stages._search`): Adam on minibatches moves the start to
   where Levenberg-Marquardt converges (many low-rank heads);
2. **per-head refinement** (:mod:`.stages._refine`): every head on its own
   one-head problem, stuck heads on more sequences, far heads searched afresh
   (heads that decouple: ``n_heads * head_rank <= d_out``);
3. **joint polish** (:mod:`.stages._polish`): Levenberg-Marquardt on all heads,
   on a warm-up subset and then on all examples, skipped where it has nothing
   left to do (an exact start) or where it would crawl (unconverged heads).

The kernels these stages share (loss and projections, parametrizations and their
Jacobian products, whitening) are in :mod:`.kernels`; the iterative methods
(Levenberg-Marquardt, L-BFGS, Adam) in :mod:`.optimizers`.

The tokens may be of any array-API namespace (numpy, torch, CuPy): every stage runs
in it and on its device, the layer comes back in it, and the record holds Python
numbers.  The starts are drawn (and factored) on the host by a numpy generator and
then moved: a seed gives the same starts in every namespace.
"""

import dataclasses
import functools
import math

import joblib
from sklearn.utils import check_random_state

from ..utils._array_api import device, namespace, to_namespace
from ._checkpoints import StageMemory, _rng_state, _set_rng_state, kept
from ._options import PolishOptions, RandomStartOptions
from .kernels._loss import REALISABLE_RESIDUAL, uniform_residual
from .kernels._parametrization import FactoredHeads, random_attention
from .kernels._varpro import _intercept_direction
from .kernels._whitening import _unwhiten, _whiten
from .optimizers._lm_matrix_free import settled
from .stages._common import _blas_limits, _on_accelerator, _threads
from .stages._polish import choose_factor_values, staged_polish, warmup_size
from .stages._refine import refine_heads
from .stages._rounds import can_decouple
from .stages._search import minibatch_search


def fit_from_random_starts(
    X,
    Y,
    n_heads,
    *,
    sample_weight=None,
    random_state=None,
    starts=None,
    polish=None,
    n_warmup_samples="auto",
    progress=None,
    memory=None,
):
    """The random-start path: search, per-head refinement and joint polish from
    random starts, the best kept.

    Starts are tried one after another; the loop stops at the first whose fit is
    realisable (relative residual below ``REALISABLE_RESIDUAL``), else keeps the
    lowest residual of ``starts.n_starts``.  For each start:

    1. the minibatch search (:func:`~skattn.solvers.minibatch_search`) moves it to
       where Levenberg-Marquardt converges (``starts.start_search``);
    2. every head is refined on its own one-head problem
       (:func:`~skattn.solvers.stages._refine.refine_heads`;
       ``starts.decouple``);
    3. the joint polish (:func:`~skattn.solvers.stages._polish.staged_polish`)
       fits all heads, unless a head stayed unconverged in step 2, where it
       would crawl.

    The starts are drawn, and every stage runs, on whitened tokens
    (:func:`~skattn.solvers.whitening_map`) when ``starts.whiten`` says so; the
    layer is mapped back.

    Parameters
    ----------
    X : array of shape (n, k, d)
        numpy, or any array-API namespace (torch, CuPy, ...).
    Y : array of shape (n, k, d_out)
        Of the namespace of ``X``.
    n_heads : int
    sample_weight : ndarray of shape (n,) or None
    random_state : int, RandomState instance or None
    starts : RandomStartOptions or None
        The starts and the stages before the polish (``None``: the defaults).
    polish : PolishOptions or None
        The joint polish (``None``: the defaults).
    n_warmup_samples : int, None or "auto", default="auto"
        Examples of the polish's warm-up stage; ``"auto"``:
        :func:`~skattn.solvers.stages._polish.warmup_size`.
    progress : callable or None, default=None
        ``progress(message, done)``, called as each stage of a start begins
        (``done`` False) and when a start ends (``done`` True, with its
        relative residual): a progress bar's hook.
    memory : str, joblib.Memory, StageMemory or None, default=None
        Where to keep each finished stage (the search, each head's refinement,
        the polish and its iterates at intervals; :mod:`._checkpoints`): run again
        with the same arguments after an interruption, the fit reads them back and
        goes on from the last, to the layer of an uninterrupted fit.

    Returns
    -------
    attention : array of shape (m, d, d)
        In the namespace and on the device of ``X``, as ``projection``.
    projection : array of shape (m, d, d_out)
    info : dict
        Python numbers (no arrays).
        As :func:`~skattn.solvers.stages._polish.staged_polish`, for the best
        start; also ``n_starts_run``, ``start_residuals`` (one per start tried),
        ``whitening`` (``applied``, ``condition``, ``rank``) and
        ``start_search`` (the search's info of the best start, or None; with the
        per-head refinement's info under ``"decoupled"``); ``memory`` (None,
        or the ``folder`` of the kept stages and the stages ``reused`` and
        ``computed``, in order).  When that refinement
        left heads unconverged, the polish returns its start
        (:func:`_unconverged_heads`): ``converged`` is False, ``stop_reason``
        ``"heads_unconverged"``, and ``unconverged_heads`` lists them.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> th = rng.normal(size=(1, 4, 4)); W = rng.normal(size=(1, 4, 4))
    >>> th_hat, W_hat, info = fit_from_random_starts(
    ...     X, forward(X, th, W), 1, random_state=0
    ... )
    >>> info["n_starts_run"], bool(np.allclose(th_hat, th, atol=1e-8))
    (1, True)
    """
    starts = RandomStartOptions() if starts is None else starts
    polish = PolishOptions() if polish is None else polish
    if not polish.enabled:
        raise ValueError(
            "The random-start path needs the polish (PolishOptions.enabled=True): "
            "without it a random start is no estimate."
        )
    if n_warmup_samples == "auto":
        n_warmup_samples = warmup_size(
            n_heads, X.shape[1], X.shape[2], polish.head_rank
        )
    # what decides the fit besides its data (not verbose); the tokens as given,
    # not whitened: a whitening computed with another number of threads rounds
    # otherwise, and would miss every kept stage
    key = {
        "n_heads": int(n_heads),
        "starts": repr(starts),
        "polish": repr(dataclasses.replace(polish, verbose=0)),
        "n_warmup_samples": repr(n_warmup_samples),
    }
    stages = functools.partial(
        _encoder_stages,
        n_heads=n_heads,
        starts=starts,
        polish=polish,
        n_warmup_samples=n_warmup_samples,
    )
    (attention, projection, info), A, record = random_starts(
        X,
        Y,
        key,
        stages,
        sample_weight=sample_weight,
        random_state=random_state,
        n_starts=starts.n_starts,
        whiten=starts.whiten,
        progress=progress,
        memory=memory,
    )
    if A is not None:
        attention, projection = _unwhiten(attention, projection, A)
    info.update(record)
    return attention, projection, info


def random_starts(
    X,
    Y,
    key,
    stages,
    *,
    sample_weight=None,
    random_state=None,
    n_starts=3,
    whiten="auto",
    progress=None,
    memory=None,
):
    """The loop of random starts that every kind of head goes through: the
    stages kept in ``memory``, the tokens whitened, the starts tried one after
    another (:func:`best_of_starts`), each reported to ``progress``.

    ``key`` (a dict of what decides the fit besides its data) and the random
    generator's state, the arrays' namespace and device name the fit in
    ``memory``.  ``stages(X, Y, sample_weight, rng, memory, report)`` is
    called once, on the whitened tokens, and returns ``one_start(start)``:
    start ``start``'s outcome ``(heads, projection, info)``, ``info`` with
    its ``relative_residual``; ``report(message, done)`` is the progress
    hook.  The heads of position-free layers are :func:`_encoder_stages`'s,
    decoder heads :func:`~._decoder.decoder_stages`'.

    Returns
    -------
    best : tuple
        The outcome of the start of the lowest residual, on whitened tokens.
    whitener : array or None
        The whitening map (:func:`~.kernels._whitening._whiten`), to map the
        heads back with.
    record : dict
        ``n_starts_run``, ``start_residuals`` (one per start tried),
        ``whitening`` (``applied``, ``condition``, ``rank``) and ``memory``
        (None, or the ``folder`` of the kept stages and the stages
        ``reused`` and ``computed``, in order).
    """
    xp = namespace(X, Y)
    rng = check_random_state(random_state)
    if not isinstance(memory, StageMemory):
        key = {
            **key,
            "random_state": joblib.hash(_rng_state(rng)),
            "namespace": xp.__name__,
            "device": str(device(X)),
        }
        memory = StageMemory(memory, key, (X, Y, sample_weight))
    X, A, whitening = _whiten(X, sample_weight, whiten)
    report = progress if progress is not None else (lambda message, done: None)
    one_start = stages(X, Y, sample_weight, rng, memory, report)

    def tried(start, outcome):
        residual = outcome[2]["relative_residual"]
        report(f"start {start}: relative residual {residual:.2g}", True)
        return residual

    best, residuals = best_of_starts(n_starts, one_start, tried)
    record = {
        "n_starts_run": len(residuals),
        "start_residuals": residuals,
        "whitening": whitening,
        "memory": memory.record(),  # what was read back, what was computed
    }
    return best, A, record


def _encoder_stages(
    X,
    Y,
    sample_weight,
    rng,
    memory,
    report,
    *,
    n_heads,
    starts,
    polish,
    n_warmup_samples,
):
    """:func:`random_starts`' stages for position-free heads: ``one_start``
    (the rank-free start, the search and the per-head refinement, the joint
    polish; the module's docstring).  The info of its outcome also holds
    ``start_search`` (the search's info, or None)."""
    xp = namespace(X, Y)
    d, d_out, head_rank = X.shape[2], Y.shape[2], polish.head_rank
    factored, search, decouple = _plan(n_heads, d, d_out, starts, polish)
    rank_free = _plans_rank_free(X.shape, n_heads, d_out, starts, polish, factored)
    direction = None  # the tokens' constant coordinate, found once for all starts
    if search and polish.intercept:
        direction = _intercept_direction(X)
    # what heads that attend uniformly leave (once for all starts): a search
    # that ends no better found no head
    uniform = uniform_residual(X, Y, sample_weight) if search else None

    def one_start(start):
        """Start ``start``'s stages: ``(attention, projection, info)``."""
        # drawn on the host: the same start in every namespace
        attention = random_attention(n_heads, d, rng)
        values = None
        if factored or search:  # a random start of the V_i too
            values = rng.normal(scale=1.0 / d, size=(n_heads, d, head_rank))
            values = values @ rng.normal(size=(n_heads, head_rank, d_out))
        search_info = None
        if rank_free:  # 0. full-rank heads first, kept where they fit
            report(f"start {start}: full-rank heads", False)
            result = kept(
                memory,
                "rank-free",
                lambda child, attention=attention: _rank_free(
                    X, Y, attention, sample_weight, polish, rng, n_warmup_samples, child
                ),
                rng,
                # its full-rank stage runs under min(cap, _RANK_FREE_MAX_ITER):
                # under another cap, run again (from the kept polish stages)
                lambda value: False,
            )
            if result is not None:
                result[2]["start_search"] = None
                return result
        if search:  # 1. the search, 2. the per-head refinement
            report(f"start {start}: search and per-head refinement", False)
            attention, values, search_info = _search(
                X,
                Y,
                attention,
                values,
                head_rank,
                direction,
                sample_weight,
                rng,
                verbose=int(polish.verbose > 1),
                decouple=decouple,
                memory=memory,
            )
            search_info["uniform_residual"] = uniform
            if not factored:  # the polish eliminates whole W_i
                values = None
        else:  # the start moved to the tokens' namespace and device
            attention = to_namespace(attention, xp, device(X))
            values = to_namespace(values, xp, device(X))
        # 3. the joint polish; not where the heads' own problems stopped short:
        # there it crawls (see _unconverged_heads)
        unconverged = _unconverged_heads(search_info)
        report(f"start {start}: joint polish", False)

        def joint_polish(child, attention=attention, values=values, stop=unconverged):
            return staged_polish(
                X,
                Y,
                attention,
                values,
                sample_weight=sample_weight,
                n_polish_samples=polish.n_samples,
                n_warmup_samples=n_warmup_samples,
                random_state=rng,
                memory=child,
                **polish.polish_kwargs(),
                **({"stop_below": math.inf} if stop else {}),
            )

        result = kept(
            memory,
            "polish",
            joint_polish,
            rng,
            lambda value: settled(value[2], polish.max_iter),
        )
        if unconverged and result[2]["relative_residual"] > REALISABLE_RESIDUAL:
            result[2].update(
                converged=False,
                stop_reason="heads_unconverged",
                unconverged_heads=unconverged,
            )
        result[2]["start_search"] = search_info
        return result

    return one_start


# Features per token from which start_search='auto' searches low-rank heads that
# are refined alone even when the polish does not factor the values: above the 16
# where init='auto' starts from the phases (a tiny planted layer, d = 8, k = 4,
# 300 warm-up sequences, was found by the polish and not by the search)
_SEARCH_MIN_FEATURES = 17


def _plan(n_heads, n_features, n_outputs, starts, polish):
    """``(factored, search, decouple)``: whether the polish factors the values,
    whether the minibatch search runs, whether the heads are refined alone."""
    head_rank = polish.head_rank
    factored = polish.factor_values
    if factored == "auto":
        factored = choose_factor_values(n_heads, n_features, head_rank)
    search = starts.start_search
    if search == "auto":  # the search pays where the values are factored, or
        # where the heads are then refined alone (a 2-5x shorter fit than the
        # polish from a random start, which crawls on a sharp head for an hour:
        # benchmarks/HISTORY.md, the planted previous-token head); not on the
        # few features where the phases start the fits of init='auto'
        low_rank = head_rank is not None and head_rank < n_features
        refined = (
            low_rank
            and n_features >= _SEARCH_MIN_FEATURES
            and can_decouple(n_heads, head_rank, n_outputs)
        )
        search = "minibatch" if factored or refined else "none"
    if search == "minibatch" and (head_rank is None or head_rank >= n_features):
        raise ValueError(
            "start_search='minibatch' needs low-rank heads (head_rank < d)."
        )
    search = search == "minibatch"
    decouplable = search and can_decouple(n_heads, head_rank, n_outputs)
    if starts.decouple is True and not decouplable:
        raise ValueError(
            "decouple=True needs the minibatch search (start_search) and "
            f"n_heads * head_rank <= n_outputs, got {n_heads} * {head_rank} and "
            f"{n_outputs} outputs."
        )
    return bool(factored), search, decouplable and starts.decouple is not False


# Attention parameters (m d^2 of full-rank heads) up to which a random start of
# low-rank heads is first polished with full-rank heads (_rank_free): soft heads
# (logits of a standard deviation about 1) leave the factored search at the fit
# of heads that attend uniformly (2 planted heads of rank 4 at d = 32: the
# search stalled at 0.737 where uniform heads give 0.742, the fit ended at 0.14),
# where the polish of full-rank heads, linear in each Theta_i, converges in a
# dozen iterations (8 such heads: 12 iterations, 30 s; issue 61).  Up to 8192
# parameters (8 heads at d = 32) that polish costs seconds a start.
RANK_FREE_MAX_PARAMETERS = 8192
# Its iterations, on _rank_free_size sequences: soft heads were fitted to
# rounding in 8-12 (8 planted heads of rank 4, d = 32); a sharp head crawls there
# (a previous-token head: the loss still falling 2-3x a step after 18), and the
# start goes on to the search as it would have without this stage.
_RANK_FREE_MAX_ITER = 15
# ... and the residual on them below which its heads are taken (truncated and
# polished at their rank on all examples): soft heads were at 3.8e-9 after 15
# iterations on 293 sequences (8 heads of rank 4), converging fast; the
# previous-token head's problem at about 1e-3.
_RANK_FREE_NEAR = 1e-6
# ... and its tokens at least (in sequences of k tokens; twice the logit
# differences and four times the output equations that the full-rank unknowns
# ask for, if more): 8 heads of rank 4 at k = 8 were at 3.8e-9 after 15
# iterations on 293 sequences, at 6.9e-16 after 12 on 600.  (At k = 16 the
# trial on a previous-token layer that it cannot fit costs 32 s on 600
# sequences, against 8 s for the whole fit before it.)
_RANK_FREE_MIN_TOKENS = 4800


def _plans_rank_free(shape, n_heads, n_outputs, starts, polish, factored):
    """Whether each random start first tries full-rank heads (:func:`_rank_free`).

    With ``starts.rank_free="auto"``: low-rank heads (``head_rank < d``) whose
    values the polish does not factor, the search left to ``"auto"``, at most
    ``RANK_FREE_MAX_PARAMETERS`` full-rank attention parameters ``m d^2``, and
    at least :func:`_rank_free_size` sequences, so that the data pin them.

    Examples
    --------
    >>> from skattn.solvers._options import PolishOptions, RandomStartOptions
    >>> low = PolishOptions(head_rank=4)
    >>> _plans_rank_free((4000, 8, 32), 8, 32, RandomStartOptions(), low, False)
    True
    >>> _plans_rank_free((4000, 8, 384), 12, 384, RandomStartOptions(), low, False)
    False
    """
    n, k, d = shape
    head_rank = polish.head_rank
    low_rank = head_rank is not None and head_rank < d
    if starts.rank_free is True:
        if not low_rank:
            raise ValueError(
                f"rank_free=True needs low-rank heads (head_rank < d = {d}), got "
                f"head_rank={head_rank}."
            )
        return True
    return (
        starts.rank_free == "auto"
        and starts.start_search == "auto"
        and low_rank
        and not factored
        and n_heads * d * d <= RANK_FREE_MAX_PARAMETERS
        and n >= _rank_free_size(n_heads, k, d)
    )


def _rank_free_size(n_heads, n_tokens, n_features):
    """Sequences of :func:`_rank_free`'s full-rank polish: twice the logit
    differences that pin ``m d^2`` attention parameters (``k (k - 1)`` a sequence
    and head) and four output equations per value parameter (``m d`` per output
    coordinate, ``k`` a sequence), at least ``_RANK_FREE_MIN_TOKENS`` tokens.

    Examples
    --------
    >>> _rank_free_size(8, 8, 32), _rank_free_size(2, 16, 32)
    (600, 300)
    >>> _rank_free_size(8, 4, 128)
    21846
    """
    m, k, d = n_heads, max(n_tokens, 2), n_features
    return max(
        math.ceil(_RANK_FREE_MIN_TOKENS / k),
        math.ceil(2 * m * d * d / (k * (k - 1))),
        math.ceil(4 * m * d / k),
    )


def _rank_free(
    X, Y, attention, sample_weight, polish, rng, n_warmup_samples="auto", memory=None
):
    """A random start's full-rank heads, polished; ``(attention, projection,
    info)`` of rank ``polish.head_rank``, or None where they did not fit.

    The polish of full-rank heads (linear in each ``Theta_i``: no saddle of the
    factors ``Q_i K_i^T`` near heads that attend uniformly) on
    :func:`_rank_free_size` random sequences, at most
    ``_RANK_FREE_MAX_ITER`` iterations.  Where it fits them to
    ``_RANK_FREE_NEAR``, its heads are truncated to ``head_rank`` and
    polished at that rank on all examples (:func:`~.stages._polish.
    staged_polish`, its warm-up on ``n_warmup_samples``, ``"auto"``:
    :func:`~.stages._polish.warmup_size`; the info's ``rank_free`` records the
    full-rank stage).
    Otherwise the random generator is put back where it was, so that the start
    goes on as it would have without this stage.
    """
    state = _rng_state(rng)
    m, d = attention.shape[:2]
    size = _rank_free_size(m, X.shape[1], d)
    options = dataclasses.replace(polish, head_rank=None).polish_kwargs()
    options["max_iter"] = min(options["max_iter"], _RANK_FREE_MAX_ITER)
    full, _, full_info = staged_polish(
        X,
        Y,
        to_namespace(attention, namespace(X), device(X)),
        sample_weight=sample_weight,
        n_polish_samples=size,
        n_warmup_samples=None,
        random_state=rng,
        **options,
    )
    record = {
        "n_iter": int(full_info["n_iter"]),
        "n_sequences": int(full_info["n_polish_samples"]),
        "relative_residual": float(full_info["relative_residual"]),
    }
    if not record["relative_residual"] <= _RANK_FREE_NEAR:
        _set_rng_state(rng, state)
        return None
    attention, projection, info = staged_polish(
        X,
        Y,
        full,
        sample_weight=sample_weight,
        n_polish_samples=polish.n_samples,
        n_warmup_samples=(
            warmup_size(m, X.shape[1], d, polish.head_rank)
            if n_warmup_samples == "auto"
            else n_warmup_samples
        ),
        random_state=rng,
        memory=memory,
        **polish.polish_kwargs(),
    )
    info["rank_free"] = record
    return attention, projection, info


def best_of_starts(n_starts, one_start, residual_of):
    """Starts one after another, the best kept: :func:`random_starts`' loop.

    ``one_start(start)`` runs start ``start`` (1 to ``n_starts``) and returns
    its outcome; ``residual_of(start, outcome)`` its relative residual (and
    says it, where the driver reports progress).  The loop stops at the first
    outcome whose residual is at most ``REALISABLE_RESIDUAL`` (a realisable
    fit: no start does better), else runs every start.

    Returns
    -------
    best : the outcome of the lowest residual (the first of equals)
    residuals : list of float
        One per start run, in order.

    Examples
    --------
    >>> outcomes = {1: 0.3, 2: 1e-15, 3: 0.1}
    >>> best_of_starts(3, outcomes.get, lambda start, outcome: outcome)
    (1e-15, [0.3, 1e-15])
    """
    best, best_residual, residuals = None, math.inf, []
    for start in range(1, n_starts + 1):
        outcome = one_start(start)
        residual = residual_of(start, outcome)
        residuals.append(residual)
        if best is None or residual < best_residual:
            best, best_residual = outcome, residual
        if residual <= REALISABLE_RESIDUAL:
            break
    return best, residuals


def _unconverged_heads(search_info):
    """The heads that the decoupled refinement of a search left unconverged.

    The joint polish is not run from such a point (it returns the start, its
    projections fitted): its Levenberg-Marquardt over all heads' parameters
    crawled where the heads' own problems had stopped, on MiniLM layer 0 of real
    text from 0.056 to 0.0485 in 56 iterations, until the run's 50-minute limit,
    with six heads unconverged (benchmarks/HISTORY.md).  The fit
    then ends with a ``ConvergenceWarning`` naming the heads.  (When the
    refinement was not kept, every refined head stayed at the search's end.)"""
    decoupled = (search_info or {}).get("decoupled")
    if not decoupled:
        return []
    return [
        i
        for i, row in enumerate(decoupled["heads"])
        if row is not None and not (row["converged"] and decoupled["kept"])
    ]


def _search(
    X,
    Y,
    attention,
    projection,
    head_rank,
    direction,
    sample_weight,
    rng,
    verbose,
    decouple=False,
    memory=None,
):
    """The minibatch search from a start: ``(attention, value factors, info)``.

    The value factors ``V_i`` ``(m, d, r)`` stand for the projections: the polish
    starts its factored values from their column space (:meth:`FactoredHeads.
    from_attention`), an unfactored polish ignores them.  With ``decouple`` the
    searched heads are then refined each on its own problem
    (:func:`decoupled_refine`, on :func:`decoupled_size` random sequences); its
    info is ``info["decoupled"]``.
    """
    m, d = attention.shape[:2]
    par = FactoredHeads(m, d, head_rank)
    # one BLAS thread per half batch, the halves at once when BLAS has two threads
    # or more (12 MiniLM heads: 1400 steps took 5-6 min with two BLAS threads on
    # whole batches, 3.3 min on one); in order on a GPU
    n_jobs = 1 if _on_accelerator(X) else _threads(None, 2)
    # the start factored on the host, where it was drawn (the same start in every
    # namespace), then moved
    start = to_namespace(
        par.from_attention(attention, projection), namespace(X), device(X)
    )

    def search(child):
        with _blas_limits(namespace(X)):
            return minibatch_search(
                X,
                Y,
                start,
                par,
                intercept_direction=direction,
                sample_weight=sample_weight,
                n_jobs=n_jobs,
                random_state=rng,
                verbose=verbose,
                memory=child,
            )

    params, info = kept(memory, "search", search, rng)
    if decouple:

        def refine(child):
            return refine_heads(
                X, Y, params, par, direction, sample_weight, rng, verbose, child
            )

        params, info["decoupled"] = kept(memory, "refine", refine, rng)
    return par.attention(params), par.factors(params)[2], info
