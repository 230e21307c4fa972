"""Batch access to X and y that do not fit in memory, and the scans over them.

The estimators take ``numpy.memmap``, zarr and h5py arrays and dask arrays without
loading them: :func:`validate_batches` checks them chunk by chunk (shapes, lengths,
finiteness, token layout) and wraps them in :class:`TokenBatches`, a read-only,
sliceable ``(n_samples, n_tokens, n_features)`` view that reads only the rows
asked for.

Every pass of phases 1-4 over all the samples goes through
:func:`map_reduce_batches`: a pure function turns one batch into small partial
statistics (sums, counts, the few rows kept) and an associative merge combines
them.  On an ndarray or a memmap, zarr or h5py source the batches are read and
processed in this process.  On dask arrays (X and y) every chunk is one dask task
that runs the function on the chunk where it lives -- on a ``dask.distributed``
cluster's workers when a ``Client`` is active -- and only the partial statistics
come back, merged here (many chunks: first in groups on the workers).  The merges
are exact up to the order of floating-point sums, so the result depends on the
chunking and the batch size only by rounding.  The reads at scattered indices
(the kept rows, subsamples; at most a few times ``max_rows`` rows) stay in this
process.  ``dask`` is imported only when a source is a dask array.
"""

import os
import time
import uuid
from functools import partial
from pathlib import Path

import numpy as np

# A zarr folder is walked at most this often (seconds) by the reads, and at the end
# of every scan and fit; a memmap or h5py file is checked at every read (one stat).
_FOLDER_CHECK_INTERVAL = 1.0
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


class SourceChangedError(RuntimeError):
    """The file or folder behind an out-of-core X or y changed or vanished mid-fit.

    A fit reads its data many times (one scan per phase); data that differ
    between the reads would give a layer fitted to neither version, so the fit
    stops instead.
    """


def _source_location(source):
    """``(kind, path)`` of the local file (memmap, h5py) or folder (zarr) behind
    ``source``, or ``None`` when it has none (in memory, dask, a remote store)."""
    if isinstance(source, np.memmap):
        name = getattr(source, "filename", None)
        return None if name is None else ("file", Path(name))
    module = type(source).__module__.split(".")[0]
    if module == "h5py":
        return ("file", Path(source.file.filename))
    if module == "zarr":
        root = getattr(getattr(source, "store", None), "root", None)
        if root is None:
            return None
        return ("folder", Path(root) / getattr(source, "path", ""))
    return None


