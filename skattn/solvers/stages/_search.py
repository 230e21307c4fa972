"""A first-order search on minibatches before the Levenberg-Marquardt polish.

From a random start, Levenberg-Marquardt on all examples moves a layer of many heads
slowly: with 12 heads of rank 32 at d = 384 (a whole all-MiniLM-L6-v2 layer) each
iteration costs a minute of products over the data and twenty of them left half of
the targets unexplained.  Far from a minimum a step does not need all the examples:
Adam on the variable-projection loss of small random batches (the output factors
``O_i`` and the intercept eliminated by least squares on each batch) moves the
heads to where Gauss-Newton steps converge, at a small fraction of the cost.

The reduced loss of a batch ``B`` is ``L_B(p) = min_O ||A_B(p) O - Y_B||^2 / (2 |B|)``
with the design ``A_B(p)`` of :class:`skattn.solvers.VarproProblem`; its gradient is
that of the loss at the minimising ``O`` (the envelope theorem), one backward
pass.  Everything runs in single precision but the batch's small Gram solve.

Pure functions on token tensors (no validation; callers validate), of any array-API
namespace (numpy, torch, CuPy): the products run in the namespace and on the device
of ``X``, the batches are drawn on the host (a numpy generator: the same batches in
every namespace), and the records hold Python numbers.
"""

import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from sklearn.utils import check_random_state

from ...layer._math import softmax
from ...utils._array_api import (
    cholesky_solve,
    cholesky_solve_unchecked,
    device,
    is_numpy,
    lstsq,
    namespace,
    to_namespace,
    to_numpy,
)
from ...utils._progress import stage_bar
from .._checkpoints import _rng_state, _set_rng_state
from ..kernels._decoupling import _design
from ..kernels._parametrization import _at_least, random_attention
from ..optimizers._adam import _ADAM_BETA1 as _BETA1
from ..optimizers._adam import _ADAM_BETA2 as _BETA2
from ..optimizers._adam import _ADAM_EPSILON as _EPSILON
from ._common import _blas_limits, _copy, _device_rows, _on_accelerator, _take

# The search's defaults (also those of the replacements after a decoupled refinement).
_BATCH_SIZE = 256
_LEARNING_RATE = 0.1
# Ridge of a batch's Gram matrix, relative to its mean diagonal: keeps the solve
# defined when a batch's design is rank deficient (a head with no signal yet).
_BATCH_RIDGE = 1e-10
# ... and, on torch (no host check of the factor), the ridge taken where that
# Gram is still not definite (float32 designs of two heads with the same
# columns), in place of the host's minimum-norm least squares
_FALLBACK_RIDGE = 1e-6
# A check counts as progress when the residual falls below (1 - _PROGRESS) times
# the best so far.  (A tenth cut the step size of 12 MiniLM heads while Adam at
# the first step size still gained 3-5 % a check; benchmarks/HISTORY.md.)
_PROGRESS = 0.01
# Sequences, in batches, that a replaced head is searched on (what the other heads
# leave unexplained is computed on them once).
_REPLACEMENT_BATCHES = 16
# The weakest head is replaced only when it explains less than what all heads
# leave unexplained: its removal raises the residual by less than this factor
# (the explained energy ``without**2 - residual**2`` below ``residual**2``).  A
# stall with every head contributing (12 MiniLM heads at 0.006, the weakest
# worth 0.117) is the step size's noise floor, not an unfound head.
_REPLACE_BELOW = math.sqrt(2.0)
# The start's plateau: from a random start the residual falls for a check or two
# (output factors and intercept), then sits still while the heads' overlap with
# the real ones grows, and then falls fast.  That plateau lasts about
# 3.4e-4 m d^2 steps (planted heads, m r = d, batches of 256: 150 steps at
# d = 192, 550 at d = 384, about 2400 predicted at d = 768; neither the step size
# nor the start's scale shortens it; benchmarks/studies/study_bert_base_search.py),
# and a step-size cut on it lengthens it: with patience 3 the search of 12 heads
# of rank 32 at d = 384 was cut three times on it and ended at 0.706, where
# uncut it left at step 550 and reached 0.13.  So while the residual has not
# fallen below _PLATEAU_EXIT times the start's, the step size is not cut before
# _PLATEAU_STEPS m d^2 steps (twice the measured plateau).  The level is half the
# start's: where the values are searched too, they fall by more than a tenth on
# their own before any head is found (8 heads of 128 at d = 1024, a Llama-shaped
# layer: 0.824 -> 0.726 at the first check, then a plateau at 0.57; 12 heads of
# 64 at d = 768: a plateau at 0.88 of the start's), so at 0.9 the rule was void
# and the plateau's stalls cut the step size (the Llama-shaped search ended at
# 0.48 on an H200; benchmarks/HISTORY.md, eighteenth session).  Off the plateau
# the residual falls fast, through half the start's within a check or two.
_PLATEAU_STEPS = 7e-4
_PLATEAU_EXIT = 0.5

