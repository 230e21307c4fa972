"""MultiHeadAttentionRegressor: the phased learner of Chen & Li, end to end.

The estimator holds the parameters, validates the data and keeps the fitted
attributes; the learner itself is :func:`skattn.phased.phased_fit`.
"""

import time
import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.base import _fit_context
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import HasMethods, Interval, StrOptions

from ..datasets import BooleanTokens
from ..diagnostics import certify
from ..layer._positions import key_head_index
from ..metrics._identifiability import (
    IdentifiabilityWarning,
    data_verdict,
    describe_verdict,
)
from ..phased import phased_fit
from ..phased._model_selection import split_indices
from ..phased._options import PARAMETERS, PhasedOptions
from ..phased._pipeline import random_starts_bar
from ..phased._report import PhaseReport
from ..solvers import balanced_factors
from ..solvers._decoder import fit_decoder_from_random_starts
from ..solvers.kernels._loss import REALISABLE_RESIDUAL
from ..utils._array_api import device, namespace, to_namespace, to_numpy
from ..utils._batches import TokenBatches, check_sources, map_reduce_batches
from ..utils._validation import all_or_nothing, is_foreign_array
from ..utils._warnings import warn_at_caller
from ._base import BaseAttentionRegressor

# Held-out examples that n_heads="auto" needs: its paired test compares the
# per-example held-out losses of m and m + 1 heads at 3 standard errors, which a
# handful of examples cannot estimate (one example has no spread at all).
MIN_HELD_OUT = 10


