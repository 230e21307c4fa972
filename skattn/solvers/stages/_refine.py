"""Decoupled heads: one small problem per head, through the output factors' inverse.

A layer of low-rank heads with factored values writes its outputs as

    Y_s = sum_j S_j(X_s) X_s V_j O_j (+ 1 c^T),     O_j of shape (r, d_out).

When the heads' output factors together fit in the outputs (``m r <= d_out``, the
shape of real transformers, where ``m r = d_model``) the stacked ``O = [O_1; ...;
O_m]`` has full row rank, and with ``D = O^+ = [D_1, ..., D_m]`` (``O D = I``)

    Y_s D_i = S_i(X_s) X_s V_i (+ 1 c^T D_i):

each head's share of the outputs is a linear image of the outputs, and it depends
on head i's parameters alone.  ``D`` is not known exactly, but it need not be: for
any ``B = [B_1, B_2]`` (``B_1`` of r columns) near ``D``, the true ``D_i`` is
``B_1 M + B_2 N`` with ``M`` invertible, so

    Y_s B_1 = S_i(X_s) X_s V_i M^{-1} - Y_s B_2 N M^{-1} (+ const):

a one-head regression of the r targets ``Y B_1`` on the design
``[S_i X, Y B_2]`` whose only nonlinear unknowns are head i's ``Theta_i = Q_i
K_i^T``, and whose residual is exactly zero at the real head, whatever the other
heads' errors.  :func:`decoupled_refine` takes ``B = D`` at the current point
(``B_1 = D_i``, ``B_2`` the other heads' columns) and solves the ``m`` one-head
problems by the matrix-free variable projection
(:func:`skattn.solvers.optimizers._lm_matrix_free.varpro_least_squares`, the
``Y B_2`` columns eliminated with the head's ``W``), independently (in threads
with ``n_jobs``).

Why it matters: the joint Levenberg-Marquardt problem of 12 MiniLM heads (442 368
parameters) converges only linearly from where the minibatch search leaves it,
held back by one nearly one-hot head whose Gauss-Newton block is tiny next to the
others'; the one-head problems are each well scaled on their own: from the search's
end, ten of the twelve converged to rounding in 6-17 iterations each
(benchmarks/HISTORY.md).

Pure functions on token tensors (no validation; callers validate), of any array-API
namespace (numpy, torch, CuPy): the heads' problems run in the namespace and on the
device of ``X`` (in host threads on the CPU, one after another on a GPU), the
sequences are drawn on the host, and the records hold Python numbers.
"""

import math
import time

import numpy as np
from joblib import Parallel, delayed
from sklearn.utils import check_random_state
from threadpoolctl import threadpool_info

from ...utils._array_api import (
    device,
    einsum,
    is_numpy,
    namespace,
    to_namespace,
    to_numpy,
)
from ...utils._progress import current_bar, stage_bar
from .._checkpoints import kept
from ..kernels._decoupling import (
    _one_head_problem,
    _output_factors,
    decoupling_map,
)
from ..kernels._logits import split_rows, split_rows_needed
from ..kernels._loss import REALISABLE_RESIDUAL, _weights
from ..kernels._parametrization import LowRank
from ..optimizers._lm_matrix_free import varpro_least_squares
from ._search import (
    _BATCH_SIZE,
    _LEARNING_RATE,
    _REPLACEMENT_BATCHES,
    _blas_limits,
    _copy,
    _on_accelerator,
    _replace_head,
    _search_alone,
    _take,
)
from ._sharp_heads import can_read_patterns, fit_logits, read_patterns

# The one-head problems' rows: this many equations per unknown at least (each row
# of r targets against Q_i, K_i, the head's W and the fixed columns' coefficients).
_EQUATIONS_PER_UNKNOWN = 4
# ... and never fewer sequences than this.
_MIN_SEQUENCES = 200
# A head's problem has converged at this relative residual: the head is taken.
# (Solving the heads that had not converged together, the other heads'
# shares fixed, was tried: on 12 MiniLM heads two such heads ended at 0.030 and
# 0.191, worse than alone, after 250-300 s.)
_CONVERGED = 1e-10
# A problem that ended unconverged at or below this relative residual is near its
# head: its end is taken, and the problem is restarted from there (a fresh trust
# region, the decoupling map recomputed at the improved point) while its residual
# keeps falling at least _PROGRESS-fold per round.  (On MiniLM layer 2 from real
# text four heads ended round one at 1.5e-5-6.8e-5 after 20 iterations; one more
# round took them to 7.8e-11-2.2e-6, where a search afresh had made such heads
# worse in 4 of 4 trials: benchmarks/HISTORY.md.)
_NEAR = 1e-3
_PROGRESS = 10.0
# ... and converged problems too, while above this and the layer's fit is not
# realisable yet (REALISABLE_RESIDUAL, below which the polish does not run): heads
# just under _CONVERGED can leave the layer short of it (on MiniLM layer 2 heads at
# 2e-11-8e-11 left it at 1.4e-9, and one iteration of the joint polish to below
# 1e-10 took 6 minutes; on layer 4 heads at or below 1.8e-12 left it at 1.1e-12).
_EXACT = 1e-12
# No round starts once the layer fits its sequences to this fraction of
# REALISABLE_RESIDUAL: the polish judges the fit on other sequences (on MiniLM
# layer 2 every head converged, the layer fit its own sequences to 1e-10, and the
# polish's start on its own missed the rule: a joint iteration ran into the
# 25-minute limit).
_LAYER_MARGIN = 0.1