# Off numpy, the search copies its rows to the device for this many check
# intervals at once (each copy from the host blocks a GPU's host; a search afresh
# in the refinement made one every interval: 563 of its 2472 round trips on issue
# 63's soft recipe)
_DRAWN_AHEAD = 8


# The array namespace's small helpers of the search (those the stages share are in
# _common): each keeps the numpy route of the code it replaced (so that numpy's
# results keep their bits) and is written against the array API standard for the
# other namespaces.


def _xp_dtype(xp, dtype):
    """The dtype of ``xp`` named like the numpy dtype ``dtype`` (``dtype`` itself
    when it is one of ``xp``'s already)."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        return dtype
    return getattr(xp, name)


def _sum_squares(xp, a):
    """``sum(a**2)`` as a float64 0-d array or numpy scalar (no host sync on a
    device; numpy: ``np.vdot`` as before)."""
    if is_numpy(xp):
        return np.float64(np.vdot(a, a))
    return xp.astype(xp.sum(a * a), xp.float64)


def _norm(xp, a):
    """The Frobenius norm of ``a`` as a Python float (numpy: ``np.linalg.norm``,
    a BLAS dot, as before; the compat ``vector_norm`` sums pairwise)."""
    if is_numpy(xp):
        return float(np.linalg.norm(a))
    return float(xp.linalg.vector_norm(a))


def _drop_block(xp, a, start, stop, axis):
    """``a`` without the indices ``[start, stop)`` of ``axis``, a copy (numpy: the
    fancy index of before, whose copy has its own memory order, and so its own
    BLAS calls)."""
    if is_numpy(xp):
        return _columns(
            xp, a, np.setdiff1d(np.arange(a.shape[axis]), range(start, stop)), axis
        )
    before = (slice(None),) * axis + (slice(0, start), ...)
    after = (slice(None),) * axis + (slice(stop, None), ...)
    return xp.concat([a[before], a[after]], axis=axis)


def _columns(xp, a, indices, axis):
    """``a``'s entries ``indices`` (host integers) along ``axis``, a copy (numpy:
    a fancy index, as before)."""
    if is_numpy(xp):
        return a[(slice(None),) * axis + (indices,)]
    indices = to_namespace(np.asarray(indices), xp, device(a))
    return xp.take(a, indices, axis=axis)


def batch_loss_gradient(
    X,
    Y,
    params,
    parametrization,
    intercept_direction=None,
    n_jobs=1,
    fixed=None,
    *,
    losses=True,
):
    """The reduced loss of one batch and its gradient, the output factors eliminated.

    Parameters
    ----------
    X : ndarray of shape (b, k, d)
        Tokens of the batch (their dtype sets the precision of the products).
    Y : ndarray of shape (b, k, d_out)
    params : ndarray of shape (p,)
        Parameters of ``parametrization`` (:class:`FactoredHeads`: ``Q, K, V``).
    parametrization : FactoredHeads
    intercept_direction : ndarray of shape (d,) or None
        A token-space vector ``g`` with ``X g = 1`` on every token: the design gets
        a column of ones (an intercept), eliminated with the ``O_i``.
    n_jobs : int, default=1
        Threads: the batch is computed in two halves (their sums, so the result
        does not depend on ``n_jobs``), at once when ``n_jobs`` is 2, each with
        one BLAS thread.
    fixed : ndarray of shape (b, k, c) or None
        Columns of the design that are not searched (no gradient): eliminated
        with the output factors, like the intercept.
    losses : bool, default=True
        Whether to read the two losses to the host (a wait for the device each):
        a training step, which uses the gradient only, passes False.

    Returns
    -------
    loss : float or None
        ``min_O ||A(p) O - Y||^2 / (2 b)`` (None without ``losses``).
    gradient : ndarray of shape (p,), float64
    target : float or None
        ``||Y||^2 / (2 b)``, the loss of predicting zero (None without
        ``losses``).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.solvers import FactoredHeads
    >>> rng = np.random.default_rng(0)
    >>> X, Y = rng.normal(size=(40, 3, 5)), rng.normal(size=(40, 3, 4))
    >>> par = FactoredHeads(2, 5, 2)
    >>> p, v = rng.normal(size=par.size), rng.normal(size=par.size)
    >>> loss, grad, _ = batch_loss_gradient(X, Y, p, par)
    >>> h = 1e-6
    >>> slope = (batch_loss_gradient(X, Y, p + h * v, par)[0]
    ...          - batch_loss_gradient(X, Y, p - h * v, par)[0]) / (2 * h)
    >>> bool(abs(slope - grad @ v) < 1e-6 * abs(slope))
    True
    """
    xp = namespace(X, Y)
    b, k, _ = X.shape
    low = xp.astype(to_namespace(params, xp, device(X)), X.dtype, copy=False)
    intercept = intercept_direction is not None
    # the batch in _PARTS parts, each a forward pass and its share of the Gram
    # matrix, then each a backward pass against the batch's O: the parts run in
    # n_jobs threads of one BLAS thread each (12 MiniLM heads: 0.11 s a step on
    # two such threads, 0.16 s on one; whole batches on two BLAS threads were
    # slower than on one), and the sums are the same either way
    # (contiguous slices: no index copied to a device)
    parts = [
        slice(int(part[0]), int(part[-1]) + 1)
        for part in np.array_split(np.arange(b), _PARTS)
        if len(part)
    ]
    with _Workers(len(parts), n_jobs, X) as run:
        states = run(
            _part_forward,
            [
                (
                    X[i, ...],
                    Y[i, ...],
                    low,
                    parametrization,
                    intercept,
                    _rows(xp, fixed, i),
                )
                for i in parts
            ],
        )
        gram = sum(state["gram"] for state in states)
        rhs = sum(state["rhs"] for state in states)
        coef = xp.astype(
            _solve_gram(
                gram,
                rhs,
                lambda: (
                    xp.concat([s["design"] for s in states]),
                    xp.concat([s["target"] for s in states]),
                ),
            ),
            X.dtype,
        )
        backward = run(
            _part_backward,
            [
                (X[i, ...], low, parametrization, state, coef)
                for i, state in zip(parts, states, strict=True)
            ],
        )
    gradient = sum(xp.astype(part[1], xp.float64) for part in backward)
    if not losses:  # a training step: nothing read by the host
        return None, gradient / b, None
    # one host read for the loss and the zero loss together (the gradient stays)
    sums = xp.stack(
        [sum(part[0] for part in backward), sum(state["zero"] for state in states)]
    )
    loss, zero = (0.5 * float(v) / b for v in to_numpy(sums))
    return loss, gradient / b, zero


# A batch's parts (see batch_loss_gradient): fixed, so that the result does not
# depend on the number of threads.
_PARTS = 2


class _Workers:
    """Run a function over argument tuples: in ``n_jobs`` threads, each limited to
    one BLAS thread, or (``n_jobs=1``, or arrays on a GPU) in order."""

    # On a GPU the parts' kernels queue on one stream anyway: host threads would
    # only contend for it, so the parts run in order there.

    def __init__(self, n_parts, n_jobs, like=None):
        self.n_jobs = max(1, min(n_parts, int(n_jobs)))
        if _on_accelerator(like):
            self.n_jobs = 1
        self._xp = namespace(like)

    def __enter__(self):
        if self.n_jobs > 1:
            self._limits = _blas_limits(self._xp)
            self._limits.__enter__()
            self._pool = ThreadPoolExecutor(self.n_jobs)
        return self

    def __call__(self, function, arguments):
        if self.n_jobs == 1:
            return [function(*args) for args in arguments]
        return list(self._pool.map(lambda args: function(*args), arguments))

    def __exit__(self, *exc):
        if self.n_jobs > 1:
            self._pool.shutdown()
            self._limits.__exit__(None, None, None)


def _rows(xp, fixed, part):
    """The fixed columns of the sequences of slice ``part``, as token rows, or
    None."""
    if fixed is None:
        return None
    chosen = fixed[part, ...]
    return xp.reshape(chosen, (chosen.shape[0] * fixed.shape[1], fixed.shape[2]))


def _part_forward(X, Y, low, parametrization, intercept, fixed=None):
    """A part's forward pass: its state and its share of the Gram system."""
    xp = namespace(X, Y)
    b, k, _ = X.shape
    cache = parametrization.cache(X, low)
    patterns = softmax(parametrization.logits(X, low, cache), axis=-1)
    values = parametrization.values(X, low, cache)  # (b, m, k, r)
    design = _design(patterns, values, intercept)
    if fixed is not None:
        design = xp.concat([design, xp.astype(fixed, design.dtype)], axis=1)
    target = xp.astype(xp.reshape(Y, (b * k, Y.shape[2])), X.dtype, copy=False)
    return {
        "cache": cache,
        "patterns": patterns,
        "values": values,
        "design": design,
        "target": target,
        "gram": xp.astype(design.T @ design, xp.float64),
        "rhs": xp.astype(design.T @ target, xp.float64),
        "zero": _sum_squares(xp, target),
    }


