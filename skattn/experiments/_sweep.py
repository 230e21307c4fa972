"""recovery_sweep: a grid of planted recoveries run through joblib, one row per fit.

The grid is learner x planted-layer settings x n_samples x noise x seed.  Each cell
is one fit, run by :func:`_run_cell` (a pure function of the cell: it plants the
layer, draws the data, fits, measures and returns a flat row, or the error).  The
fits go through :class:`joblib.Parallel`, so the engine is joblib's: local
processes by default, a Dask cluster under ``joblib.parallel_backend("dask")``
(opened here when a scheduler address is given).  The main process writes each
finished row to the output file (atomically: a temporary file renamed over it), so
an interrupted sweep resumes where it stopped, losing no finished row.
"""

import contextlib
import inspect
import json
import math
import os
import tempfile
import time
import warnings
from itertools import product
from numbers import Integral, Real
from pathlib import Path

import numpy as np
from sklearn.base import clone

from ..utils._optional import require
from ._config import PLANTED_KEYS, seed_list

# The planted layer of a cell when the sweep does not set a key.
DEFAULT_PLANTED = {
    "n_heads": 1,
    "n_tokens": 4,
    "n_features": 4,
    "n_outputs": None,
    "attention_scale": 2.0,
    "distribution": "boolean",
    "structure": "random",
    "head_rank": None,
}
# A learner parameter with this value takes the cell's planted value of the same name.
PLANTED = "planted"
# Columns of a result row, in file order.
SETTING_COLUMNS = ("learner", "estimator", *PLANTED_KEYS, "n_samples", "noise", "seed")
RESULT_COLUMNS = (
    "status",
    "error",
    "success",
    "precision",
    "stop_reason",
    "learner_tol",
    "attention_error",
    "projection_error",
    "prediction_error",
    "test_r2",
    "fit_seconds",
    "n_iter",
    "n_heads_fitted",
    "hull_gap_ratio",
    "certified_fraction",
    "n_warnings",
    "warnings",
    "phase_summary",
)
COLUMNS = ("cell_id", *SETTING_COLUMNS, *RESULT_COLUMNS)
# The stopping tolerance of each skattn learner (its value is the column
# learner_tol), and the value a sweep gives it when the learner leaves it at its
# default (tighten_tol=True; None: the default is kept).  tol=0 trains the gradient
# baseline until no step decreases the loss: the rounding floor (about 1e-16 on
# noise-free data) that the phased learner's polish reaches with its default, where
# the default tol=1e-6 stops near 1e-6, on either side of success_tol=1e-6.
STOPPING_TOL = {
    "GradientAttentionRegressor": ("tol", 0.0),
    "MultiHeadAttentionRegressor": ("polish_tol", None),
}
# The column stop_reason compares learners in three outcomes: a tolerance met
# ("tol"), the rounding floor ("no_progress"), the budget ("max_iter"); the
# solvers' own words (skattn.solvers.STOP_REASONS) map to them.
_STOP_REASONS = {
    "step": "tol",
    "gradient": "tol",
    "residual": "tol",
    "start": "tol",
    "no_decrease": "no_progress",
}
_SCHEDULER_TIMEOUT = 10  # seconds a scheduler has to answer


def _require(module, caller):
    """Import an optional dependency or say which extra installs it."""
    extra = {"pandas": "sweep", "distributed": "dask", "dask": "dask"}[module]
    return require(module, extra=extra, feature=caller)


def _as_list(value, name, kind, check):
    is_list = isinstance(value, list | tuple | range | np.ndarray)
    values = list(value) if is_list else [value]
    if not values:
        raise ValueError(f"{name} is an empty list; give at least one value.")
    for v in values:
        if not check(v):
            raise ValueError(f"{name} must hold {kind}, got {v!r} in {value!r}.")
    return values


