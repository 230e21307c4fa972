"""GradientAttentionRegressor: the attention layer trained from a random start.

The gradient baseline from the same literature: the same layer ``F(X) = sum_i
softmax(X Theta_i X^T) X W_i`` fitted by minimising the (weighted,
ridge-penalised) squared loss by full-batch L-BFGS (scipy) or mini-batch Adam
(numpy), from one or several random starts.  The optimizers live in
:mod:`skattn.solvers.optimizers` (``_lbfgs``, ``_adam``); the estimator validates,
orchestrates and stores the fitted attributes.
"""

import copy
import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.base import _fit_context
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import _check_sample_weight, validate_data
from tqdm.auto import tqdm

from ..solvers.kernels._loss import _loss_chunk_size, _penalized_loss_gradient
from ..solvers.kernels._parametrization import _initial_parameters
from ..solvers.optimizers._adam import _adam_epoch, _adam_state, _fit_adam
from ..solvers.optimizers._lbfgs import lbfgs_layer
from ..utils._batches import check_sources
from ..utils._validation import (
    all_or_nothing,
    check_fitted_tokens,
    check_target,
    flatten_tokens,
    resolve_n_tokens,
    unflatten_tokens,
)
from ._base import (
    Y_SHAPES,
    BaseAttentionRegressor,
    available_if_explained,
    check_weights,
)


def _check_not_diverged(estimator, loss, attention, projection):
    """Raise a ValueError when a fit's loss or parameters are not finite."""
    if all(np.all(np.isfinite(v)) for v in (loss, attention, projection)):
        return
    raise ValueError(
        f"{type(estimator).__name__} diverged: the loss or the parameters are NaN or "
        f"infinite (loss {loss}), which for finite X and y means values too large "
        f"for float64 arithmetic (attention logits overflow) or a step too large. "
        f"Rescale X and y (e.g. with sklearn.preprocessing.StandardScaler), or "
        f"lower learning_rate for optimizer='adam'."
    )


