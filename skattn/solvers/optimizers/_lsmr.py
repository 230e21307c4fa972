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

Off numpy, where a host read waits for the device, ``||u||`` and ``||v||`` stay
on the device to scale the vectors and reach the host in one stacked read an
iteration, with ``||x||`` of the iteration before: an iteration's stopping tests
wait for the next one's read, so that a run that stops spends one pair of
products in vain (one read an iteration instead of three).
"""

import math
from typing import NamedTuple

import numpy as np

from ...utils._array_api import device, is_numpy, to_numpy

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
    check_every=1,
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
    check_every : int, default=1
        Off numpy only: above 1, every scalar of the recurrences stays on the
        device and the host reads them (one stacked read) only every
        ``check_every`` iterations and at ``maxiter``, where the stopping
        tests are decided (:func:`_lsmr_on_device`): a run that stops between
        two reads goes on to the next, up to ``check_every - 1`` pairs of
        products spent beyond scipy's stop, its solution no worse.  (A
        ``maxiter`` of truncated steps, ``check_every >= maxiter``: one read a
        run.)

    Returns
    -------
    LsmrResult
        ``(x, istop, itn, normr, normar, norma, conda, normx)`` as scipy's ``lsmr``;
        ``x`` in ``xp`` on ``b``'s device, the rest Python numbers.

    Notes
    -----
    On numpy the recurrences read three scalars an iteration (``||u||``,
    ``||v||`` and ``||x||``, one after the other since each vector is scaled by
    the previous norm), as scipy's.  Off numpy the norms stay on the device and
    one stacked read an iteration brings them to the host with the previous
    iteration's ``||x||``: its stopping tests are decided one iteration late (a
    pair of products spent in vain when they stop the run).  The scalars meet
    the vectors as Python floats or 0-d arrays (array-api-strict takes no numpy
    scalars).

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
    lagged = not is_numpy(xp)
    if lagged and check_every > 1:
        n = rmatvec(b).shape[0] if shape is None else shape[1]
        return _lsmr_on_device(
            xp, matvec, rmatvec, b, n, damp, atol, btol, conlim,
            min(m, n) if maxiter is None else maxiter, int(check_every),
        )  # fmt: skip
    if lagged:  # ||b|| and the first alpha in one read
        u, v, normb, alpha = _first_vectors(xp, rmatvec, b)
        beta = normb
    else:
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
    if alpha > 0 and not lagged:
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
    # off numpy, an iteration's stopping tests wait for ||x|| until the next
    # iteration's read: (itn, normr, normar, norma, conda) of the iteration
    pending = None

    while itn < maxiter:
        itn += 1
        # bidiagonalization: beta u = A v - alpha u, alpha v = A^T u - beta v
        u *= float(-alpha)
        u += matvec(v)
        if lagged:
            u, v, beta, alpha, xx = _next_vectors(
                xp, rmatvec, u, v, alpha, x if pending else None
            )
            if pending:  # the previous iteration's tests, now that ||x|| is known
                normx = np.sqrt(xx)
                istop = _stop(*pending, normx, normb, atol, btol, ctol, maxiter)
                if istop > 0:  # its x stands (this iteration's products unused)
                    return _result(x, istop, *pending, normx)
        else:
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
        if lagged:
            pending = (itn, normr, normar, norma, conda)
            continue
        normx = _norm(x)
        istop = _stop(
            itn, normr, normar, norma, conda, normx, normb, atol, btol, ctol, maxiter
        )
        if istop > 0:
            break
    if pending:  # off numpy, the last iteration's tests: one more read
        normx = _norm(x)
        istop = _stop(*pending, normx, normb, atol, btol, ctol, maxiter)
    return _result(x, istop, itn, normr, normar, norma, conda, normx)


def _stop(itn, normr, normar, norma, conda, normx, normb, atol, btol, ctol, maxiter):
    """scipy's stopping tests of an iteration: ``istop`` (0: go on); the last
    one that holds sets it."""
    istop = 0
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
    return istop


def _host(xp, *scalars):
    """0-d arrays of ``xp`` as numpy ``float64`` on the host, in one stacked
    copy (one host read): the recurrences then divide as scipy's do."""
    return [np.float64(a) for a in to_numpy(xp.stack(scalars))]