def _check_grid(learners, planted, n_samples, noise, seeds, tighten_tol=True):
    """Validate every argument that defines the grid; return the expanded axes.

    Before any fit: the planted settings against the constraints of
    ``make_attention_regression`` (each value, then each planted layer of the
    grid, drawn once with one example), and every learner's parameters as each
    cell will set them (``"planted"`` values, ``n_tokens``, the seed and the
    tightened tolerance filled in), through the estimator's own parameter
    validation.  A ``ValueError`` names the learner or the planted key.
    """
    if not isinstance(learners, dict) or not learners:
        raise TypeError(
            f"learners must be a non-empty dict mapping a name to an unfitted "
            f"estimator, got {type(learners).__name__}."
        )
    for name, est in learners.items():
        if not (hasattr(est, "fit") and hasattr(est, "get_params")):
            raise TypeError(
                f"learners[{name!r}] must be a scikit-learn estimator, got "
                f"{type(est).__name__}."
            )
        for param, value in est.get_params(deep=False).items():
            if isinstance(value, str) and value == PLANTED:
                if param not in PLANTED_KEYS:
                    raise ValueError(
                        f"learners[{name!r}] has {param}='planted', but only the "
                        f"planted keys {list(PLANTED_KEYS)} can follow the planted "
                        f"layer."
                    )
    planted = dict(planted or {})
    unknown = sorted(set(planted) - set(PLANTED_KEYS))
    if unknown:
        raise ValueError(
            f"planted has unknown key(s) {unknown}; allowed keys are "
            f"{list(PLANTED_KEYS)}."
        )
    axes = {}
    for key, default in DEFAULT_PLANTED.items():
        axes[key] = (
            list(planted[key])
            if isinstance(planted.get(key), list | tuple | range)
            else [planted.get(key, default)]
        )
    positive_int = lambda v: _is_int(v) and v > 0  # noqa: E731
    for key in ("n_heads", "n_tokens", "n_features"):
        _as_list(axes[key], f"planted[{key!r}]", "positive integers", positive_int)
    _as_list(
        axes["n_outputs"],
        "planted['n_outputs']",
        "positive integers or None",
        lambda v: v is None or positive_int(v),
    )
    axes["n_samples"] = _as_list(n_samples, "n_samples", "positive ints", positive_int)
    axes["noise"] = _as_list(
        noise,
        "noise",
        "non-negative numbers",
        lambda v: isinstance(v, Real) and not isinstance(v, bool) and v >= 0,
    )
    axes["seed"] = seed_list(seeds)
    _check_planted(axes)
    _check_learners(learners, axes, tighten_tol)
    return axes


def _is_int(value):
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_planted(axes):
    """Each planted value, then each planted layer of the grid, as
    ``make_attention_regression`` will see them: a ``ValueError`` naming the
    key (or the layer's settings), before any fit."""
    from sklearn.utils._param_validation import (
        InvalidParameterError,
        validate_parameter_constraints,
    )

    from ..datasets import make_attention_regression
    from ..datasets._generators import _REGRESSION_PARAMETERS

    for key in ("attention_scale", "distribution", "structure", "head_rank"):
        for value in axes[key]:
            if isinstance(value, bool):  # scikit-learn takes a bool for a number
                raise ValueError(
                    f"planted[{key!r}]={value!r}: give a value of "
                    f"make_attention_regression's {key}, not a boolean."
                )
            try:
                validate_parameter_constraints(
                    {key: _REGRESSION_PARAMETERS[key]},
                    {key: value},
                    caller_name="make_attention_regression",
                )
            except InvalidParameterError as exc:
                raise ValueError(f"planted[{key!r}]={value!r}: {exc}") from None
    seed = max(axes["seed"])
    for values in product(*(_distinct(axes[key]) for key in PLANTED_KEYS)):
        layer = dict(zip(PLANTED_KEYS, values, strict=True))
        try:
            make_attention_regression(
                1,
                layer["n_tokens"],
                layer["n_features"],
                layer["n_heads"],
                n_outputs=layer["n_outputs"],
                distribution=layer["distribution"],
                attention_scale=layer["attention_scale"],
                structure=layer["structure"],
                head_rank=layer["head_rank"],
                random_state=seed,
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"the planted layer {layer} is invalid: {exc}") from None