def _part_backward(X, low, parametrization, state, coef):
    """A part's squared residual and loss gradient (unscaled) at the batch's O."""
    xp = namespace(X, low)
    b, k, _ = X.shape
    values, patterns = state["values"], state["patterns"]
    m, r = values.shape[1], values.shape[3]
    residual = state["design"] @ coef - state["target"]
    # the envelope gradient: the loss's derivative in the design is residual O^T
    d_features = xp.permute_dims(
        xp.reshape(residual @ coef[: m * r, :].T, (b, k, m, r)), (0, 2, 1, 3)
    )
    d_patterns = xp.matmul(d_features, xp.matrix_transpose(values))
    d_values = xp.matmul(xp.matrix_transpose(patterns), d_features)
    d_logits = patterns * (
        d_patterns - xp.sum(patterns * d_patterns, axis=-1, keepdims=True)
    )
    gradient = parametrization.vjp(X, low, d_logits, d_values, state["cache"])
    return _sum_squares(xp, residual), gradient


def _least_squares(design, target):
    """``argmin_O ||design O - target||``: a float64 Cholesky solve of the (ridged)
    Gram matrix, in the design's dtype (least squares when that is not definite)."""
    xp = namespace(design, target)
    gram = xp.astype(design.T @ design, xp.float64)
    rhs = xp.astype(design.T @ target, xp.float64)
    return xp.astype(_solve_gram(gram, rhs, lambda: (design, target)), design.dtype)


