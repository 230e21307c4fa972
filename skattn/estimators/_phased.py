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

from ..datasets import BooleanTokens
from ..phased._affine_hull import sculpt_hull
from ..phased._errors import CertificationError, CertificationWarning
from ..phased._model_selection import polish_on_all, select_n_heads
from ..phased._net import _MAX_GRID_GRAM, fit_from_hull
from ..phased._projection_sum import crude_projection_sum
from ..phased._report import PhaseReport
from ..phased._span import hull_span
from ..solvers import balanced_factors
from ..solvers._polish import (
    REALISABLE_RESIDUAL,
    polish_from_random_starts,
    warmup_size,
)
from ..utils._batches import TokenBatches, check_sources, map_reduce_batches
from ._base import BaseAttentionRegressor

# Appended to certification messages of phases 2-4, whose functions say tol/tol_final.
_TOLERANCE_NAMES = (
    " (In MultiHeadAttentionRegressor, tol is the first round's certify_tol and "
    "tol_final is certify_tol_final.)"
)

# init="auto" runs phases 1-5 up to this many features per token.  Since the
# matrix-free hull (hull_solver) they run at any d (k = 8, m = 2, n = 5e4, loaded
# machine: 11 s at d = 16 and 32, 34 s at d = 64, 57 s at d = 128), but their start
# saves the polish little: 8 Levenberg-Marquardt iterations against 8-9 from a
# random start at d = 8-16, 8 vs 10-11 at d = 32-64, 11 vs 16 at d = 128 (benchmarks/
# README.md, 2026-11-24), far less time than the phases take.  So beyond d = 16 the
# faster default (random starts) is kept; init="phased" runs the phases at any d.
_MAX_PHASE_FEATURES = 16

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
        Number of heads m.  ``"auto"`` selects it from data, up to ``max_heads``:
        m = 1, 2, ... heads are fitted on a training part of the examples, each
        from the previous fit plus one new head (Levenberg-Marquardt polish), and
        the search stops at the first m whose held-out error is at machine
        precision (noise-free data) or that m + 1 heads do not improve
        significantly (a one-sided paired test at 3 standard errors on the
        per-example held-out losses); heads of that fit which are redundant
        (negligible or duplicate, the certificate's test; with two tokens also
        a uniform part absorbed by negating another head) are dropped while the
        re-polished smaller fit stays exact or not significantly worse; the
        selected fit is then polished on all examples.  Phases 2-4 still run and
        their spectral gap (the hull of m heads has dimension m - 1) is recorded
        as a second opinion; phase 6 is skipped.  Every candidate and the
        decision are in ``model_selection_``.
    n_tokens : int, default=None
        Tokens per sequence k.  ``None``: from a 3-D X, else 1 (F is then linear).
    input_distribution : {"gaussian", "boolean"}, default="gaussian"
        ``"boolean"`` verifies that every input is +-1, the setting of Chen & Li's
        guarantee, and raises otherwise; ``"gaussian"`` accepts any finite real
        tokens (the Gaussian extension).  The algorithm is the same.
    fit_intercept : bool, default=False
        Also learn key biases ``u_i`` and an output intercept ``c``: the model
        ``sum_i softmax(X Theta_i X^T + 1 (X u_i)^T) X W_i + 1 c^T`` of real
        layers with biases.  The phases then run on tokens with a constant
        coordinate 1 appended (see Notes); ``input_distribution="boolean"``
        checks the given X, not that coordinate.
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
    hull_solver : {"auto", "dense", "matrix-free"}, default="auto"
        How phases 2 and 4 solve the hull's constraint system (``d^2`` unknowns):
        ``"dense"`` forms its normal matrix (``O(rows d^4)`` a round) and
        diagonalises it; ``"matrix-free"`` applies the system in factored form
        (``O(rows d^2)`` a product) inside an iterative eigensolver (LOBPCG) and
        conjugate gradients.  ``"auto"``: dense up to 32 features per token
        (the measured crossover), matrix-free beyond.
    max_heads : int, default=6
        Largest number of heads ``n_heads="auto"`` may return.
    validation_fraction : float, default=0.2
        ``n_heads="auto"`` only: share of the examples held out to select m.
    selection_samples : int, default=400
        ``n_heads="auto"`` only: training examples each candidate m is polished
        on (a random subset of the training part; the selected fit is then
        polished on all examples).  Every Levenberg-Marquardt iteration costs
        time linear in them.
    certificate : bool, default=False
        Compute ``certificate_`` (:func:`skattn.certify` on the training data)
        at the end of ``fit``.  Opt-in because its Jacobian costs ``O(P^3)`` for
        ``P = m (d^2 + d d_out)`` parameters: about 0.2 s at P = 400, several
        seconds at P = 1200.
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
    head_rank : int, default=None
        Learn low-rank heads, the shape of real transformers: ``Theta_i = Q_i
        K_i^T`` with ``Q_i, K_i`` of shape ``(d, head_rank)``, and ``W_i`` of rank
        at most ``head_rank`` (``V_i O_i``).  The polish works on the factors
        ``Q_i, K_i`` (matrix-free), with the ``W_i`` eliminated by least squares;
        phases 1-5 and the net are unchanged (full rank), and their winner is
        truncated to rank ``head_rank`` as the polish's start.  Factors are
        identifiable only up to an invertible ``r x r`` gauge: the products are
        in ``attention_``/``projection_``, balanced factors in ``factors_``.
        ``None``: full rank.  Needs an integer ``n_heads``.
    init : {"auto", "phased", "random"}, default="auto"
        Where the polish starts.  ``"phased"``: the net's winner over the hull of
        phases 1-5 (the paper's algorithm); a ``CertificationError`` when phases
        2-4 certify too few rows.  ``"random"``: no phases; the polish runs from
        up to ``n_restarts`` random starts (the first whose fit is realisable
        wins, else the lowest residual).  ``"auto"``: ``"phased"`` when the
        phases pay for themselves (``n_features_per_token <= 16``; beyond, they
        run in seconds with ``hull_solver="matrix-free"`` but their start saves
        the polish no iterations, see ``benchmarks/README.md``) and
        ``n_outputs_per_token >= n_tokens`` (phase 2's condition), else
        ``"random"`` with a ``UserWarning`` saying why; and when phases 2-4 fail
        to certify, a ``CertificationWarning`` names the failure and the fit
        goes on from random starts.  ``phase_report_`` records which start was
        used and why.  ``polish=False`` always runs the phases.
    n_restarts : int, default=3
        Most random starts of ``init="random"`` (and of the fallback).
    whiten : {"auto", True, False}, default="auto"
        Random starts only: polish in coordinates where the tokens (with the
        constant coordinate of ``fit_intercept``) have identity second moment on
        the subspace they reach, then map the layer back exactly
        (:func:`skattn.solvers.whitening_map`; ``Theta_i = A Theta'_i A^T``,
        ``W_i = A W'_i``).  A preconditioner: anisotropic inputs such as
        embedded text after a LayerNorm slow Gauss-Newton steps down by the
        square of their moment's condition number (measured on two heads of
        all-MiniLM-L6-v2: held-out error 1.2e-3 without, 9e-8 with, after the
        same 30 iterations).  ``"auto"``: when that condition number exceeds 10
        or the subspace is proper; uniform Boolean and standard Gaussian tokens
        are left as they are.  ``phase_report_`` records it.
    polish_solver : {"auto", "dense", "matrix-free"}, default="auto"
        Levenberg-Marquardt solver of the polish: the Gauss-Newton matrix formed
        and factored (``"dense"``: ``O((m d^2)^3)`` a step, fastest for small
        layers) or each step solved by LSMR from Jacobian-vector products
        (``"matrix-free"``: a few tens of passes over the examples a step, no
        ``(m d^2)^2`` matrix).  ``"auto"``: dense when ``m d^2 <= 400`` and
        ``head_rank`` is None, else matrix-free
        (:func:`skattn.solvers.choose_solver`).  ``phase_report_`` says which ran,
        its iterations and its Jacobian products.
    batch_size : int, default=4096
        Examples processed at once in phases 2-4: memory is bounded by the batch.
        Also the rows read at a time from an out-of-core X, and the batches of a
        dask chunk within its task (see Notes).
    random_state : int, RandomState instance or None, default=None
        Subsampling in phases 2-4 and 6.
    verbose : int, default=0
        Show a progress bar over the phases (tqdm) when positive; from 2 on, the
        matrix-free polish also prints one line per iteration.

    Attributes
    ----------
    attention_ : ndarray of shape (n_heads, n_features_per_token, n_features_per_token)
        Learned Theta_i.
    projection_ : ndarray of shape (n_heads, n_features_per_token, n_outputs_per_token)
        Learned W_i.
    key_bias_ : ndarray of shape (n_heads, n_features_per_token)
        Learned key biases u_i (zeros when ``fit_intercept=False``).
    intercept_ : ndarray of shape (n_outputs_per_token,)
        Learned output intercept c (zeros when ``fit_intercept=False``).
    layer_ : AttentionLayer
        The learned layer.
    factors_ : tuple of ndarray
        With ``head_rank`` only: balanced factors ``(Q, K, V, O)`` of shapes
        ``(m, d, r)``, ``(m, d, r)``, ``(m, d, r)``, ``(m, r, d_out)`` with
        ``Theta_i = Q_i K_i^T`` (exact) and ``V_i O_i`` the best rank-r
        approximation of ``W_i`` (exact on realisable data; the ``W_i`` are
        least-squares solutions, not rank-constrained).  Defined up to an
        invertible ``r x r`` gauge per head.
    n_heads_ : int
        Number of heads used (selected when ``n_heads="auto"``).
    model_selection_ : dict
        ``n_heads="auto"`` only (absent otherwise): ``n_heads`` (selected),
        ``reason`` ("exact", "no_significant_drop" or "max_heads"), ``candidates``
        (one dict per m tried: ``n_heads``, ``train_error``, ``held_out_error``,
        ``held_out_interval``, ``drop_statistic``, ``significant_drop``,
        ``exact``, ``n_iter``, ``converged``, ``capped``, ``resumed``,
        ``seconds``), ``pruned`` (one dict per redundant head dropped from the
        search's choice: ``n_heads`` after the drop, ``dropped_head``, ``note``,
        ``held_out_error``, ``accepted``, ...), the selected fit's
        ``held_out_error``, ``held_out_interval``, ``n_held_out`` and
        ``confidence_level``, and ``spectral`` (the second opinion of phases
        2-4: ``n_heads``, ``augmented_gap_ratio``, ``strong`` (ratio >= 3),
        ``agrees``, or ``available=False`` with the reason).
    certificate_ : Certificate
        With ``certificate=True`` only: :func:`skattn.certify` of the fit on the
        training data (the held-out error from ``model_selection_``).
    phase_report_ : list of PhaseReport
        One record per phase (and per round of phases 2-4): what it saw, decided
        and handed on, and its wall time.
    hull_point_ : ndarray of shape (n_features_per_token, n_features_per_token)
        A point of the estimated affine hull of the Theta_i (``None`` when
        ``n_heads="auto"`` and phases 2-4 certified too few rows).
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

    With ``fit_intercept=True`` every phase sees the tokens ``[x, 1]``, so it
    learns ``Theta~_i = [[Theta_i, g_i], [u_i^T, t_i]]`` and ``W~_i = [W_i;
    w0_i]``: the logits on ``[x, 1]`` are those of the biased model plus terms
    constant in the key token, and the output gains ``sum_i w0_i = c`` because
    attention rows sum to 1.  The last column ``(g_i, t_i)`` is a gauge (null in
    every hull equation, since it multiplies ``x_a - x_b``'s constant coordinate,
    0): phases 2-4 pin it to 0 explicitly
    (``gauge_features`` of :func:`~skattn.phased._affine_hull.hull_constraints`)
    so that it neither counts as a hull direction nor disturbs the spectral gap.
    The fitted ``attention_``/``projection_`` are then ``Theta_i``/``W_i``, with
    ``key_bias_`` the ``u_i`` and ``intercept_`` the ``c``; ``hull_point_``,
    ``hull_directions_`` and ``projection_sum_`` stay in the augmented
    coordinates (one more feature).  Only this gauge is pinned: inputs confined
    to an affine hyperplane (e.g. LayerNorm outputs, ``w^T x = const``) add
    further null directions (``Theta~_i + a w~^T`` and ``w~ b^T``), which phases
    2-4 report as a ``CertificationError``; ``GradientAttentionRegressor`` is
    not affected.

    When the hull's spectral evidence is weak (augmented gap ratio below 3, as
    for three heads at k = 4 on 3e4 examples), a ``ConvergenceWarning`` says so:
    the net then searches a wrong hull and any recovery is the polish's.

    Out-of-core data: X and y may be ``numpy.memmap``, zarr, h5py or dask
    arrays of shape ``(n_samples, n_tokens * width)``.  They are validated chunk
    by chunk and read ``batch_size`` rows at a time by phases 1-4 and the net
    (``net_samples`` rows); the result depends on the chunking only by rounding.
    When X and y are both dask arrays, every pass of phases 1-4 over the
    examples (phase 1's token sums, phase 3's certification and normal
    equations, phase 2's certification scan, and the Boolean input check) is
    one dask task per chunk, run where the chunk lives -- on a
    ``dask.distributed`` cluster's workers when a ``Client`` is active -- which
    returns small partial statistics that are merged in this process
    (:func:`~skattn.utils._batches.map_reduce_batches`); only the rows kept by phase 2
    (``max_rows``) and phase 3's curvature subsample are read here.  The polish
    works in memory: on ``polish_samples`` random examples, 100000 when
    ``polish_samples=None`` and there are more.  A memmap or h5py file or a
    zarr folder that changes or vanishes during the fit raises
    :class:`skattn.utils._batches.SourceChangedError` naming it.

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
        "fit_intercept": ["boolean"],
        "certify_tol": [Interval(Real, 0, None, closed="neither")],
        "certify_tol_final": [Interval(Real, 0, None, closed="neither")],
        "n_rounds": [Interval(Integral, 1, None, closed="left")],
        "refine_iter": [Interval(Integral, 0, None, closed="left")],
        "min_pattern_prob": [Interval(Real, 0, 1, closed="left")],
        "confidence_floor": [Interval(Real, 0, None, closed="neither"), None],
        "max_rows": [Interval(Integral, 1, None, closed="left")],
        "hull_method": [StrOptions({"lstsq", "huber"})],
        "hull_solver": [StrOptions({"auto", "dense", "matrix-free"})],
        "max_heads": [Interval(Integral, 1, None, closed="left")],
        "validation_fraction": [Interval(Real, 0, 1, closed="neither")],
        "selection_samples": [Interval(Integral, 1, None, closed="left")],
        "certificate": ["boolean"],
        "net_resolution": [Interval(Integral, 2, None, closed="left"), None],
        "net_radius": [Interval(Real, 0, None, closed="neither"), None],
        "net_samples": [Interval(Integral, 1, None, closed="left")],
        "max_net_candidates": [Interval(Integral, 1, None, closed="left")],
        "polish": ["boolean"],
        "polish_samples": [Interval(Integral, 1, None, closed="left"), None],
        "polish_max_iter": [Interval(Integral, 1, None, closed="left")],
        "polish_tol": [Interval(Real, 0, None, closed="neither")],
        "head_rank": [Interval(Integral, 1, None, closed="left"), None],
        "init": [StrOptions({"auto", "phased", "random"})],
        "n_restarts": [Interval(Integral, 1, None, closed="left")],
        "whiten": [StrOptions({"auto"}), "boolean"],
        "polish_solver": [StrOptions({"auto", "dense", "matrix-free"})],
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
        fit_intercept=False,
        certify_tol=0.3,
        certify_tol_final=0.02,
        n_rounds=5,
        refine_iter=2,
        min_pattern_prob=0.05,
        confidence_floor=None,
        max_rows=20000,
        hull_method="lstsq",
        hull_solver="auto",
        max_heads=6,
        validation_fraction=0.2,
        selection_samples=400,
        certificate=False,
        net_resolution=None,
        net_radius=None,
        net_samples=1000,
        max_net_candidates=20000,
        polish=True,
        polish_samples=None,
        polish_max_iter=100,
        polish_tol=1e-10,
        head_rank=None,
        init="auto",
        n_restarts=3,
        whiten="auto",
        polish_solver="auto",
        batch_size=4096,
        random_state=None,
        verbose=0,
    ):
        self.n_heads = n_heads
        self.n_tokens = n_tokens
        self.input_distribution = input_distribution
        self.fit_intercept = fit_intercept
        self.certify_tol = certify_tol
        self.certify_tol_final = certify_tol_final
        self.n_rounds = n_rounds
        self.refine_iter = refine_iter
        self.min_pattern_prob = min_pattern_prob
        self.confidence_floor = confidence_floor
        self.max_rows = max_rows
        self.hull_method = hull_method
        self.hull_solver = hull_solver
        self.max_heads = max_heads
        self.validation_fraction = validation_fraction
        self.selection_samples = selection_samples
        self.certificate = certificate
        self.net_resolution = net_resolution
        self.net_radius = net_radius
        self.net_samples = net_samples
        self.max_net_candidates = max_net_candidates
        self.polish = polish
        self.polish_samples = polish_samples
        self.polish_max_iter = polish_max_iter
        self.polish_tol = polish_tol
        self.head_rank = head_rank
        self.init = init
        self.n_restarts = n_restarts
        self.whiten = whiten
        self.polish_solver = polish_solver
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
            if isinstance(X3, TokenBatches):
                _check_boolean_batches(X3, Y3, self.batch_size)
            else:
                BooleanTokens(*X3.shape[1:]).check(X3.reshape(len(X3), -1))
        if self.fit_intercept and isinstance(X3, TokenBatches):
            raise ValueError(
                "fit_intercept=True needs in-memory X (the tokens [x, 1] are built "
                "in memory); pass a numpy array, or fit_intercept=False for "
                "out-of-core X."
            )
        X3 = self._model_tokens(X3)  # [x, 1] tokens when fitting an intercept
        rng = check_random_state(self.random_state)
        self.phase_report_ = []
        if self.n_tokens_ == 1:
            self._fit_linear(X3, Y3, weights)
        elif self.n_heads == "auto":
            if self.head_rank is not None:
                raise ValueError(
                    "head_rank needs an integer n_heads; n_heads='auto' searches "
                    "full-rank heads. Pass n_heads=m or head_rank=None."
                )
            self._fit_auto(X3, Y3, weights, rng)
        else:
            self._fit_fixed(X3, Y3, weights, rng)
        if self.head_rank is not None and self.n_tokens_ > 1:
            self.factors_ = _factors(self.attention_, self.projection_, self.head_rank)
        if self.certificate:
            from ..diagnostics import certify

            self.certificate_ = certify(self, X3, Y3)
        check_sources(X3, Y3)  # files read in batches did not change during the fit
        if not all(np.all(np.isfinite(p)) for p in (self.attention_, self.projection_)):
            raise ValueError(
                "MultiHeadAttentionRegressor's fitted parameters are NaN or infinite: "
                "for finite X and y, values too large for float64 arithmetic (the "
                "attention logits overflow). Rescale X and y (e.g. with sklearn."
                "preprocessing.StandardScaler) first."
            )
        return self

    def _choose_init(self, X3, Y3):
        """``("phased" | "random", reason)``: where the polish starts."""
        k, d = X3.shape[1], self.n_features_per_token_  # d without [x, 1]
        d_out = Y3.shape[2]
        if self.init != "auto":
            return self.init, f"init={self.init!r}"
        if not self.polish:
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
        if self.init == "random" and not self.polish:
            raise ValueError(
                "init='random' needs polish=True: without the polish a random start "
                "is no estimate. Pass init='phased' or 'auto' for the pure phased "
                "estimate."
            )
        init, reason = self._choose_init(X3, Y3)
        self.phase_report_.append(
            PhaseReport("0-start", 0, 0.0, {"init": init, "reason": reason})
        )
        if init == "random" and self.init == "auto":
            warnings.warn(
                f"Phases 1-5 of Chen & Li were skipped ({reason}); the polish "
                f"starts from up to {self.n_restarts} random starts. Pass "
                f"init='random' to silence this warning.",
                UserWarning,
                stacklevel=3,
            )
        if init == "phased":
            try:
                self._fit_phased(X3, Y3, weights, rng)
                return
            except CertificationError as exc:
                if self.init == "phased":
                    raise
                message = str(exc)
            warnings.warn(
                f"Phases 2-4 failed, so the polish starts from up to "
                f"{self.n_restarts} random starts instead of the phased estimate "
                f"(init='phased' raises instead). What failed: {message}",
                CertificationWarning,
                stacklevel=3,
            )
            reason = f"fallback after phases 2-4 failed: {message}"
            self.phase_report_.append(
                PhaseReport("0-start", 1, 0.0, {"init": "random", "reason": reason})
            )
        self._fit_random(X3, Y3, weights, rng, reason)

    def _polish_data(self, X3, Y3):
        """``(X3, Y3, n_polish_samples)`` for the in-memory polish.

        Out-of-core input is polished on a random subset of
        ``_OUT_OF_CORE_POLISH_SAMPLES`` examples when ``polish_samples`` is None and
        there are more, else loaded.
        """
        n = len(X3)
        polish_rows = None
        if self.polish_samples is not None and self.polish_samples < n:
            polish_rows = self.polish_samples
        elif isinstance(X3, TokenBatches) and n > _OUT_OF_CORE_POLISH_SAMPLES:
            polish_rows = _OUT_OF_CORE_POLISH_SAMPLES  # the polish is in memory
        elif isinstance(X3, TokenBatches):  # few enough for the in-memory polish
            X3, Y3 = X3[0:n], Y3[0:n]
        return X3, Y3, polish_rows

    def _polish_options(self, X3, n_polish_samples):
        """Options of the polish shared by the phased and the random starts."""
        m = int(self.n_heads)
        return dict(
            n_polish_samples=n_polish_samples,
            n_warmup_samples=warmup_size(m, X3.shape[1], X3.shape[2], self.head_rank),
            max_iter=self.polish_max_iter,
            tol=self.polish_tol,
            solver=self.polish_solver,
            head_rank=self.head_rank,
            intercept=self.fit_intercept,
            verbose=2 if self.verbose > 1 else 0,
        )

    def _fit_random(self, X3, Y3, weights, rng, reason):
        """The polish from random starts (no phases)."""
        m = int(self.n_heads)
        start = time.perf_counter()
        X3, Y3, polish_rows = self._polish_data(X3, Y3)
        with _progress(self.verbose, total=1) as bar:
            attention, projection, info = polish_from_random_starts(
                X3,
                Y3,
                m,
                n_starts=self.n_restarts,
                whiten=self.whiten,
                sample_weight=weights,
                random_state=rng.randint(np.iinfo(np.int32).max),
                **self._polish_options(X3, polish_rows),
            )
            _advance(bar, "random-start-polish")
        info = {key: value for key, value in info.items() if key != "stages"}
        info["reason"] = reason
        self.phase_report_.append(
            PhaseReport("6-polish", 0, time.perf_counter() - start, info)
        )
        self._warn_if_not_converged(info)
        self.n_heads_ = m
        self.n_iter_ = 0
        self.projection_sum_ = projection.sum(axis=0)
        self.hull_point_, self.hull_directions_ = None, None
        self._set_layer(attention, projection)

    def _fit_phased(self, X3, Y3, weights, rng):
        """Phases 1-6 for a given number of heads."""
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

    def _fit_auto(self, X3, Y3, weights, rng):
        """n_heads="auto": phases 1-5 as a second opinion, then the head search."""
        self._check_learnable()
        with _progress(self.verbose, total=6) as bar:
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
            notes = [str(w.message) for w in caught]
            if "error" in hull_info:
                spectral = {"available": False, "reason": hull_info["error"]}
                point = directions = None
                self.n_iter_ = 0
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
                max_heads=self.max_heads,
                sample_weight=weights,
                validation_fraction=self.validation_fraction,
                n_fit_samples=self.selection_samples,
                max_iter=min(self.polish_max_iter, 30),
                tol=self.polish_tol,
                random_state=rng.randint(np.iinfo(np.int32).max),
            )
            seconds = time.perf_counter() - start
            m = info["n_heads"]
            if spectral["available"]:
                spectral["agrees"] = spectral["n_heads"] == m
            held = info["held_out_indices"]
            self.model_selection_ = {
                "n_heads": m,
                "reason": info["reason"],
                "candidates": info["candidates"],
                "pruned": info["pruned"],
                "held_out_error": info["held_out_error"],
                "held_out_interval": info["held_out_interval"],
                "n_held_out": int(held.size),
                "confidence_level": 0.95,
                "validation_fraction": self.validation_fraction,
                "n_fit_samples": info["n_fit_samples"],
                "spectral": spectral,
            }
            self.phase_report_.append(
                PhaseReport(
                    "auto-select-heads",
                    0,
                    seconds,
                    {k: v for k, v in self.model_selection_.items()},
                )
            )
            _advance(bar, "auto-select-heads")
            start = time.perf_counter()
            attention, projection, pinfo = polish_on_all(
                X3,
                Y3,
                attention,
                weights,
                max_iter=self.polish_max_iter,
                tol=self.polish_tol,
            )
            pinfo = {k: v for k, v in pinfo.items() if k != "stages"}
            self.phase_report_.append(
                PhaseReport("auto-polish-all", 0, time.perf_counter() - start, pinfo)
            )
            _advance(bar, "auto-polish-all")
        self.n_heads_ = m
        self.projection_sum_ = W_sum
        self.hull_point_, self.hull_directions_ = point, directions
        self._set_layer(attention, projection)

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
                f"{d_out} outputs per token and n_tokens={k}. Use init='random' "
                f"(the polish from random starts) or GradientAttentionRegressor "
                f"for such data."
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
            gauge_features=(X3.shape[2] - 1,) if self.fit_intercept else (),
            solver=self.hull_solver,
        )

    def _phase6(self, X3, Y3, weights, point, directions, rng, bar):
        """Phase 6: the net over the hull, then the polish; one report each."""
        X3, Y3, polish_rows = self._polish_data(X3, Y3)
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
            random_state=rng.randint(np.iinfo(np.int32).max),
            **self._polish_options(X3, polish_rows),
        )
        for phase, record in (("6-net", info["net"]), ("6-polish", info["polish"])):
            if record is not None:
                record = dict(record)
                seconds = record.pop("seconds")
                self.phase_report_.append(PhaseReport(phase, 0, seconds, record))
        if self.polish:
            self._warn_if_not_converged(info["polish"])
        _advance(bar, "6-net-and-polish")
        return attention, projection

    def _warn_if_not_converged(self, info):
        """ConvergenceWarning when the polish stopped early short of an exact fit."""
        if info.get("converged", True):
            return
        if info.get("relative_residual", 1.0) <= REALISABLE_RESIDUAL:
            return  # at the rounding floor: nothing left to converge to
        stages = info.get("stages") or [info]
        reason = stages[-1].get("stop_reason", stages[-1].get("message", "?"))
        fix = (
            "raise polish_max_iter"
            if reason == "max_iter"
            else "check the data for duplicated or degenerate sequences"
        )
        warnings.warn(
            f"The polish did not converge (stopped: {reason}) after "
            f"{info.get('n_iter')} iterations with polish_tol="
            f"{self.polish_tol:g}; {fix}.",
            ConvergenceWarning,
            stacklevel=4,
        )

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