def can_decouple(n_heads, head_rank, n_outputs):
    """Whether the heads' output factors fit in the outputs: ``m r <= d_out``.

    Examples
    --------
    >>> can_decouple(12, 32, 384), can_decouple(12, 32, 300), can_decouple(2, None, 8)
    (True, False, False)
    """
    return head_rank is not None and n_heads * head_rank <= n_outputs


def decoupled_size(n_heads, n_tokens, n_features, head_rank, n_outputs):
    """Sequences the one-head problems need: ``_EQUATIONS_PER_UNKNOWN`` equations
    per unknown, at least ``_MIN_SEQUENCES``.

    A head's problem has ``2 d r`` nonlinear unknowns (``Q_i``, ``K_i``) and
    ``(d + d_out - r) r`` eliminated ones (its ``W`` and the fixed columns'
    coefficients); a sequence gives ``k r`` equations.

    Examples
    --------
    >>> decoupled_size(12, 16, 385, 32, 384)
    377
    """
    unknowns = 3 * n_features + n_outputs - head_rank
    return max(_MIN_SEQUENCES, math.ceil(_EQUATIONS_PER_UNKNOWN * unknowns / n_tokens))


def _solve_head(
    X,
    shares,
    i,
    Q,
    K,
    sample_weight,
    max_iter,
    tol,
    jacobian_dtype=np.float32,
    n_jobs=1,
    memory=None,
):
    """Head i's problem: targets ``Y D_i``, the other heads' shares ``Y D_{-i}`` as
    fixed columns.  Returns its ``Q_i, K_i``, value factor ``V_i`` (each ``(d,
    r)``; ``V_i`` the coefficients of its features ``S_i X``) and the solver's
    info.  ``jacobian_dtype``: the precision of the Jacobian products (see the
    call; benchmarks/studies/bench_decoupled_precision.py compares the two); ``n_jobs``:
    threads of its products."""
    clock = time.perf_counter()
    xp = namespace(X, shares)
    n, k, m, r = shares.shape
    target, fixed = _head_shares(xp, shares, i)
    par = LowRank(1, Q.shape[1], r)
    params, projection, info = varpro_least_squares(
        X,
        target,
        xp.concat([xp.reshape(Q[i, ...], (-1,)), xp.reshape(K[i, ...], (-1,))]),
        par,
        sample_weight,
        max_iter=max_iter,
        tol=tol,
        # every step to LSMR's default tolerance, its residuals in double
        # precision: loose (LSMR to 1e-2) or wholly single-precision steps failed
        # on MiniLM heads (a head's loose steps were rejected 17 times in a row at
        # 1e-2 of its targets; twelve heads stalled near 7e-6 when the residual too
        # was single precision: the fixed columns are large next to what is left of
        # the targets)
        coarse=False,
        # ... but the Jacobian products, nearly all of the work, in single by
        # default: on MiniLM layer 4 from real text they took the heads' problems
        # to the same residuals in about as many products and half the time
        # (benchmarks/HISTORY.md)
        jacobian_dtype=jacobian_dtype,
        fixed_columns=fixed,
        n_jobs=n_jobs,
        memory=memory,
    )
    omega = _weights(n, sample_weight, X)[1]
    norm = math.sqrt(float(omega @ einsum(xp, "nkj,nkj->n", target, target)))
    info["relative_residual"] = math.sqrt(2.0 * info["loss"]) / max(
        norm, np.finfo(float).tiny
    )
    info["seconds"] = time.perf_counter() - clock
    q, kk = par.factors(params)
    return q[0, ...], kk[0, ...], projection[0, ...], info


def _head_shares(xp, shares, i):
    """Head ``i``'s targets ``(n, k, r)`` and the other heads' shares as fixed
    columns ``(n, k, (m - 1) r)`` (None for one head), copies of ``shares``."""
    n, k, m, r = shares.shape
    if is_numpy(xp):  # as before (the same memory order, the same bits)
        target = np.ascontiguousarray(shares[:, :, i])
        fixed = None
        if m > 1:
            fixed = np.delete(shares, i, axis=2).reshape(n, k, (m - 1) * r)
        return target, fixed
    target = xp.asarray(shares[:, :, i, :], copy=True)
    fixed = None
    if m > 1:
        others = xp.concat([shares[:, :, :i, :], shares[:, :, i + 1 :, :]], axis=2)
        fixed = xp.reshape(others, (n, k, (m - 1) * r))
    return target, fixed


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