def _solve_gram(gram, rhs, system):
    """``gram^{-1} rhs`` in float64 by Cholesky, ``gram`` ridged by _BATCH_RIDGE
    of its mean diagonal; when that is not definite (two heads with the same
    columns, in single precision), the minimum-norm least-squares solution of
    ``system() = (design, target)`` instead."""
    xp = namespace(gram, rhs)
    p = gram.shape[0]
    # the ridge as a 0-d array (no host sync); adding it times the identity
    # changes the diagonal only (x + 0.0 is x)
    mean = xp.linalg.trace(gram) / p
    ridge = _BATCH_RIDGE * _at_least(mean, np.finfo(float).tiny)
    gram = gram + ridge * xp.eye(p, dtype=gram.dtype, device=device(gram))
    # on torch: no host check of the factor at every step (a GPU's host waited
    # for it: 154 checks in a small fit's search); where the ridged Gram is
    # still not definite, a larger ridge instead of the least squares below
    unchecked = cholesky_solve_unchecked(xp, gram, rhs, _FALLBACK_RIDGE * mean)
    if unchecked is not None:
        return unchecked
    try:
        return cholesky_solve(xp, gram, rhs)
    except np.linalg.LinAlgError:
        design, target = system()
        return lstsq(xp, xp.astype(design, xp.float64), xp.astype(target, xp.float64))


