"""Trust-region least squares for a batch of independent heads: each head by
the steps :func:`~._trf.trf` takes alone, all of them by the one core
(:func:`~._trf.trust_region_steps`), every scalar on the device.

A :class:`~skattn.solvers.kernels._head_batch.HeadBatch` holds ``h`` problems of
the same shape (one head each): vectors have a head axis (``(h, p)``
parameters, ``(h, N)`` residuals), and its products act on every head at once.
:func:`batched_least_squares` gives the core the batch in the variables of each
head's right preconditioner (``LowRank``'s scaled metric at the start), the
coefficients of each head at its end, and the batch's shrinking as heads stop
(:meth:`HeadBatch.select`), so that the products shrink with it.  On a GPU the
one-head problems, each too small to fill the device, were bound by launches
and host reads one after another; together they share both.

A rejected trial retries with a quarter of the radius in the same 2-D span,
without a new solve.  (A Levenberg-Marquardt damping in its place solved afresh
after each rejected step: on heads far from their minimum, issue 63's, it spent
five times the products and three times the operations of the heads one at a
time, and left heads unconverged that converged alone.)
"""

import numpy as np

from ..kernels._parametrization import _inverse_root
from ._trf import trust_region_steps

__all__ = ["batched_least_squares"]

_EPS = float(np.finfo(float).eps)


def _preconditioner(xp, params, d, r):
    """LowRank's scaled metric (``Q_i = Z^Q_i C^K_i``, ``K_i = Z^K_i C^Q_i``)
    of every head at ``params`` ``(h, 2 d r)``: ``(apply, inverse)``, each
    ``(h, 2 d r) -> (h, 2 d r)`` (``apply`` is its own transpose)."""
    h = params.shape[0]
    Q = xp.reshape(params[:, : d * r], (h, d, r))
    K = xp.reshape(params[:, d * r :], (h, d, r))
    c_k, c_k_inv = _inverse_root(xp.matrix_transpose(K) @ K)
    c_q, c_q_inv = _inverse_root(xp.matrix_transpose(Q) @ Q)

    def mapped(z, left, right):
        zq = xp.reshape(z[:, : d * r], (-1, d, r)) @ left
        zk = xp.reshape(z[:, d * r :], (-1, d, r)) @ right
        return xp.concat(
            [xp.reshape(zq, (zq.shape[0], -1)), xp.reshape(zk, (zk.shape[0], -1))],
            axis=1,
        )

    def apply(z, keep=None):
        if keep is None:
            return mapped(z, c_k, c_q)
        return mapped(z, xp.take(c_k, keep, axis=0), xp.take(c_q, keep, axis=0))

    def inverse(p):
        return mapped(p, c_k_inv, c_q_inv)

    return apply, inverse


