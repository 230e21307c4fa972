"""Batch access to X and y that do not fit in memory.

The estimators take ``numpy.memmap``, zarr and h5py arrays and dask arrays without
loading them: :func:`validate_batches` checks them chunk by chunk (shapes, lengths,
finiteness, token layout) and wraps them in :class:`TokenBatches`, a read-only,
sliceable ``(n_samples, n_tokens, n_features)`` view that reads only the rows
asked for.  The phase functions and the gradient objective already work in batches
(``X[start:stop]`` or ``X[indices]``), so they run on a ``TokenBatches`` unchanged.

Dask arrays: every batch is computed by dask (on a ``dask.distributed`` cluster's
workers when a ``Client`` is active), and the phase-1 token-sum statistics are a
dask reduction over the array's chunks (:func:`token_sum_moments`), summed in the
estimator.  An in-memory ndarray never goes through this module.
"""

import numpy as np

# Rows validated at a time (at least batch_size).
_VALIDATION_ROWS = 65536
# Rows at indices spanning at most this many times their number (or one batch) are
# read as one slice, then selected; sparser ones row by row (fewer bytes, slower).
_DENSE_FACTOR = 4


def _is_dask(array):
    return type(array).__module__.split(".")[0] == "dask" and hasattr(array, "dask")


def is_out_of_core(array):
    """Whether ``array`` is read in batches: a memmap, zarr, h5py or dask array.

    Parameters
    ----------
    array : object
        An input of ``fit``.

    Returns
    -------
    out_of_core : bool

    Examples
    --------
    >>> import numpy as np
    >>> is_out_of_core(np.zeros((2, 3)))
    False
    """
    if isinstance(array, np.memmap) or _is_dask(array):
        return True
    module = type(array).__module__.split(".")[0]
    return module in ("zarr", "h5py") and hasattr(array, "shape")


def _read(source, key):
    """``source[key]`` as a float64 ndarray (dask: computed)."""
    part = source[key]
    if _is_dask(part):
        part = part.compute()
    return np.asarray(part, dtype=np.float64)


def _read_sorted_rows(source, rows):
    """Rows (sorted, unique) of a 2-D source, reading only those rows."""
    if isinstance(source, np.ndarray) or _is_dask(source):
        return _read(source, rows)
    if hasattr(source, "oindex"):  # zarr
        return np.asarray(source.oindex[rows, :], dtype=np.float64)
    return np.asarray(source[rows], dtype=np.float64)  # h5py: increasing indices