def _distinct(values):
    """``values`` without repeats (by identity for unhashable objects), in order."""
    seen, kept = [], []
    for value in values:
        if not any(value is s or (type(value) is type(s) and value == s) for s in seen):
            seen.append(value)
            kept.append(value)
    return kept


def _check_learners(learners, axes, tighten_tol):
    """Every learner's parameters as the cells will set them, validated by the
    estimator itself (scikit-learn's ``_validate_params``): a ``ValueError``
    naming the learner, before any fit."""
    seed = max(axes["seed"])
    for name, est in learners.items():
        if not callable(getattr(est, "_validate_params", None)):
            continue  # not a scikit-learn estimator with declared constraints
        params = est.get_params(deep=False)
        keys = [k for k, v in params.items() if isinstance(v, str) and v == PLANTED]
        if params.get("n_tokens", False) is None:
            keys.append("n_tokens")
        for values in product(*(_distinct(axes[key]) for key in keys)):
            cell = dict(zip(keys, values, strict=True), seed=seed)
            try:
                _configured(est, cell, tighten_tol)._validate_params()
            except (ValueError, TypeError) as exc:
                where = ", ".join(f"{k}={cell[k]!r}" for k in keys)
                where = f" (in the cells of {where})" if keys else ""
                raise ValueError(f"learners[{name!r}]{where}: {exc}") from None


def _expand(learners, axes):
    """One dict per cell: the learner name and every setting."""
    keys = list(axes)
    cells = []
    for name in learners:
        for values in product(*(axes[key] for key in keys)):
            cell = {"learner": name, "estimator": type(learners[name]).__name__}
            cell.update(zip(keys, values, strict=True))
            cell = {key: cell[key] for key in SETTING_COLUMNS}
            cell["cell_id"] = cell_id(cell)
            cells.append(cell)
    return cells


def cell_id(cell):
    """A stable text key of one cell: its settings as sorted JSON.

    Parameters
    ----------
    cell : dict
        The settings of a fit (the columns ``learner`` ... ``seed`` of a row).

    Returns
    -------
    key : str

    Examples
    --------
    >>> from skattn.experiments import cell_id
    >>> cell_id({"seed": 1, "learner": "phased"})
    '{"learner": "phased", "seed": 1}'
    """
    return json.dumps(
        {key: _plain(cell[key]) for key in SETTING_COLUMNS if key in cell},
        sort_keys=True,
    )


def _plain(value):
    """A numpy scalar as the Python scalar JSON writes."""
    return value.item() if isinstance(value, np.generic) else value


def _configured(estimator, cell, tighten_tol=False):
    """The learner of a cell: cloned, 'planted' parameters and n_tokens filled in.

    With ``tighten_tol``, a stopping tolerance of :data:`STOPPING_TOL` left at its
    default takes the sweep's value.
    """
    est = clone(estimator)
    params = est.get_params(deep=False)
    update = {
        key: cell[key]
        for key, value in params.items()
        if isinstance(value, str) and value == PLANTED
    }
    if "n_tokens" in params and params["n_tokens"] is None:
        update["n_tokens"] = cell["n_tokens"]  # else a 2-D X means one token
    if "random_state" in params:
        update["random_state"] = cell["seed"]
    name, value = STOPPING_TOL.get(type(est).__name__, (None, None))
    if tighten_tol and value is not None and name in params:
        default = inspect.signature(type(est)).parameters[name].default
        if params[name] == default:
            update[name] = value
    return est.set_params(**update)