def minibatch_search(
    X,
    Y,
    params,
    parametrization,
    *,
    intercept_direction=None,
    sample_weight=None,
    batch_size=_BATCH_SIZE,
    learning_rate=_LEARNING_RATE,
    max_steps=5000,
    check_every=50,
    stop_residual=2e-2,
    patience=3,
    decay=0.3,
    n_decays=3,
    n_replacements=2,
    plateau_steps="auto",
    dtype=np.float32,
    n_jobs=1,
    fixed_columns=None,
    random_state=None,
    verbose=0,
    memory=None,
):
    """Adam on the reduced loss of random batches, until a polish can take over.

    Every ``check_every`` steps the relative residual (the root of the reduced loss
    over the loss of predicting zero) of one fixed evaluation set of
    ``batch_size`` examples is measured.  When it has not fallen by 1 % for
    ``patience`` checks in a row, the step size is cut by ``decay`` (Adam's steps
    hover at a noise floor set by the step size), at most ``n_decays`` times.  The
    search stops when the residual is at most ``stop_residual``, when it stalls
    after the last cut, or after ``max_steps`` steps.  The parameters of the best
    check are returned.  No cut is made on the start's plateau (the residual not
    yet below half the start's) in the first ``plateau_steps`` steps: a random
    start's residual stalls there for a number of steps that grows as ``m d^2``,
    and a smaller step size only lengthens the stall.

    A search that stalls above ``stop_residual`` has often left a real head
    unfound, with one learned head doing little (12 heads of all-MiniLM-L6-v2).
    Then, up to ``n_replacements`` times, the head whose removal raises the
    evaluation residual least (:func:`head_contributions`) is replaced when it
    explains less than all heads leave unexplained (its removal raises the
    residual by less than a factor sqrt(2)): one head
    is searched alone on what the other heads leave unexplained (a one-head
    search, which finds its head reliably), put in its place, and the search of
    all heads resumes from there at ``decay`` times the step size.  A
    replacement is kept only when the resumed search ends lower.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    params : ndarray of shape (p,)
        Start (:class:`FactoredHeads` parameters).
    parametrization : FactoredHeads
    intercept_direction : ndarray of shape (d,) or None
        See :func:`batch_loss_gradient`.
    sample_weight : ndarray of shape (n,) or None
        Batches are drawn with probabilities proportional to the weights (with
        replacement), so each batch's loss estimates the weighted loss.
    batch_size : int, default=256
        Examples per step (at most n); each batch needs more tokens ``batch_size *
        k`` than eliminated columns ``m r + 1``.
    learning_rate : float, default=0.1
        Adam's step size relative to the root mean square of the start's
        parameters (Adam moves each parameter by about its step size: this way
        the search does not depend on the parameters' scale).
    max_steps : int, default=5000
    check_every : int, default=50
    stop_residual : float, default=2e-2
    patience : int, default=3
    decay : float, default=0.3
    n_decays : int, default=3
    n_replacements : int, default=2
        Weakest-head replacements after a stalled search (0: none; nothing is
        replaced for one head, for query heads that share key heads, when the
        search reaches ``stop_residual``, or when every head explains more than
        what is left).  Causal and rotary heads are replaced by heads masked and
        rotated as they are.
    plateau_steps : int or "auto", default="auto"
        Steps in which the step size is not cut while the residual is above
        half the start's; ``"auto"``: ``ceil(7e-4 m d^2)`` (``m`` heads, ``d``
        features: 313 steps for 12 heads at d = 193, 4982 at d = 769, twice the
        plateau measured on planted layers); 0: the plain stall rule.
    dtype : dtype, default=numpy.float32
        Precision of the products.
    n_jobs : int, default=1
        Threads for each batch (see :func:`batch_loss_gradient`).
    fixed_columns : ndarray of shape (n, k, c) or None
        Per-token columns eliminated with the output factors on every batch (see
        :func:`batch_loss_gradient`); e.g. the other heads' shares of a one-head
        problem (:func:`skattn.solvers.search_head`).
    random_state : int, RandomState instance or None
        The batches.
    memory : StageMemory or None
        Keeps each Adam run's state (its point, moments, best point, counters
        and the random generator's state) every ``memory.iterate_interval``
        seconds at a check, and at its end: run again with the same arguments
        (``random_state`` where the interrupted run's was), an interrupted
        search goes on from its last kept check and ends as the uninterrupted
        one does (a search of hours on 2 cores otherwise starts again at step
        0 after each interruption).
    verbose : int, default=0
        1 prints one line per check.

    Returns
    -------
    params : ndarray of shape (p,)
    info : dict
        ``n_steps``, ``n_decays`` (step-size cuts), ``residuals`` (relative
        residual at each check, the start first), ``residual`` (of the returned
        parameters), ``stop_reason`` (``"residual"``, ``"no_decrease"`` or
        ``"max_iter"``) and ``replacements`` (one dict per replacement tried:
        ``head``, ``residual_without`` the head, ``residual_before``,
        ``residual_after`` the resumed search, ``kept``).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers import FactoredHeads
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(2000, 4, 6))
    >>> par = FactoredHeads(2, 6, 2)
    >>> truth = rng.normal(size=par.size) / 2
    >>> Q, K, V = par.factors(truth)
    >>> Y = forward(X, par.attention(truth), V @ rng.normal(size=(2, 2, 6)))
    >>> p, info = minibatch_search(X, Y, rng.normal(size=par.size) / 2, par,
    ...                            batch_size=64, random_state=0)
    >>> bool(info["residual"] < info["residuals"][0] / 2)
    True
    """
    xp = namespace(X, Y)
    rng = check_random_state(random_state)
    n = X.shape[0]
    batch_size = min(int(batch_size), n)
    dtype = _xp_dtype(xp, dtype)  # the products' precision, in X's namespace
    probabilities = None  # the batches are drawn on the host (same in every namespace)
    if sample_weight is not None:
        probabilities = np.asarray(to_numpy(sample_weight), dtype=float)
        probabilities = probabilities / probabilities.sum()

    def draw(size=batch_size):
        return np.sort(
            rng.choice(n, size=size, replace=probabilities is not None, p=probabilities)
        )

    def batch(A, rows):
        """Rows ``rows`` of ``A`` in the products' precision (None for None)."""
        return None if A is None else xp.astype(_take(xp, A, rows), dtype, copy=False)

    ahead = {"rows": None, "copy": None, "used": 0}

    def draw_steps(count):
        """The rows of ``count`` training steps, drawn as the steps would draw
        them one by one; off numpy, copied to X's device at once (a copy from
        the host blocks it: once a step each for X, Y and the fixed columns
        before, 1380 waits in issue 49's search), and with them the rows of the
        next ``_DRAWN_AHEAD - 1`` check intervals, drawn by the generator with
        its state put back after: each interval's rows are still drawn when
        its steps come, and the copy made ahead is used where they are the
        same (unless the generator drew something else between: a
        replacement's start).  The same rows, the same generator's state."""
        rows = np.stack([draw() for _ in range(count)])
        if is_numpy(xp):
            return rows
        used, block = ahead["used"], ahead["rows"]
        if (
            block is not None
            and used + count <= block.shape[0]
            and np.array_equal(block[used : used + count], rows)
        ):
            ahead["used"] = used + count
            return ahead["copy"][used : used + count, ...]
        state = _rng_state(rng)
        later = [draw() for _ in range((_DRAWN_AHEAD - 1) * check_every)]
        _set_rng_state(rng, state)
        block = np.concatenate([rows, np.stack(later)]) if later else rows
        ahead.update(rows=block, copy=_device_rows(xp, block, device(X)), used=count)
        return ahead["copy"][:count, ...]

    evaluation = _device_rows(xp, draw(), device(X))  # one copy for the three
    X_eval, Y_eval = batch(X, evaluation), batch(Y, evaluation)
    fixed = to_namespace(fixed_columns, xp, device(X))
    F_eval = batch(fixed, evaluation)

    def check(p):
        loss, _, zero = batch_loss_gradient(
            X_eval, Y_eval, p, parametrization, intercept_direction, n_jobs, F_eval
        )
        return math.sqrt(loss / zero) if zero > 0 else 0.0

    params = xp.asarray(
        to_namespace(params, xp, device(X)), dtype=xp.float64, copy=True
    )
    step_size = learning_rate * math.sqrt(float(xp.mean(params**2)))
    if plateau_steps == "auto":
        plateau_steps = math.ceil(
            _PLATEAU_STEPS * parametrization.n_heads * parametrization.n_features**2
        )
    best_residual = check(params)
    residuals = [best_residual]
    if verbose:
        print(f"minibatch search: start residual {best_residual:.4g}")

    if memory is not None and not memory.enabled:
        memory = None

    def adam(params, best_residual, step_size, max_steps, plateau=0):
        """Adam with step-size cuts (none on the start's plateau in the first
        ``plateau`` steps): ``(best, residual, steps, cuts, reason)``; its state
        kept in ``memory`` (see the parameter), and read back from there."""
        plateau_level = _PLATEAU_EXIT * best_residual
        best = _copy(xp, params)
        first = xp.zeros_like(params)
        second = xp.zeros_like(params)
        stalled, n_cuts, stop_reason, step, t = 0, 0, "max_iter", 0, 0
        name = None if memory is None else memory.next_name("adam")
        if name is not None:
            found, state = memory.load(name)
            if found:
                memory.reused.append(name)
                _set_rng_state(rng, state["rng"])
                residuals[:] = state["residuals"]
                bar.update(state["step"])
                if state["finished"]:
                    found_best, *rest = state["result"]
                    return (to_namespace(found_best, xp, device(X)), *rest)
                params, first, second, best = (
                    to_namespace(state[key], xp, device(X))
                    for key in ("params", "first", "second", "best")
                )
                best_residual, step_size = state["best_residual"], state["step_size"]
                stalled, n_cuts = state["stalled"], state["n_cuts"]
                stop_reason, step, t = state["stop_reason"], state["step"], state["t"]
        last_kept = time.monotonic()

        def keep(finished=False, result=None):
            """Keep the run's state (arrays on the host) in ``memory``."""
            if result is not None:
                result = (to_numpy(result[0]), *result[1:])
            state = {
                "params": to_numpy(params),
                "first": to_numpy(first),
                "second": to_numpy(second),
                "best": to_numpy(best),
                "best_residual": best_residual,
                "step_size": step_size,
                "stalled": stalled,
                "n_cuts": n_cuts,
                "stop_reason": stop_reason,
                "step": step,
                "t": t,
                "rng": _rng_state(rng),
                "residuals": list(residuals),
                "finished": finished,
                "result": result,
            }
            memory.save(name, state)

        planned, used = None, 0
        while step < max_steps and best_residual > stop_residual:
            if planned is None or used == planned.shape[0]:  # to the next check
                planned = draw_steps(
                    min(check_every - step % check_every, max_steps - step)
                )
                used = 0
            rows, used = planned[used, ...], used + 1
            _, gradient, _ = batch_loss_gradient(
                batch(X, rows),
                batch(Y, rows),
                params,
                parametrization,
                intercept_direction,
                n_jobs,
                batch(fixed, rows),
                losses=False,
            )
            step, t = step + 1, t + 1
            first = _BETA1 * first + (1 - _BETA1) * gradient
            second = _BETA2 * second + (1 - _BETA2) * gradient * gradient
            params -= (
                step_size
                * (first / (1 - _BETA1**t))
                / (xp.sqrt(second / (1 - _BETA2**t)) + _EPSILON)
            )
            if step % check_every:
                continue
            residual = check(params)
            residuals.append(residual)
            bar.update(check_every)
            bar.set_postfix_str(f"residual {residual:.3g}")
            if verbose:
                print(f"minibatch search: step {step} residual {residual:.4g}")
            if residual < (1 - _PROGRESS) * best_residual:
                stalled = 0
            else:
                stalled += 1
            if residual < best_residual:
                best, best_residual = _copy(xp, params), residual
            # no cut on the start's plateau: a cut would lengthen it
            on_plateau = step < plateau and best_residual > plateau_level
            if stalled >= patience and not on_plateau:
                if n_cuts == n_decays:
                    stop_reason = "no_decrease"
                    break
                n_cuts, stalled = n_cuts + 1, 0
                step_size *= decay
                # Adam afresh from the best point: its moments, grown on the large
                # early gradients, would shrink the smaller steps further
                params, first, second, t = _copy(xp, best), 0 * first, 0 * second, 0
            if name is not None and time.monotonic() - last_kept >= (
                memory.iterate_interval
            ):
                keep()
                last_kept = time.monotonic()
        if best_residual <= stop_residual:
            stop_reason = "residual"
        result = best, best_residual, step, n_cuts, stop_reason
        if name is not None:
            keep(finished=True, result=result)
        return result

    # one bar for the search, its replacements' steps included: open-ended, as
    # the search stops at its residual or when it stalls, and replacements add
    # steps
    with stage_bar("search", None, "step") as bar:
        best, best_residual, n_steps, n_cuts, stop_reason = adam(
            params, best_residual, step_size, max_steps, int(plateau_steps)
        )
        replacements = []
        while (
            len(replacements) < n_replacements
            and stop_reason == "no_decrease"
            and parametrization.n_heads > 1
            and parametrization.n_kv_heads == parametrization.n_heads
            and n_steps < max_steps
        ):
            residual, contributions = head_contributions(
                X_eval, Y_eval, best, parametrization, intercept_direction
            )
            head = int(xp.argmin(contributions))
            without = float(contributions[head])
            if without >= _REPLACE_BELOW * residual:
                break  # every head explains more than is left: nothing to replace
            candidate = _replace_head(
                X,
                Y,
                best,
                parametrization,
                head,
                rows=draw(min(n, _REPLACEMENT_BATCHES * batch_size)),
                intercept_direction=intercept_direction,
                batch_size=batch_size,
                learning_rate=learning_rate,
                random_state=rng,
                dtype=dtype,
                n_jobs=n_jobs,
            )
            start_residual = check(candidate)
            if verbose:
                print(
                    f"minibatch search: replacing head {head} (residual without it "
                    f"{without:.4g}); all heads with the new one {start_residual:.4g}"
                )
            searched, residual, steps, cuts, reason = adam(
                candidate, start_residual, decay * step_size, max_steps - n_steps
            )
            n_steps, n_cuts = n_steps + steps, n_cuts + cuts
            kept = residual < best_residual
            replacements.append(
                {
                    "head": int(head),
                    "residual_without": float(without),
                    "residual_before": float(best_residual),
                    "residual_after": float(residual),
                    "kept": bool(kept),
                }
            )
            if not kept:
                break
            best, best_residual, stop_reason = searched, residual, reason
    info = {
        "n_steps": n_steps,
        "n_decays": n_cuts,
        "residuals": residuals,
        "residual": best_residual,
        "stop_reason": stop_reason,
        "replacements": replacements,
    }
    return best, info