class TokenBatches:
    """A read-only ``(n_samples, n_tokens, n_features)`` view of a 2-D array source.

    Indexing with a slice or an integer array reads those rows only and returns
    a float64 ndarray of shape ``(rows, n_tokens, n_features)``; nothing else of
    the ndarray interface exists, so code that would load the whole array fails
    loudly instead.

    Parameters
    ----------
    source : memmap, zarr, h5py or dask array of shape (n_samples, width)
        Token-major rows, ``width = n_tokens * n_features``.
    n_tokens : int
        Tokens per row.
    batch_size : int
        Rows read at a time by :meth:`iter_batches`.

    Examples
    --------
    >>> import numpy as np
    >>> view = TokenBatches(np.arange(24.0).reshape(4, 6), 3, batch_size=2)
    >>> view.shape, view[1:2].shape, view[np.array([3, 0])][:, 0, 0].tolist()
    ((4, 3, 2), (1, 3, 2), [18.0, 0.0])
    """

    ndim = 3

    def __init__(self, source, n_tokens, batch_size):
        self.source = source
        n, width = source.shape
        self.shape = (int(n), int(n_tokens), int(width) // int(n_tokens))
        self.batch_size = int(batch_size)

    def __len__(self):
        return self.shape[0]

    def _tokens(self, rows):
        return rows.reshape(rows.shape[0], *self.shape[1:])

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._tokens(_read(self.source, key))
        idx = np.asarray(key)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise TypeError(
                f"TokenBatches takes a slice or a 1-D integer array of rows, got "
                f"{key!r}."
            )
        if idx.size == 0:
            return np.empty((0, *self.shape[1:]))
        unique, inverse = np.unique(idx, return_inverse=True)
        lo, hi = int(unique[0]), int(unique[-1]) + 1
        if hi - lo <= max(_DENSE_FACTOR * unique.size, self.batch_size):
            rows = _read(self.source, slice(lo, hi))[unique - lo]
        else:
            rows = _read_sorted_rows(self.source, unique)
        return self._tokens(rows[inverse])

    def iter_batches(self):
        """Yield ``(start, rows)`` over consecutive batches of ``batch_size`` rows.

        Yields
        ------
        start : int
            Index of the batch's first row.
        rows : ndarray of shape (batch, n_tokens, n_features)
            The batch.
        """
        for start in range(0, len(self), self.batch_size):
            yield start, self[start : start + self.batch_size]


def _check_chunks(array, name, batch_size):
    """Finiteness and numeric dtype of a 2-D source, checked chunk by chunk."""
    dtype = np.dtype(array.dtype)
    if dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must hold numbers, got an array of dtype {dtype}; convert it "
            f"to float64."
        )
    if dtype.kind != "f":
        return
    if _is_dask(array):
        import dask.array as da

        n_bad = int((~da.isfinite(array)).sum().compute())
    else:
        n_bad = 0
        for start in range(0, array.shape[0], batch_size):
            part = np.asarray(array[start : start + batch_size])
            n_bad += int(part.size - np.count_nonzero(np.isfinite(part)))
    if n_bad:
        raise ValueError(
            f"{name} contains {n_bad} NaN or infinite value(s); attention layers "
            f"need finite inputs. Remove or impute them first."
        )


def _as_2d(array, name):
    shape = tuple(array.shape)
    if len(shape) == 3:
        if _is_dask(array):
            return array.reshape(shape[0], shape[1] * shape[2]), shape[1]
        raise ValueError(
            f"{name} is a 3-D out-of-core array of shape {shape}; store it 2-D "
            f"(n_samples, n_tokens * n_features), token-major, or wrap it with "
            f"dask.array.from_array(...).reshape(n_samples, -1)."
        )
    if len(shape) != 2:
        raise ValueError(
            f"{name} must be 2-D (n_samples, n_tokens * width), got an array of "
            f"shape {shape}; store it as one."
        )
    return array, None


def validate_batches(X, y, n_tokens, batch_size):
    """Check out-of-core ``X`` and ``y`` chunk by chunk and wrap them.

    Parameters
    ----------
    X : memmap, zarr, h5py or dask array of shape (n_samples, n_tokens * n_features)
        A dask X may also be 3-D ``(n_samples, n_tokens, n_features)``.
    y : memmap, zarr, h5py, dask array or ndarray of shape \
(n_samples, n_tokens * n_outputs)
    n_tokens : int or None
        The estimator's ``n_tokens``.
    batch_size : int
        Rows read at a time.

    Returns
    -------
    X3 : TokenBatches of shape (n_samples, n_tokens, n_features)
    Y3 : TokenBatches of shape (n_samples, n_tokens, n_outputs)

    Examples
    --------
    >>> import numpy as np
    >>> X = np.lib.format.open_memmap("/tmp/skattn_doc_X.npy", "w+", "f8", (5, 6))
    >>> X3, Y3 = validate_batches(X, np.zeros((5, 3)), 3, 2)
    >>> X3.shape, Y3.shape
    ((5, 3, 2), (5, 3, 1))
    """
    from ._sequences import resolve_n_tokens

    X = X if is_out_of_core(X) else np.asarray(X)
    y = y if is_out_of_core(y) else np.asarray(y)
    X, k3 = _as_2d(X, "X")
    if y.ndim == 1 and (_is_dask(y) or isinstance(y, np.ndarray)):
        y = y[:, None]
    y, _ = _as_2d(y, "y")
    if X.shape[0] != y.shape[0]:
        raise ValueError(
            f"X and y have different numbers of samples: X has {X.shape[0]} rows, "
            f"y has {y.shape[0]}; pass arrays of the same length."
        )
    if X.shape[0] == 0:
        raise ValueError("X has 0 samples; pass at least one sample.")
    k = resolve_n_tokens(X.shape[1], n_tokens, k3)
    if y.shape[1] % k:
        raise ValueError(
            f"y has {y.shape[1]} columns, which is not divisible by n_tokens={k}; "
            f"expected n_tokens * n_outputs columns (token-major), one output "
            f"vector per token."
        )
    rows = max(batch_size, _VALIDATION_ROWS)
    _check_chunks(X, "X", rows)
    _check_chunks(y, "y", rows)
    return TokenBatches(X, k, batch_size), TokenBatches(y, k, batch_size)