def _stopping(estimator):
    """``(stop_reason, learner_tol)`` of a fitted learner.

    ``stop_reason`` is ``"tol"`` (its tolerance met), ``"no_progress"`` (no step
    decreases the loss: the rounding floor), ``"max_iter"`` (the iteration cap),
    another solver's reason, ``"no_polish"`` (the phased learner with
    ``polish=False``), ``"closed_form"`` (no iterations: one token, or a learner
    that solves in closed form) or ``"not_recorded"`` (an estimator that does not
    say).
    """
    name, _ = STOPPING_TOL.get(type(estimator).__name__, (None, None))
    tol = float(getattr(estimator, name)) if name else np.nan
    reason = getattr(estimator, "stop_reason_", None)
    reports = getattr(estimator, "phase_report_", None)
    if reason is None and reports is not None:
        polish = [r for r in reports if r.phase == "6-polish"]
        if polish:
            reason = polish[-1].info.get("stop_reason", "not_recorded")
        elif getattr(estimator, "polish", True) is False:
            reason = "no_polish"
        else:
            reason = "closed_form"
    elif reason is None:
        reason = "not_recorded" if hasattr(estimator, "n_iter_") else "closed_form"
    return _STOP_REASONS.get(reason, reason), tol


def _phase_summary(estimator):
    """Scalar findings of each phase report, and two headline numbers."""
    reports = getattr(estimator, "phase_report_", None) or []
    summary, gap, certified = [], np.nan, np.nan
    for report in reports:
        entry = {"phase": report.phase, "round": report.round}
        entry["seconds"] = round(float(report.seconds), 6)
        for key, value in report.info.items():
            if isinstance(value, bool | str | Integral | Real | np.generic):
                entry[key] = _plain(value)
        summary.append(entry)
        if report.phase == "2-4-hull-selected":
            gap = float(report.info.get("augmented_gap_ratio", np.nan))
            certified = float(report.info.get("certified_fraction", np.nan))
    return json.dumps(summary, default=str), gap, certified