def head_contributions(X, Y, params, parametrization, intercept_direction=None):
    """How much each head explains: the relative residual without it.

    The relative residual of the batch (output factors and intercept eliminated,
    as :func:`batch_loss_gradient`), and for each head that of the design
    without the head's columns.  A head whose removal hardly raises the residual
    contributes little: after a stalled search, usually a head that found no real
    one.

    Parameters
    ----------
    X : ndarray of shape (b, k, d)
    Y : ndarray of shape (b, k, d_out)
    params : ndarray of shape (p,)
    parametrization : FactoredHeads
    intercept_direction : ndarray of shape (d,) or None

    Returns
    -------
    residual : float
        ``||A O - Y|| / ||Y||`` at the best ``O``.
    without : ndarray of shape (m,)
        The same with head ``i``'s columns left out of ``A``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers import FactoredHeads
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 4, 6))
    >>> par = FactoredHeads(2, 6, 2)
    >>> p = rng.normal(size=par.size)
    >>> Q, K, V = par.factors(p)
    >>> O = rng.normal(size=(2, 2, 6))
    >>> O[1] *= 0.01  # head 1 hardly reaches the outputs
    >>> Y = forward(X, par.attention(p), V @ O)
    >>> residual, without = head_contributions(X, Y, p, par)
    >>> bool(residual < 1e-8), int(np.argmin(without))
    (True, 1)
    """
    xp = namespace(X, Y)
    b, k, _ = X.shape
    params = to_namespace(params, xp, device(X))
    if not is_numpy(xp):
        # numpy promotes float32 tokens and float64 parameters in each product;
        # torch does not mix them
        common = xp.result_type(X.dtype, params.dtype)
        X, params = xp.astype(X, common, copy=False), xp.astype(params, common)
    cache = parametrization.cache(X, params)
    patterns = softmax(parametrization.logits(X, params, cache), axis=-1)
    values = parametrization.values(X, params, cache)
    m, r = values.shape[1], values.shape[3]
    design = _design(patterns, values, intercept_direction is not None)
    target = xp.astype(xp.reshape(Y, (b * k, Y.shape[2])), design.dtype, copy=False)
    # the design without head i's columns (a copy, as numpy's fancy index was)
    parts = [_drop_block(xp, design, i * r, (i + 1) * r, axis=1) for i in range(m)]
    parts.append(_columns(xp, design, np.arange(design.shape[1]), axis=1))
    tiny = float(np.finfo(float).tiny)
    if is_numpy(xp):
        norm = max(_norm(xp, target), tiny)
        relative = [
            _norm(xp, part @ _least_squares(part, target) - target) / norm
            for part in parts
        ]
        return relative[-1], np.asarray(relative[:-1], dtype=np.float64)
    # off numpy every norm stays on the device, and the layer's is read once
    misfits = xp.stack(
        [
            xp.linalg.vector_norm(part @ _least_squares(part, target) - target)
            for part in parts
        ]
    )
    relative = xp.astype(
        misfits / xp.clip(xp.linalg.vector_norm(target), min=tiny), xp.float64
    )
    return float(relative[-1]), relative[:-1]


