"""Counting what a fit asks of an array library: operations and host reads.

On a GPU the random-start path is bound by launches and by the host waiting for
the device (a value read by the host, ``float(t)``, ``bool(t)``, a copy to
numpy, waits for every kernel queued before it).  Both show on the CPU too,
where torch CPU tensors take the same code path: :class:`DeviceWork` counts the
torch operations (each a kernel launch on a GPU) and the host reads
(``aten._local_scalar_dense``, and tensors copied to numpy or to lists) while
it is active, by *stage*, so that a benchmark can compare versions and a test can
catch a regression without a GPU.  It also counts, by kind, the other operations
after which a GPU's host waits (``waits``; issue 63): the error checks of
``torch.linalg.cholesky``, ``inv`` and ``solve`` (``_linalg_check_errors``;
``cholesky_ex`` has none), ``eigh`` (its solver's status is read back on CUDA),
``nonzero``, boolean masks (``t[mask]``, ``masked_select``: a shape that
depends on the values), and copies from the host (``torch.asarray`` and its kin
of a numpy array, a list or a number: from pageable memory, a copy that blocks).
``round_trips`` is all of them with the host reads.

A ``TorchDispatchMode`` sees the operations of its own thread only: count a fit
that runs in one thread (``threadpoolctl.threadpool_limits(1)`` and
``torch.set_num_threads(1)``, as :func:`count_fit` does).
"""

import collections
import contextlib
import functools
import sys
import warnings

__all__ = ["CudaSyncs", "DeviceWork", "count_fit"]

# what torch warns at each synchronization under set_sync_debug_mode("warn")
_SYNC_MESSAGE = "called a synchronizing CUDA operation"


class DeviceWork:
    """Torch operations and host reads, counted by stage while active.

    Use it as a context manager; :meth:`stage` names the stage that the counts
    go to (``"other"`` outside any), and :meth:`wrap` makes a function count as
    a stage whenever it runs.

    Parameters
    ----------
    where : bool, default=False
        Also count the host reads and copies by the skattn function that made
        them (``reads_by_source``, ``copies_by_source``; a walk up the stack at
        each).

    Attributes
    ----------
    operations, host_reads : collections.Counter
        Counts by stage.
    waits : dict of collections.Counter
        By stage, the operations after which a GPU's host waits, by kind
        (``"linalg check"``, ``"eigh"``, ``"nonzero"``, ``"boolean mask"``,
        ``"host copy"``).
    reads_by_source, copies_by_source : collections.Counter
        With ``where``: host reads and copies from the host by
        ``"module.function:line"`` of the innermost skattn frame that made them
        (the array helpers' frames skipped).

    Examples
    --------
    >>> import torch
    >>> from skattn.utils._device_work import DeviceWork
    >>> with DeviceWork() as work:
    ...     with work.stage("sum"):
    ...         total = float(torch.ones(3).sum())
    >>> work.host_reads["sum"], work.operations["sum"] >= 2
    (1, True)
    >>> with DeviceWork() as work:
    ...     factor = torch.linalg.cholesky(torch.eye(2))  # checked on the host
    ...     factor, info = torch.linalg.cholesky_ex(torch.eye(2))  # not
    >>> dict(work.waits["other"]), work.round_trips()["other"]
    ({'linalg check': 1}, 1)
    """

    def __init__(self, where=False):
        self.operations = collections.Counter()
        self.host_reads = collections.Counter()
        self.reads_by_source = collections.Counter()
        self.copies_by_source = collections.Counter()
        self.waits = collections.defaultdict(collections.Counter)
        self._where = where
        self._stages = ["other"]
        self._mode = None
        self._patched = []

    @contextlib.contextmanager
    def stage(self, name):
        """Count as stage ``name`` (nested stages count as the innermost)."""
        self._stages.append(name)
        try:
            yield
        finally:
            self._stages.pop()

    def wrap(self, function, name):
        """``function``, counting as stage ``name`` while it runs."""

        @functools.wraps(function)
        def counted(*args, **kwargs):
            with self.stage(name):
                return function(*args, **kwargs)

        return counted

    def _read(self):
        self.host_reads[self._stages[-1]] += 1
        if self._where:
            self.reads_by_source[_skattn_caller()] += 1

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        work = self
        aten = torch.ops.aten
        scalar = aten._local_scalar_dense.default
        waiting = {
            aten._linalg_check_errors.default: "linalg check",
            aten._linalg_eigh.default: "eigh",
            aten._linalg_eigh.eigenvalues: "eigh",
            aten.nonzero.default: "nonzero",
            aten.masked_select.default: "boolean mask",
        }
        index = aten.index.Tensor

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                stage = work._stages[-1]
                work.operations[stage] += 1
                if func is scalar:
                    work._read()
                elif func in waiting:
                    work.waits[stage][waiting[func]] += 1
                elif func is index and _has_mask(args[1]):
                    work.waits[stage]["boolean mask"] += 1
                return func(*args, **(kwargs or {}))

        # copies to the host that no torch operation shows: to numpy, to lists
        for name in ("numpy", "tolist", "__array__"):
            original = getattr(torch.Tensor, name)

            def copying(tensor, *args, _original=original, **kwargs):
                work._read()
                return _original(tensor, *args, **kwargs)

            self._patched.append((torch.Tensor, name, original))
            setattr(torch.Tensor, name, copying)
        # copies from the host (a numpy array, a list, a Python number made a
        # tensor): on a GPU a copy from pageable memory, which blocks the host
        for name in ("asarray", "as_tensor", "tensor"):
            original = getattr(torch, name)

            def uploading(data, *args, _original=original, **kwargs):
                if not isinstance(data, torch.Tensor):
                    work.waits[work._stages[-1]]["host copy"] += 1
                    if work._where:
                        work.copies_by_source[_skattn_caller()] += 1
                return _original(data, *args, **kwargs)

            self._patched.append((torch, name, original))
            setattr(torch, name, uploading)
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        return False

    def round_trips(self):
        """By stage, every operation after which a GPU's host waits: the host
        reads and the :attr:`waits` of every kind."""
        trips = collections.Counter(self.host_reads)
        for stage, kinds in self.waits.items():
            trips[stage] += sum(kinds.values())
        return trips

    def summary(self):
        """``{stage: {"operations": n, "host_reads": n, "waits": {kind: n},
        "round_trips": n}}``, and a ``"total"``."""
        stages = sorted(set(self.operations) | set(self.host_reads) | set(self.waits))
        trips = self.round_trips()
        table = {
            stage: {
                "operations": self.operations[stage],
                "host_reads": self.host_reads[stage],
                "waits": dict(self.waits[stage]),
                "round_trips": trips[stage],
            }
            for stage in stages
        }
        waits = collections.Counter()
        for kinds in self.waits.values():
            waits.update(kinds)
        table["total"] = {
            "operations": sum(self.operations.values()),
            "host_reads": sum(self.host_reads.values()),
            "waits": dict(waits),
            "round_trips": sum(trips.values()),
        }
        return table


