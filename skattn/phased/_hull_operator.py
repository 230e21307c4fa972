"""The hull's constraint system without forming it: products in O(rows d^2).

Equation ``a`` of a certified row ``l`` is ``x_l^T Theta v_la = beta_la`` (see
:func:`~skattn.phased._affine_hull._row_equations`): a rank-one measurement
``<Theta, x_l v_la^T>`` of ``Theta``.  So with the rows stacked as ``x_row``
(L, d) and ``v`` (L, k, d), and a block of ``b`` matrices stored as the columns of
``U`` (d^2, b) (each column ``vec(Theta)``, row-major):

* ``A U = v @ (x_row @ Theta)``, per row (two GEMM-sized products);
* ``A^T R = x_row^T (v^T R)``, summed over rows (one GEMM);

each ``O(L d^2 b + L k d b)`` flops, against ``O(L d^4)`` to accumulate the dense
normal matrix ``A^T A`` (d^2, d^2) and ``O(d^6)`` to diagonalise it.

The hull needs only the bottom of the normal matrix's spectrum (``m - 1``
directions, the gap after them) and a least-squares point orthogonal to them:
:func:`iterative_hull` gets them by LOBPCG on the normal operator, preconditioned
by its Kronecker approximation ``(sum_l x_l x_l^T) kron (sum_l V_l) / L``, and
by preconditioned conjugate gradients, and the bottom of the augmented
matrix's spectrum by LOBPCG on the augmented operator.
"""

import warnings

import numpy as np
from scipy.sparse.linalg import LinearOperator, cg, lobpcg


def constraint_matvec(x_row, v, U):
    """``A U``: the equations' values at a block of matrices.

    Parameters
    ----------
    x_row : ndarray of shape (L, d)
    v : ndarray of shape (L, k, d)
    U : ndarray of shape (d * d, b)
        Columns ``vec(Theta_s)`` (row-major).

    Returns
    -------
    R : ndarray of shape (L, k, b)
        ``R[l, a, s] = x_l^T Theta_s v_la``.
    """
    L, d = x_row.shape
    b = U.shape[1]
    T = (x_row @ U.reshape(d, d * b)).reshape(L, d, b)  # Theta_s^T x_l
    if b == 1:  # a vector: einsum beats the stacked matmul
        return np.einsum("lad,ld->la", v, T[:, :, 0])[:, :, None]
    return v @ T


def constraint_rmatvec(x_row, v, R):
    """``A^T R``: the equations' transpose applied to a block of residuals.

    Parameters
    ----------
    x_row : ndarray of shape (L, d)
    v : ndarray of shape (L, k, d)
    R : ndarray of shape (L, k, b)

    Returns
    -------
    U : ndarray of shape (d * d, b)
        ``vec(sum_{l, a} R[l, a, s] x_l v_la^T)``.
    """
    L, d = x_row.shape
    b = R.shape[2]
    if b == 1:
        S = np.einsum("lad,la->ld", v, R[:, :, 0])[:, :, None]
    else:
        S = np.swapaxes(v, 1, 2) @ R  # (L, d, b)
    return (x_row.T @ S.reshape(L, d * b)).reshape(d * d, b)


def constraint_matrix(x_row, v):
    """The dense equations ``A`` (L * k, d^2) (row ``(l, a)`` is ``x_l kron v_la``).

    For tests and small problems; :func:`constraint_matvec` and
    :func:`constraint_rmatvec` apply it without forming it.
    """
    L, d = x_row.shape
    return np.einsum("li,laj->laij", x_row, v).reshape(L * v.shape[1], d * d)


def _normal_diag(x_row, v):
    """Diagonal of ``A^T A`` (d^2,): ``sum_l x_li^2 sum_a v_laj^2``."""
    return ((x_row**2).T @ np.sum(v**2, axis=1)).reshape(-1)


class _NormalOperator:
    """``A^T A`` with the gauge entries pinned, scaled by ``1 / scale``.

    ``mask`` is 1 on free entries and 0 on gauge entries; a pinned entry gets the
    value ``pin`` on the diagonal (as :func:`~skattn.phased._affine_hull._pin_gauge`
    does on the dense matrix).  With ``rhs`` and ``rhs_norm2`` it also applies the
    augmented matrix ``[A, -b]^T [A, -b]`` (``d^2 + 1`` unknowns).
    """

    def __init__(self, x_row, v, mask, pin, rhs, rhs_norm2):
        self.x_row, self.v, self.mask, self.pin = x_row, v, mask, pin
        self.rhs, self.rhs_norm2 = rhs, rhs_norm2
        self.n = x_row.shape[1] ** 2
        self.scale = 1.0
        self.n_products = 0

    def normal(self, U):
        U = U.reshape(self.n, -1)
        self.n_products += U.shape[1]
        masked = U * self.mask[:, None]
        out = constraint_rmatvec(
            self.x_row, self.v, constraint_matvec(self.x_row, self.v, masked)
        )
        out = out * self.mask[:, None] + self.pin * (1.0 - self.mask)[:, None] * U
        return out / self.scale

    def augmented(self, U):
        U = U.reshape(self.n + 1, -1)
        head, tail = U[: self.n], U[self.n :]
        out = np.empty_like(U)
        out[: self.n] = self.normal(head) - np.outer(self.rhs, tail) / self.scale
        out[self.n :] = (-(self.rhs @ head) + self.rhs_norm2 * tail) / self.scale
        return out