def decoupled_refine(
    X,
    Y,
    params,
    parametrization,
    *,
    sample_weight=None,
    intercept_direction=None,
    heads=None,
    max_iter=20,
    restarts=5,
    tol=1e-10,
    n_jobs=None,
    verbose=0,
    memory=None,
):
    """Refine every head on its own problem (see the module's docstring).

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    params : ndarray of shape (3 m d r,)
        :class:`FactoredHeads` parameters (``Q, K, V``), e.g. from
        :func:`skattn.solvers.minibatch_search`.
    parametrization : FactoredHeads
        With ``m r <= d_out`` (:func:`can_decouple`).
    sample_weight : ndarray of shape (n,) or None
    intercept_direction : ndarray of shape (d,) or None
        A token-space ``g`` with ``X g = 1`` when the outputs have an intercept:
        the output factors are then fitted with a column of ones.  (The one-head
        designs ``S_i X`` hold a constant already through that coordinate.)
    heads : list of int or None
        The heads to refine (``None``: all); the others keep their parameters.
    max_iter : int, default=20
        Levenberg-Marquardt iterations of each problem per round.
    restarts : int, default=5
        Rounds after the first.  A problem that ended unconverged but near
        (relative residual at most ``_NEAR``, 1e-3) has its end taken, and is
        solved again from there, with the decoupling map recomputed at the new
        point, while its residual falls at least ``_PROGRESS`` (10) fold per
        round; so is a converged one (at most ``_CONVERGED``, 1e-10) while
        above ``_EXACT`` (1e-12).  No round starts once the layer, the output
        factors eliminated, fits to a relative residual of 1e-11 (a tenth of
        ``REALISABLE_RESIDUAL``, below which the polish does not run: it judges
        on other sequences).
    tol : float, default=1e-10
        Relative step tolerance of each head's problem.
    n_jobs : int or None
        Heads solved at once (joblib threads); each head always runs on one
        BLAS thread, and when fewer heads are left than threads, the threads
        left share each head's products (over chunks of its sequences, with
        the same results).  ``None``: as many as BLAS has threads
        (``OMP_NUM_THREADS=1``: one head at a time): the heads' problems are
        independent, and their products too small for BLAS to use several
        cores well.
    verbose : int, default=0
        1 prints one line per problem.

    memory : StageMemory or None
        Keeps each head's solve, and its iterates at intervals
        (:mod:`skattn.solvers._checkpoints`).
    Returns
    -------
    params : ndarray of shape (3 m d r,)
        The refined parameters: the converged heads' solutions, and the near
        unconverged heads' ends when the layer fits better with them than
        without; or ``params`` when neither fits better.
    info : dict
        ``heads`` (per head, its problem's ``n_iter``, ``n_products`` and
        ``seconds`` over all rounds, ``rounds``, the last round's
        ``relative_residual``, and ``converged``; None for a head not refined),
        ``n_products``, ``condition``
        (of the stacked output factors), ``residual_start``, ``residual`` (the
        relative residual with the output factors eliminated, before and after),
        ``kept``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers import FactoredHeads
    >>> rng = np.random.default_rng(0)
    >>> par = FactoredHeads(3, 8, 2)
    >>> truth = rng.normal(size=par.size) / 2
    >>> Q, K, V = par.factors(truth)
    >>> O = rng.normal(size=(3, 2, 6))  # m r = 6 outputs
    >>> X = rng.normal(size=(300, 5, 8))
    >>> Y = forward(X, par.attention(truth), V @ O)
    >>> start = truth + 0.02 * rng.normal(size=par.size)
    >>> refined, info = decoupled_refine(X, Y, start, par)
    >>> bool(info["residual_start"] > 1e-3), bool(info["residual"] < 1e-10)
    (True, True)
    """
    xp = namespace(X, Y)
    m, r = parametrization.n_heads, parametrization.rank
    n, k, o = Y.shape
    if not can_decouple(m, r, o):
        raise ValueError(
            f"decoupled_refine needs n_heads * head_rank <= n_outputs, got "
            f"{m} * {r} > {o}."
        )
    intercept = intercept_direction is not None

    def flat(Q, K, V):
        return xp.concat(
            [xp.reshape(Q, (-1,)), xp.reshape(K, (-1,)), xp.reshape(V, (-1,))]
        )

    def fit(params):
        return _output_factors(X, Y, params, parametrization, sample_weight, intercept)

    params = to_namespace(params, xp, device(X))
    Q, K, V = (_copy(xp, f) for f in parametrization.factors(params))
    start = flat(Q, K, V)
    Qc, Kc, Vc = _copy(xp, Q), _copy(xp, K), _copy(xp, V)  # only converged heads
    active = list(range(m)) if heads is None else [int(i) for i in heads]
    rows = [None] * m
    residual_start = condition = None
    for round_ in range(1 + restarts):
        output_factors, residual = fit(flat(Q, K, V))
        if round_ > 0 and residual <= _LAYER_MARGIN * REALISABLE_RESIDUAL:
            break  # the layer fits to rounding
        D, round_condition = decoupling_map(output_factors)
        if round_ == 0:
            residual_start, condition = residual, round_condition
        shares = xp.reshape(xp.reshape(Y, (n * k, o)) @ D, (n, k, m, r))
        results = _solve_heads(
            X, shares, active, Q, K, sample_weight, max_iter, tol, n_jobs, memory
        )
        again = []
        for i, (q, kk, values, solved) in zip(active, results, strict=True):
            row = rows[i]
            previous = math.inf if row is None else row["relative_residual"]
            if row is None:
                row = rows[i] = {"n_iter": 0, "n_products": 0, "seconds": 0.0}
            for key in ("n_iter", "n_products", "seconds"):
                row[key] += solved[key]
            residual_i = solved["relative_residual"]
            row.update(
                relative_residual=residual_i,
                converged=residual_i <= _CONVERGED,
                rounds=round_ + 1,
                stop_reason=solved["stop_reason"],  # of its last solve
            )
            if row["converged"]:
                Qc[i, ...], Kc[i, ...], Vc[i, ...] = q, kk, values
            if residual_i <= _NEAR:
                Q[i, ...], K[i, ...], V[i, ...] = q, kk, values
                if _EXACT < residual_i <= previous / _PROGRESS:
                    again.append(i)
            if verbose:
                print(
                    f"decoupled head {i} (round {round_ + 1}): {solved['n_iter']} "
                    f"iterations, {solved['n_products']} products, relative "
                    f"residual {residual_i:.3g}, {solved['seconds']:.1f} s",
                    flush=True,
                )
        active = again
        if not active:
            break
    # the unconverged heads' ends are taken only if the layer fits better with
    # them: such a problem may explain its targets through the fixed columns
    # (the other heads' shares) rather than through its head
    refined = flat(Q, K, V)
    residual = fit(refined)[1]
    converged_only = flat(Qc, Kc, Vc)
    if not bool(xp.all(refined == converged_only)):
        other = fit(converged_only)[1]
        if other < residual:
            refined, residual = converged_only, other
    kept = residual < residual_start
    info = {
        "heads": rows,
        "n_products": int(sum(row["n_products"] for row in rows if row)),
        "condition": condition,
        "residual_start": residual_start,
        "residual": residual if kept else residual_start,
        "kept": bool(kept),
    }
    return (refined if kept else start), info


