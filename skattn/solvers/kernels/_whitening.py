"""Whitening of the tokens: the random-start path's preconditioner.

:func:`whitening_map` maps the tokens to identity second moment on the subspace
they reach; a layer fitted on the whitened tokens maps back exactly
(:func:`_unwhiten`).  Arrays in, arrays out.
"""

import numpy as np

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
    X = X[:max_samples]
    n, k, d = X.shape
    omega = _normalized_weights(n, None if sample_weight is None else sample_weight[:n])
    tokens = X.reshape(n * k, d)
    moment = (tokens * np.repeat(omega, k)[:, None]).T @ tokens / k
    values, vectors = np.linalg.eigh(moment)
    keep = values > d * np.finfo(float).eps * max(values.max(), 0.0)
    if not np.any(keep):
        return np.eye(d), 1.0
    kept = values[keep]
    return vectors[:, keep] / np.sqrt(kept), float(kept.max() / kept.min())


def _unwhiten(attention, projection, A):
    """``A Theta'_i A^T`` and ``A W'_i``: a layer fitted on whitened tokens."""
    return (
        np.einsum("ap,mpq,bq->mab", A, attention, A, optimize=True),
        np.einsum("ap,mpo->mao", A, projection, optimize=True),
    )
