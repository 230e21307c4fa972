"""MultiHeadAttentionRegressor: the phased learner of Chen & Li, end to end."""

import math
import time
import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.base import _fit_context
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions

from .._batches import TokenBatches
from ..datasets import BooleanTokens
from ..phased._affine_hull import sculpt_hull
from ..phased._errors import CertificationError, CertificationWarning
from ..phased._net import _MAX_GRID_GRAM, fit_from_hull
from ..phased._projection_sum import crude_projection_sum
from ..phased._report import PhaseReport
from ..phased._span import hull_span
from ._base import BaseAttentionRegressor

# Appended to certification messages of phases 2-4, whose functions say tol/tol_final.
_TOLERANCE_NAMES = (
    " (In MultiHeadAttentionRegressor, tol is the first round's certify_tol and "
    "tol_final is certify_tol_final.)"
)

# Below this augmented gap ratio the hull's spectral evidence is weak (see Notes).
_WEAK_GAP_RATIO = 3.0
# Examples the in-memory polish gets from an out-of-core X when polish_samples=None.
_OUT_OF_CORE_POLISH_SAMPLES = 100_000


class MultiHeadAttentionRegressor(BaseAttentionRegressor):
    """Learn a multi-head attention layer with the phased algorithm of Chen & Li.

    The model is ``F(X) = sum_i softmax(X Theta_i X^T) X W_i`` on sequences of
    ``n_tokens`` tokens.  ``fit`` runs the phases of Chen & Li (2024), each a pure
    function in :mod:`skattn.phased`, and records what each did in
    ``phase_report_``:

    1. a crude estimate of ``W_sum = sum_i W_i`` from the token sums;
    2. certification of rows on which all heads agree (the pattern solved through
       ``W_sum`` fits the output to relative residual ``certify_tol``), whose
       log-ratio equations ``x_l^T Theta (x_a - x_b) = ln(p_a / p_b)`` carve the
       affine hull of the ``Theta_i``;
    3. refinement of ``W_sum`` from the certified rows (joint Gauss-Newton fit of
       ``W_sum`` and each row's pattern);
    4. phases 2-3 repeated ``n_rounds`` times with the tolerance tightening
       geometrically from ``certify_tol`` to ``certify_tol_final``;
    5. the span of the hull, reported (its rank) but not used further: phase 6
       works in hull coordinates, which need fewer unknowns (with
       ``n_heads="auto"`` the number of heads comes from the spectral gap of the
       constraint system, in phases 2-4);
    6. an epsilon-net over the hull with the ``W_i`` solved by least squares for
       each candidate, then (``polish=True``) a Levenberg-Marquardt polish by
       variable projection, which leaves the hull.

    Parameters
    ----------
    n_heads : int or "auto", default=1
        Number of heads m.  ``"auto"`` estimates it from the spectral gap of the
        hull's constraint system (the hull of m heads has dimension m - 1), up to
        ``max_heads``; the evidence is in ``phase_report_``.
    n_tokens : int, default=None
        Tokens per sequence k.  ``None``: from a 3-D X, else 1 (F is then linear).
    input_distribution : {"gaussian", "boolean"}, default="gaussian"
        ``"boolean"`` verifies that every input is +-1, the setting of Chen & Li's
        guarantee, and raises otherwise; ``"gaussian"`` accepts any finite real
        tokens (the Gaussian extension).  The algorithm is the same.
    certify_tol : float, default=0.3
        Relative residual below which a row counts as certified (all heads agree)
        in the first round.  Raise it when too few rows certify.
    certify_tol_final : float, default=0.02
        Certification tolerance of the last round.  Tighter cuts the bias of the
        hull's equations but leaves fewer rows.
    n_rounds : int, default=5
        Rounds of phases 2-4 (tolerance schedule from ``certify_tol`` to
        ``certify_tol_final``).
    refine_iter : int, default=2
        Gauss-Newton iterations of phase 3 per round (0 keeps the phase-1 W_sum).
        Each costs a pass over the examples; a third changed neither the hull's
        spectral evidence nor the phased estimate's error measurably (d = 8-16,
        m = 2-3) and made phases 2-4 1.5-2 times slower.
    min_pattern_prob : float, default=0.05
        Tokens with certified attention below this are left out of the hull's
        equations (their log-ratios are unreliable).
    confidence_floor : float, default=None
        ``None`` weighs every certified row alike.  A float ``c`` divides a row's
        weight by ``r**2 + (c * tol)**2`` for its relative residual ``r``: rows on
        which the heads agree less get less weight.  ``c = 0.03`` halved the hull
        error or better for two heads and for three heads at k = 2 in
        ``benchmarks/study_three_heads.py``, and was neutral (+-0.03) where phases
        2-4 fail (three heads at k = 4); off by default until measured more widely.
    max_rows : int, default=20000
        Most certified rows kept per round (those with the smallest residuals).
    hull_method : {"lstsq", "huber"}, default="lstsq"
        Fit of the hull's point: weighted least squares, or a Huber fit solved by
        cvxpy that resists mis-certified rows.
    max_heads : int, default=6
        Largest number of heads ``n_heads="auto"`` may return.
    net_resolution : int, default=None
        Net points per hull coordinate.  ``None``: 41 for 2 heads, 7 for 3, 5 for
        4, coarser beyond.
    net_radius : float, default=None
        Half-width of the net's box, relative to the norm of the hull's minimum-norm
        point.  ``None``: ``1.5 * sqrt(m - 1)``.
    net_samples : int, default=1000
        Examples used by the net search.
    max_net_candidates : int, default=20000
        Above this many head subsets, the net scores this many random ones and
        improves the best by single-head swaps.
    polish : bool, default=True
        Polish the net's winner (Levenberg-Marquardt on the variable-projection
        problem).  ``False`` returns the pure phased estimate.
    polish_samples : int, default=None
        Examples used by the polish (a random subset when more are given;
        ``None`` uses all).  The polish runs in two stages: first on a random
        subset of 1000 of them (every Levenberg-Marquardt iteration costs time
        linear in the examples), then on all the polish examples from that
        result.  The second stage is skipped when the first already fits them
        all to a relative RMS residual below 1e-10 (noise-free data: then only
        one forward pass touches them all).  With noise it runs (a few to ten
        iterations, each linear in the examples) and every example lowers the
        variance of the estimate; an int caps its cost on very large noisy
        data at the price of that variance.
    polish_max_iter : int, default=100
        Iterations of the polish.
    polish_tol : float, default=1e-10
        Relative tolerance of the polish.
    batch_size : int, default=4096
        Examples processed at once in phases 2-4: memory is bounded by the batch.
        Also the rows read at a time from an out-of-core X (see Notes).
    random_state : int, RandomState instance or None, default=None
        Subsampling in phases 2-4 and 6.
    verbose : int, default=0
        Show a progress bar over the phases (tqdm) when positive.

    Attributes
    ----------
    attention_ : ndarray of shape (n_heads, n_features_per_token, n_features_per_token)
        Learned Theta_i.
    projection_ : ndarray of shape (n_heads, n_features_per_token, n_outputs_per_token)
        Learned W_i.
    layer_ : AttentionLayer
        The learned layer.
    n_heads_ : int
        Number of heads used (estimated when ``n_heads="auto"``).
    phase_report_ : list of PhaseReport
        One record per phase (and per round of phases 2-4): what it saw, decided
        and handed on, and its wall time.
    hull_point_ : ndarray of shape (n_features_per_token, n_features_per_token)
        A point of the estimated affine hull of the Theta_i.
    hull_directions_ : ndarray of shape (n_heads - 1, n_features_per_token, \
n_features_per_token)
        Orthonormal directions of the estimated hull (none when ``n_tokens_ == 1``).
    projection_sum_ : ndarray of shape (n_features_per_token, n_outputs_per_token)
        Phase-3 estimate of ``sum_i W_i``.
    n_iter_ : int
        Rounds of phases 2-4 that ran (0 when ``n_tokens_ == 1``).
    n_features_in_ : int
        Width of the flattened input.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Names of the input columns, when X is a DataFrame with string names.
    n_tokens_, n_features_per_token_, n_outputs_per_token_ : int
        Shape facts of the training data.

    See Also
    --------
    GradientAttentionRegressor : the same layer trained from a random start.
    skattn.check_conditions : the non-degeneracy conditions the phases rely on.

    Notes
    -----
    Phase 2 needs ``n_outputs_per_token >= n_tokens`` (a row's pattern is solved
    through ``W_sum``) and certification is unambiguous only when
    ``n_outputs_per_token > n_heads * n_tokens``; ``fit`` raises or warns.  With
    one token per sequence softmax is identically 1 and ``F(x) = x sum_i W_i``:
    the phases are skipped, ``attention_`` is zero and ``projection_`` holds the
    least-squares ``W_sum`` divided equally among the heads.

    When the hull's spectral evidence is weak (augmented gap ratio below 3, as
    for three heads at k = 4 on 3e4 examples), a ``ConvergenceWarning`` says so:
    the net then searches a wrong hull and any recovery is the polish's.

    Out-of-core data: X and y may be ``numpy.memmap``, zarr, h5py or dask
    arrays of shape ``(n_samples, n_tokens * width)``.  They are validated chunk
    by chunk and read ``batch_size`` rows at a time by phases 1-4 and the net
    (``net_samples`` rows); the result depends on the chunking only by rounding.
    Phase 1's statistics of a dask array are reduced by dask over its chunks;
    phases 2-4 compute each batch with dask and work on it in this process.  The
    polish works in memory: on ``polish_samples`` random examples, 100000 when
    ``polish_samples=None`` and there are more.

    References
    ----------
    S. Chen and Y. Li. Provably learning a multi-head attention layer.
    STOC 2025. arXiv:2402.04084.

    Examples
    --------
    >>> from skattn import MultiHeadAttentionRegressor, make_attention_regression
    >>> X, y = make_attention_regression(3000, 4, 6, 1, n_outputs=6, random_state=0)
    >>> est = MultiHeadAttentionRegressor(n_heads=1, n_tokens=4, random_state=0)
    >>> est.fit(X, y).score(X, y) > 0.999999
    True
    """

    _parameter_constraints = {
        **BaseAttentionRegressor._parameter_constraints,
        "n_heads": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "input_distribution": [StrOptions({"gaussian", "boolean"})],
        "certify_tol": [Interval(Real, 0, None, closed="neither")],
        "certify_tol_final": [Interval(Real, 0, None, closed="neither")],
        "n_rounds": [Interval(Integral, 1, None, closed="left")],
        "refine_iter": [Interval(Integral, 0, None, closed="left")],
        "min_pattern_prob": [Interval(Real, 0, 1, closed="left")],
        "confidence_floor": [Interval(Real, 0, None, closed="neither"), None],
        "max_rows": [Interval(Integral, 1, None, closed="left")],
        "hull_method": [StrOptions({"lstsq", "huber"})],
        "max_heads": [Interval(Integral, 1, None, closed="left")],
        "net_resolution": [Interval(Integral, 2, None, closed="left"), None],
        "net_radius": [Interval(Real, 0, None, closed="neither"), None],
        "net_samples": [Interval(Integral, 1, None, closed="left")],
        "max_net_candidates": [Interval(Integral, 1, None, closed="left")],
        "polish": ["boolean"],
        "polish_samples": [Interval(Integral, 1, None, closed="left"), None],
        "polish_max_iter": [Interval(Integral, 1, None, closed="left")],
        "polish_tol": [Interval(Real, 0, None, closed="neither")],
        "batch_size": [Interval(Integral, 1, None, closed="left")],
        "random_state": ["random_state"],
        "verbose": ["verbose"],
    }

    def __init__(
        self,
        n_heads=1,
        n_tokens=None,
        *,
        input_distribution="gaussian",
        certify_tol=0.3,
        certify_tol_final=0.02,
        n_rounds=5,
        refine_iter=2,
        min_pattern_prob=0.05,
        confidence_floor=None,
        max_rows=20000,
        hull_method="lstsq",
        max_heads=6,
        net_resolution=None,
        net_radius=None,
        net_samples=1000,
        max_net_candidates=20000,
        polish=True,
        polish_samples=None,
        polish_max_iter=100,
        polish_tol=1e-10,
        batch_size=4096,
        random_state=None,
        verbose=0,
    ):
        self.n_heads = n_heads
        self.n_tokens = n_tokens
        self.input_distribution = input_distribution
        self.certify_tol = certify_tol
        self.certify_tol_final = certify_tol_final
        self.n_rounds = n_rounds
        self.refine_iter = refine_iter
        self.min_pattern_prob = min_pattern_prob
        self.confidence_floor = confidence_floor
        self.max_rows = max_rows
        self.hull_method = hull_method
        self.max_heads = max_heads
        self.net_resolution = net_resolution
        self.net_radius = net_radius
        self.net_samples = net_samples
        self.max_net_candidates = max_net_candidates
        self.polish = polish
        self.polish_samples = polish_samples
        self.polish_max_iter = polish_max_iter
        self.polish_tol = polish_tol
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, sample_weight=None):
        """Learn the layer from examples with the phased algorithm.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences, token-major.  A ``numpy.memmap``, zarr, h5py or
            dask array is read in ``batch_size`` batches, never whole (see Notes).
        y : array-like of shape (n_samples, n_tokens * n_outputs)
            Output sequences ``F(X)`` (+ noise), token-major; out of core too.
        sample_weight : array-like of shape (n_samples,), default=None
            Weights of the examples in every statistic and least-squares fit.

        Returns
        -------
        self : MultiHeadAttentionRegressor
        """
        X3, Y3, weights = self._validate_fit_data(X, y, sample_weight)
        if self.input_distribution == "boolean":
            check = BooleanTokens(*X3.shape[1:]).check
            batches = X3.iter_batches() if isinstance(X3, TokenBatches) else [(0, X3)]
            for _, Xb in batches:
                check(Xb.reshape(len(Xb), -1))
        rng = check_random_state(self.random_state)
        self.phase_report_ = []
        if self.n_tokens_ == 1:
            return self._fit_linear(X3, Y3, weights)
        self._check_learnable()
        with _progress(self.verbose, total=6) as bar:
            W_sum = self._run(
                "1-crude-projection-sum", bar, crude_projection_sum, X3, Y3, weights
            )
            W_sum, point, directions, hull_info = self._sculpt(
                X3, Y3, weights, W_sum, rng, bar
            )
            self._run("5-span", bar, hull_span, point, directions)
            attention, projection = self._phase6(
                X3, Y3, weights, point, directions, rng, bar
            )
        self.projection_sum_ = W_sum
        self.hull_point_, self.hull_directions_ = point, directions
        self._warn_if_weak(hull_info)
        self._set_layer(attention, projection)
        return self

    def _check_learnable(self):
        k, d, d_out = (
            self.n_tokens_,
            self.n_features_per_token_,
            self.n_outputs_per_token_,
        )
        if self.certify_tol_final > self.certify_tol:
            raise ValueError(
                f"certify_tol_final={self.certify_tol_final:g} is larger than "
                f"certify_tol={self.certify_tol:g}; the tolerance tightens from the "
                f"first round to the last, so pass certify_tol_final <= certify_tol."
            )
        if self.net_resolution is not None and self.n_heads != "auto":
            n_grid = self.net_resolution ** (self.n_heads - 1)
            if (n_grid * d) ** 2 > _MAX_GRID_GRAM:
                raise ValueError(
                    f"net_resolution={self.net_resolution} gives {n_grid} net points "
                    f"per head for {self.n_heads} heads, too many to hold their Gram "
                    f"matrix; lower net_resolution so that net_resolution ** "
                    f"{self.n_heads - 1} * {d} <= {int(math.sqrt(_MAX_GRID_GRAM))}."
                )
        if d_out < k:
            raise ValueError(
                f"The phased learner needs n_outputs_per_token >= n_tokens (phase 2 "
                f"solves each row's attention pattern through sum_i W_i), got "
                f"{d_out} outputs per token and n_tokens={k}. Use "
                f"GradientAttentionRegressor for such data."
            )
        if self.n_heads != "auto" and d_out <= self.n_heads * k:
            warnings.warn(
                f"n_outputs_per_token={d_out} <= n_heads * n_tokens = "
                f"{self.n_heads * k}: a mixture of different patterns may pass "
                f"certification, so the hull may be biased (identifiability of "
                f"phase 2 needs d_out > m k). Check phase_report_ and the fit.",
                UserWarning,
                stacklevel=3,
            )

    def _run(self, phase, bar, func, *args, **kwargs):
        """Run one phase function, time it, record its report, return its estimate."""
        start = time.perf_counter()
        *estimate, info = func(*args, **kwargs)
        self.phase_report_.append(
            PhaseReport(phase, 0, time.perf_counter() - start, info)
        )
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
                raise CertificationError(f"{exc}{_TOLERANCE_NAMES}") from exc
        for warning in caught:  # re-issue, certification ones in the estimator's terms
            suffix = (
                _TOLERANCE_NAMES if warning.category is CertificationWarning else ""
            )
            warnings.warn(f"{warning.message}{suffix}", warning.category, stacklevel=4)
        seconds = time.perf_counter() - start
        for record in info["rounds"]:
            self.phase_report_.append(
                PhaseReport(
                    "2-4-certify-refine-hull",
                    record["round"],
                    record["seconds"],
                    record,
                )
            )
        summary = {key: value for key, value in info.items() if key != "rounds"}
        summary["projection_sum"] = W_sum
        self.phase_report_.append(
            PhaseReport("2-4-hull-selected", info["best_round"], seconds, summary)
        )
        self.n_iter_ = info["n_rounds"]
        self.n_heads_ = int(info["n_heads"])
        _advance(bar, "2-4-hull", steps=3)
        return W_sum, point, directions, info

    def _sculpt_hull(self, X3, Y3, weights, W_sum, rng):
        return sculpt_hull(
            X3,
            Y3,
            self.n_heads if self.n_heads == "auto" else int(self.n_heads),
            W_sum=W_sum,
            tol=self.certify_tol,
            tol_final=self.certify_tol_final,
            n_rounds=self.n_rounds,
            refine_iter=self.refine_iter,
            sample_weight=weights,
            p_min=self.min_pattern_prob,
            confidence_floor=self.confidence_floor,
            max_rows=self.max_rows,
            method=self.hull_method,
            batch_size=self.batch_size,
            max_heads=self.max_heads,
            random_state=rng.randint(np.iinfo(np.int32).max),
        )

    def _phase6(self, X3, Y3, weights, point, directions, rng, bar):
        """Phase 6: the net over the hull, then the polish; one report each."""
        n = len(X3)
        polish_rows = None
        if self.polish_samples is not None and self.polish_samples < n:
            polish_rows = self.polish_samples
        elif isinstance(X3, TokenBatches) and n > _OUT_OF_CORE_POLISH_SAMPLES:
            polish_rows = _OUT_OF_CORE_POLISH_SAMPLES  # the polish is in memory
        elif isinstance(X3, TokenBatches):  # few enough for the in-memory polish
            X3, Y3 = X3[0:n], Y3[0:n]
        attention, projection, info = fit_from_hull(
            X3,
            Y3,
            point,
            directions,
            self.n_heads_,
            resolution=self.net_resolution,
            radius=self.net_radius,
            polish=self.polish,
            sample_weight=weights,
            n_net_samples=self.net_samples,
            max_candidates=self.max_net_candidates,
            max_iter=self.polish_max_iter,
            tol=self.polish_tol,
            n_polish_samples=polish_rows,
            random_state=rng.randint(np.iinfo(np.int32).max),
        )
        for phase, record in (("6-net", info["net"]), ("6-polish", info["polish"])):
            if record is not None:
                record = dict(record)
                seconds = record.pop("seconds")
                self.phase_report_.append(PhaseReport(phase, 0, seconds, record))
        if self.polish and not info["polish"].get("converged", True):
            stages = info["polish"].get("stages") or [{}]
            reason = stages[-1].get("stop_reason", stages[-1].get("message", "?"))
            fix = (
                "raise polish_max_iter"
                if reason == "max_iter"
                else "check the data for duplicated or degenerate sequences"
            )
            warnings.warn(
                f"The polish did not converge (stopped: {reason}) after "
                f"{info['polish'].get('n_iter')} iterations with polish_tol="
                f"{self.polish_tol:g}; {fix}.",
                ConvergenceWarning,
                stacklevel=3,
            )
        _advance(bar, "6-net-and-polish")
        return attention, projection

    def _warn_if_weak(self, hull_info):
        ratio = hull_info["augmented_gap_ratio"]
        if self.n_heads_ > 1 and not ratio >= _WEAK_GAP_RATIO:
            warnings.warn(
                f"Weak spectral evidence for the hull of {self.n_heads_} heads "
                f"(augmented gap ratio {ratio:.2f} < {_WEAK_GAP_RATIO}): too few rows "
                f"on which all heads agree were certified, so phases 2-4 did not "
                f"locate the hull and the result rests on the net and the polish. "
                f"Give more examples, or raise certify_tol_final; see phase_report_.",
                ConvergenceWarning,
                stacklevel=3,
            )

    def _fit_linear(self, X3, Y3, weights):
        """One token per sequence: softmax is 1 and F(x) = x W_sum."""
        start = time.perf_counter()
        if isinstance(X3, TokenBatches):  # with one token, phase 1 is exact
            W_sum = crude_projection_sum(X3, Y3, weights)[0]
        else:
            sw = np.sqrt(weights)[:, None]
            W_sum = np.linalg.lstsq(X3[:, 0] * sw, Y3[:, 0] * sw, rcond=None)[0]
        m = 1 if self.n_heads == "auto" else int(self.n_heads)
        d = X3.shape[2]
        self.phase_report_.append(
            PhaseReport(
                "linear-one-token",
                0,
                time.perf_counter() - start,
                {"n_samples": len(X3), "note": "k = 1: F is linear, phases skipped"},
            )
        )
        self.n_iter_ = 0
        self.n_heads_ = m
        self.projection_sum_ = W_sum
        self.hull_point_, self.hull_directions_ = np.zeros((d, d)), np.zeros((0, d, d))
        self._set_layer(np.zeros((m, d, d)), np.repeat(W_sum[None] / m, m, axis=0))
        return self


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(verbose, total):
    if not verbose:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="phased learner", unit="phase")


def _advance(bar, phase, steps=1):
    if bar is not None:
        bar.set_postfix_str(phase)
        bar.update(steps)