def search_head(
    X,
    Y,
    params,
    parametrization,
    head,
    *,
    sample_weight=None,
    intercept_direction=None,
    n_jobs=1,
    random_state=None,
):
    """``params`` with head ``head`` searched afresh on its own one-head problem.

    The one-head problem of :func:`decoupled_refine` (targets ``Y D_i``, the other
    heads' shares ``Y D_{-i}`` as fixed columns, ``D`` the decoupling map at
    ``params``) is searched from a random start by
    :func:`~skattn.solvers.stages._search.minibatch_search`, the fixed columns (and
    the intercept) eliminated with the head's output factors on every batch.
    Unlike a search on what the other heads leave unexplained, whose target
    holds the other heads' errors, this problem is realisable by the head
    alone, whatever the other heads' errors.  The result is a start for
    :func:`decoupled_refine` (``heads=[head]``).

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    params : ndarray of shape (3 m d r,)
        :class:`FactoredHeads` parameters.
    parametrization : FactoredHeads
        With ``m r <= d_out`` (:func:`can_decouple`).
    head : int
    sample_weight : ndarray of shape (n,) or None
    intercept_direction : ndarray of shape (d,) or None
        As in :func:`decoupled_refine`.
    n_jobs : int, default=1
        Threads of the search's batches.
    random_state : int, RandomState instance or None
        The start and the batches.

    Returns
    -------
    params : ndarray of shape (3 m d r,)
        ``params`` with head ``head``'s ``Q, K, V`` replaced.
    info : dict
        The search's info (:func:`~skattn.solvers.stages._search.minibatch_search`).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers import FactoredHeads
    >>> rng = np.random.default_rng(0)
    >>> par = FactoredHeads(2, 6, 2)
    >>> truth = rng.normal(size=par.size) / 2
    >>> Q, K, V = par.factors(truth)
    >>> X = rng.normal(size=(1000, 4, 6))
    >>> Y = forward(X, par.attention(truth), V @ rng.normal(size=(2, 2, 4)))
    >>> other = par.factors(rng.normal(size=par.size) / 2)  # head 1 lost
    >>> lost = np.concatenate([np.stack([f[0], g[1]]).ravel()
    ...                        for f, g in zip(par.factors(truth), other)])
    >>> found, info = search_head(X, Y, lost, par, 1, random_state=0)
    >>> bool(info["residual"] < info["residuals"][0] / 2)
    True
    """
    rng = check_random_state(random_state)
    target, fixed = _one_head_problem(
        X,
        Y,
        params,
        parametrization,
        head,
        sample_weight,
        intercept_direction is not None,
        dtype=np.float32,
    )
    return _search_alone(
        X,
        target,
        params,
        parametrization,
        head,
        rng,
        intercept_direction=intercept_direction,
        sample_weight=sample_weight,
        fixed_columns=fixed,
        n_jobs=n_jobs,
    )


