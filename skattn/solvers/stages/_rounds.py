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
``Y B_2`` columns eliminated with the head's ``W``), independently: in threads
with ``n_jobs`` on numpy, or as one problem with a head axis
(:class:`~skattn.solvers.kernels._head_batch.HeadBatch`, solved by
:func:`~skattn.solvers.optimizers._batched_lm.batched_least_squares`) in the other
namespaces, where a GPU would otherwise run twelve small problems one after
another, bound by launches and host reads.

Why it matters: the joint Levenberg-Marquardt problem of 12 MiniLM heads (442 368
parameters) converges only linearly from where the minibatch search leaves it,
held back by one nearly one-hot head whose Gauss-Newton block is tiny next to the
others'; the one-head problems are each well scaled on their own: from the search's
end, ten of the twelve converged to rounding in 6-17 iterations each
(benchmarks/HISTORY.md).

Pure functions on token tensors (no validation; callers validate), of any array-API
namespace (numpy, torch, CuPy): the heads' problems run in the namespace and on the
device of ``X``, the sequences are drawn on the host, and the records hold Python
numbers.
"""

import math
import time

import numpy as np
from joblib import Parallel, delayed

from ...utils._array_api import (
    device,
    einsum,
    is_numpy,
    namespace,
    to_namespace,
    to_numpy,
)
from ...utils._progress import current_bar
from ..kernels._decoupling import _output_factors, decoupling_map
from ..kernels._head_batch import HeadBatch
from ..kernels._loss import REALISABLE_RESIDUAL, _device_weights
from ..kernels._parametrization import LowRank
from ..optimizers._batched_lm import batched_least_squares
from ..optimizers._lm_matrix_free import _STATUS, varpro_least_squares
from ._common import _blas_limits, _copy, _on_accelerator, _on_rows, _threads

__all__ = ["can_decouple", "decoupled_refine", "decoupled_size"]

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
    omega = _device_weights(n, sample_weight, X)
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
    batched=None,
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
        (:mod:`skattn.solvers._checkpoints`); batched, each round's solve.
    batched : bool or None
        Solve a round's heads as one problem with a head axis
        (:class:`~skattn.solvers.kernels._head_batch.HeadBatch`, by
        :func:`~skattn.solvers.optimizers._batched_lm.batched_least_squares`:
        each head's own trust region and stopping, every scalar on the
        device, the host looking once per trial) rather than one after another or in
        threads.  ``None``: batched outside numpy (torch, CuPy: on a GPU the
        one-head problems are each too small to fill it, and one after another
        they are bound by launches and host reads), threads with numpy (where
        they are as fast, and the results of before are kept).

    Returns
    -------
    params : ndarray of shape (3 m d r,)
        The refined parameters: the converged heads' solutions, and the near
        unconverged heads' ends when the layer fits better with them than
        without; ``params`` when no head converged and neither fits better.
        Converged heads are taken even when the layer then fits worse (a
        converged problem's solution is its real head), unless ``params``
        fitted the layer to rounding already.
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
        D, round_condition = decoupling_map(output_factors, condition=round_ == 0)
        if round_ == 0:
            residual_start, condition = residual, round_condition
        shares = xp.reshape(xp.reshape(Y, (n * k, o)) @ D, (n, k, m, r))
        results = _solve_heads(
            X,
            shares,
            active,
            Q,
            K,
            sample_weight,
            max_iter,
            tol,
            n_jobs,
            memory,
            batched=batched,
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
    differ = not bool(xp.all(refined == converged_only))
    if differ:
        other = fit(converged_only)[1]
        if other < residual:
            refined, residual = converged_only, other
    kept = residual < residual_start
    fitted = residual_start <= _LAYER_MARGIN * REALISABLE_RESIDUAL
    converged = [i for i, row in enumerate(rows) if row and row["converged"]]
    if not (kept or fitted) and converged and _distinct(X, Qc, Kc, converged):
        # the converged heads are taken whatever the layer's fit: a converged
        # problem is solved by its real head whatever the other heads' errors,
        # and the layer may fit worse with exact heads beside the search's others,
        # which had shared out what a head not yet found leaves (MiniLM layer 0
        # at k = 64: 9 exact heads dropped so, benchmarks/HISTORY.md); not two
        # problems that found the same real head
        if differ:
            refined, residual = converged_only, other
        kept = True
    info = {
        "heads": rows,
        "n_products": int(sum(row["n_products"] for row in rows if row)),
        "condition": condition,
        "residual_start": residual_start,
        "residual": residual if kept else residual_start,
        "kept": bool(kept),
    }
    return (refined if kept else start), info


def _distinct(X, Q, K, heads, tol=1e-6):
    """Whether heads ``heads`` have different logits on the first sequences of
    ``X``, each row's mean left out (it cancels in the softmax, and with it the
    constant key coordinate's column): two problems that converged to the same
    real head are one head, not two.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.solvers.stages._rounds import _distinct
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(4, 5, 6))
    >>> Q, K = rng.normal(size=(2, 3, 6, 2))
    >>> bool(_distinct(X, Q, K, [0, 1, 2]))
    True
    >>> Q[2], K[2] = Q[0], K[0]
    >>> bool(_distinct(X, Q, K, [0, 1, 2])), bool(_distinct(X, Q, K, [0, 1]))
    (False, True)
    """
    xp = namespace(X)
    sample = X[:8, None]  # (s, 1, k, d) against the heads' (h, d, r)
    index = xp.asarray(heads, device=device(X))
    L = (sample @ xp.take(Q, index, axis=0)) @ xp.matrix_transpose(
        sample @ xp.take(K, index, axis=0)
    )
    centred = xp.permute_dims(L - xp.mean(L, axis=-1, keepdims=True), (1, 0, 2, 3))
    # squared distances between the heads' centred logits, read by the host once
    flat = xp.reshape(centred, (len(heads), -1))
    gram = to_numpy(flat @ xp.matrix_transpose(flat))
    norms = np.diag(gram)
    gaps = norms[:, None] + norms[None, :] - 2 * gram
    close = gaps <= tol**2 * norms[:, None]  # against the earlier head, as i < j
    return not bool(np.any(np.triu(close, 1)))


def _solve_heads(
    X,
    shares,
    heads,
    Q,
    K,
    sample_weight,
    max_iter,
    tol,
    n_jobs,
    memory=None,
    batched=None,
):
    """:func:`_solve_head` for each of ``heads``: in threads on the host
    (``n_jobs`` at a time; fewer heads than threads share the rest among their
    products' chunks), or as one batched problem (:func:`_solve_batch`).
    ``batched=None``: batched outside numpy (torch, CuPy: on a device the
    heads' problems one after another are bound by launches and host reads),
    threads with numpy."""
    if batched is None:
        batched = not is_numpy(namespace(X))
    call = None
    if memory is not None and memory.enabled:
        call = memory.next_name("heads")

    bar = current_bar()  # the refinement's (open-ended): a head solved, its residual

    if batched:

        def compute():
            return _solve_batch(X, shares, heads, Q, K, sample_weight, max_iter, tol)

        # ".trust": the batch's trust-region steps (issue 63; ".batch" kept the
        # Levenberg-Marquardt steps of before, whose results differ)
        results = compute() if call is None else memory.stage(f"{call}.trust", compute)
        bar.update(len(heads))
        worst = max(solved[3]["relative_residual"] for solved in results)
        bar.set_postfix_str(f"worst head: {worst:.2g}")
        return results

    # each head's problem keeps its result and iterates under a name given here,
    # in the heads' order, whatever thread solves it
    scopes = {
        i: None if call is None else memory.child(f"{call}.head{i}") for i in heads
    }
    # on a GPU one after another: host threads would only contend for its stream
    threads = 1 if _on_accelerator(X) else _threads(n_jobs, math.inf)
    jobs = min(threads, len(heads))
    inner = threads // jobs

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


def _solve_batch(
    X, shares, heads, Q, K, sample_weight, max_iter, tol, jacobian_dtype=np.float32
):
    """The one-head problems of ``heads`` as one :class:`HeadBatch`, solved
    together by :func:`batched_least_squares`: per head, what
    :func:`_solve_head` returns (``seconds``: the batch's, shared equally)."""
    clock = time.perf_counter()
    xp = namespace(X, shares)
    n, k, m, r = shares.shape
    where = device(X)
    index = xp.asarray(heads, device=where)  # one copy from the host, used twice
    targets = xp.take(shares, index, axis=2)
    fixed = None
    if m > 1:  # head i's fixed columns: the other heads' shares, in order
        others = [j for i in heads for j in range(m) if j != i]
        fixed = xp.take(shares, xp.asarray(others, device=where), axis=2)
        fixed = xp.reshape(fixed, (n, k, len(heads), (m - 1) * r))
    problem = HeadBatch(X, targets, fixed, sample_weight, dtype=jacobian_dtype)
    norms = to_numpy(problem.target_norms)  # one read
    h = len(heads)
    start = xp.concat(
        [
            xp.reshape(xp.take(Q, index, axis=0), (h, -1)),
            xp.reshape(xp.take(K, index, axis=0), (h, -1)),
        ],
        axis=1,
    )
    params, coefficients, solved = batched_least_squares(
        problem, start, max_nfev=max_iter, xtol=tol
    )
    seconds = (time.perf_counter() - clock) / h
    d = X.shape[2]
    results = []
    for j in range(h):
        loss = solved["loss"][j]
        info = {
            "n_iter": solved["n_iter"][j],
            "n_evaluations": solved["n_evaluations"][j],
            # the products this head took part in (summed over the heads, the
            # count of heads one at a time: not h times the batch's)
            "n_products": solved["head_products"][j],
            "loss": loss,
            "converged": solved["status"][j] > 0,
            "stop_reason": _STATUS[solved["status"][j]],
            "relative_residual": math.sqrt(2.0 * loss)
            / max(float(norms[j]), np.finfo(float).tiny),
            "seconds": seconds,
            "host_reads": solved["host_reads"],
        }
        q = xp.reshape(params[j, : d * r], (d, r))
        kk = xp.reshape(params[j, d * r :], (d, r))
        results.append((q, kk, coefficients[j, :d, :], info))
    return results


def _refine_on(
    X, Y, sample_weight, rows, params, par, direction, heads, verbose, memory
):
    """:func:`decoupled_refine` of ``heads`` from ``params`` on the sequences
    ``rows`` (the stages that solve heads again on other sequences)."""
    Xr, Yr, weights = _on_rows(namespace(X, Y), rows, X, Y, sample_weight)
    return decoupled_refine(
        Xr,
        Yr,
        params,
        par,
        sample_weight=weights,
        intercept_direction=direction,
        heads=heads,
        verbose=verbose,
        memory=memory,
    )