def _first_vectors(xp, rmatvec, b):
    """LSMR's first ``u = b / ||b||``, ``v = A^T u / ||A^T u||`` off numpy, the
    two norms on the device until one host read: ``(u, v, ||b||, alpha)``
    (``v`` None when ``b = 0``, unscaled when ``alpha = 0``)."""
    normb = xp.sqrt(b @ b)
    u = b * (1 / xp.where(normb > 0, normb, 1.0))  # b = 0 (a fit already exact)
    w = rmatvec(u)
    alpha = xp.sqrt(w @ w)
    v = w * (1 / xp.where(alpha > 0, alpha, 1.0))
    normb, alpha = _host(xp, normb, alpha)
    if normb == 0:
        return b, None, 0.0, 0.0
    return u, (v if alpha > 0 else w), normb, alpha


def _next_vectors(xp, rmatvec, u, v, alpha, x=None):
    """One bidiagonalization step off numpy from ``u = A v - alpha u``: ``beta``
    and ``alpha`` stay on the device to scale ``u`` and ``v``, and are read with
    ``x . x`` (when ``x`` is given) in one host read; the host's steps, to the
    bit (``u``, ``v`` and ``alpha`` left as they were when ``beta = 0``, ``v``
    unscaled when ``alpha = 0``: known after the read)."""
    beta = xp.sqrt(u @ u)
    scaled = u * (1 / beta)
    w = rmatvec(scaled) - beta * v
    norm = xp.sqrt(w @ w)
    scalars = [beta, norm] + ([] if x is None else [x @ x])
    values = _host(xp, *scalars)
    xx = values[2] if x is not None else None
    if values[0] == 0:  # A v = alpha u: nothing more to add
        return u, v, 0.0, alpha, xx
    return scaled, (w * (1 / norm) if values[1] > 0 else w), values[0], values[1], xx


def _sym_ortho_xp(xp, a, b):
    """:func:`_sym_ortho` of 0-d device arrays: ``r = (a^2 + b^2)^{1/2} >= 0``,
    ``c = a / r``, ``s = b / r`` (0, 0 for ``a = b = 0``), SymOrtho's values to
    rounding without a branch on the host."""
    r = xp.sqrt(a * a + b * b)
    safe = xp.where(r > 0, r, 1.0)
    return xp.where(r > 0, a / safe, 0.0), xp.where(r > 0, b / safe, 0.0), r