def _solve_heads(
    X, shares, heads, Q, K, sample_weight, max_iter, tol, n_jobs, memory=None
):
    """:func:`_solve_head` for each of ``heads``, ``n_jobs`` at a time; fewer
    heads than threads share the rest among their products' chunks."""
    # On a GPU the heads are solved one after another: host threads would only
    # contend for its stream.  (The device's way is to batch the heads' one-head
    # problems, each of the same shape, into one problem of block-diagonal
    # Jacobians; the matrix-free Levenberg-Marquardt solves one problem at a
    # time, so that is left to do.)
    threads = 1 if _on_accelerator(X) else _threads(n_jobs, math.inf)
    jobs = min(threads, len(heads))
    inner = threads // jobs

    # each head's problem keeps its result and iterates under a name given here,
    # in the heads' order, whatever thread solves it
    scopes = {i: None for i in heads}
    if memory is not None and memory.enabled:
        call = memory.next_name("heads")
        scopes = {i: memory.child(f"{call}.head{i}") for i in heads}

    bar = current_bar()  # the refinement's: a head solved, its residual
    if bar.n + len(heads) > (bar.total or 0):  # heads solved again: more to do
        bar.total = bar.n + len(heads)
        bar.refresh()

    def job(i):
        solved = _solve_head(
            X,
            shares,
            i,
            Q,
            K,
            sample_weight,
            max_iter,
            tol,
            n_jobs=inner,
            memory=scopes[i],
        )
        bar.update(1)
        bar.set_postfix_str(f"head {i}: {solved[3]['relative_residual']:.2g}")
        return solved

    # one BLAS thread a head, also when one head is left (its chunks then in
    # threads): on MiniLM layer 4 a head alone on two BLAS threads took 28 ms a
    # product, two heads at once on one thread each 14 ms (the products' GEMMs are
    # too thin to share)
    with _blas_limits(namespace(X)):
        if jobs == 1:
            return [job(i) for i in heads]
        return Parallel(n_jobs=jobs, prefer="threads")(delayed(job)(i) for i in heads)


# Heads whose problems ended near but stopped improving are solved again on this
# many times the sequences, and again on this many times those while they stay
# near and unconverged and the training set has more: a sharp head's problem is
# badly conditioned on few (on MiniLM layer 1 of real text, heads 0, 2 and 3
# stopped at 5.5e-5-1.4e-4 on 376 sequences and converged on 1128; the sharpest
# head, 2.0e-4 on 376 and 2.6e-5 on 1128, converged alone on 3384 to 2.3e-12,
# held out 7.6e-12; benchmarks/HISTORY.md).
_STUCK_SEQUENCES = 3


def _stalled(heads, among):
    """The heads of ``among`` whose problems (rows of ``heads``, None when not
    refined) ended near (at most ``_NEAR``) but unconverged."""
    return [
        i
        for i in among
        if heads[i] is not None
        and not heads[i]["converged"]
        and heads[i]["relative_residual"] <= _NEAR
    ]


def _on_more_sequences(
    X, Y, params, par, direction, sample_weight, rng, verbose, info, stuck, rows, memory
):
    """The ``stuck`` heads refined again on ``_STUCK_SEQUENCES`` times the
    sequences (``rows`` and more), those still near and unconverged there on
    ``_STUCK_SEQUENCES`` times those, and so on while the training set has
    more; each stage starts from the previous one's ends, and the heads that
    converge are taken.  ``info["stuck"]`` lists the stages (``heads``,
    ``n_sequences``, ``converged``)."""
    xp = namespace(X, Y)
    n = X.shape[0]
    more, start, info["stuck"] = rows, params, []
    taken = []
    while stuck and len(more) < n:
        more = _with_more(rng, n, more, min(n, _STUCK_SEQUENCES * len(more)))
        start, again = decoupled_refine(
            _take(xp, X, more),
            _take(xp, Y, more),
            start,
            par,
            sample_weight=_take(xp, sample_weight, more),
            intercept_direction=direction,
            heads=stuck,
            verbose=verbose,
            memory=memory,
        )
        info["n_products"] += again["n_products"]
        converged = [i for i in stuck if again["heads"][i]["converged"]]
        info["stuck"].append(
            {"heads": stuck, "n_sequences": len(more), "converged": converged}
        )
        if converged:
            params = _with_heads(xp, par, params, start, converged)
            for i in converged:
                info["heads"][i] = again["heads"][i]
            taken += converged
        stuck = _stalled(again["heads"], stuck)
    if taken:
        info["residual"] = _fit_on(X, Y, params, par, sample_weight, direction, rows)
        info["kept"] = True
    return params, info


# A head left unconverged whose attention the refinement's sequences split on
# fewer rows than its logits need (split_rows_needed: a counting bound) is solved
# again at once on as many sequences as the bound asks, times this margin, at most
# _PINNING_CAP times the refinement's (and at most the training set): a sharp head
# stalls, near or far, on sequences that do not pin it (all-MiniLM-L6-v2 layer 0,
# head 2 on random tokens, 4 % of rows split, 1596 needed: about 246 on the 376
# sequences, where its problem stalled at 5e-3; benchmarks/HISTORY.md).
_PINNING_MARGIN = 1.5
_PINNING_CAP = 9


def _unpinned(X, params, par, heads, direction, verbose=0):
    """``{head: sequences}`` for the unconverged ``heads`` (rows of the refinement,
    None when not refined) that ``X`` does not pin: the sequences the counting
    bound asks for, by each head's current split rows per sequence (``inf`` with
    none split)."""
    n, k, d = X.shape
    Xh = to_numpy(X)
    Q, K, _ = (to_numpy(f) for f in par.factors(params))
    needed = split_rows_needed(
        d - (direction is not None), par.rank, k, key_bias=direction is not None
    )
    wanted = {}
    for i, row in enumerate(heads):
        if row is None or row["converged"]:
            continue
        split = split_rows(Xh, Q[i], K[i])
        if verbose:
            print(
                f"decoupled: head {i}: {split} of {n * k} rows split its attention "
                f"on {n} sequences, {needed} needed",
                flush=True,
            )
        if split < needed:
            wanted[i] = _sequences_needed(split, n, needed)
    return wanted