class CudaSyncs:
    """The host's synchronizations with a CUDA device, by stage, as torch sees
    them (issue 63).

    :class:`DeviceWork` counts on the CPU what should make a GPU wait; this
    counts what does: while active, ``torch.cuda.set_sync_debug_mode("warn")``
    makes torch warn at every synchronizing CUDA operation (a copy to the host, a
    scalar read, ``nonzero``, a solver status read back...), and each such
    warning counts for the stage that runs (:meth:`stage`, :meth:`wrap`, as
    :class:`DeviceWork`'s), without reaching the user.  Other warnings go on to
    ``keep`` (a list of :class:`warnings.WarningMessage`) where one is given,
    else as usual.  A warning costs the host a few microseconds: negligible
    beside a synchronization, which is what it counts.

    Parameters
    ----------
    keep : list or None, default=None
        Where the other warnings go.
    stages : iterable of (module, name, stage), default=()
        Functions ``module.name`` whose calls count as ``stage`` while active
        (patched, as :func:`count_fit` does).

    Attributes
    ----------
    syncs : collections.Counter
        Synchronizations by stage.
    """

    def __init__(self, keep=None, stages=()):
        self.syncs = collections.Counter()
        self._keep = keep
        self._patches = list(stages)
        self._stages = ["other"]

    stage = DeviceWork.stage
    wrap = DeviceWork.wrap

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if _SYNC_MESSAGE in str(message):
            self.syncs[self._stages[-1]] += 1
        elif self._keep is not None:
            self._keep.append(
                warnings.WarningMessage(message, category, filename, lineno, file, line)
            )
        else:
            self._shown(message, category, filename, lineno, file, line)

    def __enter__(self):
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=_SYNC_MESSAGE)
        self._shown = warnings.showwarning
        warnings.showwarning = self._show
        self._patched = _stages_counted(self, self._patches)
        self._patched.__enter__()
        self._mode = None
        if torch.cuda.is_available():  # else nothing synchronizes: nothing warns
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import torch

        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._patched.__exit__(*exc)
        self._catch.__exit__(*exc)
        return False


@contextlib.contextmanager
def _stages_counted(counter, stages):
    """Functions ``module.name`` counting as ``stage`` for ``counter`` (a
    :class:`DeviceWork` or :class:`CudaSyncs`) while active: patched where their
    callers look them up, restored after."""
    stages = list(stages)
    saved = [getattr(module, name) for module, name, _ in stages]
    try:
        for (module, name, stage), function in zip(stages, saved, strict=True):
            setattr(module, name, counter.wrap(function, stage))
        yield
    finally:
        for (module, name, _), function in zip(stages, saved, strict=True):
            setattr(module, name, function)


def _has_mask(indices):
    """Whether an ``aten.index`` call's indices hold a boolean mask (its result's
    shape depends on the mask's values: the host waits for them)."""
    import torch

    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()
    )


# helpers whose reads and copies are their callers' (the caller is named)
_HELPERS = (__name__, "skattn.utils._array_api")


def _skattn_caller():
    """``"module.function:line"`` of the innermost skattn frame on the stack
    (this module's and the array helpers' frames skipped: a read by
    ``to_numpy`` is named by its caller)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("skattn.") and module not in _HELPERS:
            return f"{module}.{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside skattn"


def count_fit(estimator, X, y, stages=(), where=False):
    """Fit ``estimator`` on torch tensors ``X``, ``y`` (CPU) under the array API
    dispatch, in one thread, counting the work by stage.

    Parameters
    ----------
    estimator : estimator
        Fitted in place.
    X, y : torch tensors
        The data, on the CPU.
    stages : iterable of (module, name, stage)
        Functions ``module.name`` whose calls count as ``stage`` (patched while
        the fit runs: name them where their caller looks them up).
    where : bool, default=False
        Count the host reads by source too (:class:`DeviceWork`).

    Returns
    -------
    estimator, work : the fitted estimator and its :class:`DeviceWork`.

    Needs torch, and ``SCIPY_ARRAY_API=1`` set before scipy was imported.
    """
    import torch
    from sklearn import config_context
    from threadpoolctl import threadpool_limits

    work = DeviceWork(where=where)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with (
            _stages_counted(work, stages),
            threadpool_limits(1),
            config_context(array_api_dispatch=True),
            work,
        ):
            estimator.fit(X, y)
    finally:
        torch.set_num_threads(threads)
    return estimator, work