def token_sum_moments(X, Y, sample_weight):
    """Phase-1 statistics of token sums ``u = sum_l x_l``, ``v = sum_l y_l``.

    Summed batch by batch; for dask sources, per chunk by dask and the chunks'
    sums added here.

    Parameters
    ----------
    X : TokenBatches of shape (n_samples, n_tokens, n_features)
    Y : TokenBatches of shape (n_samples, n_tokens, n_outputs)
    sample_weight : ndarray of shape (n_samples,)

    Returns
    -------
    gram : ndarray of shape (n_features, n_features)
        ``sum_n w_n u_n u_n^T``.
    cross : ndarray of shape (n_features, n_outputs)
        ``sum_n w_n u_n v_n^T``.
    v_sq : float
        ``sum_n w_n ||v_n||^2``.

    Examples
    --------
    >>> import numpy as np
    >>> X = TokenBatches(np.ones((4, 6)), 3, 2); Y = TokenBatches(np.ones((4, 3)), 3, 2)
    >>> gram, cross, v_sq = token_sum_moments(X, Y, np.ones(4))
    >>> float(gram[0, 0]), float(cross[0, 0]), v_sq
    (36.0, 36.0, 36.0)
    """
    (_, k, d), d_out = X.shape, Y.shape[2]
    if _is_dask(X.source) and _is_dask(Y.source):
        return _dask_token_sum_moments(X.source, Y.source, sample_weight, k, d, d_out)
    gram, cross, v_sq = np.zeros((d, d)), np.zeros((d, d_out)), 0.0
    for start, Xb in X.iter_batches():
        w = sample_weight[start : start + len(Xb)]
        u, v = Xb.sum(axis=1), Y[start : start + len(Xb)].sum(axis=1)
        gram += (u * w[:, None]).T @ u
        cross += (u * w[:, None]).T @ v
        v_sq += float(np.sum(w * np.sum(v**2, axis=1)))
    return gram, cross, v_sq


def _dask_token_sum_moments(X, Y, sample_weight, k, d, d_out):
    import dask.array as da

    X = X.astype(np.float64)
    Y = da.asarray(Y).astype(np.float64).rechunk({0: X.chunks[0], 1: -1})
    X = X.rechunk({1: -1})
    w = da.from_array(np.asarray(sample_weight), chunks=(X.chunks[0],))

    def moments(xb, yb, wb):
        wb = wb[:, 0]
        u = xb.reshape(len(xb), k, d).sum(axis=1)
        v = yb.reshape(len(yb), k, d_out).sum(axis=1)
        out = np.empty((1, d * d + d * d_out + 1))
        out[0, : d * d] = ((u * wb[:, None]).T @ u).ravel()
        out[0, d * d : -1] = ((u * wb[:, None]).T @ v).ravel()
        out[0, -1] = np.sum(wb * np.sum(v**2, axis=1))
        return out

    parts = da.map_blocks(
        moments,
        X,
        Y,
        w[:, None],
        dtype=np.float64,
        chunks=((1,) * len(X.chunks[0]), (d * d + d * d_out + 1,)),
    )
    total = parts.compute().sum(axis=0)  # one row per chunk, summed here
    gram = total[: d * d].reshape(d, d)
    cross = total[d * d : -1].reshape(d, d_out)
    return gram, cross, float(total[-1])