class GradientAttentionRegressor(BaseAttentionRegressor):
    """A multi-head attention layer trained by gradient descent from random starts.

    Fits ``F(X) = sum_i softmax(X Theta_i X^T) X W_i`` by minimising the weighted
    squared loss plus a ridge penalty,

        ``J = sum_n w_n ||F(X_n) - Y_n||^2 / (2 sum_n w_n)
        + alpha / 2 (||Theta||^2 + ||W||^2)``,

    with analytic gradients: full-batch L-BFGS (``optimizer="lbfgs"``) or mini-batch
    Adam (``optimizer="adam"``, which also offers :meth:`partial_fit`).  The baseline
    to the provable phased learner; ``n_heads`` may exceed the number of heads of
    the target (the over-parameterised regime of Deora et al. 2023), and nothing
    requires the data to be realizable.

    Parameters
    ----------
    n_heads : int, default=1
        Number of heads m of the fitted layer.
    n_tokens : int, default=None
        Tokens per sequence k.  ``None`` takes k from a 3-D X, else k = 1 (then
        every softmax is 1 and the model is linear: ``y = x sum_i W_i``).
    fit_intercept : bool, default=False
        Also learn key biases ``u_i`` and an output intercept ``c`` (the model
        ``sum_i softmax(X Theta_i X^T + 1 (X u_i)^T) X W_i + 1 c^T`` of real
        layers with biases), by training on tokens with a constant coordinate
        1 appended and mapping the result back (see
        :class:`MultiHeadAttentionRegressor`'s Notes).  ``alpha`` then also
        penalises the ``u_i`` and the per-head shares of ``c``.
    optimizer : {"lbfgs", "adam"}, default="lbfgs"
        ``"lbfgs"``: scipy's L-BFGS-B on all samples at once (deterministic, the
        accurate choice for up to ~10^5 samples).  ``"adam"``: shuffled
        mini-batches with Adam steps; supports :meth:`partial_fit`.
    alpha : float, default=0.0
        Ridge penalty on all parameters (see the objective above; the loss is a
        weighted mean, so alpha does not scale with the number of samples).
    max_iter : int, default=500
        Most L-BFGS iterations, or Adam epochs, per start.
    tol : float, default=1e-6
        ``"lbfgs"``: stop when the largest absolute gradient entry is below tol
        (on planted layers the head-matched parameter error ends near tol:
        about 1e-6 by default; ``tol=0`` trains until no step decreases the
        loss, to about 1e-16 on noise-free data, in about twice the iterations).
        ``"adam"``: stop when the epoch loss has not improved by at least tol for
        ``n_iter_no_change`` consecutive epochs.
    head_rank : int, default=None
        Train low-rank heads, the shape of real transformers: L-BFGS on the
        factors ``Q_i, K_i, V_i`` (``(d, r)``) and ``O_i`` (``(r, d_out)``) with
        ``Theta_i = Q_i K_i^T`` and ``W_i = V_i O_i`` (the start is the balanced
        rank-r truncation of the usual one).  The fitted attributes are the
        products; ``alpha`` penalises the products.  ``optimizer="lbfgs"`` only.
        ``None``: full rank.
    n_restarts : int, default=1
        Independent random starts; the one with the lowest final objective is
        kept (all final objectives are in ``restart_losses_``).
    init_scale : float, default=1.0
        Scale of the random initial attention: Theta_i has i.i.d.
        ``N(0, (init_scale / d)^2)`` entries, so its expected Frobenius norm is
        about ``init_scale`` (the standard deviation of a logit for unit-variance
        tokens).  ``0`` starts from uniform attention, where all heads coincide.
    learning_rate : float, default=0.01
        Adam step size (``"adam"`` only).
    batch_size : int or "auto", default="auto"
        Adam mini-batch size; ``"auto"`` is ``min(200, n_samples)``.
    n_iter_no_change : int, default=10
        Adam epochs without an improvement of ``tol`` before stopping.
    warm_start : bool, default=False
        If True and already fitted, ``fit`` continues from the previous solution
        (a single start; ``n_restarts`` is ignored; Adam restarts its moment
        estimates) instead of random starts.
    random_state : int, RandomState instance or None, default=None
        Seeds the initial attention matrices and Adam's shuffling.  An int gives
        bit-identical refits.
    verbose : int, default=0
        ``1``: a progress bar over restarts; ``2``: also the loss after every
        iteration (L-BFGS) or epoch (Adam).

    Attributes
    ----------
    attention_ : ndarray of shape (n_heads, `n_features_per_token_`, \
`n_features_per_token_`)
        The learned Theta_i.
    projection_ : ndarray of shape (n_heads, `n_features_per_token_`, \
`n_outputs_per_token_`)
        The learned W_i.
    key_bias_ : ndarray of shape (n_heads, `n_features_per_token_`)
        Learned key biases u_i (zeros when ``fit_intercept=False``).
    intercept_ : ndarray of shape (`n_outputs_per_token_`,)
        Learned output intercept c (zeros when ``fit_intercept=False``).
    layer_ : AttentionLayer
        The learned layer as a transformer.
    loss_ : float
        Final training objective J of the kept start.
    loss_curve_ : list of float
        J after each iteration (L-BFGS) or epoch (Adam) of the kept start; each
        :meth:`partial_fit` call appends its epoch loss.
    n_iter_ : int
        Iterations (L-BFGS) or epochs (Adam) run by the kept start, at least 1 (a
        start that is already optimal, e.g. the exact least-squares W when k = 1,
        counts as one); each :meth:`partial_fit` call adds one.
    stop_reason_ : str
        Why training of the kept start stopped, in the words of
        :data:`skattn.solvers.STOP_REASONS`: ``"gradient"`` (L-BFGS: the largest
        gradient entry fell below ``tol``), ``"no_decrease"`` (L-BFGS: no step
        decreases the loss any more, which is where ``tol=0`` stops: the
        rounding floor; Adam: the epoch loss improved by less than ``tol`` for
        ``n_iter_no_change`` epochs), ``"max_iter"`` (the iterations or epochs
        ran out; ``fit`` warns) or ``"partial_fit"`` (one epoch of
        :meth:`partial_fit`, no stopping rule).
    restart_losses_ : ndarray of shape (n_starts,)
        Final objective of every start, in the order they were run.
    n_features_in_ : int
        Width of the flattened input.
    n_tokens_ : int
        Tokens per sequence k.
    n_features_per_token_ : int
        Features per input token d.
    n_outputs_per_token_ : int
        Outputs per token d_out.

    See Also
    --------
    skattn.AttentionLayer : the model, as a fixed transformer.

    Notes
    -----
    **Initialisation.** Each start draws a small random Theta and then solves for
    the W exactly: given Theta the model is linear in W (``F(X) = sum_i (S_i X)
    W_i`` with the head features ``S_i X`` of :func:`skattn.layer._math.head_features`),
    so the best W is one (ridge) least-squares solve on the normal equations,
    accumulated over chunks of samples.  Starting from the optimal W for the
    initial Theta, rather than from random W, removes the large initial
    projection error, and L-BFGS spends its iterations on the attention only.
    Do not make ``init_scale`` too small with several heads: when the Theta_i
    nearly coincide, so do the heads' features, and the exact W is a large,
    nearly cancelling pair from which training often does not recover (measured
    on planted d=8, k=4, m=2 Boolean layers with 1000-2000 samples: 5 of 16
    starts recovered the layer with ``init_scale=0.1``, all 18 with 0.3, 1 or 3,
    and all 40 with the default 1 over attention scales 2-8).

    **Memory.** The objective (:func:`skattn.solvers.kernels._loss._loss_gradient`)
    and the least-squares W of a start (:func:`skattn.solvers.solve_projections`) are
    accumulated over chunks of samples so that no intermediate array
    (``n_chunk * m * k * max(k, d, d_out)`` entries) exceeds 16 MiB; the result
    does not depend on the chunking beyond rounding.

    **Symmetries.** Heads are unordered: compare learned and planted parameters
    after matching heads (Hungarian assignment).

    References
    ----------
    .. [1] P. Deora, R. Ghaderi, H. Taheri, C. Thrampoulidis. "On the
       Optimization and Generalization of Multi-head Attention", 2023.
    .. [2] S. Chen, Y. Li. "Provably learning a multi-head attention layer",
       arXiv:2402.04084, 2024.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> from skattn import GradientAttentionRegressor
    >>> rng = np.random.default_rng(0)
    >>> X = rng.choice([-1.0, 1.0], size=(300, 3, 4))
    >>> theta, W = rng.normal(size=(1, 4, 4)) / 2, rng.normal(size=(1, 4, 4)) / 2
    >>> y = forward(X, theta, W).reshape(300, -1)
    >>> reg = GradientAttentionRegressor(n_heads=1, random_state=0).fit(X, y)
    >>> reg.attention_.shape, reg.projection_.shape
    ((1, 4, 4), (1, 4, 4))
    >>> bool(reg.score(X, y) > 0.999)
    True
    """

    _parameter_constraints = {
        **BaseAttentionRegressor._parameter_constraints,
        "n_heads": [Interval(Integral, 1, None, closed="left")],
        "fit_intercept": ["boolean"],
        "optimizer": [StrOptions({"lbfgs", "adam"})],
        "alpha": [Interval(Real, 0, None, closed="left")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "head_rank": [Interval(Integral, 1, None, closed="left"), None],
        "n_restarts": [Interval(Integral, 1, None, closed="left")],
        "init_scale": [Interval(Real, 0, None, closed="left")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "batch_size": [
            Interval(Integral, 1, None, closed="left"),
            StrOptions({"auto"}),
        ],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "warm_start": ["boolean"],
        "random_state": ["random_state"],
        "verbose": ["verbose"],
    }

    def __init__(
        self,
        n_heads=1,
        n_tokens=None,
        *,
        fit_intercept=False,
        optimizer="lbfgs",
        alpha=0.0,
        max_iter=500,
        tol=1e-6,
        head_rank=None,
        n_restarts=1,
        init_scale=1.0,
        learning_rate=0.01,
        batch_size="auto",
        n_iter_no_change=10,
        warm_start=False,
        random_state=None,
        verbose=0,
    ):
        self.n_heads = n_heads
        self.n_tokens = n_tokens
        self.fit_intercept = fit_intercept
        self.optimizer = optimizer
        self.alpha = alpha
        self.max_iter = max_iter
        self.tol = tol
        self.head_rank = head_rank
        self.n_restarts = n_restarts
        self.init_scale = init_scale
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.n_iter_no_change = n_iter_no_change
        self.warm_start = warm_start
        self.random_state = random_state
        self.verbose = verbose

    def _rank(self, d, d_out):
        """The factors' rank, or None when ``head_rank`` does not restrict."""
        if self.head_rank is None or self.head_rank >= min(d, d_out):
            return None
        return self.head_rank

    def _batch_size(self, n_samples):
        if self.batch_size == "auto":
            return min(200, n_samples)
        return min(self.batch_size, n_samples)

    def _previous_solution(self, d, d_out):
        """The fitted parameters, checked against the new data's shapes."""
        expected = (self.n_heads, d, d, d_out)
        attention, projection = self._model_parameters()
        found = attention.shape + projection.shape[2:]
        if found != expected:
            raise ValueError(
                f"warm_start=True but the previous solution has (n_heads, n_features,"
                f" n_features, n_outputs) = {found} while the new fit needs "
                f"{expected}; refit with warm_start=False."
            )
        return attention, projection

    @_fit_context(prefer_skip_nested_validation=True)
    @all_or_nothing
    def fit(self, X, y, sample_weight=None):
        """Train the layer on (X, y) from ``n_restarts`` random starts.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences, token-major.  A ``numpy.memmap``, zarr, h5py or
            dask array is validated in chunks and read chunk by chunk by every
            evaluation of the objective (L-BFGS: a pass per iteration).
        y : array-like of shape (n_samples, n_tokens * n_outputs)
            Targets, token-major (1-D only when ``n_tokens * n_outputs == 1``);
            out of core too.
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights of the samples in the loss.

        Returns
        -------
        self : GradientAttentionRegressor
            The fitted estimator.

        Raises
        ------
        ValueError
            On invalid X, y or sample_weight (ragged lists, NaN, shapes that do
            not fit ``n_tokens``, values too large for float64 arithmetic, fewer
            than 2 samples of positive weight) and when training diverges.
            Nothing of the previous fit is changed then: the fitted attributes
            are those of the last successful fit.
        TypeError
            On sparse X or y.
        """
        warm = self.warm_start and hasattr(self, "attention_")
        X3, Y3, sample_weight = self._validate_fit_data(X, y, sample_weight)
        sources = (X3, Y3)
        if self.head_rank is not None and self.optimizer != "lbfgs":
            raise ValueError(
                f"head_rank={self.head_rank} needs optimizer='lbfgs' (the factors are "
                f"trained by L-BFGS); got optimizer={self.optimizer!r}."
            )
        X3 = self._model_tokens(X3)  # [x, 1] tokens when fitting an intercept
        n, k, d = X3.shape
        d_out = Y3.shape[2]
        previous = self._previous_solution(d, d_out) if warm else None
        rng = check_random_state(self.random_state)
        chunk = _loss_chunk_size(n, k, d, d_out, self.n_heads)
        batch_size = self._batch_size(n)
        n_starts = 1 if warm else self.n_restarts

        best = None
        restart_losses = []
        starts = tqdm(
            range(n_starts),
            desc=f"{type(self).__name__} ({self.optimizer})",
            disable=not self.verbose,
        )
        for _ in starts:
            if previous is not None:
                attention, projection = previous
            else:
                attention, projection = _initial_parameters(
                    X3,
                    Y3,
                    sample_weight,
                    self.n_heads,
                    self.init_scale,
                    self.alpha,
                    rng,
                )
            if self.optimizer == "lbfgs":
                state = None
                attention, projection, curve, n_iter, stop = _lbfgs_curve(
                    X3,
                    Y3,
                    sample_weight,
                    attention,
                    projection,
                    self.alpha,
                    self.max_iter,
                    self.tol,
                    chunk,
                    self.verbose,
                    self._rank(d, d_out),
                )
            else:
                state = _adam_state(attention, projection)
                attention, projection, curve, n_iter, stop = _fit_adam(
                    X3,
                    Y3,
                    sample_weight,
                    attention,
                    projection,
                    state,
                    self.alpha,
                    self.learning_rate,
                    batch_size,
                    self.max_iter,
                    self.tol,
                    self.n_iter_no_change,
                    rng,
                    chunk,
                    self.verbose,
                )
            loss = _penalized_loss_gradient(
                X3, Y3, attention, projection, sample_weight, self.alpha, chunk
            )[0]
            restart_losses.append(loss)
            if best is None or loss < best[0]:
                best = (loss, attention, projection, curve, n_iter, stop, state)
            starts.set_postfix(best_loss=f"{best[0]:.3e}")

        loss, attention, projection, curve, n_iter, stop, state = best
        if stop == "max_iter":
            what = "iterations" if self.optimizer == "lbfgs" else "epochs"
            warnings.warn(
                f"{type(self).__name__} (optimizer={self.optimizer!r}) stopped after "
                f"{n_iter} {what} (max_iter={self.max_iter}) without reaching "
                f"tol={self.tol} (final loss {loss:.3e}); increase max_iter (or "
                f"loosen tol).",
                ConvergenceWarning,
                stacklevel=4,  # fit, all_or_nothing, _fit_context: the caller's line
            )
        check_sources(*sources)  # files read in batches did not change during the fit
        _check_not_diverged(self, loss, attention, projection)
        self._set_layer(attention, projection)
        self.loss_ = float(loss)
        self.loss_curve_ = list(curve)
        self.n_iter_ = max(int(n_iter), 1)
        self.stop_reason_ = stop
        self.restart_losses_ = np.asarray(restart_losses)
        self._adam = state
        self._random_state = rng
        return self

    def _validate_partial_fit_data(self, X, y, sample_weight):
        """Validate a later batch against the fitted shapes (no reset)."""
        X, k3 = flatten_tokens(X)
        y = check_target(y, type(self).__name__, Y_SHAPES)
        X, y = validate_data(
            self,
            X,
            y,
            reset=False,
            multi_output=True,
            y_numeric=True,
            dtype=np.float64,
        )
        check_fitted_tokens(k3, self.n_tokens_)
        k = resolve_n_tokens(X.shape[1], self.n_tokens_, k3)
        y = np.asarray(y, dtype=np.float64)
        self._check_magnitudes(X, y)
        if y.ndim == 1:
            y = y[:, None]
        expected = self.n_tokens_ * self.n_outputs_per_token_
        if y.shape[1] != expected:
            raise ValueError(
                f"y has {y.shape[1]} columns but the estimator was fitted with "
                f"n_tokens_ * n_outputs_per_token_ = {expected}."
            )
        sample_weight = _check_sample_weight(sample_weight, X, dtype=np.float64)
        return unflatten_tokens(X, k), unflatten_tokens(y, k), sample_weight

    def _adam_optimizer(self):
        """``partial_fit`` exists only for Adam; otherwise say why it is missing."""
        if self.optimizer != "adam":
            raise AttributeError(
                f"partial_fit needs optimizer='adam' (one Adam epoch per call); this "
                f"{type(self).__name__} has optimizer={self.optimizer!r}, whose "
                f"L-BFGS trains on all samples at once. Use "
                f"{type(self).__name__}(optimizer='adam') for partial_fit, or fit."
            )
        return True

    @available_if_explained(_adam_optimizer)
    @_fit_context(prefer_skip_nested_validation=True)
    @all_or_nothing
    def partial_fit(self, X, y, sample_weight=None):
        """One Adam epoch over the given batch, continuing from the current layer.

        The first call (on an unfitted estimator) validates the shapes and starts
        from a random Theta with the least-squares W for this batch; later calls
        continue the parameters and Adam's moments.  Only with ``optimizer="adam"``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences, token-major.
        y : array-like of shape (n_samples, n_tokens * n_outputs)
            Targets, token-major.
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights of the samples in the loss.

        Returns
        -------
        self : GradientAttentionRegressor
            The updated estimator.

        Raises
        ------
        AttributeError
            On access, when ``optimizer`` is not ``"adam"`` (the message says so).
        ValueError
            On an invalid batch, or one that does not match the shapes of the
            first; the estimator is then left exactly as before the call.
        """
        if self.head_rank is not None:
            raise ValueError(
                f"partial_fit trains with Adam, which does not support "
                f"head_rank={self.head_rank}; use fit with optimizer='lbfgs'."
            )
        first = not hasattr(self, "attention_")
        if first:  # a batch of a stream: one sample is a batch
            X3, Y3, sample_weight = self._validate_fit_data(
                X, y, sample_weight, min_samples=1
            )
        else:
            X3, Y3, sample_weight = self._validate_partial_fit_data(X, y, sample_weight)
        X3 = self._model_tokens(X3)
        check_weights(sample_weight)
        n, k, d = X3.shape
        d_out = Y3.shape[2]
        chunk = _loss_chunk_size(n, k, d, d_out, self.n_heads)
        if first:
            rng = check_random_state(self.random_state)
            attention, projection = _initial_parameters(
                X3,
                Y3,
                sample_weight,
                self.n_heads,
                self.init_scale,
                self.alpha,
                rng,
            )
            loss_curve, n_iter = [], 0
        else:
            # a copy of the generator: a failed call must not advance the kept one
            rng = copy.deepcopy(self._random_state)
            attention, projection = self._model_parameters()
            loss_curve, n_iter = self.loss_curve_, self.n_iter_
        previous = None if first else getattr(self, "_adam", None)
        # a copy: the epoch's steps replace its entries, kept if the epoch is finite
        if previous is None:
            state = _adam_state(attention, projection)
        else:
            state = dict(previous)
        attention, projection, epoch_loss = _adam_epoch(
            X3,
            Y3,
            sample_weight,
            attention,
            projection,
            state,
            self.alpha,
            self.learning_rate,
            self._batch_size(n),
            rng,
            chunk,
        )
        _check_not_diverged(self, epoch_loss, attention, projection)
        self._adam = state
        self._random_state = rng
        self._set_layer(attention, projection)
        self.loss_ = float(epoch_loss)
        self.n_iter_ = n_iter + 1
        self.stop_reason_ = "partial_fit"
        self.restart_losses_ = np.asarray([epoch_loss])
        # last, as nothing after it can fail: restore_on_error puts back objects,
        # not their contents (a new list per call would cost O(calls) each)
        loss_curve.append(float(epoch_loss))
        self.loss_curve_ = loss_curve
        return self


def _lbfgs_curve(
    X,
    Y,
    sample_weight,
    attention,
    projection,
    alpha,
    max_iter,
    tol,
    chunk_size,
    verbose,
    head_rank,
):
    """Full-batch L-BFGS over all parameters (scipy's default memory, a budget of
    function evaluations), with the loss after each iteration: ``(attention,
    projection, loss_curve, n_iter, stop_reason)``."""
    loss_curve = []

    def callback(intermediate_result):
        loss_curve.append(float(intermediate_result.fun))
        if verbose >= 2:
            print(f"iteration {len(loss_curve)}, loss = {loss_curve[-1]:.6e}")

    attention, projection, info = lbfgs_layer(
        X,
        Y,
        attention,
        projection,
        sample_weight,
        alpha,
        max_iter,
        tol,
        head_rank=head_rank,
        alpha_attention=alpha,
        chunk_size=chunk_size,
        maxcor=10,
        maxfun=2 * max_iter + 20,
        callback=callback,
    )
    if not loss_curve or loss_curve[-1] != info["loss"]:
        loss_curve.append(info["loss"])
    return attention, projection, loss_curve, info["n_iter"], info["stop_reason"]
