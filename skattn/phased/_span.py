"""Phase 5 of the phased learner: the span of the Theta_i, and the number of heads.

The affine hull of ``Theta_1..Theta_m`` is a point plus ``m - 1`` directions; their
linear span is the span of the point and the directions (dimension ``m``, or
``m - 1`` when the hull passes through the origin).  The number of heads shows in
the spectrum of the augmented constraint matrix ``[A, -b]^T Omega [A, -b]`` of
:func:`~skattn.phased._affine_hull.fit_affine_hull`: its near-null space is spanned
by the homogeneous points ``(vec Theta_i, 1)``, so it has exactly ``m`` small
eigenvalues, then a gap.
"""

import warnings

import numpy as np


def hull_span(point, directions, *, rtol=1e-8):
    """Phase 5: an orthonormal basis of ``span(Theta_1, ..., Theta_m)``.

    Parameters
    ----------
    point : ndarray of shape (d, d)
        A point of the affine hull.
    directions : ndarray of shape (m - 1, d, d)
        The hull's directions.
    rtol : float, default=1e-8
        Singular values below ``rtol`` times the largest are dropped (a hull through
        the origin spans only ``m - 1`` dimensions).

    Returns
    -------
    basis : ndarray of shape (r, d, d)
        Orthonormal in the Frobenius inner product, ``r <= m``.
    info : dict
        ``rank`` r, ``singular_values`` of the stacked ``[point, directions]``,
        ``offset``: the norm of the point's component orthogonal to the directions
        (0 when the hull passes through the origin).

    Examples
    --------
    >>> import numpy as np
    >>> basis, info = hull_span(np.eye(2), np.zeros((0, 2, 2)))
    >>> info["rank"], bool(np.allclose(np.abs(basis[0]), np.eye(2) / np.sqrt(2)))
    (1, True)
    """
    point = np.asarray(point, dtype=float)
    directions = np.asarray(directions, dtype=float)
    if point.ndim != 2 or point.shape[0] != point.shape[1]:
        raise ValueError(f"point must have shape (d, d); got {point.shape}.")
    d = point.shape[0]
    if directions.ndim != 3 or directions.shape[1:] != (d, d):
        raise ValueError(
            f"directions must have shape (m - 1, {d}, {d}); got {directions.shape}."
        )
    stack = np.concatenate([point.reshape(1, -1), directions.reshape(-1, d * d)])
    _, sing, vt = np.linalg.svd(stack, full_matrices=False)
    rank = int(np.sum(sing > rtol * max(sing[0], np.finfo(float).tiny)))
    D = directions.reshape(-1, d * d)
    offset = point.reshape(-1) - (point.reshape(-1) @ D.T) @ D
    info = {
        "rank": rank,
        "singular_values": sing,
        "offset": float(np.linalg.norm(offset)),
    }
    return vt[:rank].reshape(rank, d, d), info


def estimate_n_heads(spectrum, *, max_heads=8, min_ratio=5.0):
    """Number of heads from the spectral gap of the augmented constraint matrix.

    With ascending eigenvalues ``mu_0 <= mu_1 <= ...`` of the augmented matrix
    (``info["augmented_spectrum"]`` of
    :func:`~skattn.phased._affine_hull.fit_affine_hull`), ``m`` homogeneous points
    ``(vec Theta_i, 1)`` make ``m`` eigenvalues near zero.  The estimate is the
    largest ``m`` in ``1..max_heads`` with ``mu_m / mu_{m-1} >= min_ratio`` (the last
    clear gap before the bulk, whose consecutive ratios are close to 1); if no ratio
    reaches ``min_ratio``, the ``m`` of the largest ratio, with a warning.

    Parameters
    ----------
    spectrum : array-like of shape (n_eigenvalues,)
        Ascending, non-negative eigenvalues (any common scale).
    max_heads : int, default=8
        Largest number of heads considered.
    min_ratio : float, default=5.0
        Smallest ratio that counts as a gap.  When no ratio reaches it a
        ``UserWarning`` says the certified rows do not clearly determine the hull
        (relax the tolerance or add samples).  Well-certified planted layers show
        ratios of 10 to 10^3 at the gap and 1.0-1.5 in the bulk.

    Returns
    -------
    n_heads : int
    info : dict
        ``ratios`` (``ratios[j-1] = mu_j / mu_{j-1}`` for j = 1..max_heads),
        ``gap_ratio`` (the ratio at the chosen ``m``), ``runner_up_ratio`` (the
        largest ratio at another ``m``), ``spectrum`` (the
        smallest ``max_heads + 1`` eigenvalues).

    Examples
    --------
    >>> n_heads, info = estimate_n_heads([1e-9, 2e-9, 0.3, 0.5, 1.0])
    >>> n_heads, bool(info["gap_ratio"] > 1e7)
    (2, True)
    """
    spectrum = np.asarray(spectrum, dtype=float)
    if spectrum.ndim != 1 or spectrum.size < 2:
        raise ValueError(
            f"spectrum must be a 1-D array of at least 2 eigenvalues; got shape "
            f"{spectrum.shape}."
        )
    if np.any(np.diff(spectrum) < 0) or spectrum[0] < 0:
        raise ValueError("spectrum must be non-negative and sorted ascending.")
    top = min(int(max_heads), spectrum.size - 1)
    low = spectrum[: top + 1]
    floor = np.finfo(float).tiny
    ratios = low[1:] / np.maximum(low[:-1], floor)
    order = np.argsort(ratios)[::-1]
    # The last clear gap before the bulk: the first ratio is large whenever the
    # best homogeneous point fits better than any direction, so "the largest ratio"
    # would undercount heads whose hull directions are only nearly null.
    clear = np.flatnonzero(ratios >= min_ratio)
    n_heads = int(clear[-1] + 1) if clear.size else int(order[0] + 1)
    best = float(ratios[n_heads - 1])
    if not clear.size:
        warnings.warn(
            f"Weak evidence for the number of heads: the largest spectral gap ratio "
            f"is {best:.3g} (< min_ratio={min_ratio:g}) at m={n_heads}. The "
            f"certified rows do not clearly determine the affine hull; relax the "
            f"certification tolerance or pass more samples.",
            UserWarning,
            stacklevel=2,
        )
    info = {
        "ratios": ratios,
        "gap_ratio": best,
        "runner_up_ratio": float(np.max(np.delete(ratios, n_heads - 1), initial=0.0)),
        "spectrum": low,
    }
    return n_heads, info