def _sequences_needed(split, sequences, needed):
    """Sequences like ``sequences`` of which ``split`` rows split a head's
    attention that give ``needed`` such rows (``inf`` when none split)."""
    if split >= needed:
        return sequences
    return math.inf if split == 0 else math.ceil(sequences * needed / split)


def _stage_size(wanted, rows, n):
    """Sequences of a stage for ``wanted`` (the bound's, possibly ``inf``):
    times ``_PINNING_MARGIN``, at most ``_PINNING_CAP`` times ``rows`` and ``n``."""
    cap = min(n, _PINNING_CAP * rows)
    if wanted == math.inf:
        return cap
    return min(cap, math.ceil(_PINNING_MARGIN * wanted))


def _on_enough_sequences(
    X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
):
    """The unconverged heads that the refinement's sequences (``rows``) do not
    pin (:func:`_unpinned`) refined again on as many as their logits need (times
    ``_PINNING_MARGIN``, at most ``_PINNING_CAP`` times ``rows`` and the training
    set), from their ends; those that converge are taken.  ``info["pinning"]``
    records the stage (``heads``, ``n_sequences``, ``wanted``, ``converged``)."""
    xp = namespace(X, Y)
    n = X.shape[0]
    wanted = _unpinned(
        _take(xp, X, rows), params, par, info["heads"], direction, verbose
    )
    if not wanted or n <= len(rows):
        return params, info
    size = _stage_size(max(wanted.values()), len(rows), n)
    if size <= len(rows):
        return params, info
    more = _with_more(rng, n, rows, size)
    heads = sorted(wanted)
    refined, again = decoupled_refine(
        _take(xp, X, more),
        _take(xp, Y, more),
        params,
        par,
        sample_weight=_take(xp, sample_weight, more),
        intercept_direction=direction,
        heads=heads,
        verbose=verbose,
        memory=memory,
    )
    info["n_products"] += again["n_products"]
    converged = [i for i in heads if again["heads"][i]["converged"]]
    info["pinning"] = {
        "heads": heads,
        "n_sequences": len(more),
        "wanted": {i: float(w) for i, w in wanted.items()},
        "converged": converged,
    }
    if verbose:
        print(
            f"decoupled: heads {heads} not pinned by {len(rows)} sequences, "
            f"solved on {len(more)}: converged {converged}"
        )
    if converged:
        params = _with_heads(xp, par, params, refined, converged)
        for i in converged:
            info["heads"][i] = again["heads"][i]
        info["residual"] = _fit_on(X, Y, params, par, sample_weight, direction, rows)
        info["kept"] = True
    return params, info


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
    """Each of ``arrays`` (None stays None) on the sequences ``rows``."""
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


# Heads whose one-head problem ended far (above _NEAR) are searched afresh and
# refined again in two passes over the heads still far (at most as many tries as
# heads): first on the head's own one-head problem (search_head), realisable by
# the head alone whatever the other heads' errors; then on what the other heads
# leave unexplained (_replace_head, the search's replacement), whose target is
# the head's alone once the other heads are exact.  (On MiniLM layer 0 of real
# text, five heads far after the rounds: the first gave converged heads in 3 of 7
# tries, the second in 5 of 15, the farthest head only with five other far heads
# made exact; benchmarks/HISTORY.md.)
_DECOUPLED_PASSES = ("own problem", "what the others leave")


def refine_heads(
    X, Y, params, par, direction, sample_weight, rng, verbose, memory=None
):
    """:func:`decoupled_refine` on :func:`decoupled_size` random sequences; then
    each head it could not bring near (a head the search left mixed with another,
    or found only roughly) is searched afresh and refined alone again, in the
    passes of ``_DECOUPLED_PASSES`` (at most ``m`` tries).  Before that, heads
    left unconverged that the refinement's sequences do not pin (too few rows
    split their attention, by a counting bound) are refined again on as many as
    the bound asks (:func:`_on_enough_sequences`), and the other heads that ended
    near but unconverged on more sequences (:func:`_on_more_sequences`).  Heads
    still unconverged at the end are restarted from their patterns, fitted in
    logit space (:func:`_from_patterns`; with ``head_rank >= k``).  Returns the
    parameters and the refinement's info, with ``pinning`` (``heads``,
    ``n_sequences``, ``wanted``, ``converged``; when there were such heads),
    ``stuck`` (per stage on more sequences: ``heads``, ``n_sequences``,
    ``converged``; when there were such heads), ``replacements`` (per try:
    ``head``, ``searched_on`` and ``converged``) and ``from_patterns`` (per
    restart: ``head``, ``n_sequences``, ``logit_cost``, ``relative_residual``,
    ``converged``, ``taken``, ``seconds``).
    ``memory`` (a StageMemory) keeps each head's solve and each search afresh
    with the generator's state after it."""
    with stage_bar("refine", par.n_heads, "head"):
        return _refine_heads(
            X, Y, params, par, direction, sample_weight, rng, verbose, memory
        )


