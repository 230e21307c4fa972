"""The phased learner composed: phases 1-6, the fallback and the head search.

:func:`phased_fit` is the whole learner of :class:`skattn.MultiHeadAttentionRegressor`
as one pure function on token tensors (``X`` of shape ``(n, k, d)``, ``Y`` of
shape ``(n, k, d_out)``): it chooses where the polish starts (``init``), runs
phases 1-6 (:func:`crude_projection_sum`, :func:`sculpt_hull`, :func:`hull_span`,
:func:`fit_from_hull`), falls back to the polish from random starts when phases
2-4 fail, and, with ``n_heads="auto"``, runs the head search
(:func:`search_n_heads`).  It returns the estimate and an info dict whose
``"reports"`` are the :class:`PhaseReport` records of what each phase did; the
estimator validates its parameters and data, makes this one call and stores the
result as fitted attributes (as scikit-learn's ``_BaseRidge.fit`` calls
``_ridge_regression``).
"""

import contextlib
import math
import re
import time
import warnings
from dataclasses import replace
from functools import partial

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import Bunch, check_random_state

from ..metrics._sharpness import sharp_head_pinning
from ..solvers._driver import RANK_FREE_MAX_PARAMETERS, fit_from_random_starts
from ..solvers.kernels._loss import REALISABLE_RESIDUAL
from ..solvers.stages._polish import staged_polish, warmup_size
from ..utils._array_api import (
    device,
    lstsq,
    namespace,
    namespace_name,
    to_namespace,
    to_numpy,
)
from ..utils._batches import TokenBatches
from ..utils._progress import make_bar, shown
from ..utils._validation import is_foreign_array
from ..utils._warnings import warn_at_caller
from ._affine_hull import sculpt_hull
from ._errors import CertificationError, CertificationWarning
from ._model_selection import polish_on_all, select_n_heads
from ._net import _MAX_GRID_GRAM, fit_from_hull, net_search
from ._options import PhasedOptions
from ._projection_sum import crude_projection_sum
from ._report import PhaseReport
from ._span import hull_span

# The words of the phase functions in a message, and the estimator's for them:
# round r of phases 2-4 runs at a tolerance from certify_tol (round 0) down to
# certify_tol_final (the last round).
_ESTIMATOR_TERMS = (
    (
        r"sculpt_hull stopped at round (\d+) \(tol=",
        r"Phases 2-4 stopped at round \1 (tolerance ",
    ),
    (
        r"\(tol=([^,)]+), try ([^)]+)\)",
        r"(this round's tolerance \1; try \2 for certify_tol_final, or for "
        r"certify_tol when it is the first round)",
    ),
    (
        r"relax tol \(e\.g\. tol=([^)]+)\)",
        r"relax the certification tolerance (e.g. \1 for certify_tol_final, or "
        r"for certify_tol when it is the first round)",
    ),
    (
        r"relax the tolerance \(tol=([^)]+)\)",
        r"relax the certification tolerance (this round's is \1: raise "
        r"certify_tol_final, or certify_tol for the first round)",
    ),
    (r"\bat tol=", "at tolerance "),
    (r"\btol_final\b", "certify_tol_final"),
)


def _in_estimator_terms(message):
    """A phase function's message in the words of the estimator's parameters.

    Examples
    --------
    >>> _in_estimator_terms("Returning round 3; set tol_final >= 0.0394.")
    'Returning round 3; set certify_tol_final >= 0.0394.'
    """
    for pattern, replacement in _ESTIMATOR_TERMS:
        message = re.sub(pattern, replacement, message)
    return message


# init="auto" runs phases 1-5 up to this many features per token.  Since the
# matrix-free hull (hull_solver) they run at any d (k = 8, m = 2, n = 5e4, one
# loaded thread, 2026-11-25: 3.0 s at d = 16, 4.6 s at d = 32, 8.9 s at d = 64),
# but their start saves the polish little: 8 Levenberg-Marquardt iterations against
# 8-9 from a random start at d = 8-16, 8 vs 10-11 at d = 32-64, 11 vs 16 at d = 128
# (benchmarks/HISTORY.md, 2026-11-24), and a whole default (random-start) fit takes
# 2.4 s at d = 32 and 6.0 s at d = 64.  Running the phases only for their report on
# a subsample costs more than a tenth of that even at 2500 samples (0.9 s at d = 32,
# 1.1 s at d = 64), where they locate nothing (gap ratios 1.04-1.11; benchmarks/
# README.md, 2026-11-25).  So beyond d = 16 the faster default (random starts) is
# kept; init="phased" runs the phases at any d.
_MAX_PHASE_FEATURES = 16

# Below this augmented gap ratio the hull's spectral evidence is weak (see Notes).
_WEAK_GAP_RATIO = 3.0
# Examples the in-memory polish gets from an out-of-core X when polish_samples=None.
_OUT_OF_CORE_POLISH_SAMPLES = 100_000


def _build(options, params):
    """The run's :class:`PhasedOptions`: ``options``, or built from ``params``."""
    if options is None:
        return PhasedOptions.from_params(**params)
    if params:
        raise TypeError(
            f"Pass either options or the parameters {sorted(params)}, not both."
        )
    if not isinstance(options, PhasedOptions):
        raise TypeError(
            f"options must be a PhasedOptions, got {type(options).__name__}."
        )
    return options


