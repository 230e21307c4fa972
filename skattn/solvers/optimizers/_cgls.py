"""CGLS for a batch of independent damped least-squares problems, every scalar
on the device: the inner solver of :func:`~._trf.trust_region_steps` (the
Gauss-Newton steps of every least-squares stage).

LSMR (scipy's, which the trust-region steps used before) needs some 200 scalar
operations an iteration where CGLS needs a dozen, each a kernel launch on a GPU,
and its recurrences read the host once an iteration; CGLS here stops where LSMR
would (its tests, from CG's coefficients) and reads the host every
``check_every`` iterations.
"""

__all__ = ["batched_cgls"]


def _norms2(xp, v):
    """Squared row norms of ``(h, n)``: ``(h,)``."""
    return xp.sum(v * v, axis=1)


def _column(xp, a):
    """``(h,)`` as ``(h, 1)``, to scale rows."""
    return xp.reshape(a, (-1, 1))


def _safe(xp, a):
    """``a`` with zeros replaced by ones (a divisor)."""
    return xp.where(a == 0, 1.0, a)


def batched_cgls(
    xp,
    matvec,
    rmatvec,
    b,
    damp,
    *,
    rtol=None,
    atol=1e-6,
    btol=1e-6,
    maxiter=None,
    first_check=None,
    check_every=8,
    counter=None,
    active=None,
):
    """CGLS (conjugate gradients on the normal equations, Hestenes & Stiefel's
    least-squares form) for ``h`` problems at once:
    ``min ||A_i x_i - b_i||^2 + damp_i^2 ||x_i||^2``.

    Each head stops where LSMR would (scipy's ``lsmr``, whose defaults
    ``atol``, ``btol`` these are, in the damped problem's terms): LSMR's
    normal-equations residual ``||A_i^T r_i - damp_i^2 x_i||`` below ``atol
    ||A_i|| ||r_i||`` (``r_i`` the damped residual), or ``||r_i||`` below
    ``btol ||b_i|| + atol ||A_i|| ||x_i||``.  LSMR is MINRES on the normal
    equations, CGLS conjugate gradients on them, and MINRES's residual at
    iteration ``k`` is ``(sum_{j <= k} ||s_j||^{-2})^{-1/2}`` of CG's ``s_j``
    (CG's own is larger and erratic: stopped on it, heads far from their
    minimum ran to the iteration cap at almost every step); ``||A_i||`` as
    LSMR estimates it, the Frobenius norm of the projected matrix (here the
    square root of the trace of the Lanczos matrix that CG's coefficients
    define).  ``rtol``, when
    given, replaces both by ``||s_i||`` below ``rtol`` of its start.  A head
    that has stopped is frozen (its step length masked).  The stopping tests
    run, and the host reads whether every head has stopped, at iteration
    ``first_check`` (default ``check_every``) and every ``check_every`` after:
    between two looks a head may iterate past its test, which only solves its
    system more exactly.  A few ``(h,)`` operations an iteration beside the two
    products (LSMR's recurrences, on ``(h,)`` arrays, took about 200).

    Parameters
    ----------
    xp : namespace
    matvec, rmatvec : callable
        ``(h, n) -> (h, N)`` and ``(h, N) -> (h, n)``.
    b : array of shape (h, N)
    damp : array of shape (h,)
    rtol, atol, btol : float
    maxiter : int or None
        Iterations at most (``None``: ``min(n, 200)``).
    counter : dict or None
        Gets ``"reads"`` (host reads) added.
    active : array of shape (h,) of bool, or None
        The heads to solve (``None``: all); the others get zero.

    Returns
    -------
    x : array of shape (h, n)
    converged : array of shape (h,)
        Whether each head met its test (at the last look).
    itn : int
        Iterations run.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> A = rng.normal(size=(2, 6, 3)); b = rng.normal(size=(2, 6))
    >>> x, converged, itn = batched_cgls(
    ...     np, lambda v: np.einsum("hij,hj->hi", A, v),
    ...     lambda u: np.einsum("hij,hi->hj", A, u), b, np.zeros(2), rtol=1e-12)
    >>> expected = [np.linalg.lstsq(A[i], b[i], rcond=None)[0] for i in range(2)]
    >>> bool(np.allclose(x, expected)), converged.tolist()
    (True, [True, True])
    """
    shift = damp * damp
    r = b
    s = rmatvec(r)
    n = s.shape[1]
    if maxiter is None:
        maxiter = min(n, 200)
    x = xp.zeros_like(s)
    p = s
    gamma = _norms2(xp, s)
    if rtol is not None:
        goal = rtol * rtol * gamma
    else:
        b_norm = xp.sqrt(_norms2(xp, b))
    running = gamma > 0
    if active is not None:
        running = running & active
    done = ~running
    weight = xp.astype(running, s.dtype)
    # the trace of the Lanczos matrix of A^T A + damp^2 I: 1 / alpha_k +
    # beta_{k-1} / alpha_{k-1} on its diagonal
    trace = xp.zeros_like(gamma)
    last = xp.zeros_like(gamma)  # beta_{k-1} / alpha_{k-1}
    # sum of 1 / ||s_j||^2: LSMR's (MINRES's) ||A^T r|| at the same iteration
    # is its inverse square root, CG's being larger and erratic
    smoothing = _inverse(xp, gamma)
    itn = 0
    check = check_every if first_check is None else max(1, int(first_check))
    while itn < maxiter:
        itn += 1
        q = matvec(p)
        delta = _norms2(xp, q) + shift * _norms2(xp, p)
        alpha = weight * gamma / _safe(xp, delta)
        x = x + _column(xp, alpha) * p
        r = r - _column(xp, alpha) * q
        s = rmatvec(r) - _column(xp, shift) * x
        gamma_new = _norms2(xp, s)
        beta = gamma_new / _safe(xp, gamma)
        inverse = delta / _safe(xp, gamma)  # 1 / alpha, whatever the mask
        trace = trace + inverse + last
        last = beta * inverse
        gamma = gamma_new
        smoothing = smoothing + _inverse(xp, gamma)
        p = s + _column(xp, beta) * p
        if itn == check or itn >= maxiter:
            if rtol is not None:
                met = gamma <= goal
            else:
                x_norm2 = _norms2(xp, x)
                r_norm = xp.sqrt(_norms2(xp, r) + shift * x_norm2)
                a_norm = xp.sqrt(trace)
                met = (1.0 / xp.sqrt(smoothing) <= atol * a_norm * r_norm) | (
                    r_norm <= btol * b_norm + atol * a_norm * xp.sqrt(x_norm2)
                )
            done = done | met
            running = running & ~met
            weight = xp.astype(running, s.dtype)
            if counter is not None:
                counter["reads"] = counter.get("reads", 0) + 1
            if not bool(xp.any(running)):
                break
            check = itn + check_every
    return x, done, itn


def _inverse(xp, a):
    """``1 / a``, infinite where ``a`` is zero (without a warning)."""
    return xp.where(a > 0, 1.0 / _safe(xp, a), xp.inf)