def _replace_head(
    X,
    Y,
    params,
    parametrization,
    head,
    *,
    rows,
    intercept_direction,
    batch_size,
    learning_rate,
    random_state,
    dtype,
    n_jobs=1,
):
    """``params`` with head ``head`` searched afresh on what the others leave.

    On the sequences ``rows``, the other heads' design (and the intercept) is
    fitted to ``Y`` by least squares; one head is searched from a random start
    on the residual, with no intercept (the residual has none left), and takes
    ``head``'s place.
    """
    xp = namespace(X, Y)
    rng = random_state
    dtype = _xp_dtype(xp, dtype)
    Xr = xp.astype(_take(xp, X, rows), dtype, copy=False)
    Yr = xp.astype(_take(xp, Y, rows), dtype, copy=False)
    b, k, _ = Xr.shape
    low = xp.astype(to_namespace(params, xp, device(X)), dtype)
    cache = parametrization.cache(Xr, low)
    patterns = softmax(parametrization.logits(Xr, low, cache), axis=-1)
    values = parametrization.values(Xr, low, cache)
    design = _design(
        _drop_block(xp, patterns, head, head + 1, axis=1),
        _drop_block(xp, values, head, head + 1, axis=1),
        intercept_direction is not None,
    )
    target = xp.reshape(Yr, (b * k, Yr.shape[2]))
    rest = xp.reshape(target - design @ _least_squares(design, target), Yr.shape)
    return _search_alone(
        Xr,
        rest,
        params,
        parametrization,
        head,
        rng,
        batch_size=batch_size,
        learning_rate=learning_rate,
        dtype=dtype,
        n_jobs=n_jobs,
    )[0]