def _refine_heads(X, Y, params, par, direction, sample_weight, rng, verbose, memory):
    """:func:`refine_heads` within its progress bar."""
    xp = namespace(X, Y)
    n, k = X.shape[:2]
    size = decoupled_size(par.n_heads, k, par.n_features, par.rank, Y.shape[2])
    rows = np.sort(rng.choice(n, size=min(n, size), replace=False))
    Xd, Yd = _take(xp, X, rows), _take(xp, Y, rows)
    weights = _take(xp, sample_weight, rows)
    params, info = decoupled_refine(
        Xd,
        Yd,
        params,
        par,
        sample_weight=weights,
        intercept_direction=direction,
        verbose=verbose,
        memory=memory,
    )
    params, info = _on_enough_sequences(
        X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
    )
    # (heads solved on enough sequences already are not grown again from rows)
    pinned_stage = info.get("pinning", {}).get("heads", [])
    stuck = [
        i for i in _stalled(info["heads"], range(par.n_heads)) if i not in pinned_stage
    ]
    if stuck and n > len(rows):
        params, info = _on_more_sequences(
            X,
            Y,
            params,
            par,
            direction,
            sample_weight,
            rng,
            verbose,
            info,
            stuck,
            rows,
            memory,
        )
    info["replacements"] = []
    n_jobs = 1 if _on_accelerator(X) else _threads(None, 2)
    for searched_on in _DECOUPLED_PASSES:
        # near heads were restarted from their ends already (every replacement of
        # such a head measured on MiniLM ended worse than it began)
        pending = [
            i for i, row in enumerate(info["heads"]) if row["relative_residual"] > _NEAR
        ]
        for head in pending[: par.n_heads - len(info["replacements"])]:
            searched = np.sort(
                rng.choice(
                    n, size=min(n, _REPLACEMENT_BATCHES * _BATCH_SIZE), replace=False
                )
            )

            def search_afresh(_, head=head, rows=searched, on=searched_on, p=params):
                with _blas_limits(xp):
                    if on == "own problem":
                        return search_head(
                            _take(xp, X, rows),
                            _take(xp, Y, rows),
                            p,
                            par,
                            head,
                            sample_weight=_take(xp, sample_weight, rows),
                            intercept_direction=direction,
                            n_jobs=n_jobs,
                            random_state=rng,
                        )[0]
                    return _replace_head(
                        X,
                        Y,
                        p,
                        par,
                        head,
                        rows=rows,
                        intercept_direction=direction,
                        batch_size=min(n, _BATCH_SIZE),
                        learning_rate=_LEARNING_RATE,
                        random_state=rng,
                        dtype=np.float32,
                        n_jobs=n_jobs,
                    )

            candidate = kept(memory, "search-afresh", search_afresh, rng)
            refined, again = decoupled_refine(
                Xd,
                Yd,
                candidate,
                par,
                sample_weight=weights,
                intercept_direction=direction,
                heads=[head],
                verbose=verbose,
                memory=memory,
            )
            converged = bool(again["heads"][head]["converged"])
            info["n_products"] += again["n_products"]  # spent, taken or not
            if converged and again["residual"] < info["residual"]:
                params, info["residual"] = refined, again["residual"]
                info["heads"][head] = again["heads"][head]
                info["kept"] = True
            info["replacements"].append(
                {"head": int(head), "searched_on": searched_on, "converged": converged}
            )
            if verbose:
                print(
                    f"decoupled: head {head} searched afresh on {searched_on}, "
                    f"converged: {converged}"
                )
    return _from_patterns(
        X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
    )