def _stat_key(stat):
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _fingerprint(location):
    """Identity, size and modification time of every file of ``location``, or
    ``None`` when it does not exist."""
    kind, path = location
    try:
        if kind == "file":
            return _stat_key(os.stat(path))
        if not path.is_dir():
            return None
        files = sorted(
            os.path.join(folder, name)
            for folder, _, names in os.walk(path)
            for name in names
        )
        return tuple((file, _stat_key(os.stat(file))) for file in files)
    except FileNotFoundError:
        return None


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
    name : str, default="X"
        What the source is to the user, for error messages.

    Attributes
    ----------
    max_abs : float or None
        Largest ``|value|`` of the source, measured by :func:`validate_batches`
        in its one pass over the chunks; ``None`` on a view it did not make.

    Notes
    -----
    The file of a memmap or h5py array, or the folder of a zarr array, is
    fingerprinted when the view is made (identity, size and modification time
    of every file) and checked before and after every read: a source that
    changed or vanished raises :class:`SourceChangedError` naming it, instead of
    a crash (a memmap read past a truncated file's end) or of data that silently
    differ between the scans of a fit (a zarr chunk rewritten, or deleted and
    then read as the fill value).  A change within the file system's timestamp
    resolution that keeps the size is not seen.

    Examples
    --------
    >>> import numpy as np
    >>> view = TokenBatches(np.arange(24.0).reshape(4, 6), 3, batch_size=2)
    >>> view.shape, view[1:2].shape, view[np.array([3, 0])][:, 0, 0].tolist()
    ((4, 3, 2), (1, 3, 2), [18.0, 0.0])
    """

    ndim = 3

    def __init__(self, source, n_tokens, batch_size, *, name="X"):
        self.source = source
        n, width = source.shape
        self.shape = (int(n), int(n_tokens), int(width) // int(n_tokens))
        self.batch_size = int(batch_size)
        self.name = name
        self.max_abs = None
        self._location = _source_location(source)
        if self._location is not None:
            self._fingerprint = _fingerprint(self._location)
            self._checked = time.monotonic()

    def check_source(self, *, throttle=False):
        """Raise :class:`SourceChangedError` if the source's files changed since
        the view was made.

        Parameters
        ----------
        throttle : bool, default=False
            Skip the walk of a zarr folder checked less than
            ``_FOLDER_CHECK_INTERVAL`` seconds ago (the reads do; the end of a
            scan and of a fit check in full).
        """
        if self._location is None:
            return
        kind, path = self._location
        if (
            throttle
            and kind == "folder"
            and time.monotonic() - self._checked < _FOLDER_CHECK_INTERVAL
        ):
            return
        now = _fingerprint(self._location)
        if now == self._fingerprint:
            self._checked = time.monotonic()
            return
        what = "was deleted" if now is None else "was modified"
        raise SourceChangedError(
            f"{self.name}'s {kind} {str(path)!r} {what} during the fit, which "
            f"reads it several times; a layer fitted to a mix of old and new data "
            f"would be wrong. Fit again once nothing writes to it (or fit a copy)."
        )

    def __len__(self):
        return self.shape[0]

    def _tokens(self, rows):
        return rows.reshape(rows.shape[0], *self.shape[1:])

    def __getitem__(self, key):
        # before: a memmap read past the end of a cut file crashes the process
        self.check_source(throttle=True)
        rows = self._getitem(key)
        # after: the rows read are those of the fingerprint
        self.check_source(throttle=True)
        return rows

    def _getitem(self, key):
        if isinstance(key, tuple) and len(key) == 2 and key[1] is Ellipsis:
            key = key[0]  # X[rows, ...], as the array API writes X[rows]
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


def _scan_chunks(array, name, batch_size):
    """Numeric dtype, finiteness and largest ``|value|`` of a 2-D source, in one
    pass over its chunks; return the largest ``|value|`` (0.0 when empty).

    The largest ``|value|`` is ``max(|min|, |max|)`` of each chunk (two
    reductions, no temporary array), for the estimators' check of values too
    large for float64 arithmetic (``check_largest_magnitude``); on dask arrays
    the three reductions are one computation, which reads every chunk once.
    """
    dtype = np.dtype(array.dtype)
    if dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must hold numbers, got an array of dtype {dtype}; convert it "
            f"to float64."
        )
    floating = dtype.kind == "f"
    if array.shape[0] == 0 or array.shape[1] == 0:
        return 0.0
    if _is_dask(array):
        import dask
        import dask.array as da

        bad = (~da.isfinite(array)).sum() if floating else 0
        n_bad, high, low = dask.compute(bad, array.max(), array.min())
        n_bad, largest = int(n_bad), max(abs(float(high)), abs(float(low)))
    else:
        n_bad, largest = 0, 0.0
        for start in range(0, array.shape[0], batch_size):
            part = np.asarray(array[start : start + batch_size])
            if floating:
                n_bad += int(part.size - np.count_nonzero(np.isfinite(part)))
            high, low = float(np.max(part)), float(np.min(part))
            largest = max(largest, abs(high), abs(low))
    if n_bad:
        raise ValueError(
            f"{name} contains {n_bad} NaN or infinite value(s); attention layers "
            f"need finite inputs. Remove or impute them first."
        )
    return largest


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

    One pass over each source checks that it holds finite numbers and measures
    its largest ``|value|`` (the views' ``max_abs``), for the estimators' check
    of values too large for float64 arithmetic.

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
        Their ``max_abs`` is the largest ``|value|`` of X and of y.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.lib.format.open_memmap("/tmp/skattn_doc_X.npy", "w+", "f8", (5, 6))
    >>> X[0, 0] = -3.0
    >>> X3, Y3 = validate_batches(X, np.zeros((5, 3)), 3, 2)
    >>> X3.shape, Y3.shape, X3.max_abs, Y3.max_abs
    ((5, 3, 2), (5, 3, 1), 3.0, 0.0)
    """
    from ._validation import resolve_n_tokens

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
    X3 = TokenBatches(X, k, batch_size, name="X")
    Y3 = TokenBatches(y, k, batch_size, name="y")
    rows = max(batch_size, _VALIDATION_ROWS)
    X3.max_abs = _scan_chunks(X, "X", rows)
    Y3.max_abs = _scan_chunks(y, "y", rows)
    X3.check_source()
    Y3.check_source()
    return X3, Y3


def _uses_dask(X, Y):
    """Whether the scans of ``X`` and ``Y`` run as dask tasks (both dask-backed)."""
    return (
        isinstance(X, TokenBatches)
        and isinstance(Y, TokenBatches)
        and _is_dask(X.source)
        and _is_dask(Y.source)
    )


def map_reduce_batches(
    X, Y, func, merge, *, batch_size, samples=None, per_sample=(), name="skattn-scan"
):
    """Partial statistics of every batch of samples, merged: one scan of the data.

    ``func`` turns one batch into partial statistics and ``merge`` combines
    partials; the result is the merge of the partials of all batches, in sample
    order.  ``merge`` must be associative, and exact up to the rounding of
    floating-point sums (sums, counts, concatenations in sample order, the rows
    of smallest keys under a total order), so the result depends on how the
    samples are cut into batches and chunks only by rounding.

    Where the batches are computed:

    * an ndarray, or a :class:`TokenBatches` of a memmap, zarr or h5py array:
      read ``batch_size`` samples at a time and processed in this process;
    * a :class:`TokenBatches` of dask arrays (X and Y): one dask task per chunk
      of X (Y is rechunked to match), named ``(f"{name}-<token>", i)``, reads its
      chunk and runs ``func`` on it in batches of ``batch_size``; on a
      ``dask.distributed`` cluster the tasks run on its workers (when a ``Client``
      is active) and only the partials travel.  With more than 16 chunks the
      partials are first merged in groups of 16 by tasks ``f"{name}-merge-..."``;
      the last merge runs here.

    Parameters
    ----------
    X : ndarray or TokenBatches of shape (n_samples, n_tokens, n_features)
    Y : ndarray or TokenBatches of shape (n_samples, n_tokens, n_outputs)
    func : callable
        ``func(Xb, Yb, idx, *per_sample_b)`` returns the partial statistics of
        the samples ``idx`` (increasing global indices, int64), given their
        float64 tokens ``Xb`` (b, n_tokens, n_features) and ``Yb``
        (b, n_tokens, n_outputs) and their slices of ``per_sample``.  On a
        cluster it is pickled: pass a module-level function or a
        ``functools.partial`` of one.
    merge : callable
        ``merge(parts)`` returns one partial from a list of partials of
        consecutive samples, in sample order.
    batch_size : int
        Samples per call of ``func``.
    samples : ndarray of int, default=None
        Increasing sample indices to visit; ``None`` visits all.
    per_sample : tuple of ndarray of shape (n_samples,), default=()
        Arrays indexed like the samples (e.g. sample weights), sliced for
        ``func``.  A constant array is sent to the dask tasks as its value.
    name : str, default="skattn-scan"
        Prefix of the dask tasks' keys (what a dashboard or
        ``Client.get_task_stream`` shows).

    Returns
    -------
    partial : object or None
        The merge of all partials; ``None`` when no sample is visited.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.arange(12.0).reshape(6, 2, 1); Y = X
    >>> def count_and_sum(Xb, Yb, idx):
    ...     return len(idx), float(Xb.sum())
    >>> def add(parts):
    ...     return tuple(sum(values) for values in zip(*parts))
    >>> map_reduce_batches(X, Y, count_and_sum, add, batch_size=4)
    (6, 66.0)
    >>> map_reduce_batches(X, Y, count_and_sum, add, batch_size=4,
    ...                    samples=np.array([0, 5]))
    (2, 22.0)
    """
    batch_size = max(int(batch_size), 1)
    if samples is not None:
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and np.any(np.diff(samples) <= 0):
            raise ValueError("samples must be increasing sample indices.")
    per_sample = tuple(np.asarray(a) for a in per_sample)
    if _uses_dask(X, Y):
        return _dask_map_reduce(
            X, Y, func, merge, batch_size, samples, per_sample, name
        )
    total = None
    n = len(X)
    visit = range(0, n if samples is None else samples.size, batch_size)
    for start in visit:
        if samples is None:
            key = slice(start, min(start + batch_size, n))
            idx = np.arange(key.start, key.stop, dtype=np.int64)
        else:
            key = idx = samples[start : start + batch_size]
        part = func(X[key], Y[key], idx, *(a[key] for a in per_sample))
        total = part if total is None else merge([total, part])
    check_sources(X, Y)  # every batch of the scan came from the fingerprinted files
    return total


def check_sources(*views):
    """:meth:`TokenBatches.check_source` in full on every view among ``views``.

    Parameters
    ----------
    *views : TokenBatches or ndarray
        Arrays that are not :class:`TokenBatches` are skipped.

    Examples
    --------
    >>> import numpy as np
    >>> check_sources(np.zeros((2, 1, 1)))
    """
    for view in views:
        if isinstance(view, TokenBatches):
            view.check_source()


# Partials of more chunks than this are merged in groups on the dask workers.
_SPLIT_EVERY = 16


def _compact(values):
    """A per-sample array for a dask task: ``("const", v)`` when constant."""
    if values.size and np.all(values == values.flat[0]):
        return ("const", values.flat[0])
    return ("array", values)


def _expand(packed, size):
    kind, values = packed
    return np.full(size, values) if kind == "const" else values


def _chunk_task(xb, yb, start, local, per_sample, func, merge, batch_size, k):
    """One dask chunk: ``func`` over its (selected) samples in batches, merged."""
    xb = np.asarray(xb, dtype=np.float64)
    yb = np.asarray(yb, dtype=np.float64)
    if local is None:
        idx = np.arange(start, start + len(xb), dtype=np.int64)
    else:
        xb, yb, idx = xb[local], yb[local], start + local
    xb = xb.reshape(len(xb), k, -1)
    yb = yb.reshape(len(yb), k, -1)
    per_sample = [_expand(packed, len(idx)) for packed in per_sample]
    total = None
    for s in range(0, len(idx), batch_size):
        sl = slice(s, s + batch_size)
        part = func(xb[sl], yb[sl], idx[sl], *(a[sl] for a in per_sample))
        total = part if total is None else merge([total, part])
    return total


def _dask_map_reduce(X, Y, func, merge, batch_size, samples, per_sample, name):
    import dask
    import dask.array as da

    k = X.shape[1]
    Xs = X.source.rechunk({1: -1})
    Ys = da.asarray(Y.source).rechunk({0: Xs.chunks[0], 1: -1})
    bounds = np.cumsum((0, *Xs.chunks[0]))
    xblocks, yblocks = Xs.to_delayed().ravel(), Ys.to_delayed().ravel()
    token = uuid.uuid4().hex
    parts = []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        lo, hi = int(lo), int(hi)
        if samples is None:
            local, rows = None, slice(lo, hi)
        else:
            a, b = np.searchsorted(samples, [lo, hi])
            if a == b:
                continue
            rows = samples[a:b]
            local = None if rows.size == hi - lo else rows - lo
        task = partial(
            _chunk_task,
            func=func,
            merge=merge,
            batch_size=batch_size,
            k=k,
        )
        parts.append(
            dask.delayed(task, pure=False)(
                xblocks[i],
                yblocks[i],
                lo,
                local,
                [_compact(a[rows]) for a in per_sample],
                dask_key_name=(f"{name}-{token}", i),
            )
        )
    level = 0
    while len(parts) > _SPLIT_EVERY:
        parts = [
            dask.delayed(merge, pure=False)(
                parts[j : j + _SPLIT_EVERY],
                dask_key_name=(f"{name}-merge-{token}", level, j // _SPLIT_EVERY),
            )
            for j in range(0, len(parts), _SPLIT_EVERY)
        ]
        level += 1
    if not parts:
        return None
    try:
        parts = dask.compute(*parts)  # the partials, in chunk order
    except Exception as exc:  # e.g. KilledWorker: keep its type, say which scan
        exc.add_note(
            f"skattn: raised by the dask scan {name!r} of a fit (one task per "
            f"chunk of X); the fit stopped there and fitted nothing."
        )
        raise
    return parts[0] if len(parts) == 1 else merge(list(parts))


def _token_sum_batch(Xb, Yb, idx, w):
    """Phase-1 partial of one batch: ``(gram, cross, v_sq)`` of its token sums."""
    u, v = Xb.sum(axis=1), Yb.sum(axis=1)
    uw = u * w[:, None]
    return uw.T @ u, uw.T @ v, float(np.sum(w * np.sum(v**2, axis=1)))


def _add_parts(parts):
    """Merge of partials that are tuples of sums."""
    return tuple(sum(values[1:], values[0]) for values in zip(*parts, strict=True))


def token_sum_moments(X, Y, sample_weight):
    """Phase-1 statistics of token sums ``u = sum_l x_l``, ``v = sum_l y_l``.

    One scan (:func:`map_reduce_batches`): summed batch by batch, or for dask
    sources per chunk by dask tasks named ``skattn-token-sums`` (on a cluster's
    workers) and the chunks' sums added here.

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
    gram, cross, v_sq = map_reduce_batches(
        X,
        Y,
        _token_sum_batch,
        _add_parts,
        batch_size=getattr(X, "batch_size", 4096),
        per_sample=(sample_weight,),
        name="skattn-token-sums",
    )
    return gram, cross, float(v_sq)