def _search_alone(X, Y, params, parametrization, head, random_state, **options):
    """``params`` with head ``head`` replaced by one head searched from a random
    start on ``(X, Y)`` (:func:`minibatch_search` with ``options``, no
    replacements): ``(params, info)``, ``info`` the search's."""
    xp = namespace(X, Y)
    rng = random_state
    d, r = parametrization.n_features, parametrization.rank
    # one head of the same kind, masked and rotated as the others
    single = type(parametrization)(
        1,
        d,
        r,
        causal=parametrization.causal,
        rope_theta=parametrization.rope_theta,
        rope_layout=parametrization.rope_layout,
    )
    # the start drawn and factored on the host, then moved: the same start (and
    # the same generator state) in every namespace
    start = single.from_attention(
        random_attention(1, d, rng), rng.normal(scale=1.0 / d, size=(1, d, r))
    )
    found, info = minibatch_search(
        X,
        Y,
        to_namespace(start, xp, device(X)),
        single,
        n_replacements=0,
        random_state=rng,
        **options,
    )
    return _with_head(xp, parametrization, params, single, found, head), info


def _with_head(xp, parametrization, params, single, found, head):
    """``params`` with head ``head``'s factors those of the one-head ``found``
    (``single``'s parameters), a new flat vector."""
    params = to_namespace(params, xp, device(found))
    factors = [_copy(xp, factor) for factor in parametrization.factors(params)]
    for factor, new in zip(factors, single.factors(found), strict=True):
        factor[head, ...] = new[0, ...]
    return xp.concat([xp.reshape(factor, (-1,)) for factor in factors])