def _boolean_scan_batch(Xb, Yb, idx):
    """Count of entries other than +-1 in a batch, and the first: (row, col, value)."""
    flat = Xb.reshape(len(Xb), -1)
    bad = np.abs(flat) != 1.0
    if not np.any(bad):
        return 0, None
    row, col = np.argwhere(bad)[0]
    return int(bad.sum()), (int(idx[row]), int(col), float(flat[row, col]))


def _merge_boolean_scans(parts):
    first = next((part[1] for part in parts if part[1] is not None), None)
    return sum(part[0] for part in parts), first


def _check_boolean_batches(X3, Y3, batch_size):
    """``BooleanTokens.check`` of out-of-core X, as one scan (dask: on its chunks)."""
    n_bad, first = map_reduce_batches(
        X3,
        Y3,
        _boolean_scan_batch,
        _merge_boolean_scans,
        batch_size=batch_size,
        name="skattn-check-boolean",
    )
    if n_bad:
        row, col, value = first
        raise ValueError(
            f"X must have entries in {{-1, +1}} for the Boolean input distribution, "
            f"but found {value!r} at row {row}, column {col} ({n_bad} such "
            f"value(s) in total). For real-valued tokens use "
            f'input_distribution="gaussian".'
        )


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


def _factors(attention, projection, rank):
    """Balanced rank-``rank`` factors ``(Q, K, V, O)`` of the fitted heads."""
    rank = min(rank, attention.shape[1])
    query, key = balanced_factors(attention, rank)
    value, output = balanced_factors(projection, min(rank, projection.shape[2]))
    return query, key, value, np.swapaxes(output, 1, 2)