def _optional_int(value):
    """An int, or None for None or NaN (a missing value read back from a table)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value)


def _run_cell(estimator, cell, n_test, success_tol, tighten_tol=True):
    """Plant, sample, fit and measure one cell; a failure becomes the row's error.

    Returns
    -------
    row : dict
        Every column of ``COLUMNS``.
    """
    from ..datasets import make_attention_regression, sample_inputs
    from ..metrics import parameter_error, prediction_error

    row = dict(cell)
    row.update(dict.fromkeys(RESULT_COLUMNS, np.nan))
    row.update(status="failed", error="", success=False, warnings="[]")
    row["n_warnings"], row["phase_summary"] = 0, "[]"
    seed = int(cell["seed"])
    caught = []
    try:
        X, y, layer = make_attention_regression(
            int(cell["n_samples"]),
            int(cell["n_tokens"]),
            int(cell["n_features"]),
            int(cell["n_heads"]),
            n_outputs=cell["n_outputs"],
            distribution=cell["distribution"],
            noise=float(cell["noise"]),
            attention_scale=float(cell["attention_scale"]),
            structure=cell["structure"],
            head_rank=_optional_int(cell["head_rank"]),
            random_state=seed,
            return_layer=True,
        )
        X_test = sample_inputs(
            cell["distribution"],
            n_test,
            int(cell["n_tokens"]),
            int(cell["n_features"]),
            random_state=np.random.default_rng([seed, 1]),
        )
        est = _configured(estimator, cell, tighten_tol)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            est.fit(X, y)
            row["fit_seconds"] = time.perf_counter() - start
        row["prediction_error"] = float(prediction_error(layer, est, X_test))
        row["test_r2"] = float(est.score(X_test, layer.transform(X_test)))
        try:
            errors = parameter_error(layer, est)
            row["attention_error"] = float(errors.attention_error)
            row["projection_error"] = float(errors.projection_error)
            row["precision"] = max(row["attention_error"], row["projection_error"])
            row["success"] = bool(row["precision"] <= success_tol)
        except (TypeError, ValueError):  # no heads to compare (e.g. random features)
            pass
        row["stop_reason"], row["learner_tol"] = _stopping(est)
        n_iter = getattr(est, "n_iter_", None)
        row["n_iter"] = np.nan if n_iter is None else float(np.max(n_iter))
        row["n_heads_fitted"] = float(getattr(est, "n_heads_", np.nan))
        summary, row["hull_gap_ratio"], row["certified_fraction"] = _phase_summary(est)
        row["phase_summary"] = summary
        row["status"] = "ok"
    except Exception as exc:  # a failed fit is a row, not a crash
        row["error"] = f"{type(exc).__name__}: {exc}"
    messages = [f"{w.category.__name__}: {w.message}" for w in caught]
    row["n_warnings"] = len(messages)
    row["warnings"] = json.dumps(messages)
    return row


class _ResultFile:
    """The sweep's output: read the finished cells, rewrite the file as rows finish.

    Every write is atomic: the whole table goes to a temporary file in the same
    folder, is flushed to disk (``fsync``) and renamed over the result file
    (``os.replace``), so a sweep killed at any moment leaves either the old or
    the new complete file, readable by anyone at every moment, and a rerun finds
    every row written before the kill.  An existing file is checked before it is
    used: one that cannot be parsed, was cut short or is not a sweep's result
    file is an error that names it, never silently repaired.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.format = self.path.suffix.lower().lstrip(".")
        if self.format not in ("csv", "parquet"):
            raise ValueError(
                f"output={str(path)!r} must end in .csv or .parquet (the format of "
                f"the results file)."
            )
        self.pd = _require("pandas", "recovery_sweep")
        self._check_writable()
        self.frame = self._read()

    def _check_writable(self):
        parent = self.path.parent
        if not parent.is_dir():
            raise ValueError(
                f"output={str(self.path)!r}: the folder {str(parent)!r} does not "
                f"exist; create it first."
            )
        try:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".skattn-probe-"):
                pass
            if self.path.exists():
                with self.path.open("ab"):
                    pass
        except OSError as exc:
            raise ValueError(
                f"output={str(self.path)!r} is not writable ({exc}); choose another "
                f"path or fix its permissions."
            ) from exc

    def _invalid(self, reason):
        return ValueError(
            f"output={str(self.path)!r} exists but {reason}, so it is not a "
            f"sweep's result file as recovery_sweep writes it (a truncated copy, "
            f"or another file); nothing was changed. Move it away or pass another "
            f"output path."
        )

    def _read(self):
        if not self.path.exists():
            return None
        if self.path.stat().st_size == 0:
            raise self._invalid("is empty")
        try:
            if self.format == "csv":
                with self.path.open("rb") as file:
                    file.seek(-1, os.SEEK_END)
                    if file.read(1) != b"\n":
                        raise self._invalid("does not end with a newline (cut short)")
                frame = self.pd.read_csv(
                    self.path, keep_default_na=False, na_values=[""]
                )
            else:
                frame = self.pd.read_parquet(self.path)
        except ValueError as exc:
            if str(exc).startswith(f"output={str(self.path)!r}"):
                raise
            raise self._invalid(
                f"cannot be read as {self.format} ({type(exc).__name__}: {exc})"
            ) from exc
        except Exception as exc:
            raise self._invalid(
                f"cannot be read as {self.format} ({type(exc).__name__}: {exc})"
            ) from exc
        self._check_rows(frame)
        return frame

    def _check_rows(self, frame):
        """Every row of a sweep's file has a cell key, its settings and a status."""
        missing = [c for c in ("cell_id", *SETTING_COLUMNS, "status") if c not in frame]
        if missing:
            raise self._invalid(f"has no column(s) {missing}")
        status = frame["status"]
        bad = ~status.isin(["ok", "failed"])
        for i, key in enumerate(frame["cell_id"]):
            if bad.iloc[i] or not _is_cell_key(key):
                raise self._invalid(
                    f"has a damaged row {i + 2} (cell_id={key!r}, "
                    f"status={status.iloc[i]!r})"
                )

    def done(self, retry_failed):
        if self.frame is None:
            return set()
        frame = self.frame
        if retry_failed:
            frame = frame[frame["status"] == "ok"]
        return set(frame["cell_id"])

    def append(self, row):
        new = self.pd.DataFrame([row], columns=list(COLUMNS))
        frame = new if self.frame is None else self._concat(self.frame, new)
        self._write_atomically(frame)
        self.frame = frame

    def _write_atomically(self, frame):
        """Write ``frame`` to a temporary file, fsync it, rename it over the file."""
        fd, tmp = tempfile.mkstemp(
            dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
        )
        try:
            with os.fdopen(fd, "wb") as file:
                if self.format == "csv":
                    frame.to_csv(file, index=False)
                else:
                    frame.to_parquet(file, index=False)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, self.path)  # atomic: readers see the old or new file
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_folder(self.path.parent)

    def _concat(self, old, new):
        with warnings.catch_warnings():  # all-NaN columns in one frame: fine here
            warnings.simplefilter("ignore", FutureWarning)
            return self.pd.concat([old, new], ignore_index=True)