def _lsmr_on_device(
    xp, matvec, rmatvec, b, n, damp, atol, btol, conlim, maxiter, check_every
):
    """:func:`lsmr` off numpy with every scalar a 0-d array on ``b``'s device:
    the recurrences of the host's run, the host reading ``||b||`` and the
    stopping tests' scalars only at the checks (every ``check_every``
    iterations and at ``maxiter``).  A breakdown (``beta`` or ``alpha`` zero)
    keeps the vectors as the host's run does, by ``where``."""
    on = device(b)
    dtype = b.dtype

    def zero():
        return xp.zeros((), dtype=dtype, device=on)

    def safe(a):
        return xp.where(a > 0, a, 1.0)

    def div(a, c):  # a / c, 0 where c is 0 (a breakdown the host's run stops at)
        return xp.where(c != 0, a / xp.where(c != 0, c, 1.0), 0.0)

    normb = xp.sqrt(b @ b)
    u = b * (1 / safe(normb))
    w = rmatvec(u)
    alpha = xp.sqrt(w @ w)
    v = w * (1 / safe(alpha))
    beta = normb
    alpha0, normar0 = alpha, alpha * beta
    x = xp.zeros(n, dtype=dtype, device=on)
    damp = xp.full((), float(damp), dtype=dtype, device=on)  # no host copy
    zetabar = alpha * beta
    alphabar = alpha
    rho = rhobar = cbar = zero() + 1
    sbar = zero()
    h = xp.asarray(v, copy=True)
    hbar = xp.zeros(n, dtype=dtype, device=on)
    betadd, betad, rhodold = beta, zero(), zero() + 1
    tautildeold = thetatilde = zeta = d = zero()
    norma2 = alpha * alpha
    maxrbar, minrbar = zero(), zero() + 1e100
    norma = xp.sqrt(norma2)
    conda = zero() + 1
    normr, normar = beta, alpha * beta
    ctol = 1 / conlim if conlim > 0 else 0
    itn = 0
    while True:
        if itn == maxiter or (itn > 0 and itn % check_every == 0):
            scalars = (normb, normar0, alpha0, normr, normar, norma, conda, x @ x)
            nb, nar0, a0, nr, nar, na, cd, xx = (float(a) for a in _host(xp, *scalars))
            if nb == 0 or nar0 == 0 or itn == 0:  # x = 0 solves it, or no iteration
                return _result(xp.zeros_like(x), 0, 0, nb, nar0, a0, 1.0, 0.0)
            normx = math.sqrt(xx)
            istop = _stop(itn, nr, nar, na, cd, normx, nb, atol, btol, ctol, maxiter)
            if istop > 0:
                return _result(x, istop, itn, nr, nar, na, cd, normx)
        itn += 1
        # bidiagonalization, the vectors kept where a norm is zero
        u = matvec(v) - alpha * u
        beta_new = xp.sqrt(u @ u)
        u = xp.where(beta_new > 0, u * (1 / safe(beta_new)), u)
        w = rmatvec(u) - beta_new * v
        alpha_new = xp.sqrt(w @ w)
        w = xp.where(alpha_new > 0, w * (1 / safe(alpha_new)), w)
        v = xp.where(beta_new > 0, w, v)
        alpha = xp.where(beta_new > 0, alpha_new, alpha)
        beta = beta_new
        # the host's recurrences, on the device
        chat, shat, alphahat = _sym_ortho_xp(xp, alphabar, damp)
        rhoold = rho
        c, s, rho = _sym_ortho_xp(xp, alphahat, beta)
        thetanew = s * alpha
        alphabar = c * alpha
        rhobarold = rhobar
        zetaold = zeta
        thetabar = sbar * rho
        rhotemp = cbar * rho
        cbar, sbar, rhobar = _sym_ortho_xp(xp, cbar * rho, thetanew)
        zeta = cbar * zetabar
        zetabar = -sbar * zetabar
        hbar = h - div(thetabar * rho, rhoold * rhobarold) * hbar
        x = x + div(zeta, rho * rhobar) * hbar
        h = v - div(thetanew, rho) * h
        betaacute = chat * betadd
        betacheck = -shat * betadd
        betahat = c * betaacute
        betadd = -s * betaacute
        thetatildeold = thetatilde
        ctildeold, stildeold, rhotildeold = _sym_ortho_xp(xp, rhodold, thetabar)
        thetatilde = stildeold * rhobar
        rhodold = ctildeold * rhobar
        betad = -stildeold * betad + ctildeold * betahat
        tautildeold = div(zetaold - thetatildeold * tautildeold, rhotildeold)
        taud = div(zeta - thetatilde * tautildeold, rhodold)
        d = d + betacheck * betacheck
        normr = xp.sqrt(d + (betad - taud) ** 2 + betadd * betadd)
        norma2 = norma2 + beta * beta
        norma = xp.sqrt(norma2)
        norma2 = norma2 + alpha * alpha
        maxrbar = xp.maximum(maxrbar, rhobarold)
        if itn > 1:
            minrbar = xp.minimum(minrbar, rhobarold)
        conda = div(xp.maximum(maxrbar, rhotemp), xp.minimum(minrbar, rhotemp))
        normar = xp.abs(zetabar)