def _kronecker_preconditioner(x_row, v, mask, pin, scale):
    """Inverse of the Kronecker approximation of the (scaled) normal operator.

    ``A^T A = sum_l (x_l x_l^T) kron V_l`` is approximated by
    ``c (sum_l x_l x_l^T) kron (sum_l V_l)``, with ``c`` matching the traces; its
    inverse is two ``d x d`` solves per side.  Gauge entries get ``scale / pin``.
    """
    d = x_row.shape[1]
    Cx = x_row.T @ x_row
    v2 = v.reshape(-1, d)
    Cv = v2.T @ v2
    gauge_cols = mask.reshape(d, d)[0] == 0  # gauge entries are whole columns
    Cv[gauge_cols, :] = 0.0
    Cv[:, gauge_cols] = 0.0
    free = ~gauge_cols
    ridge = 1e-10 * max(np.trace(Cv) / max(free.sum(), 1), np.finfo(float).tiny)
    Cv[np.ix_(free, free)] += ridge * np.eye(free.sum())
    Cv[gauge_cols, gauge_cols] = 1.0
    Cx = Cx + 1e-10 * max(np.trace(Cx) / d, np.finfo(float).tiny) * np.eye(d)
    c = float(np.sum(np.sum(x_row**2, axis=1) * np.sum(v**2, axis=(1, 2)))) / max(
        np.trace(Cx) * np.trace(Cv[np.ix_(free, free)]), np.finfo(float).tiny
    )
    Cx_inv, Cv_inv = np.linalg.inv(Cx), np.linalg.inv(Cv)
    Cx_inv = (Cx_inv + Cx_inv.T) / 2
    Cv_inv = (Cv_inv + Cv_inv.T) / 2
    pin_inv = scale / pin if pin > 0 else 1.0

    def apply(U):
        U = U.reshape(d * d, -1)
        b = U.shape[1]
        blocks = U.reshape(d, d, b).transpose(2, 0, 1)  # (b, d, d)
        out = (Cx_inv @ blocks @ Cv_inv) * (scale / max(c, np.finfo(float).tiny))
        out = out.transpose(1, 2, 0).reshape(d * d, b)
        return out * mask[:, None] + pin_inv * (1.0 - mask)[:, None] * U

    return apply