def _check_columns(frame, output):
    """A result file of another skattn version cannot take this one's rows."""
    if list(frame.columns) != list(COLUMNS):
        missing = [c for c in COLUMNS if c not in frame.columns]
        extra = [c for c in frame.columns if c not in COLUMNS]
        raise ValueError(
            f"output={str(output)!r} was written by another version of skattn: its "
            f"columns differ (missing {missing}, unknown {extra}); pass another "
            f"output path (a rerun cannot resume into it)."
        )


def _is_cell_key(key):
    """Whether ``key`` is a cell_id: the JSON object of a cell's settings."""
    try:
        settings = json.loads(key)
    except (TypeError, ValueError):
        return False
    return (
        isinstance(settings, dict)
        and "learner" in settings
        and set(settings) <= set(SETTING_COLUMNS)
    )


def _fsync_folder(folder):
    """Make a rename in ``folder`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _connect(scheduler):
    """A Client of the scheduler, or a ValueError when it does not answer."""
    distributed = _require("distributed", "recovery_sweep(scheduler=...)")
    _require("dask", "recovery_sweep(scheduler=...)")
    try:
        return distributed.Client(scheduler, timeout=_SCHEDULER_TIMEOUT)
    except (OSError, TimeoutError, ValueError) as exc:
        raise ValueError(
            f"scheduler={scheduler!r} did not answer within {_SCHEDULER_TIMEOUT} s "
            f"({type(exc).__name__}: {exc}); start one with `dask scheduler` (and "
            f"`dask worker ADDRESS`), fix the address, or drop scheduler to run on "
            f"local processes."
        ) from exc


def recovery_sweep(
    learners,
    *,
    n_samples,
    planted=None,
    noise=(0.0,),
    seeds=(0,),
    output=None,
    n_jobs=-1,
    scheduler=None,
    n_test=1000,
    success_tol=1e-6,
    tighten_tol=True,
    retry_failed=False,
    progress=True,
):
    """Fit every learner on every planted setting of a grid; one row per fit.

    The grid is learner x planted-layer settings x ``n_samples`` x ``noise`` x
    ``seeds``.  Each cell plants a layer with
    :func:`~skattn.datasets.make_attention_regression` (``random_state=seed``),
    fits a clone of the learner (``random_state=seed``) and measures it on
    ``n_test`` fresh noise-free examples.  Every argument is checked before any
    fit starts: the planted settings against the constraints of
    ``make_attention_regression`` and every learner's parameters as the cells
    set them (the estimator's own validation), each a ``ValueError`` naming the
    learner or the key.  A fit that still raises is a row with
    ``status="failed"`` and its error, not a crash.

    The fits run through :class:`joblib.Parallel`: on local processes by default
    (``n_jobs``), on a Dask cluster when ``scheduler`` is given (a
    ``dask.distributed.Client`` under ``joblib.parallel_backend("dask")``), or on
    whatever joblib backend is active around the call.  Finished rows are
    written to ``output`` as they arrive; a rerun with the same ``output`` skips
    the cells already there.

    Parameters
    ----------
    learners : dict of str to estimator
        Name -> unfitted estimator.  A parameter set to the string
        ``"planted"`` takes the cell's planted value of the same name (e.g.
        ``n_heads="planted"``); ``n_tokens=None`` becomes the planted
        ``n_tokens``; ``random_state`` becomes the seed.
    n_samples : int or list of int
        Training examples per fit (a grid axis).
    planted : dict, default=None
        Settings of the planted layer, each a value or a list of values (a grid
        axis): ``n_heads``, ``n_tokens``, ``n_features``, ``n_outputs``,
        ``attention_scale``, ``distribution``, ``structure`` (arguments of
        ``make_attention_regression``).  Missing keys take the values 1, 4, 4,
        None, 2.0, "boolean", "random".
    noise : float or list of float, default=(0.0,)
        Label noise levels (a grid axis).
    seeds : int or iterable of int, default=(0,)
        Seeds (a grid axis): the planted layer, the data and the learner's
        ``random_state`` of a cell.  An int is a number of seeds, as in a TOML
        config: ``seeds=10`` runs the seeds 0 .. 9 (``range(10)``); a single
        seed s is ``[s]``.  Any other iterable of distinct non-negative ints
        (list, tuple, ``range``, array) is the seeds themselves.
    output : str or path-like, default=None
        Result file, ``.csv`` or ``.parquet``, rewritten atomically after every
        fit (a temporary file renamed over it), so that it is complete and
        readable at every moment, even when the sweep is killed.  When it
        exists, its finished cells are skipped; a file that cannot be read, was
        cut short or is not a sweep's result file raises a ``ValueError`` that
        names it.  ``None`` keeps the results in memory only.
    n_jobs : int, default=-1
        Parallel fits on local processes (joblib's ``n_jobs``); ignored by a Dask
        backend, which uses its workers.
    scheduler : str, default=None
        Address of a Dask scheduler (``"tcp://host:8786"``): the fits run on its
        workers.  It must answer within 10 s.
    n_test : int, default=1000
        Noise-free test examples per fit.
    success_tol : float, default=1e-6
        A fit is a success when both head-matched parameter errors are at most
        this (when its ``precision`` is).
    tighten_tol : bool, default=True
        Run the learners to the precision they can reach, so that success
        measures the learner and not its stopping rule: a learner whose
        stopping tolerance is at its default takes the sweep's instead
        (``GradientAttentionRegressor``: ``tol=0``, train until no step
        decreases the loss, the rounding floor that
        ``MultiHeadAttentionRegressor``'s polish reaches by default; its default
        ``tol=1e-6`` stops near 1e-6 parameter error, on either side of the
        default ``success_tol``).  A tolerance the learner sets to another
        value is kept.  ``False`` keeps every learner's defaults.  The column
        ``learner_tol`` holds the tolerance used, ``stop_reason`` why the fit
        stopped.
    retry_failed : bool, default=False
        Rerun the cells whose row in ``output`` failed (their old rows stay in
        the file; the returned frame keeps the newest).
    progress : bool, default=True
        Show a progress bar over the fits (tqdm).

    Returns
    -------
    results : pandas.DataFrame
        One row per cell of the grid, in grid order: ``cell_id``, the settings
        (``learner``, ``estimator``, the planted keys, ``n_samples``, ``noise``,
        ``seed``), ``status``, ``error``, ``success``, ``precision`` (the larger
        head-matched parameter error, the one ``success`` compares with
        ``success_tol``), ``stop_reason`` (``"tol"``: the learner's tolerance
        met; ``"no_progress"``: no step decreases the loss, the rounding floor;
        ``"max_iter"``: its iteration cap; ``"no_polish"``, ``"closed_form"``:
        no iterative stop), ``learner_tol`` (the stopping tolerance used:
        ``tol`` of the gradient baseline, ``polish_tol`` of the phased
        learner), ``attention_error``,
        ``projection_error``, ``prediction_error``, ``test_r2``,
        ``fit_seconds``, ``n_iter``, ``n_heads_fitted``, ``hull_gap_ratio``,
        ``certified_fraction`` (of the hull the phased learner kept),
        ``n_warnings``,
        ``warnings`` and ``phase_summary`` (JSON).  ``results.attrs["n_fitted"]``
        is the number of fits this call ran.

    See Also
    --------
    SweepCurveDisplay : success rate or error against n from the results.
    PhaseDiagramDisplay : a value over two axes of the grid.

    Examples
    --------
    >>> from skattn import GradientAttentionRegressor
    >>> from skattn.experiments import recovery_sweep
    >>> results = recovery_sweep(
    ...     {"gradient": GradientAttentionRegressor(n_heads="planted")},
    ...     n_samples=[100, 200], planted={"n_tokens": 2, "n_features": 3},
    ...     seeds=[0, 1], n_jobs=1, n_test=50, progress=False)
    >>> len(results), results.attrs["n_fitted"], list(results["status"].unique())
    (4, 4, ['ok'])
    """
    pd = _require("pandas", "recovery_sweep")
    if not isinstance(n_test, Integral) or n_test < 1:
        raise ValueError(f"n_test must be a positive integer, got {n_test!r}.")
    if not isinstance(success_tol, Real) or not success_tol >= 0:
        raise ValueError(f"success_tol must be >= 0, got {success_tol!r}.")
    if not isinstance(tighten_tol, bool | np.bool_):
        raise ValueError(f"tighten_tol must be True or False, got {tighten_tol!r}.")
    if n_jobs is not None and (not _is_int(n_jobs) or n_jobs == 0):
        raise ValueError(
            f"n_jobs must be a non-zero integer (-1: all processors), got {n_jobs!r}."
        )
    if not isinstance(retry_failed, bool | np.bool_):
        raise ValueError(f"retry_failed must be True or False, got {retry_failed!r}.")
    axes = _check_grid(learners, planted, n_samples, noise, seeds, tighten_tol)
    axes["noise"] = [float(v) for v in axes["noise"]]
    cells = _expand(learners, axes)
    file = _ResultFile(output) if output is not None else None
    if file is not None and file.frame is not None:
        _check_columns(file.frame, output)
    done = file.done(retry_failed) if file is not None else set()
    todo = [cell for cell in cells if cell["cell_id"] not in done]
    client = _connect(scheduler) if scheduler is not None else None

    rows = []
    try:
        measure = (n_test, success_tol, tighten_tol)
        for row in _run(learners, todo, measure, n_jobs, client, progress):
            rows.append(row)
            if file is not None:
                file.append(row)
    finally:
        if client is not None:
            client.close()
    frames = [pd.DataFrame(rows, columns=list(COLUMNS))]
    if file is not None and file.frame is not None:
        frames = [file.frame]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        frame = pd.concat(frames, ignore_index=True)
    frame = frame.drop_duplicates("cell_id", keep="last").set_index("cell_id")
    order = [cell["cell_id"] for cell in cells]
    results = frame.loc[order].reset_index()[list(COLUMNS)]
    results.attrs["n_fitted"] = len(rows)
    return results


def _run(learners, todo, measure, n_jobs, client, progress):
    """Yield finished rows in completion order, with a progress bar."""
    from joblib import Parallel, delayed, parallel_backend

    if not todo:
        return
    from tqdm.auto import tqdm

    jobs = (
        delayed(_run_cell)(learners[cell["learner"]], cell, *measure) for cell in todo
    )
    bar = tqdm(total=len(todo), desc="sweep", unit="fit", disable=not progress)
    try:
        if client is not None:
            with parallel_backend("dask"):
                results = Parallel(return_as="generator_unordered")(jobs)
                for row in results:
                    bar.update()
                    yield row
        else:
            results = Parallel(n_jobs=n_jobs, return_as="generator_unordered")(jobs)
            for row in results:
                bar.update()
                yield row
    finally:
        bar.close()