def _from_patterns(
    X, Y, params, par, direction, sample_weight, rng, verbose, info, rows, memory
):
    """Each head left unconverged, restarted from its patterns: read off the
    outputs (:func:`~._sharp_heads.read_patterns`) on ``_STUCK_SEQUENCES`` times
    the refinement's sequences (``rows`` and more; as many as
    :func:`_on_enough_sequences` took, if more), or, when the patterns read there
    split too few rows to pin the head, read again on as many as they ask
    (``_stage_size``); then fitted in logit space there
    (:func:`~._sharp_heads.fit_logits`) and refined alone; taken
    when it converges or ends near, and the layer fits better with it on
    sequences the restart did not use (:func:`_judged_on`); one that ends near
    but unconverged goes on from its end on more sequences
    (:func:`_on_more_sequences`).  A head whose patterns ask for more sequences
    than the training set has is left as it is: no fit there pins it.  Only when
    the patterns can be read (``head_rank >= k``).  ``info["from_patterns"]``
    lists the tries (``head``, ``n_sequences``, ``sequences_needed``,
    ``logit_cost``, ``relative_residual``, ``converged``, ``judged_on``,
    ``layer_residuals``: the layer's relative residual there before and after,
    ``taken``, ``seconds``, ``stuck``: the stages on more sequences; the fit's
    entries None for a head left as it is)."""
    xp = namespace(X, Y)
    n, k = X.shape[:2]
    info["from_patterns"] = []
    pending = [i for i, row in enumerate(info["heads"]) if row and not row["converged"]]
    if not pending or not can_read_patterns(par.rank, k):
        return params, info
    # as many as the stage on enough sequences took, when it ran
    size = max(
        _STUCK_SEQUENCES * len(rows), info.get("pinning", {}).get("n_sequences", 0)
    )
    more = _with_more(rng, n, rows, min(n, size))
    needed = split_rows_needed(
        X.shape[2] - (direction is not None),
        par.rank,
        k,
        key_bias=direction is not None,
    )
    first = more
    for head in pending:

        def restart(_, head=head, p=params):
            # the read-off patterns show how sharp the head is: when they split
            # too few rows to pin it, they are read again on as many sequences
            # as it needs before its logits are fitted (on MiniLM layer 0's
            # previous-token head, random tokens, a fit on 1128 sequences, where
            # the real head splits about 740 rows of 1592 needed, reached 7.3e-5
            # there and 2.0e-3 on 3384)
            chosen, seconds = first, 0.0
            while True:
                Xc, Yc, wc = _on_rows(xp, chosen, X, Y, sample_weight)
                patterns, read = read_patterns(
                    Xc,
                    Yc,
                    p,
                    par,
                    head,
                    sample_weight=wc,
                    intercept_direction=direction,
                )
                seconds += read.pop("seconds")
                wanted = _sequences_needed(read["n_split_rows"], len(chosen), needed)
                read["sequences_needed"] = float(wanted)
                if wanted > n:
                    # by the counting bound, no fit on the training set pins
                    # the head: it would learn the sequences it sees, not the
                    # head (see the judging below), at the cost of a fit
                    return None, {**read, "seconds": seconds}, chosen
                size = _stage_size(wanted, len(rows), n) if wanted > len(chosen) else 0
                if size <= len(chosen):
                    break
                chosen = _with_more(rng, n, chosen, size)
            found, fit = fit_logits(Xc, patterns, p, par, head, sample_weight=wc)
            fit["seconds"] += seconds
            return found, {**read, **fit}, chosen

        candidate, read, more = kept(memory, "from-patterns", restart, rng)
        entry = {
            "head": int(head),
            "n_sequences": len(more),
            "sequences_needed": read["sequences_needed"],
            "logit_cost": None,
            "relative_residual": None,
            "converged": False,
            "judged_on": 0,
            "layer_residuals": None,
            "taken": False,
            "seconds": read["seconds"],
            "stuck": [],
        }
        if candidate is None:
            info["from_patterns"].append(entry)
            if verbose:
                print(
                    f"decoupled: head {head} left as it is: its patterns split "
                    f"{read['n_split_rows']} rows on {len(more)} sequences, "
                    f"{read['sequences_needed']:.0f} needed to pin it, {n} given"
                )
            continue
        Xm, Ym, weights = _on_rows(xp, more, X, Y, sample_weight)
        refined, again = decoupled_refine(
            Xm,
            Ym,
            candidate,
            par,
            sample_weight=weights,
            intercept_direction=direction,
            heads=[head],
            verbose=verbose,
            memory=memory,
        )
        solved = again["heads"][head]
        info["n_products"] += again["n_products"]  # spent, taken or not
        grown = []
        if _stalled(again["heads"], [head]) and n > len(more):
            # near but stopped: on more sequences from its end, as a stuck head
            # (on MiniLM layer 0's previous-token head, random tokens: 5.1e-3
            # before the restart, 1.1e-4 after it on 1128 sequences)
            again["n_products"] = 0
            refined, again = _on_more_sequences(
                X,
                Y,
                refined,
                par,
                direction,
                sample_weight,
                rng,
                verbose,
                again,
                [head],
                more,
                memory,
            )
            info["n_products"] += again["n_products"]
            solved, grown = again["heads"][head], again["stuck"]
        # a converged head, or a near one's end, is taken when the layer fits
        # better with it on sequences the restart did not use (a near end stays
        # unconverged in the record, and the fit warns).  On MiniLM layer 0's
        # previous-token head, random tokens, the restart on 3384 sequences ended
        # at 2.7e-10 from 5.1e-3; on real text, which does not pin that head, at
        # 9.3e-5 on its 3384 windows and 0.026 on 1616 others (0.015 before it;
        # the refinement's windows, a part of its 3384, favoured it)
        judge = _judged_on(rng, n, more, rows)
        before, after = (
            _fit_on(X, Y, p, par, sample_weight, direction, judge)
            for p in (params, refined)
        )
        near = solved["converged"] or solved["relative_residual"] <= _NEAR
        taken = bool(near and after < before)
        if taken:
            params, info["kept"], info["heads"][head] = refined, True, solved
            info["residual"] = _fit_on(
                X, Y, params, par, sample_weight, direction, rows
            )
        entry.update(
            logit_cost=read["logit_cost"],
            relative_residual=solved["relative_residual"],
            converged=bool(solved["converged"]),
            judged_on=len(judge),
            layer_residuals=(before, after),
            taken=taken,
            seconds=read["seconds"] + solved["seconds"],
            stuck=grown,
        )
        info["from_patterns"].append(entry)
        if verbose:
            print(
                f"decoupled: head {head} restarted from its patterns "
                f"({len(more)} sequences, logit cost {read['logit_cost']:.3g}): "
                f"relative residual {solved['relative_residual']:.3g}, taken: {taken}"
            )
    return params, info