def _top_eigenpair(apply, n, rng, n_iter=6):
    """Largest eigenpair of a symmetric PSD operator, to about 1e-3 (a scale).

    A few LOBPCG iterations with a block of 3 (each a single block product,
    which costs about as much as one vector's: the rows are read once).
    """
    if n < 15:
        evals, evecs = np.linalg.eigh(apply(np.eye(n)))
        return float(evals[-1]), evecs[:, -1]
    A = LinearOperator((n, n), matvec=apply, matmat=apply, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        evals, evecs = lobpcg(
            A, rng.standard_normal((n, 3)), tol=1e-3, maxiter=n_iter, largest=True
        )
    j = int(np.argmax(evals))
    return float(evals[j]), evecs[:, j]


def _bottom_eigenpairs(
    apply, precondition, n, n_eig, rng, start=None, tol=1e-6, max_iter=20, guards=2
):
    """The ``n_eig`` smallest eigenpairs of a PSD operator scaled to ``[0, 1]``.

    LOBPCG with the preconditioner ``precondition`` and a block of ``n_eig``
    vectors plus a few guards (the extra vectors speed up the convergence of
    the wanted ones); ``start`` (n, j) seeds the block.
    """
    b = min(n_eig + guards, n)
    if n < 5 * b:  # too small for LOBPCG: form the matrix
        evals, evecs = np.linalg.eigh(apply(np.eye(n)))
        return evals[:n_eig], evecs[:, :b], {"n_iter": 0, "max_residual": 0.0}
    X0 = rng.standard_normal((n, b))
    if start is not None and start.size:
        j = min(start.shape[1], b)
        X0[:, :j] = start[:, :j]
    A = LinearOperator((n, n), matvec=apply, matmat=apply, dtype=float)
    M = LinearOperator((n, n), matvec=precondition, matmat=precondition, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # lobpcg's convergence notes
        out = lobpcg(
            A,
            X0,
            M=M,
            tol=tol,
            maxiter=max_iter,
            largest=False,
            retResidualNormsHistory=True,
        )
    evals, evecs, history = out
    order = np.argsort(evals)
    evals, evecs = evals[order], evecs[:, order]
    residuals = np.asarray(history[-1])[order] if len(history) else np.full(b, np.nan)
    return (
        evals[:n_eig],
        evecs,
        {
            "n_iter": len(history),
            "max_residual": float(np.max(residuals[:n_eig])),
        },
    )


def iterative_hull(
    stats,
    n_heads,
    *,
    n_eigenvalues=None,
    random_state=0,
    start=None,
    tol=1e-6,
    max_iter=20,
    augmented_iter=8,
    cg_tol=1e-8,
):
    """The hull from matrix-free statistics (``stats["constraints"]``).

    The same quantities as the dense path of
    :func:`~skattn.phased._affine_hull.fit_affine_hull`: the ``m - 1`` bottom
    eigenvectors of the normal matrix (directions), the least-squares point
    orthogonal to them, and the bottom of both spectra divided by their largest
    eigenvalue; only the ``n_eigenvalues`` (default ``m + 1``, at least that)
    smallest of the normal matrix and one more of the augmented one are computed.
    The largest eigenvalues (the scales) are estimated to about 1e-3; LOBPCG stops
    after ``max_iter`` iterations (``augmented_iter`` for the augmented matrix)
    even when unconverged, which happens in rounds without a spectral gap (the
    bottom eigenvalues cluster and the directions are ill-determined anyway).

    Returns
    -------
    point : ndarray of shape (d^2,)
    directions : ndarray of shape (d^2, m - 1)
    evals : ndarray of shape (n_eigenvalues,)
        Smallest eigenvalues of the normal matrix, divided by the largest.
    aug : ndarray of shape (n_eigenvalues + 1,)
        Smallest eigenvalues of the augmented matrix, divided by its largest.
    info : dict
        ``n_products`` (operator products), ``lobpcg_iter``, ``cg_iter``,
        ``max_residual`` (LOBPCG's largest residual norm of a wanted pair).
    """
    rng = np.random.default_rng(random_state)
    cons = stats["constraints"]
    x_row, v = cons["x_row"], cons["v"]
    d = stats["n_features"]
    n = d * d
    m = int(n_heads)
    mask = cons["mask"]
    op = _NormalOperator(x_row, v, mask, cons["pin"], stats["rhs"], stats["rhs_norm2"])
    n_eig = m + 1 if n_eigenvalues is None else max(int(n_eigenvalues), m + 1)
    n_eig = min(n_eig, n - 1)
    top, top_vec = _top_eigenpair(op.normal, n, rng)
    top = max(top, np.finfo(float).tiny)
    n_top = op.n_products
    op.scale = top
    precond = _kronecker_preconditioner(x_row, v, mask, cons["pin"], top)
    evals, evecs, linfo = _bottom_eigenpairs(
        op.normal, precond, n, n_eig, rng, start=start, tol=tol, max_iter=max_iter
    )
    directions = evecs[:, : m - 1]
    # the point: least squares on the complement of the directions (PCG)
    proj = np.eye(n)[:, :0] if m == 1 else directions

    def project(u):
        return u - proj @ (proj.T @ u)

    rhs = project(stats["rhs"] / top)
    n_cg = [0]

    def count(_):
        n_cg[0] += 1

    A = LinearOperator((n, n), matvec=lambda u: project(op.normal(project(u))[:, 0]))
    M = LinearOperator((n, n), matvec=lambda u: project(precond(project(u))[:, 0]))
    x0 = None if start is None or not start.size else project(start[:, 0])
    point, status = cg(
        A, rhs, x0=x0, rtol=cg_tol, atol=0.0, maxiter=500, M=M, callback=count
    )
    point = project(point)
    # the augmented spectrum (d^2 + 1 unknowns); its top from the normal's top
    # vector and the new coordinate (Rayleigh-Ritz on those two)
    basis = np.zeros((n + 1, 2))
    basis[:n, 0], basis[n, 1] = top_vec / np.linalg.norm(top_vec), 1.0
    aug_top = top * float(np.linalg.eigvalsh(basis.T @ op.augmented(basis))[-1])
    aug_top = max(aug_top, top * np.finfo(float).eps)
    aug_scale = aug_top / top

    def aug_apply(U):
        return op.augmented(U) / aug_scale

    def aug_precond(U):
        U = U.reshape(n + 1, -1)
        out = np.empty_like(U)
        out[:n] = precond(U[:n]) * aug_scale
        tail = max(stats["rhs_norm2"], np.finfo(float).tiny) / top
        out[n:] = U[n:] * aug_scale / tail
        return out

    # warm start: the homogeneous point (point, 1) and the normal's Ritz vectors
    # (whose span holds the hull's other homogeneous points)
    seed = np.zeros((n + 1, evecs.shape[1] + 1))
    seed[:n, 0], seed[n, 0] = point, 1.0
    seed[:n, 1:] = evecs
    aug_vals, _, ainfo = _bottom_eigenpairs(
        aug_apply,
        aug_precond,
        n + 1,
        n_eig + 1,
        rng,
        start=seed,
        tol=tol,
        max_iter=augmented_iter,
    )
    info = {
        "n_products": op.n_products,
        "n_products_top": n_top,
        "lobpcg_iter": (linfo["n_iter"], ainfo["n_iter"]),
        "cg_iter": n_cg[0],
        "cg_status": int(status),
        "max_residual": max(linfo["max_residual"], ainfo["max_residual"]),
    }
    return (
        point,
        directions,
        np.clip(evals, 0.0, None),
        np.clip(aug_vals, 0.0, None),
        info,
    )