def batched_least_squares(
    problem,
    params,
    *,
    max_nfev=20,
    xtol=1e-10,
    ftol=_EPS,
    gtol=_EPS,
    inner_maxiter=None,
    check_every=8,
):
    """Minimise ``1/2 ||r_i(p_i)||^2`` for every head of ``problem`` at once,
    each head by the steps :func:`~._trf.trf` takes alone.

    Per head, in the variables of its right preconditioner (``LowRank``'s
    scaled metric at the start): the Gauss-Newton step by CGLS (LSMR's tests)
    damped by scipy's ``regularize`` term, the 2-D trust-region problem in the
    span of it and the gradient, the radius updated by the ratio of actual to
    predicted decrease, scipy's stopping tests.  A rejected trial retries with
    a smaller radius in the same 2-D span, without a new CGLS solve (a head
    far from its minimum costs two products a retry, not a solve: issue 63's
    heads that do not converge).  Heads with a new Jacobian solve their steps
    together; the others are masked in the solve.  The host reads the heads'
    flags once a trial, and CGLS's tests every ``check_every`` iterations.

    Parameters
    ----------
    problem : HeadBatch
    params : array of shape (h, 2 d r)
        The heads' starts (rows in ``problem``'s namespace).
    max_nfev : int, default=20
        Residual evaluations per head (the start's included, as scipy counts).
    xtol, ftol, gtol : float
        scipy's relative step, relative decrease and gradient tolerances.
    inner_maxiter : int or None
        CGLS iterations per step (``None``: ``min(2 d r, 200)``).
    check_every : int, default=8
        CGLS iterations between the host's looks (:func:`batched_cgls`).

    Returns
    -------
    params : array of shape (h, 2 d r)
    coefficients : array of shape (h, w, r)
        The eliminated coefficients at ``params``.
    info : dict
        Per head (lists of Python numbers): ``n_iter`` (accepted steps plus
        one, scipy's ``njev``), ``n_evaluations``, ``loss``, ``status``
        (scipy's codes: 0 ``max_nfev``, 1 gradient, 2 ``ftol``, 3 ``xtol``,
        4 both); ``n_products`` (batched products), ``head_products`` (per
        head, the products it took part in: :attr:`HeadBatch.head_products`),
        ``host_reads``, ``inner_iterations`` (CGLS iterations, all steps).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn.solvers.kernels._head_batch import HeadBatch
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 4, 3))
    >>> Q, K = rng.normal(size=(2, 2, 3, 1)); W = rng.normal(size=(2, 3, 2))
    >>> targets = np.stack([forward(X, Q[i:i + 1] @ K[i:i + 1].transpose(0, 2, 1),
    ...                             W[i:i + 1]) for i in range(2)], axis=2)
    >>> truth = np.concatenate([Q.reshape(2, -1), K.reshape(2, -1)], axis=1)
    >>> start = truth + 0.05 * rng.normal(size=truth.shape)
    >>> batch = HeadBatch(X, targets, None, None, head_rank=1)
    >>> p, coef, info = batched_least_squares(batch, start)
    >>> [loss < 1e-20 for loss in info["loss"]]
    [True, True]
    """
    xp = problem._xp
    h0 = problem.n_heads
    d, r = problem.n_features, problem.rank
    x_all = xp.asarray(params, dtype=xp.float64, copy=True)
    apply, inverse = _preconditioner(xp, x_all, d, r)
    if inner_maxiter is None:
        inner_maxiter = min(x_all.shape[1], 200)
    heads = _Heads(problem, apply, h0)
    out = trust_region_steps(
        xp,
        heads,
        inverse(x_all),
        max_nfev=max_nfev,
        xtol=xtol,
        ftol=ftol,
        gtol=gtol,
        inner_maxiter=inner_maxiter,
        check_every=check_every,
    )
    info = {
        "n_iter": out["njev"],
        "n_evaluations": out["nfev"],
        "loss": out["cost"],
        "status": out["status"],
        "n_products": problem.n_products,
        "head_products": list(problem.head_products),
        "host_reads": out["host_reads"],
        "inner_iterations": out["inner_iterations"],
    }
    return xp.stack(heads.x), xp.stack(heads.coefficients), info


class _Heads:
    """A :class:`HeadBatch` in its heads' preconditioned variables ``z`` (``p =
    M z``), as :func:`~._trf.trust_region_steps` takes it: each head's ``p`` and
    coefficients kept as it stops, the batch shrunk to the heads going on."""

    def __init__(self, batch, apply, h):
        self.batch, self.apply = batch, apply
        self.alive = list(range(h))  # the heads in the batch: original indices
        self.index = None  # the same as a device array (None: all)
        self.x, self.coefficients = [None] * h, [None] * h

    def residual(self, z):
        return self.batch.residual(self.apply(z, self.index))

    def products(self, z, current):
        if not current:  # the batch's point made z's (after a rejected trial)
            self.batch.evaluate(self.apply(z, self.index))
        batch, apply = self.batch, self.apply
        return (
            lambda v: batch.matvec(apply(v, self.index)),
            lambda u: apply(batch.rmatvec(u), self.index),
        )

    def finished(self, positions, z, current):
        x = self.apply(z, self.index)
        if not current:
            self.batch.evaluate(x)
        for j in positions:
            i = self.alive[j]
            self.x[i] = x[j, ...]
            self.coefficients[i] = self.batch.coefficients[j, ...]

    def leave(self, keep):
        xp = self.batch._xp
        self.batch.select(keep)
        self.alive = [self.alive[j] for j in keep]
        self.index = xp.asarray(
            np.asarray(self.alive, dtype=np.int64), device=self.batch._device
        )