def phased_fit(
    X,
    Y,
    n_heads,
    *,
    sample_weight=None,
    random_state=None,
    options=None,
    memory=None,
    **params,
):
    """Learn a multi-head attention layer with the phased algorithm of Chen & Li.

    The learner of :class:`~skattn.MultiHeadAttentionRegressor` as a pure
    function: for a given number of heads, the start of the polish is chosen
    (``init``), phases 1-6 run (or the polish from random starts, also as the
    fallback when phases 2-4 certify too few rows and ``init="auto"``); with
    ``n_heads="auto"``, :func:`search_n_heads` runs.  With one token per
    sequence F is linear and its least-squares fit is returned.

    Parameters
    ----------
    X : ndarray of shape (n_samples, n_tokens, n_features) or TokenBatches
        Input sequences (with ``fit_intercept=True``: the tokens ``[x, 1]``, the
        constant coordinate last).  Out-of-core data as
        :class:`~skattn.utils._batches.TokenBatches`.
    Y : ndarray of shape (n_samples, n_tokens, n_outputs) or TokenBatches
        Output sequences ``F(X)`` (+ noise).
    n_heads : int or "auto"
        Number of heads m; ``"auto"`` runs :func:`search_n_heads`.
    sample_weight : ndarray of shape (n_samples,), default=None
        Weights of the examples (``None``: all 1).
    random_state : int, RandomState instance or None, default=None
        Subsampling in phases 2-4 and 6, the random starts and the head search;
        a ``RandomState`` is drawn from in the order of the phases.
    options : PhasedOptions or None, default=None
        Every option of the learner, one frozen object per stage (``None``: built
        from ``params``).
    memory : str, joblib.Memory or None, default=None
        Where the random-start path keeps its finished stages, to resume an
        interrupted fit (see :func:`~skattn.solvers.fit_from_random_starts`).
    **params : dict
        Instead of ``options``: the parameters of
        :class:`~skattn.MultiHeadAttentionRegressor` that the learner uses, with
        the same names, meanings and defaults (:data:`PARAMETERS` maps each to
        the stage option it sets; any other name raises ``TypeError``): ``init``,
        ``certify_tol``, ``certify_tol_final``, ``n_rounds``, ``refine_iter``,
        ``min_pattern_prob``, ``confidence_floor``, ``max_rows``,
        ``hull_method``, ``hull_solver``, ``max_heads``,
        ``validation_fraction``, ``selection_samples``, ``net_resolution``,
        ``net_radius``, ``net_samples``, ``max_net_candidates``, ``polish``,
        ``polish_samples``, ``polish_max_iter``, ``polish_tol``, ``head_rank``,
        ``n_restarts``, ``whiten``, ``start_search``, ``polish_solver``,
        ``fit_intercept`` (the
        last feature of X is the constant 1 of ``[x, 1]`` tokens),
        ``batch_size`` and ``verbose``.

    Returns
    -------
    attention : ndarray of shape (n_heads, n_features, n_features)
        The learned Theta_i (on the given tokens).
    projection : ndarray of shape (n_heads, n_features, n_outputs)
        The learned W_i.
    info : dict
        ``reports`` (list of :class:`PhaseReport`, one per phase and per round
        of phases 2-4), ``n_heads`` (used or selected), ``n_iter`` (rounds of
        phases 2-4 that ran), ``projection_sum`` (the estimate of ``sum_i W_i``),
        ``hull_point`` and ``hull_directions`` (the estimated affine hull, or
        None), and with ``n_heads="auto"`` ``model_selection`` (the search's
        record, as ``model_selection_`` of the estimator).

    Raises
    ------
    CertificationError
        With ``init="phased"``, when phases 2-4 certify too few rows.

    See Also
    --------
    skattn.MultiHeadAttentionRegressor : the estimator that calls this function.
    search_n_heads : the search for the number of heads.

    Examples
    --------
    >>> from skattn.datasets import make_attention_regression
    >>> from skattn.phased import phased_fit
    >>> X, y = make_attention_regression(20000, 4, 8, 2, n_outputs=16,
    ...                                  distribution="boolean", random_state=0)
    >>> X3, Y3 = X.reshape(-1, 4, 8), y.reshape(-1, 4, 16)
    >>> attention, projection, info = phased_fit(X3, Y3, 2, random_state=0)
    >>> attention.shape, projection.shape
    ((2, 8, 8), (2, 8, 16))
    >>> [report.phase for report in info["reports"]][:3]
    ['0-start', '1-crude-projection-sum', '2-4-certify-refine-hull']
    """
    run = _PhasedRun(X, Y, n_heads, sample_weight, _build(options, params))
    run.memory = memory
    rng = check_random_state(random_state)
    if run.n_tokens == 1:
        run._fit_linear(run.X, run.Y, run.weights)
    elif n_heads == "auto":  # the head search is numpy-only: on host copies
        run._fit_auto(*run._host(run.X, run.Y, run.weights), rng)
    else:
        run._fit_fixed(run.X, run.Y, run.weights, rng)
    return run.result()


def search_n_heads(
    X, Y, *, sample_weight=None, random_state=None, options=None, **params
):
    """Select the number of heads from data and fit them (``n_heads="auto"``).

    Phases 1-5 run as a second opinion (the spectral gap of the hull's
    constraint system, recorded in ``model_selection["spectral"]``), then
    :func:`select_n_heads` fits m = 1, 2, ... heads on a training part and stops
    at the held-out noise floor, and the selected fit is polished on all
    examples (:func:`polish_on_all`).

    Parameters
    ----------
    X : ndarray of shape (n_samples, n_tokens, n_features) or TokenBatches
        Input sequences, as for :func:`phased_fit`.
    Y : ndarray of shape (n_samples, n_tokens, n_outputs) or TokenBatches
        Output sequences, as for :func:`phased_fit`.
    sample_weight : ndarray of shape (n_samples,), default=None
        Weights of the examples (``None``: all 1).
    random_state : int, RandomState instance or None, default=None
        Subsampling in phases 2-4 and the search's splits and starts.
    options, **params
        As for :func:`phased_fit`; the search uses ``max_heads``,
        ``validation_fraction``, ``selection_samples``, ``polish_max_iter``,
        ``polish_tol`` and, for its second opinion, those of phases 1-4.

    Returns
    -------
    attention : ndarray of shape (n_heads, n_features, n_features)
        The selected heads' Theta_i, polished on all examples.
    projection : ndarray of shape (n_heads, n_features, n_outputs)
        Their W_i.
    info : dict
        As for :func:`phased_fit`, with ``model_selection``: every candidate
        and the decision (as ``model_selection_`` of the estimator).

    See Also
    --------
    phased_fit : the learner for a given (or, with "auto", this) number of heads.

    Examples
    --------
    >>> from skattn.datasets import make_attention_regression
    >>> from skattn.phased import search_n_heads
    >>> X, y = make_attention_regression(3000, 3, 6, 2, n_outputs=12,
    ...                                  random_state=0)
    >>> X3, Y3 = X.reshape(-1, 3, 6), y.reshape(-1, 3, 12)
    >>> attention, projection, info = search_n_heads(X3, Y3, random_state=0)
    >>> info["n_heads"], info["model_selection"]["reason"]
    (2, 'exact')
    """
    run = _PhasedRun(X, Y, "auto", sample_weight, _build(options, params))
    run._fit_auto(
        *run._host(run.X, run.Y, run.weights), check_random_state(random_state)
    )
    return run.result()


