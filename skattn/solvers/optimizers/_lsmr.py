"""LSMR (Fong & Saunders 2011) in any array namespace: ``min ||A x - b||^2 +
damp^2 ||x||^2`` from the products ``A v`` and ``A^T u`` only.

scipy's ``scipy.sparse.linalg.lsmr`` is numpy-only; this is the same algorithm,
step for step and in the same floating-point operations, written against the array
namespace ``xp`` of ``b``: the vectors (``u``, ``v``, ``h``, ``hbar``, ``x``) stay
in ``xp`` on ``b``'s device, and the scalar recurrences (Givens rotations, norm
estimates, stopping tests) run on the host in Python floats.  With numpy it makes
scipy's operations (the same BLAS dot products and the same scalar arithmetic), so
that :mod:`skattn.solvers.optimizers._trf` follows scipy's ``least_squares``; the
tests hold it to scipy's solution and documented stopping behaviour, not to one
scipy version's iterates.
"""

import math
from typing import NamedTuple

import numpy as np

from ...utils._array_api import device

__all__ = ["lsmr", "LsmrResult"]


class LsmrResult(NamedTuple):
    """What :func:`lsmr` returns (the tuple of ``scipy.sparse.linalg.lsmr``).

    ``istop``: 0 ``x = 0`` is exact, 1 ``A x - b`` is small given ``atol``,
    ``btol``, 2 the least-squares solution is good enough given ``atol``, 3 the
    condition estimate exceeded ``conlim``, 4-6 the same as 1-3 at machine
    precision, 7 ``maxiter`` iterations.
    """

    x: object
    istop: int
    itn: int
    normr: float
    normar: float
    norma: float
    conda: float
    normx: float


def _norm(v):
    """``||v||_2`` on the host: ``sqrt(v . v)``, the dot product that
    ``numpy.linalg.norm`` takes for a vector (BLAS ``ddot``), so that numpy's bits
    are scipy's.  One scalar copied to the host, as a numpy ``float64``: the
    recurrences then divide as scipy's do (``inf``/``nan`` and a warning, not
    ``ZeroDivisionError``)."""
    return np.sqrt(np.float64(float(v @ v)))


def _result(x, istop, itn, *scalars):
    """The :class:`LsmrResult`, its scalars as Python numbers."""
    return LsmrResult(x, int(istop), int(itn), *(float(s) for s in scalars))


def _sign(a):
    """``numpy.sign`` of a Python float (``+0.0`` for both zeros, NaN for NaN)."""
    if a > 0:
        return 1.0
    if a < 0:
        return -1.0
    return 0.0 if a == 0 else math.nan


def _sym_ortho(a, b):
    """Stable Givens rotation ``(c, s, r)`` with ``[c s; -s c] [a; b] = [r; 0]``
    (S.-C. Choi's SymOrtho, as in scipy's ``lsqr``)."""
    if b == 0:
        return _sign(a), 0, abs(a)
    if a == 0:
        return 0, _sign(b), abs(b)
    if abs(b) > abs(a):
        tau = a / b
        s = _sign(b) / math.sqrt(1 + tau * tau)
        return s * tau, s, b / s
    tau = b / a
    c = _sign(a) / math.sqrt(1 + tau * tau)
    return c, c * tau, a / c