class MultiHeadAttentionRegressor(BaseAttentionRegressor):
    """Learn a multi-head attention layer with the phased algorithm of Chen & Li.

    The model is ``F(X) = sum_i softmax(X Theta_i X^T) X W_i`` on sequences of
    ``n_tokens`` tokens.  ``fit`` runs the phases of Chen & Li (2024), each a pure
    function in :mod:`skattn.phased` (composed by
    :func:`skattn.phased.phased_fit`), and records what each did in
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
        decision are in ``model_selection_``.  The paired test needs at least
        10 held-out examples (48 examples at the default
        ``validation_fraction``); with fewer ``fit`` raises a ValueError saying
        how many to pass, rather than choose m from one or two held-out rows
        (a single row has no spread: any drop would count as significant).
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
        ``benchmarks/studies/study_three_heads.py``, and was neutral (+-0.03) where
        phases 2-4 fail (three heads at k = 4); off by default until measured more
        widely.
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
        ``n_heads="auto"`` only: share of the examples held out to select m (at
        least 10 examples; see ``n_heads``).
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
        at most ``head_rank`` (``V_i O_i``) where the random starts' search and
        per-head refinement run (``start_search``) or the polish factors the
        values; a polish that does not factor them fits whole ``W_i``.  A layer
        whose ``W_i`` have a larger rank than its ``Theta_i`` is outside the
        search's model: a sharp positional head beside another, both with
        full-rank ``W_i``, ends at 0.03 held out with ``head_rank=16``, exact
        without ``head_rank`` or when its ``W_i`` have the heads' rank
        (benchmarks/HISTORY.md, issue 61).  The polish works on
        the factors ``Q_i, K_i`` (matrix-free), with the ``W_i`` (or their output
        factors) eliminated by least squares;
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
        are left as they are.  ``phase_report_`` records it.  Decoder layers
        too (``causal``, ``rope``, ``n_kv_heads``: ``Q_i = A Q'_i``, ``K_g = A
        K'_g``, the rotations acting after the map): a trained GPT-2's second
        layer, 0.026 held out without, 4e-15 with.
    start_search : {"auto", "minibatch", "none"}, default="auto"
        Random starts of low-rank heads only: first move each start by Adam on
        the reduced loss of random batches of 256 sequences (the output factors
        eliminated on each batch, single precision) until the relative residual
        of a fixed evaluation batch is 2e-2 or stops falling, then polish
        (:func:`skattn.solvers.minibatch_search`).  From a random start the
        Levenberg-Marquardt polish of many heads crawls far from the minimum
        (12 heads of all-MiniLM-L6-v2: half of the targets unexplained after 20
        iterations); the search takes them to a relative residual of about 0.1
        in minutes (11 of the 12 real heads found from each start tried), and
        cut the polish of two heads from 32 iterations to 8.  When ``n_heads *
        head_rank`` is at most the output width (every BERT-style layer), the
        searched heads are then refined each on its own one-head problem
        (:func:`skattn.solvers.decoupled_refine`).  ``"auto"``: when the polish
        factors the values (:func:`skattn.solvers.choose_factor_values`) or,
        above 16 features per token (where ``init="auto"`` takes random
        starts), the heads are then refined alone: that fit is 2-5 times
        shorter than the polish from a random start on planted layers of 2-4
        heads (d = 24-32), and a planted previous-token head beside an ordinary
        one (d = 32, k = 16, 2e4 sequences) is exact in 7 s of search where the
        polish alone had not finished in an hour.  ``phase_report_`` records both
        (``start_search``, and its ``"decoupled"``).  Before the search, on
        layers of at most 8192 full-rank attention parameters (``n_heads *
        d**2``) with enough sequences to pin them, each start is first polished
        with full-rank heads for at most 15 iterations on 4800 tokens' worth
        of sequences (or as many as pin them); where they fit, their
        truncation to ``head_rank`` is polished and the search is not run
        (soft heads, whose logits are about one nat, leave the factored search
        where heads attend uniformly: 2-8 planted heads of rank 2-4 at d = 32,
        exact in 1-9 s where the search ended at 0.14-0.25; ``phase_report_``'s
        ``rank_free``).  Sharp heads crawl there
        and go on to the search (the previous-token layer above: 26 s where
        it took 8).
    polish_solver : {"auto", "dense", "matrix-free"}, default="auto"
        Levenberg-Marquardt solver of the polish: the Gauss-Newton matrix formed
        and factored (``"dense"``: ``O((m d^2)^3)`` a step, fastest for small
        layers) or each step solved by conjugate gradients from Jacobian-vector
        products (``"matrix-free"``: a few tens of passes over the examples a
        step, no ``(m d^2)^2`` matrix).  ``"auto"``: dense when ``m d^2 <= 400`` and
        ``head_rank`` is None, else matrix-free
        (:func:`skattn.solvers.choose_solver`).  ``phase_report_`` says which ran,
        its iterations and its Jacobian products.
    batch_size : int, default=4096
        Examples processed at once in phases 2-4: memory is bounded by the batch.
        Also the rows read at a time from an out-of-core X, and the batches of a
        dask chunk within its task (see Notes).
    causal : bool, default=False
        Learn a decoder (causal) layer: token l attends to tokens ``a <= l``.
        With ``causal``, ``rope`` or ``n_kv_heads`` the layer is learned on the
        decoder random-start path (:func:`skattn.solvers._decoder.
        fit_decoder_from_random_starts`): ``init="auto"`` takes it and says so
        (``phase_report_``, and a line with ``verbose``), ``init="phased"`` is a
        ValueError (the phases of Chen & Li assume position-free, unmasked
        inputs); the heads are searched and polished jointly (no per-head
        refinement; ``phase_report_`` says so), with ``head_rank`` (``None``:
        ``n_features``), no whitening.
    rope : bool, default=False
        Rotary position embeddings (RoPE): the logits are ``q_i(l)^T R((a - l)
        omega) k_g(a)`` with ``q_i(l) = Q_i^T x_l``, ``k_g(a) = K_g^T x_a``
        (``rotary_query_``, ``rotary_key_``) and no position-free part
        (``attention_`` is zero).  Needs an even ``head_rank``.
    rope_theta : float, default=10000.0
        RoPE's base (with ``rope``).
    rope_layout : {"half", "interleaved"}, default="half"
        Pairs of rotated dimensions (with ``rope``): Llama's ``rotate_half`` or
        GPT-J's interleaved pairs.
    n_kv_heads : int, default=None
        Grouped-query heads: groups of ``n_heads / n_kv_heads`` consecutive query
        heads share one key map ``K_g`` (needs ``head_rank``).  ``None``: one
        key head per query head.
    random_state : int, RandomState instance or None, default=None
        Subsampling in phases 2-4 and 6.
    memory : str, joblib.Memory or None, default=None
        Where to keep each finished stage of the random-start path (the search,
        each head's refinement, the polish and its iterates every 30 s; for a
        decoder layer each start's searches, warm-up, polish and
        reorientation), as
        ``Pipeline(memory=...)`` caches its transformers: a folder or a
        ``joblib.Memory``. A fit that was interrupted (killed, Ctrl-C) and is run
        again with the same data and parameters reads the finished stages back
        and goes on from the last one, to the layer an uninterrupted fit gives
        (bit for bit with the same number of BLAS threads; to rounding with
        another, as a product's last bits depend on it).
        Changed data or parameters use none of them, but for
        ``polish_max_iter``: a fit under a larger cap (as the
        ``ConvergenceWarning`` of a polish cut short asks) reads the stages
        before the polish back from the fit under the smaller one and goes on
        from the polish's kept iterates; resuming needs an int
        ``random_state`` (with None every fit draws new starts: ``fit`` then
        warns at once that it cannot be resumed, and an interrupted fit does not
        promise it). Phases 1-6 are not kept. ``None``: nothing is kept.
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
    rotary_query_ : ndarray of shape (n_heads, n_features_per_token [+ 1], head_rank)
        With ``rope`` only (else None): the query maps ``Q_i`` of the rotary
        logits (a last bias row with ``fit_intercept``).
    rotary_key_ : ndarray of shape (n_kv_heads, n_features_per_token [+ 1], head_rank)
        With ``rope`` only (else None): the key maps ``K_g``.
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
    data_verdict_ : dict
        :func:`skattn.metrics.data_verdict` of the training data, counted before
        the fit: ``determined``, equations against unknowns, rows of attention
        against the rows a head needs to pin its logits, per head ``pinned``,
        and ``samples_needed``.  When the data cannot determine the layer, the
        fit warns at once (:class:`~skattn.metrics.IdentifiabilityWarning`), before
        its long work, and goes on.
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

    Array API (GPU): under ``sklearn.config_context(array_api_dispatch=True)``
    (which needs the environment variable ``SCIPY_ARRAY_API=1`` set before scipy
    is imported), ``fit``, ``predict`` and ``score`` accept torch tensors (CPU or
    CUDA) and other array-API arrays (CuPy: untested in CI); ``y`` and
    ``sample_weight`` follow X's namespace and device.  The random-start path
    (``init="random"``: the minibatch search, the per-head refinement, the
    Levenberg-Marquardt polish) runs in that namespace on that device, and
    ``attention_``, ``projection_``, ``key_bias_``, ``intercept_``,
    ``projection_sum_``, ``hull_point_``, ``hull_directions_`` and ``factors_``
    are float64 arrays of it; ``predict`` then wants inputs of the same
    namespace and device.  Phases 1-6 are numpy-only: with
    ``init="phased"`` (or ``"auto"`` choosing them) and with ``n_heads="auto"``
    they run on numpy copies of X and y on the host, the polish after them on
    the device, and ``phase_report_`` says so (``"host_copies"`` in its first
    record).  ``layer_``, ``phase_report_``, ``model_selection_`` and
    ``certificate_`` are host objects (numpy), the certificate computed on host
    copies.  :func:`skattn.utils.estimator_to_numpy` returns a copy with numpy
    arrays.  Without the dispatch, inputs are converted to numpy as always.

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

    # Phases 2-4 sum outer products of the hull's equations, themselves products
    # of two tokens' entries: fourth powers of X (X of 1e77 made them overflow
    # into a LinAlgError on 200 sequences of 12 columns).
    _x_degree, _x_products = 4, "the attention logits and the moments of phases 2-4"

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
        "start_search": [StrOptions({"auto", "minibatch", "none"})],
        "polish_solver": [StrOptions({"auto", "dense", "matrix-free"})],
        "batch_size": [Interval(Integral, 1, None, closed="left")],
        "causal": ["boolean"],
        "rope": ["boolean"],
        "rope_theta": [Interval(Real, 0, None, closed="neither")],
        "rope_layout": [StrOptions({"half", "interleaved"})],
        "n_kv_heads": [Interval(Integral, 1, None, closed="left"), None],
        "random_state": ["random_state"],
        "memory": [None, str, HasMethods(["cache"])],
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
        start_search="auto",
        polish_solver="auto",
        batch_size=4096,
        causal=False,
        rope=False,
        rope_theta=10000.0,
        rope_layout="half",
        n_kv_heads=None,
        random_state=None,
        memory=None,
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
        self.start_search = start_search
        self.polish_solver = polish_solver
        self.batch_size = batch_size
        self.causal = causal
        self.rope = rope
        self.rope_theta = rope_theta
        self.rope_layout = rope_layout
        self.n_kv_heads = n_kv_heads
        self.random_state = random_state
        self.memory = memory
        self.verbose = verbose

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # fit, predict and score follow X's namespace under array_api_dispatch
        tags.array_api_support = True
        return tags

    def _data_verdict(self, X3, Y3, weights):
        """:func:`~skattn.metrics.data_verdict` of the fit's data: the sequences
        of positive weight, the model's tokens (``[x, 1]`` with an intercept),
        ``n_heads`` (1 for ``"auto"``: a lower bound) and ``head_rank``."""
        n = X3.shape[0]
        if weights is not None:
            n = int(np.count_nonzero(to_numpy(weights) > 0))
        m = 1 if self.n_heads == "auto" else self.n_heads
        return data_verdict(
            n, X3.shape[1], X3.shape[2], Y3.shape[2], m, head_rank=self.head_rank
        )

    def _warn_one_token(self):
        """Warn when 2-D X was read as one token a row (``n_tokens=None``) while
        the estimator asks for several heads or low-rank heads, which then do
        nothing: the usual slip is a forgotten ``n_tokens``."""
        several = self.n_heads not in (1, "auto")
        if not (several or self.head_rank is not None):
            return
        asked = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in ("n_heads", "head_rank")
            if (name == "n_heads" and several)
            or (name == "head_rank" and self.head_rank is not None)
        )
        warn_at_caller(
            "X is 2-D and n_tokens=None, so each row is read as one token (k = 1): "
            f"F is then linear, which ignores {asked}. If each row is a "
            "sequence of k tokens, pass n_tokens=k (or X of shape (n_samples, k, "
            "n_features)); pass n_tokens=1 to keep one token a row.",
            IdentifiabilityWarning,
        )

    @_fit_context(prefer_skip_nested_validation=True)
    @all_or_nothing
    def fit(self, X, y, sample_weight=None):
        """Learn the layer from examples with the phased algorithm.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences, token-major.  A ``numpy.memmap``, zarr, h5py or
            dask array is read in ``batch_size`` batches, never whole (see Notes).
            Under ``sklearn.config_context(array_api_dispatch=True)`` a torch
            tensor (CPU or CUDA) or other array-API array is fitted
            in its namespace and on its device (see Notes).
        y : array-like of shape (n_samples, n_tokens * n_outputs)
            Output sequences ``F(X)`` (+ noise), token-major; out of core too.
        sample_weight : array-like of shape (n_samples,), default=None
            Weights of the examples in every statistic and least-squares fit.

        Returns
        -------
        self : MultiHeadAttentionRegressor

        Raises
        ------
        ValueError
            On invalid X, y or sample_weight (ragged lists, NaN, shapes that do
            not fit ``n_tokens``, values too large for float64 arithmetic, fewer
            than 2 samples of positive weight), on too few examples for
            ``n_heads="auto"``, and when the phases fail (``init="phased"``).
            Nothing of the previous fit is changed then: the fitted attributes
            are those of the last successful ``fit``.
        TypeError
            On sparse X or y.
        """
        one_token_read = self.n_tokens is None and getattr(X, "ndim", 2) != 3
        X3, Y3, weights = self._validate_fit_data(X, y, sample_weight)
        if one_token_read and self.n_tokens_ == 1:
            self._warn_one_token()
        if self.input_distribution == "boolean":
            if isinstance(X3, TokenBatches):
                _check_boolean_batches(X3, Y3, self.batch_size)
            elif is_foreign_array(X3):  # scanned on its device, reported on the host
                _check_boolean_array(X3)
            else:
                BooleanTokens(*X3.shape[1:]).check(X3.reshape(len(X3), -1))
        if self.fit_intercept and isinstance(X3, TokenBatches):
            raise ValueError(
                "fit_intercept=True needs in-memory X (the tokens [x, 1] are built "
                "in memory); pass a numpy array, or fit_intercept=False for "
                "out-of-core X."
            )
        decoder = self._check_decoder(X3)
        X3 = self._model_tokens(X3)  # [x, 1] tokens when fitting an intercept
        resumable = _resumable(self.random_state)
        if self.memory is not None and not resumable:
            warnings.warn(
                _never_resumes(self.memory, self.random_state),
                UserWarning,
                stacklevel=4,  # fit, all_or_nothing, _fit_context: the caller's line
            )
        if decoder:
            try:
                return self._fit_decoder(X3, Y3, weights)
            except KeyboardInterrupt:  # left as it was (all_or_nothing)
                raise KeyboardInterrupt(_interrupted(self.memory, resumable)) from None
        rng = check_random_state(self.random_state)
        if self.n_heads == "auto" and self.head_rank is not None and self.n_tokens_ > 1:
            raise ValueError(
                "head_rank needs an integer n_heads; n_heads='auto' searches "
                "full-rank heads. Pass n_heads=m or head_rank=None."
            )
        if self.n_heads == "auto" and self.n_tokens_ > 1:
            _check_auto_samples(X3.shape[0], self.validation_fraction)
        verdict = self._data_verdict(X3, Y3, weights)
        if not verdict["determined"]:  # said at once, before the long work
            warn_at_caller(
                describe_verdict(verdict)
                + " The fit goes on; its heads are recorded as not pinned by this "
                "data (data_verdict_).",
                IdentifiabilityWarning,
            )
        options = PhasedOptions.from_params(
            **{name: getattr(self, name) for name in PARAMETERS}
        )
        try:
            attention, projection, info = phased_fit(
                X3,
                Y3,
                self.n_heads,
                sample_weight=weights,
                random_state=rng,
                options=options,
                memory=self.memory,
            )
        except KeyboardInterrupt:  # the estimator is left as it was (all_or_nothing)
            raise KeyboardInterrupt(_interrupted(self.memory, resumable)) from None
        self.phase_report_ = info["reports"]
        self.n_heads_, self.n_iter_ = info["n_heads"], info["n_iter"]
        self.data_verdict_ = verdict
        self.projection_sum_ = info["projection_sum"]
        self.hull_point_ = info["hull_point"]
        self.hull_directions_ = info["hull_directions"]
        if "model_selection" in info:
            self.model_selection_ = info["model_selection"]
        self.rotary_query_ = self.rotary_key_ = None
        self._fitted_decoder = {}
        self._set_layer(attention, projection)
        if self.head_rank is not None and self.n_tokens_ > 1:
            self.factors_ = _factors(self.attention_, self.projection_, self.head_rank)
        if self.certificate:  # a host record: computed on numpy copies
            self.certificate_ = certify(self, to_numpy(X3), to_numpy(Y3))
        check_sources(X3, Y3)  # files read in batches did not change during the fit
        if not all(_all_finite(p) for p in (self.attention_, self.projection_)):
            raise ValueError(
                "MultiHeadAttentionRegressor's fitted parameters are NaN or infinite: "
                "for finite X and y, values too large for float64 arithmetic (the "
                "attention logits overflow). Rescale X and y (e.g. with sklearn."
                "preprocessing.StandardScaler) first."
            )
        return self

    def _check_decoder(self, X3):
        """Whether the layer to learn is a decoder's (``causal``, ``rope``,
        ``n_kv_heads``); one-line ValueErrors for what that path cannot do."""
        if not (self.causal or self.rope or self.n_kv_heads is not None):
            return False
        what = ", ".join(
            text
            for text, on in (
                ("causal=True", self.causal),
                ("rope=True", self.rope),
                (f"n_kv_heads={self.n_kv_heads}", self.n_kv_heads is not None),
            )
            if on
        )
        needs = None
        if self.init == "phased":
            needs = (
                "init='phased' runs the phases of Chen & Li, which assume "
                "position-free, unmasked inputs; pass init='auto' or 'random'"
            )
        elif self.n_heads == "auto":
            needs = "an integer n_heads (n_heads='auto' searches position-free heads)"
        elif not self.polish:
            needs = "polish=True (the random-start path is a polish)"
        elif self.certificate:
            needs = "certificate=False (the certificate is of position-free heads)"
        elif isinstance(X3, TokenBatches):
            needs = "in-memory X (the decoder path reads no batches)"
        elif (self.rope or self.n_kv_heads is not None) and self.head_rank is None:
            needs = "head_rank (the head dimension the rotation and groups act on)"
        elif self.rope and self.head_rank % 2:
            needs = f"an even head_rank (RoPE rotates pairs), got {self.head_rank}"
        elif self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            needs = f"n_kv_heads dividing n_heads={self.n_heads}"
        if needs is not None:
            raise ValueError(f"A decoder layer ({what}) needs {needs}.")
        return True

    def _fit_decoder(self, X3, Y3, weights):
        """Learn a decoder layer on its random-start path
        (:func:`~skattn.solvers._decoder.fit_decoder_from_random_starts`)."""
        m, d = int(self.n_heads), X3.shape[2]
        r = d if self.head_rank is None else min(int(self.head_rank), d)
        reason = (
            "decoder layer (causal mask, rotary positions or shared key heads): "
            "the phases assume position-free inputs, so the random-start path ran"
        )
        if self.verbose:
            print(f"MultiHeadAttentionRegressor: {reason}.")
        rng = check_random_state(self.random_state)
        start = time.perf_counter()
        # the bars of the random starts and of each stage, as the encoder's
        with random_starts_bar(self.verbose, self.n_restarts) as progress:
            query, key, projection, info = fit_decoder_from_random_starts(
                X3,
                Y3,
                m,
                r,
                causal=self.causal,
                rope_theta=self.rope_theta if self.rope else None,
                rope_layout=self.rope_layout,
                n_kv_heads=self.n_kv_heads,
                sample_weight=weights,
                random_state=rng.randint(np.iinfo(np.int32).max),
                n_starts=self.n_restarts,
                search=self.start_search != "none",
                max_iter=self.polish_max_iter,
                tol=self.polish_tol,
                n_polish_samples=self.polish_samples,
                intercept=self.fit_intercept,
                whiten=self.whiten,
                verbose=self.verbose,
                progress=progress,
                memory=self.memory,
            )
        info["reason"] = reason
        info["init"] = "random"
        self.phase_report_ = [
            PhaseReport("6-polish", 0, time.perf_counter() - start, info)
        ]
        if info["relative_residual"] > REALISABLE_RESIDUAL and not info["converged"]:
            warnings.warn(
                f"The decoder layer's polish stopped ({info['stop_reason']}) at "
                f"relative residual {info['relative_residual']:.3g}: raise "
                f"polish_max_iter or n_restarts"
                + (
                    " (with the same memory=, a larger polish_max_iter goes on "
                    "from this fit's kept stages)."
                    if self.memory is not None
                    else "."
                ),
                ConvergenceWarning,
                stacklevel=4,
            )
        self.n_heads_, self.n_iter_ = m, 0
        xp = namespace(X3)
        self.projection_sum_ = xp.sum(projection, axis=0)
        self.hull_point_ = self.hull_directions_ = None
        index = key_head_index(m, key.shape[0])
        if not isinstance(key, np.ndarray):
            index = xp.asarray(index, device=device(key))
        self._fitted_decoder = {"causal": bool(self.causal)}
        if self.rope:
            D = X3.shape[2]
            attention = xp.zeros((m, D, D), dtype=xp.float64, device=device(X3))
            self.rotary_query_, self.rotary_key_ = query, key
            self._fitted_decoder.update(
                rotary_query=query,
                rotary_key=key,
                rope_theta=float(self.rope_theta),
                rope_layout=self.rope_layout,
                n_kv_heads=int(key.shape[0]),
            )
        else:  # Theta_i = Q_i K_g^T, each query head with its group's key map
            attention = xp.matmul(
                query, xp.matrix_transpose(xp.take(key, index, axis=0))
            )
            self.rotary_query_ = self.rotary_key_ = None
        self._set_layer(attention, projection)
        check_sources(X3, Y3)
        if not all(_all_finite(p) for p in (self.attention_, self.projection_)):
            raise ValueError(
                "MultiHeadAttentionRegressor's fitted parameters are NaN or infinite: "
                "rescale X and y (e.g. with sklearn.preprocessing.StandardScaler)."
            )
        return self

    def _decoder_layer(self):
        """The fitted decoder settings as ``AttentionLayer`` keywords ({} for a
        position-free layer): those of the last fit, not of ``set_params``."""
        return dict(getattr(self, "_fitted_decoder", {}))


def _resumable(random_state):
    """Whether a fit with ``random_state`` draws the same starts when run again
    (an int seed), so that stages kept by ``memory`` can be read back."""
    return isinstance(random_state, Integral) and not isinstance(random_state, bool)


def _never_resumes(memory, random_state):
    """The warning of a fit given ``memory`` that no later fit can resume."""
    return (
        f"memory={memory!r} keeps the fit's finished stages, but random_state="
        f"{random_state!r} draws other random starts at every fit, so a fit run "
        f"again (after an interruption, say) computes everything anew and reuses "
        f"nothing. Pass an int random_state (e.g. random_state=0) to make the fit "
        f"resumable."
    )


def _interrupted(memory, resumable=True):
    """What an interrupted fit says: how to resume it, or how it could have."""
    if memory is None:
        return (
            "MultiHeadAttentionRegressor.fit was interrupted; the estimator is left "
            "as it was. Pass memory='a folder' (and an int random_state) to keep "
            "each finished stage, so that a fit run again resumes after the last."
        )
    if not resumable:  # nothing kept can be read back: no promise
        return (
            f"MultiHeadAttentionRegressor.fit was interrupted; the estimator is left "
            f"as it was. A fit run again cannot resume from memory={memory!r}: "
            f"without an int random_state it draws other random starts. Pass "
            f"random_state=0 (any int) with memory to make fits resumable."
        )
    return (
        f"MultiHeadAttentionRegressor.fit was interrupted; the estimator is left as "
        f"it was. Its finished stages are kept in memory={memory!r}: fit again with "
        f"the same data and parameters to resume after the last one."
    )


def _n_held_out(n_samples, fraction):
    """Examples the head search of ``n_heads="auto"`` holds out."""
    return 0 if n_samples < 2 else len(split_indices(n_samples, fraction, 0)[1])


def _check_auto_samples(n_samples, fraction):
    """Raise unless ``n_heads="auto"`` holds out ``MIN_HELD_OUT`` examples."""
    held = _n_held_out(n_samples, fraction)
    if held >= MIN_HELD_OUT:
        return
    # round(fraction * n) >= MIN_HELD_OUT needs n >= (MIN_HELD_OUT - 0.5) / fraction
    needed = max(MIN_HELD_OUT + 1, int((MIN_HELD_OUT - 0.5) / fraction))
    while _n_held_out(needed, fraction) < MIN_HELD_OUT:
        needed += 1
    raise ValueError(
        f"n_heads='auto' chooses the number of heads on held-out examples "
        f"(validation_fraction={fraction}), and {n_samples} sample(s) leave {held} "
        f"held out, too few for its paired test (at least {MIN_HELD_OUT}). Pass at "
        f"least {needed} samples (or a larger validation_fraction), or an integer "
        f"n_heads."
    )


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


def _factors(attention, projection, rank):
    """Balanced rank-``rank`` factors ``(Q, K, V, O)`` of the fitted heads.

    Their SVDs run on numpy copies (small: ``m`` matrices of ``d`` rows); the
    factors are returned in the namespace and on the device of the heads.
    """
    xp, where = namespace(attention), device(attention)
    attention, projection = to_numpy(attention), to_numpy(projection)
    rank = min(rank, attention.shape[1])
    query, key = balanced_factors(attention, rank)
    value, output = balanced_factors(projection, min(rank, projection.shape[2]))
    factors = query, key, value, np.swapaxes(output, 1, 2)
    return tuple(to_namespace(factor, xp, where) for factor in factors)


def _all_finite(values):
    """Whether every entry of ``values`` (an array of any namespace) is finite."""
    if is_foreign_array(values):
        xp = namespace(values)
        return bool(xp.all(xp.isfinite(values)))
    return bool(np.all(np.isfinite(values)))


def _check_boolean_array(X3):
    """``BooleanTokens.check`` of tokens in another namespace: the scan runs on
    their device; only a failing X is copied to the host, for the message."""
    xp = namespace(X3)
    if bool(xp.all(xp.abs(X3) == 1.0)):
        return
    BooleanTokens(*X3.shape[1:]).check(to_numpy(X3).reshape(X3.shape[0], -1))
