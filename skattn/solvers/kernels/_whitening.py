"""Whitening of the tokens: the random-start path's preconditioner.

:func:`whitening_map` maps the tokens to identity second moment on the subspace
they reach; a layer fitted on the whitened tokens maps back exactly
(:func:`_unwhiten`).  Arrays in, arrays out, of any array-API namespace (numpy
arrays get the numpy results of before).
"""

import numpy as np

from ...layer._math import _einsum, _namespace
from ...utils._array_api import device, to_namespace, to_numpy
from ...utils._validation import _normalized_weights

# Whiten the tokens of a random-start polish (whiten="auto") when their second
# moment's condition number on the reached subspace exceeds this, or when they
# reach a proper subspace.  Uniform Boolean and standard Gaussian tokens (moment
# about I) are left alone.
WHITEN_MIN_CONDITION = 10.0


# Sequences used to estimate the second moment.
_WHITEN_SAMPLES = 5000


def whitening_map(X, sample_weight=None, max_samples=_WHITEN_SAMPLES):
    """A linear map of the tokens to identity second moment on the reached subspace.

    With ``M = E[x x^T]`` over the tokens (weighted by sample) and its
    eigenpairs ``(lambda_j, v_j)``, ``A = [v_j / sqrt(lambda_j)]`` over the
    eigenvalues above ``d eps max(lambda)``: the tokens ``x A`` have second
    moment ``I`` in ``d' <= d`` coordinates.  A layer fitted on them maps back
    exactly: ``Theta_i = A Theta'_i A^T`` and ``W_i = A W'_i`` give the same
    logits and outputs on every token of the reached subspace (and rank
    ``Theta_i`` <= rank ``Theta'_i``, so low-rank heads stay low rank).

    This is a preconditioner: the Jacobian of the logits in ``Theta`` is
    conditioned like ``M`` squared, so anisotropic inputs (embedded text with a
    LayerNorm: eigenvalues spanning 5.4 to 0.013 for all-MiniLM-L6-v2, plus the
    hyperplane of the LayerNorm) make Gauss-Newton steps crawl.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    sample_weight : ndarray of shape (n,) or None
    max_samples : int, default=5000
        Sequences (the first ones) used to estimate ``M``.

    Returns
    -------
    A : ndarray of shape (d, d')
    condition : float
        ``max(lambda) / min(lambda)`` over the kept eigenvalues.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).normal(size=(500, 3, 2)) * [10.0, 0.1]
    >>> A, condition = whitening_map(X)
    >>> Z = (X @ A).reshape(-1, 2)
    >>> bool(np.allclose(Z.T @ Z / len(Z), np.eye(2))), bool(9e3 < condition < 1.1e4)
    (True, True)
    """
    xp = _namespace(X)
    X = X[: min(max_samples, X.shape[0]), ...]  # the standard: stop <= n
    n, k, d = X.shape
    weights = None if sample_weight is None else to_numpy(sample_weight)[:n]
    omega = to_namespace(_normalized_weights(n, weights), xp, device(X))
    tokens = xp.reshape(X, (n * k, d))
    moment = (tokens * xp.repeat(omega, k)[:, None]).T @ tokens / k
    # the d x d eigenproblem on the host, in every namespace: libraries pick
    # different bases of (nearly) equal eigenvalues, and a start drawn in other
    # coordinates would give another (equally good) fit than numpy's
    values, vectors = np.linalg.eigh(to_numpy(moment))
    keep = values > d * float(np.finfo(float).eps) * max(float(np.max(values)), 0.0)
    if not np.any(keep):
        return xp.eye(d, dtype=xp.float64, device=device(X)), 1.0
    kept = values[keep]
    whitener = to_namespace(vectors[:, keep] / np.sqrt(kept), xp, device(X))
    return whitener, float(np.max(kept) / np.min(kept))


def _unwhiten(attention, projection, A):
    """``A Theta'_i A^T`` and ``A W'_i``: a layer fitted on whitened tokens."""
    xp = _namespace(attention, projection, A)
    return (
        _einsum(xp, "ap,mpq,bq->mab", A, attention, A),
        _einsum(xp, "ap,mpo->mao", A, projection),
    )


def _whiten(X, sample_weight, whiten):
    """``(X A or X, A or None, record)``: the tokens whitened when ``whiten``
    says so (``"auto"``: their second moment's condition number above
    ``WHITEN_MIN_CONDITION`` on the subspace they reach, or that subspace
    proper)."""
    d = X.shape[2]
    if not whiten:
        return X, None, {"applied": False, "condition": None, "rank": d}
    A, condition = whitening_map(X, sample_weight)
    record = {"applied": True, "condition": condition, "rank": A.shape[1]}
    if whiten == "auto" and condition <= WHITEN_MIN_CONDITION and A.shape[1] == d:
        record["applied"] = False
        return X, None, record
    return X @ A, A, record