def lsmr(
    xp,
    matvec,
    rmatvec,
    b,
    *,
    damp=0.0,
    atol=1e-6,
    btol=1e-6,
    conlim=1e8,
    maxiter=None,
    shape=None,
):
    """Least-squares solution of ``A x = b`` (damped) by LSMR, from products.

    Parameters
    ----------
    xp : namespace
        The array namespace of ``b`` and of the products.
    matvec, rmatvec : callable
        ``v -> A v`` (``(n,) -> (m,)``) and ``u -> A^T u`` (``(m,) -> (n,)``), in
        ``xp``; they must return new arrays (LSMR updates its vectors in place).
    b : array of shape (m,)
    damp : float, default=0.0
        Tikhonov damping: minimises ``||A x - b||^2 + damp^2 ||x||^2``.
    atol, btol : float, default=1e-6
        Stopping tolerances on the relative residual and on ``||A^T r||``
        (see ``scipy.sparse.linalg.lsmr``).
    conlim : float, default=1e8
        Stop when the estimate of ``cond(A)`` exceeds this (0: never).
    maxiter : int or None
        Iteration cap (``None``: ``min(m, n)``).  Each iteration takes one
        ``matvec`` and one ``rmatvec``.
    shape : tuple (m, n) or None
        The shape of ``A``; ``None``: ``n`` is read from the first ``rmatvec``
        (when ``b = 0`` that costs one product).

    Returns
    -------
    LsmrResult
        ``(x, istop, itn, normr, normar, norma, conda, normx)`` as scipy's ``lsmr``;
        ``x`` in ``xp`` on ``b``'s device, the rest Python numbers.

    Notes
    -----
    The recurrences need three scalars a iteration on the host (``||u||``,
    ``||v||`` and ``||x||``, one after the other since each vector is scaled by
    the previous norm): three small device-to-host copies an iteration, next to
    two Jacobian products that are each a pass over the data.  The scalars meet
    the vectors as Python floats (array-api-strict takes no numpy scalars).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.utils._array_api import namespace
    >>> A = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    >>> b = np.array([1.0, 2.0, 2.0])
    >>> result = lsmr(namespace(b), lambda v: A @ v, lambda u: A.T @ u, b)
    >>> np.round(result.x, 6).tolist(), result.istop
    ([1.0, 1.0], 1)
    """
    m = b.shape[0]
    u = b
    normb = _norm(b)
    beta = normb
    v = None
    if beta > 0:
        u = float(1 / beta) * u
        v = rmatvec(u)
        alpha = _norm(v)
    else:
        alpha = 0
    if shape is not None:
        n = shape[1]
    else:
        n = (rmatvec(b) if v is None else v).shape[0]
    if maxiter is None:
        maxiter = min(m, n)
    dtype = b.dtype if v is None else xp.result_type(b.dtype, v.dtype)
    x = xp.zeros(n, dtype=dtype, device=device(b))
    if v is None:
        v = xp.zeros(n, dtype=dtype, device=device(b))
    if alpha > 0:
        v = float(1 / alpha) * v

    itn = 0
    zetabar = alpha * beta
    alphabar = alpha
    rho = rhobar = cbar = 1
    sbar = 0
    h = xp.asarray(v, copy=True)
    hbar = xp.zeros(n, dtype=dtype, device=device(b))
    # the rotations of the least-squares problem and of the residual estimate
    betadd = beta
    betad = 0
    rhodold = 1
    tautildeold = thetatilde = zeta = d = 0
    norma2 = alpha * alpha
    maxrbar, minrbar = 0, 1e100
    norma = math.sqrt(norma2)
    conda = 1
    normx = 0
    istop = 0
    ctol = 1 / conlim if conlim > 0 else 0
    normr = beta
    normar = alpha * beta
    if normar == 0 or normb == 0:  # x = 0 solves it
        return _result(x, istop, itn, normr, normar, norma, conda, normx)

    while itn < maxiter:
        itn += 1
        # bidiagonalization: beta u = A v - alpha u, alpha v = A^T u - beta v
        u *= float(-alpha)
        u += matvec(v)
        beta = _norm(u)
        if beta > 0:
            u *= float(1 / beta)
            v *= float(-beta)
            v += rmatvec(u)
            alpha = _norm(v)
            if alpha > 0:
                v *= float(1 / alpha)

        # rotation that eliminates the damping, then the plane rotation P_k
        chat, shat, alphahat = _sym_ortho(alphabar, damp)
        rhoold = rho
        c, s, rho = _sym_ortho(alphahat, beta)
        thetanew = s * alpha
        alphabar = c * alpha
        # rotation Pbar_k
        rhobarold = rhobar
        zetaold = zeta
        thetabar = sbar * rho
        rhotemp = cbar * rho
        cbar, sbar, rhobar = _sym_ortho(cbar * rho, thetanew)
        zeta = cbar * zetabar
        zetabar = -sbar * zetabar
        # update h, hbar and x
        hbar *= float(-(thetabar * rho / (rhoold * rhobarold)))
        hbar += h
        x += float(zeta / (rho * rhobar)) * hbar
        h *= float(-(thetanew / rho))
        h += v

        # estimate ||r||: rotations Phat_k, P_k, then Ptilde_{k-1}
        betaacute = chat * betadd
        betacheck = -shat * betadd
        betahat = c * betaacute
        betadd = -s * betaacute
        thetatildeold = thetatilde
        ctildeold, stildeold, rhotildeold = _sym_ortho(rhodold, thetabar)
        thetatilde = stildeold * rhobar
        rhodold = ctildeold * rhobar
        betad = -stildeold * betad + ctildeold * betahat
        tautildeold = (zetaold - thetatildeold * tautildeold) / rhotildeold
        taud = (zeta - thetatilde * tautildeold) / rhodold
        d = d + betacheck * betacheck
        normr = math.sqrt(d + (betad - taud) ** 2 + betadd * betadd)
        # estimate ||A|| and cond(A)
        norma2 = norma2 + beta * beta
        norma = math.sqrt(norma2)
        norma2 = norma2 + alpha * alpha
        maxrbar = max(maxrbar, rhobarold)
        if itn > 1:
            minrbar = min(minrbar, rhobarold)
        conda = max(maxrbar, rhotemp) / min(minrbar, rhotemp)

        # stopping tests (the last one that holds sets istop, as in scipy)
        normar = abs(zetabar)
        normx = _norm(x)
        test1 = normr / normb
        test2 = normar / (norma * normr) if (norma * normr) != 0 else math.inf
        test3 = 1 / conda
        t1 = test1 / (1 + norma * normx / normb)
        rtol = btol + atol * norma * normx / normb
        if itn >= maxiter:
            istop = 7
        if 1 + test3 <= 1:
            istop = 6
        if 1 + test2 <= 1:
            istop = 5
        if 1 + t1 <= 1:
            istop = 4
        if test3 <= ctol:
            istop = 3
        if test2 <= atol:
            istop = 2
        if test1 <= rtol:
            istop = 1
        if istop > 0:
            break
    return _result(x, istop, itn, normr, normar, norma, conda, normx)