class _PhasedRun:
    """One run of the learner: its options, data shapes and what it records.

    Its steps read their stage's options (``self.options``) and leave the
    estimate and the reports on the run; :meth:`result` hands them out.
    """

    def __init__(self, X, Y, n_heads, sample_weight, options):
        self.options = options
        self.n_heads = n_heads
        self.memory = None  # where the random-start path keeps its stages
        self.X, self.Y = X, Y
        # the input's array namespace (numpy for out-of-core data): the random-
        # start path runs in it; the phases, numpy-only, on host copies
        on_host = isinstance(X, TokenBatches) or isinstance(X, np.ndarray)
        self.xp = namespace() if on_host else namespace(X, Y)
        self.device = None if on_host else device(X)
        self.on_host = on_host
        if sample_weight is not None:
            self.weights = sample_weight
        elif on_host:
            self.weights = np.ones(len(X))
        else:
            self.weights = self.xp.ones(X.shape[0], dtype=X.dtype, device=self.device)
        self.n_tokens = X.shape[1]
        self.n_features = X.shape[2] - (1 if self.options.fit_intercept else 0)
        self.n_outputs = Y.shape[2]
        self.reports = []
        self.model_selection = None
        # warnings of the phases, issued only if the fit they lead to is not
        # exact (an exact fit makes them moot: they go to phase_report_)
        self.deferred = []
        self.polish_info = None

    def result(self):
        """``(attention, projection, info)`` of the run, the arrays in the input's
        namespace and on its device (those of the phases come from the host)."""
        if not self.on_host:
            for name in (
                "attention",
                "projection",
                "projection_sum",
                "hull_point",
                "hull_directions",
            ):
                value = getattr(self, name)
                setattr(self, name, to_namespace(value, self.xp, self.device))
        info = {
            "reports": self.reports,
            "n_heads": self.n_heads_fitted,
            "n_iter": self.n_iter,
            "projection_sum": self.projection_sum,
            "hull_point": self.hull_point,
            "hull_directions": self.hull_directions,
        }
        if self.model_selection is not None:
            info["model_selection"] = self.model_selection
        return self.attention, self.projection, info

    def _host(self, *arrays):
        """Numpy copies of ``arrays`` for the numpy-only phases (the arrays
        themselves on numpy)."""
        if self.on_host:
            return arrays
        return tuple(to_numpy(a) for a in arrays)

    def _note_host_copies(self, what, polish="the polish ran"):
        """Say that ``what`` ran on host copies of X and y: a deferred warning
        (in ``phase_report_``'s notes when the polish converged) and the
        ``"host_copies"`` entry of the run's first report."""
        if self.on_host:
            return
        name = namespace_name(self.xp)
        message = (
            f"X and y are {name} arrays on {self.device!r}: {what} ran on numpy "
            f"copies of them on the host (the phases are numpy-only); {polish} in "
            f"{name} on the device. init='random' keeps the whole fit on the device."
        )
        self._defer(message, UserWarning)
        self.reports[0].info["host_copies"] = message

    def _choose_init(self, X3, Y3):
        """``("phased" | "random", reason)``: where the polish starts."""
        k, d = X3.shape[1], self.n_features  # d without [x, 1]
        d_out = Y3.shape[2]
        if self.options.init != "auto":
            return self.options.init, f"init={self.options.init!r}"
        if not self.options.polish.enabled:
            return "phased", "polish=False: the pure phased estimate"
        if d > _MAX_PHASE_FEATURES:
            return "random", (
                f"init='auto': {d} features per token > {_MAX_PHASE_FEATURES}, "
                f"where phases 1-5 (a hull system of {d * d} unknowns) cost more "
                f"time than their start saves the polish; init='phased' runs them"
            )
        if d_out < k:
            return "random", (
                f"init='auto': phase 2 needs n_outputs_per_token >= n_tokens, got "
                f"{d_out} < {k}"
            )
        return "phased", "init='auto': the phases are affordable"

    def _fit_fixed(self, X3, Y3, weights, rng):
        """A given number of heads: phases 1-6, or random starts, then the polish."""
        if self.options.init == "random" and not self.options.polish.enabled:
            raise ValueError(
                "init='random' needs polish=True: without the polish a random start "
                "is no estimate. Pass init='phased' or 'auto' for the pure phased "
                "estimate."
            )
        init, reason = self._choose_init(X3, Y3)
        self.reports.append(
            PhaseReport("0-start", 0, 0.0, {"init": init, "reason": reason})
        )
        if init == "random" and self.options.init == "auto":
            self._defer(
                f"Phases 1-5 of Chen & Li were skipped ({reason}); the polish "
                f"started from up to {self.options.starts.n_starts} random starts. "
                f"Pass init='random' to silence this warning.",
                UserWarning,
            )
        if init == "phased":
            self._note_host_copies("phases 1-5 and the net of phase 6")
            try:
                self._fit_phased(X3, Y3, weights, rng)
                self._settle()
                return
            except CertificationError as exc:
                # polish=False asked for the phases' estimate: a random start
                # would be polished, so there is no fallback
                if self.options.init == "phased" or not self.options.polish.enabled:
                    raise
                message = str(exc)
            warn_at_caller(
                f"Phases 2-4 failed, so the polish starts from up to "
                f"{self.options.starts.n_starts} random starts instead of the phased "
                f"estimate (init='phased' raises instead). What failed: {message}",
                CertificationWarning,
            )
            reason = f"fallback after phases 2-4 failed: {message}"
            self.reports.append(
                PhaseReport("0-start", 1, 0.0, {"init": "random", "reason": reason})
            )
        self._fit_random(X3, Y3, weights, rng, reason)
        self._settle()

    def _defer(self, message, category):
        """A warning kept until the fit's end (see :meth:`_settle`)."""
        self.deferred.append((message, category))

    def _settle(self):
        """Issue the deferred warnings at the user's line, unless the polish
        converged (the phases' shortfalls did not matter then: they are noted
        in ``phase_report_`` under ``"notes"``)."""
        info = self.polish_info
        settled = info is not None and (
            info.get("converged", False)
            or info.get("relative_residual", 1.0) <= REALISABLE_RESIDUAL
        )
        if settled and self.deferred:
            hull = [r for r in self.reports if r.phase == "2-4-hull-selected"]
            record = (hull or self.reports)[0]
            record.info["notes"] = [message for message, _ in self.deferred]
        elif not settled:
            for message, category in self.deferred:
                warn_at_caller(message, category)
        self.deferred = []

    def _polish_data(self, X3, Y3):
        """``(X3, Y3, n_polish_samples)`` for the in-memory polish.

        Out-of-core input is polished on a random subset of
        ``_OUT_OF_CORE_POLISH_SAMPLES`` examples when ``polish_samples`` is None and
        there are more, else loaded.
        """
        n = X3.shape[0]
        polish_rows = None
        if (
            self.options.polish.n_samples is not None
            and self.options.polish.n_samples < n
        ):
            polish_rows = self.options.polish.n_samples
        elif isinstance(X3, TokenBatches) and n > _OUT_OF_CORE_POLISH_SAMPLES:
            polish_rows = _OUT_OF_CORE_POLISH_SAMPLES  # the polish is in memory
        elif isinstance(X3, TokenBatches):  # few enough for the in-memory polish
            X3, Y3 = X3[0:n], Y3[0:n]
        return X3, Y3, polish_rows

    def _polish(self, n_polish_samples):
        """The polish's options with this run's polish set."""
        return replace(self.options.polish, n_samples=n_polish_samples)

    def _fit_random(self, X3, Y3, weights, rng, reason):
        """The polish from random starts (no phases)."""
        m = int(self.n_heads)
        start = time.perf_counter()
        X3, Y3, polish_rows = self._polish_data(X3, Y3)
        n_starts = self.options.starts.n_starts
        with random_starts_bar(self.options.verbose, n_starts) as progress:
            attention, projection, info = fit_from_random_starts(
                X3,
                Y3,
                m,
                sample_weight=weights,
                random_state=rng.randint(np.iinfo(np.int32).max),
                starts=self.options.starts,
                polish=self._polish(polish_rows),
                progress=progress,
                memory=self.memory,
            )
        info = {key: value for key, value in info.items() if key != "stages"}
        if not self.on_host:  # the record is a host object (see _host_record)
            info = _host_record(info)
        info["reason"] = reason
        self.polish_info = info
        self.reports.append(
            PhaseReport("6-polish", 0, time.perf_counter() - start, info)
        )
        self._warn_if_not_converged(info, X3, attention)
        self.n_heads_fitted = m
        self.n_iter = 0
        self.projection_sum = self.xp.sum(projection, axis=0)
        self.hull_point, self.hull_directions = None, None
        self.attention, self.projection = attention, projection

    def _fit_phased(self, X3, Y3, weights, rng):
        """Phases 1-6 for a given number of heads."""
        self._check_learnable()
        hX, hY, hw = self._host(X3, Y3, weights)  # X3, Y3, weights on numpy
        with _progress(self.options.verbose, total=6) as bar:
            W_sum = self._run(
                "1-crude-projection-sum", bar, crude_projection_sum, hX, hY, hw
            )
            W_sum, point, directions, hull_info = self._sculpt(
                hX, hY, hw, W_sum, rng, bar
            )
            self._run("5-span", bar, hull_span, point, directions)
            attention, projection = self._phase6(
                X3, Y3, weights, point, directions, rng, bar
            )
        self.projection_sum = W_sum
        self.hull_point, self.hull_directions = point, directions
        self._warn_if_weak(hull_info)
        self.attention, self.projection = attention, projection

    def _fit_auto(self, X3, Y3, weights, rng):
        """n_heads="auto": phases 1-5 as a second opinion, then the head search."""
        self._check_learnable()
        with _progress(self.options.verbose, total=6) as bar:
            W_sum = self._run(
                "1-crude-projection-sum", bar, crude_projection_sum, X3, Y3, weights
            )
            # the phases are a second opinion here: their warnings go to the record
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    W_sum, point, directions, hull_info = self._sculpt(
                        X3, Y3, weights, W_sum, rng, bar
                    )
                except CertificationError as exc:
                    hull_info = {"error": str(exc)}
            notes = [_in_estimator_terms(str(w.message)) for w in caught]
            notes += [message for message, _ in self.deferred]  # from _sculpt
            self.deferred = []
            self._note_host_copies(
                "the head search (phases 1-5 and every candidate's polish) and "
                "the final polish",
                polish="the layer is returned",
            )
            if "error" in hull_info:
                spectral = {"available": False, "reason": hull_info["error"]}
                point = directions = None
                self.n_iter = 0
            else:
                self._run("5-span", bar, hull_span, point, directions)
                ratio = float(hull_info["augmented_gap_ratio"])
                spectral = {
                    "available": True,
                    "n_heads": int(hull_info["n_heads"]),
                    "augmented_gap_ratio": ratio,
                    "strong": bool(ratio >= _WEAK_GAP_RATIO),
                }
            spectral["warnings"] = notes
            start = time.perf_counter()
            attention, projection, info = select_n_heads(
                X3,
                Y3,
                max_heads=self.options.hull.max_heads,
                sample_weight=weights,
                validation_fraction=self.options.heads.validation_fraction,
                n_fit_samples=self.options.heads.n_fit_samples,
                max_iter=min(self.options.polish.max_iter, 30),
                tol=self.options.polish.tol,
                random_state=rng.randint(np.iinfo(np.int32).max),
            )
            seconds = time.perf_counter() - start
            m = info["n_heads"]
            if spectral["available"]:
                spectral["agrees"] = spectral["n_heads"] == m
            held = info["held_out_indices"]
            self.model_selection = {
                "n_heads": m,
                "reason": info["reason"],
                "candidates": info["candidates"],
                "pruned": info["pruned"],
                "held_out_error": info["held_out_error"],
                "held_out_interval": info["held_out_interval"],
                "n_held_out": int(held.size),
                "confidence_level": 0.95,
                "validation_fraction": self.options.heads.validation_fraction,
                "n_fit_samples": info["n_fit_samples"],
                "spectral": spectral,
            }
            self.reports.append(
                PhaseReport(
                    "auto-select-heads",
                    0,
                    seconds,
                    {k: v for k, v in self.model_selection.items()},
                )
            )
            _advance(bar, "auto-select-heads")
            start = time.perf_counter()
            attention, projection, pinfo = polish_on_all(
                X3,
                Y3,
                attention,
                weights,
                max_iter=self.options.polish.max_iter,
                tol=self.options.polish.tol,
            )
            pinfo = {k: v for k, v in pinfo.items() if k != "stages"}
            self.polish_info = pinfo
            self.reports.append(
                PhaseReport("auto-polish-all", 0, time.perf_counter() - start, pinfo)
            )
            _advance(bar, "auto-polish-all")
        self.n_heads_fitted = m
        self.projection_sum = W_sum
        self.hull_point, self.hull_directions = point, directions
        self.attention, self.projection = attention, projection
        self._settle()

    def _check_learnable(self):
        k, d, d_out = (
            self.n_tokens,
            self.n_features,
            self.n_outputs,
        )
        if self.options.hull.tol_final > self.options.hull.tol:
            raise ValueError(
                f"certify_tol_final={self.options.hull.tol_final:g} is larger than "
                f"certify_tol={self.options.hull.tol:g}; the tolerance tightens from "
                f"the first round to the last, so pass certify_tol_final <= "
                f"certify_tol."
            )
        if self.options.net.resolution is not None and self.n_heads != "auto":
            n_grid = self.options.net.resolution ** (self.n_heads - 1)
            if (n_grid * d) ** 2 > _MAX_GRID_GRAM:
                raise ValueError(
                    f"net_resolution={self.options.net.resolution} gives {n_grid} net "
                    f"points per head for {self.n_heads} heads, too many to hold their "
                    f"Gram matrix; lower net_resolution so that net_resolution ** "
                    f"{self.n_heads - 1} * {d} <= {int(math.sqrt(_MAX_GRID_GRAM))}."
                )
        if d_out < k:
            raise ValueError(
                f"The phased learner needs n_outputs_per_token >= n_tokens (phase 2 "
                f"solves each row's attention pattern through sum_i W_i), got "
                f"{d_out} outputs per token and n_tokens={k}. Use init='random' "
                f"(the polish from random starts) or GradientAttentionRegressor "
                f"for such data."
            )
        if self.n_heads != "auto" and d_out <= self.n_heads * k:
            self._defer(
                f"n_outputs_per_token={d_out} <= n_heads * n_tokens = "
                f"{self.n_heads * k}: a mixture of different patterns may pass "
                f"certification, so the hull may be biased (identifiability of "
                f"phase 2 needs d_out > m k). Check phase_report_ and the fit.",
                UserWarning,
            )

    def _run(self, phase, bar, func, *args, **kwargs):
        """Run one phase function, time it, record its report, return its estimate."""
        start = time.perf_counter()
        *estimate, info = func(*args, **kwargs)
        self.reports.append(PhaseReport(phase, 0, time.perf_counter() - start, info))
        _advance(bar, phase)
        return estimate[0] if len(estimate) == 1 else tuple(estimate)

    def _sculpt(self, X3, Y3, weights, W_sum, rng, bar):
        """Phases 2-4, with one report per round and one for the chosen hull."""
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CertificationWarning)
            try:
                W_sum, point, directions, info = self._sculpt_hull(
                    X3, Y3, weights, W_sum, rng
                )
            except CertificationError as exc:
                raise CertificationError(_in_estimator_terms(str(exc))) from exc
        for warning in caught:  # kept, in the estimator's terms
            self._defer(_in_estimator_terms(str(warning.message)), warning.category)
        seconds = time.perf_counter() - start
        for record in info["rounds"]:
            self.reports.append(
                PhaseReport(
                    "2-4-certify-refine-hull",
                    record["round"],
                    record["seconds"],
                    record,
                )
            )
        summary = {key: value for key, value in info.items() if key != "rounds"}
        summary["projection_sum"] = W_sum
        self.reports.append(
            PhaseReport("2-4-hull-selected", info["best_round"], seconds, summary)
        )
        self.n_iter = info["n_rounds"]
        self.n_heads_fitted = int(info["n_heads"])
        _advance(bar, "2-4-hull", steps=3)
        return W_sum, point, directions, info

    def _sculpt_hull(self, X3, Y3, weights, W_sum, rng):
        return sculpt_hull(
            X3,
            Y3,
            self.n_heads if self.n_heads == "auto" else int(self.n_heads),
            W_sum=W_sum,
            tol=self.options.hull.tol,
            tol_final=self.options.hull.tol_final,
            n_rounds=self.options.hull.n_rounds,
            refine_iter=self.options.hull.refine_iter,
            sample_weight=weights,
            p_min=self.options.hull.p_min,
            confidence_floor=self.options.hull.confidence_floor,
            max_rows=self.options.hull.max_rows,
            method=self.options.hull.method,
            batch_size=self.options.hull.batch_size,
            max_heads=self.options.hull.max_heads,
            random_state=rng.randint(np.iinfo(np.int32).max),
            gauge_features=(X3.shape[2] - 1,) if self.options.fit_intercept else (),
            solver=self.options.hull.solver,
        )

    def _phase6(self, X3, Y3, weights, point, directions, rng, bar):
        """Phase 6: the net over the hull, then the polish; one report each."""
        X3, Y3, polish_rows = self._polish_data(X3, Y3)
        polish = self._polish(polish_rows)
        hull_fit = fit_from_hull if self.on_host else self._fit_from_hull_on_device
        attention, projection, info = hull_fit(
            X3,
            Y3,
            point,
            directions,
            self.n_heads_fitted,
            resolution=self.options.net.resolution,
            radius=self.options.net.radius,
            polish=polish.enabled,
            sample_weight=weights,
            n_net_samples=self.options.net.n_samples,
            max_candidates=self.options.net.max_candidates,
            random_state=rng.randint(np.iinfo(np.int32).max),
            n_polish_samples=polish.n_samples,
            n_warmup_samples=warmup_size(
                int(self.n_heads), X3.shape[1], X3.shape[2], polish.head_rank
            ),
            **polish.polish_kwargs(),
        )
        for phase, record in (("6-net", info["net"]), ("6-polish", info["polish"])):
            if record is not None:
                record = dict(record)
                seconds = record.pop("seconds")
                self.reports.append(PhaseReport(phase, 0, seconds, record))
        if self.options.polish.enabled:
            self.polish_info = info["polish"]
            self._warn_if_not_converged(info["polish"], X3, attention)
        _advance(bar, "6-net-and-polish")
        return attention, projection

    def _fit_from_hull_on_device(
        self, X3, Y3, point, directions, n_heads, *, polish, random_state, **kwargs
    ):
        """:func:`fit_from_hull` for arrays of another namespace: its net on numpy
        copies, its polish in the input's namespace and on its device, from the
        same random stream (the net's draws, then the polish's subsets)."""
        net_keys = ("resolution", "radius", "max_candidates")
        net = {key: kwargs.pop(key) for key in net_keys}
        net["n_samples"] = kwargs.pop("n_net_samples")
        weights = kwargs.pop("sample_weight")
        hX, hY, hw = self._host(X3, Y3, weights)
        rng = check_random_state(random_state)
        start = time.perf_counter()
        attention, projection, net_info = net_search(
            hX,
            hY,
            point,
            directions,
            n_heads,
            sample_weight=hw,
            random_state=rng,
            **net,
        )
        net_info["seconds"] = time.perf_counter() - start
        if not polish:
            return attention, projection, {"net": net_info, "polish": None}
        start = time.perf_counter()
        attention, projection, polish_info = staged_polish(
            X3,
            Y3,
            to_namespace(attention, self.xp, self.device),
            to_namespace(projection, self.xp, self.device),
            sample_weight=weights,
            random_state=rng,
            mode="varpro",  # fit_from_hull's for the Levenberg-Marquardt polish
            method="levenberg-marquardt",
            **kwargs,
        )
        polish_info = _host_record(polish_info)
        polish_info["seconds"] = time.perf_counter() - start
        return attention, projection, {"net": net_info, "polish": polish_info}

    def _warn_if_not_converged(self, info, X3=None, attention=None):
        """ConvergenceWarning when the polish stopped early short of an exact fit.

        For unconverged heads, ``X3`` (the training tokens) and ``attention`` (the
        heads where the fit ended) say, per head, whether the data split its
        attention on enough rows to pin its logits, and what to do.
        """
        if info.get("converged", True):
            return
        if info.get("relative_residual", 1.0) <= REALISABLE_RESIDUAL:
            return  # at the rounding floor: nothing left to converge to
        stages = info.get("stages") or [info]
        reason = stages[-1].get("stop_reason", stages[-1].get("message", "?"))
        if reason == "heads_unconverged":
            heads = list(info.get("unconverged_heads") or [])
            pinning = None
            if X3 is not None and attention is not None and heads:
                pinning = self._pinning(X3, attention, heads)
            warn_at_caller(
                _unconverged_heads_message(
                    heads,
                    info.get("relative_residual", float("nan")),
                    pinning,
                    n_polish_samples=self.options.polish.n_samples,
                )
                + _search_found_no_head(info.get("start_search")),
                ConvergenceWarning,
            )
            return
        fix = (
            "raise polish_max_iter"
            if reason == "max_iter"
            else "check the data for duplicated or degenerate sequences"
        )
        warn_at_caller(
            f"The polish did not converge (stopped: {reason}) after "
            f"{_iterations_text(info, self.options.polish.max_iter)} with "
            f"polish_tol={self.options.polish.tol:g}; {fix}.",
            ConvergenceWarning,
        )

    def _pinning(self, X3, attention, heads):
        """:func:`sharp_head_pinning` of ``heads`` (in that order) on the training
        tokens, where the fit ended.

        On at most ``_PINNING_SAMPLES`` sequences, evenly spaced, with the counts
        scaled to all of them (the logits cost ``O(n k d^2)`` a head: at d = 384
        a few seconds for 4096 sequences).  With ``fit_intercept`` the tokens'
        constant is taken off and its row of ``Theta_i`` is the key bias (its
        column is a per-query constant, which the softmax ignores).
        """
        n = X3.shape[0]
        used = min(n, _PINNING_SAMPLES)
        if isinstance(X3, np.ndarray | TokenBatches):
            tokens = X3[np.unique(np.linspace(0, n - 1, used).round().astype(int))]
        else:  # another namespace: a strided slice, then a host copy
            tokens = X3[:: max(1, n // used)][:used]
        tokens = np.asarray(to_numpy(tokens), dtype=np.float64)
        theta = np.asarray(to_numpy(attention), dtype=np.float64)[heads]
        key_bias = None
        if self.options.fit_intercept:
            tokens, key_bias = tokens[..., :-1], theta[:, -1, :-1]
            theta = theta[:, :-1, :-1]
        pinning = sharp_head_pinning(
            theta, tokens, key_bias, head_rank=self.options.polish.head_rank
        )
        return _scaled_pinning(pinning, n)

    def _warn_if_weak(self, hull_info):
        ratio = hull_info["augmented_gap_ratio"]
        if self.n_heads_fitted > 1 and not ratio >= _WEAK_GAP_RATIO:
            self._defer(
                f"Weak spectral evidence for the hull of {self.n_heads_fitted} heads "
                f"(augmented gap ratio {ratio:.2f} < {_WEAK_GAP_RATIO}): too few rows "
                f"on which all heads agree were certified, so phases 2-4 did not "
                f"locate the hull and the result rests on the net (and the polish). "
                f"Give more examples, or raise certify_tol_final; see phase_report_.",
                ConvergenceWarning,
            )

    def _fit_linear(self, X3, Y3, weights):
        """One token per sequence: softmax is 1 and F(x) = x W_sum."""
        start = time.perf_counter()
        if isinstance(X3, TokenBatches):  # with one token, phase 1 is exact
            W_sum = crude_projection_sum(X3, Y3, weights)[0]
        elif self.on_host:
            sw = np.sqrt(weights)[:, None]
            W_sum = np.linalg.lstsq(X3[:, 0] * sw, Y3[:, 0] * sw, rcond=None)[0]
        else:  # on the input's device
            sw = self.xp.sqrt(weights)[:, None]
            W_sum = lstsq(self.xp, X3[:, 0, :] * sw, Y3[:, 0, :] * sw)
        m = 1 if self.n_heads == "auto" else int(self.n_heads)
        d = X3.shape[2]
        self.reports.append(
            PhaseReport(
                "linear-one-token",
                0,
                time.perf_counter() - start,
                {
                    "n_samples": X3.shape[0],
                    "note": "k = 1: F is linear, phases skipped",
                },
            )
        )
        self.n_iter = 0
        self.n_heads_fitted = m
        self.projection_sum = W_sum
        if self.on_host:
            self.hull_point = np.zeros((d, d))
            self.hull_directions = np.zeros((0, d, d))
            self.attention = np.zeros((m, d, d))
            self.projection = np.repeat(W_sum[None] / m, m, axis=0)
            return
        xp, where = self.xp, {"dtype": W_sum.dtype, "device": self.device}
        self.hull_point = xp.zeros((d, d), **where)
        self.hull_directions = xp.zeros((0, d, d), **where)
        self.attention = xp.zeros((m, d, d), **where)
        self.projection = xp.concat([W_sum[None, ...] / m] * m, axis=0)


# Sequences on which a fit's unconverged heads are measured for its warning.
_PINNING_SAMPLES = 4096


def _scaled_pinning(pinning, n_sequences):
    """:func:`sharp_head_pinning` counted on a subset, scaled to ``n_sequences``.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.utils import Bunch
    >>> sub = Bunch(n_split_rows=np.array([3, 40]), n_needed=np.array([10, 10]),
    ...             n_sequences=10, n_tokens=4, n_rows=40)
    >>> scaled = _scaled_pinning(sub, 100)
    >>> scaled.n_split_rows, scaled.pinned, scaled.sequences_needed
    (array([ 30, 400]), array([ True,  True]), array([34.,  3.]))
    """
    used = pinning.n_sequences
    if used == n_sequences:
        return pinning
    split = np.round(np.asarray(pinning.n_split_rows) * n_sequences / used)
    split = split.astype(int)
    needed = np.asarray(pinning.n_needed)
    scaled = Bunch(**pinning)
    scaled.update(
        n_split_rows=split,
        n_rows=n_sequences * pinning.n_tokens,
        n_sequences=n_sequences,
        pinned=split >= needed,
        # from the subset's own counts (the ratio the scaling keeps), not rounded
        sequences_needed=np.where(
            np.asarray(pinning.n_split_rows) > 0,
            np.ceil(used * needed / np.maximum(pinning.n_split_rows, 1)),
            np.nan,
        ),
        n_sequences_counted=used,
    )
    return scaled


def _iterations_text(info, max_iter):
    """The iterations of a polish's ``info``, in words that match ``max_iter``.

    ``polish_max_iter`` bounds each stage of the polish (a warm-up on a
    subsample, variable projection, the full problem), and ``info["n_iter"]``
    sums them: "after 198 iterations" against a bound of 100 reads as a broken
    bound unless the stages are shown.

    >>> _iterations_text({"n_iter": 198, "warmup": {"n_iter": 100},
    ...                   "final_stage": "ran"}, 100)
    '198 iterations in all (warm-up 100, polish 98; polish_max_iter=100 bounds each)'
    >>> _iterations_text({"n_iter": 100}, 100)
    '100 iterations (polish_max_iter=100)'
    """
    total = info.get("n_iter")
    parts = []
    warmup = info.get("warmup")
    rest = total
    if warmup and info.get("final_stage") == "ran" and total is not None:
        parts.append(("warm-up", warmup.get("n_iter", 0)))
        rest = total - warmup.get("n_iter", 0)
    stages = [s for s in info.get("stages") or () if "n_iter" in s]
    if len(stages) > 1:
        parts += [(s.get("stage", "polish"), s["n_iter"]) for s in stages]
    elif parts:
        parts.append(("polish", rest))
    if len(parts) < 2:
        return f"{total} iterations (polish_max_iter={max_iter})"
    each = ", ".join(f"{name} {n}" for name, n in parts)
    return f"{total} iterations in all ({each}; polish_max_iter={max_iter} bounds each)"


# A search whose fit is above this fraction of that of heads attending uniformly
# found no head (2 soft heads of rank 4 at d = 32: 0.737 against 0.742; 8 of them
# 0.617 against 0.757 after 2000 steps).
_FOUND_NO_HEAD = 0.9


def _search_found_no_head(search):
    """A sentence for the convergence warning where the minibatch search ended no
    better than heads that attend uniformly (``""`` otherwise).

    Examples
    --------
    >>> _search_found_no_head({"residual": 0.737, "uniform_residual": 0.742})[:41]
    ' The minibatch search found no head: its '
    >>> _search_found_no_head({"residual": 0.02, "uniform_residual": 0.742})
    ''
    """
    search = search or {}
    residual, uniform = search.get("residual"), search.get("uniform_residual")
    if residual is None or uniform is None or residual < _FOUND_NO_HEAD * uniform:
        return ""
    return (
        f" The minibatch search found no head: its fit ({residual:.3g}) was no "
        f"better than heads that attend uniformly ({uniform:.3g}); soft heads "
        "(logits of about one nat) leave it so. Full-rank heads (head_rank=None) "
        "do not stall there; start_search='auto' tries them first on layers of "
        f"up to {RANK_FREE_MAX_PARAMETERS} attention parameters (n_heads * d**2)."
    )


def _unconverged_heads_message(heads, residual, pinning=None, n_polish_samples=None):
    """The warning of a fit whose heads stopped short on their one-head problems.

    Per head (``pinning``: :func:`sharp_head_pinning` of ``heads``, in that
    order), its sharpness, the rows that split its attention against the
    counting bound, and what to do: more sequences whose rows split the head's
    attention when it is not pinned, else more random starts.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.utils import Bunch
    >>> pinning = Bunch(median_largest_weight=np.array([1.0]),
    ...                 n_split_rows=np.array([86]), n_rows=64000,
    ...                 n_needed=np.array([1596]), pinned=np.array([False]),
    ...                 sequences_needed=np.array([74233.0]), n_sequences=4000,
    ...                 threshold=0.99)
    >>> message = _unconverged_heads_message([2], 0.05, pinning)
    >>> message[:53]
    'Heads [2] did not converge on their one-head problems'
    >>> print(message[message.index("Head 2:"):])  # doctest: +NORMALIZE_WHITESPACE
    Head 2: median largest weight 1, 86 of 64000 rows split its attention
    (largest weight <= 0.99), 1596 needed to pin its logits (a counting bound):
    give about 74233 sequences (now 4000) of inputs whose rows split this head's
    attention.
    """
    text = (
        f"Heads {list(heads)} did not converge on their one-head problems (the "
        "decoupled refinement after the minibatch search), and the joint polish, "
        "which crawls from such a point, was skipped: the fit is approximate "
        f"(relative residual {residual:.3g} on the polish set). Heads with sharp "
        "attention (a row's largest weight near one) end so: the outputs pin "
        "their logits weakly (the user guide, 'Learn a layer of your own model', "
        "'How long, how good')."
    )
    if pinning is None:
        return text
    counted = pinning.get("n_sequences_counted", pinning.n_sequences)
    if counted != pinning.n_sequences:
        text += (
            f" Rows counted on {counted} of the {pinning.n_sequences} training "
            "sequences and scaled."
        )
    for position, head in enumerate(heads):
        split = int(pinning.n_split_rows[position])
        text += (
            f" Head {head}: median largest weight "
            f"{pinning.median_largest_weight[position]:.5g}, {split} of "
            f"{int(pinning.n_rows)} rows split its attention (largest weight <= "
            f"{pinning.threshold:g}), {int(pinning.n_needed[position])} needed to "
            "pin its logits (a counting bound): "
        )
        wanted = pinning.sequences_needed[position]
        if pinning.pinned[position]:
            text += (
                "the data should suffice; try more random starts (raise n_restarts)."
            )
        elif not np.isfinite(wanted):
            text += (
                "no training row splits its attention, so more sequences like "
                "these may never pin it; give inputs whose rows split this head's "
                "attention."
            )
        else:
            text += (
                f"give about {int(wanted)} sequences (now "
                f"{int(pinning.n_sequences)}) of inputs whose rows split this "
                "head's attention."
            )
    if n_polish_samples is not None and n_polish_samples < pinning.n_sequences:
        text += (
            f" The polish used {n_polish_samples} of them (polish_samples): raise "
            "it first."
        )
    return text


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(verbose, total, desc="phased learner", unit="phase", at_most=None):
    if not verbose:
        return _NoBar()
    bar = make_bar(total, desc, unit, at_most=at_most)
    return bar if hasattr(bar, "__enter__") else contextlib.closing(bar)


@contextlib.contextmanager
def random_starts_bar(verbose, n_starts):
    """The random starts' bar, and within it a bar per stage, when ``verbose``
    is positive: yields the drivers' ``progress`` hook (None when silent)."""
    with _progress(verbose, None, "random starts", "start", at_most=n_starts) as bar:
        with shown(verbose):  # a bar per stage
            yield None if bar is None else partial(_advance_start, bar)


def _advance_start(bar, message, done):
    """The random starts' bar: the stage running, a step per start ended."""
    bar.set_postfix_str(message)
    if done:
        bar.update(1)


def _advance(bar, phase, steps=1):
    if bar is not None:
        bar.set_postfix_str(phase)
        bar.update(steps)


def _host_record(value):
    """``value`` (a stage's info: dicts, lists, scalars and arrays) with every
    array of another namespace as a numpy copy, so that ``phase_report_`` is a
    host record whatever the input's device."""
    if isinstance(value, dict):
        return {key: _host_record(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_host_record(item) for item in value)
    if is_foreign_array(value):
        return to_numpy(value)
    return value
