"""Visualisations of learned attention layers, in scikit-learn's ``*Display`` style.

* :class:`AttentionPatternDisplay`: heatmaps of the attention patterns of a planted
  layer next to those of a learned one, heads matched first;
* :class:`RecoveryCurveDisplay`: recovery error against the number of examples (or
  any other x), one line per learner, log-log by default.

As in ``sklearn/metrics/_plot/regression.py``, the classmethods compute everything
(``from_layers``, ``from_estimator``, ``from_results``) and ``plot(ax=None)`` draws,
importing matplotlib only then.
"""

from numbers import Integral

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..layer import as_layer
from ..utils._optional import require
from ._recovery import _pattern_distances


def _check_matplotlib(caller):
    """Import matplotlib or raise an ImportError saying how to install it."""
    require("matplotlib", extra="plot", feature=caller)


def _match_heads(patterns_true, patterns_learned):
    """Match learned heads to true heads by their attention patterns.

    Minimises the summed pattern distances of the matched pairs with the
    Hungarian algorithm (``scipy.optimize.linear_sum_assignment``).  When the
    learned layer has fewer heads, some true heads stay unmatched (``-1``); when it
    has more, the extra learned heads are left out.

    Parameters
    ----------
    patterns_true : ndarray of shape (n_samples, n_heads_true, n_tokens, n_tokens)
    patterns_learned : ndarray of shape (n_samples, n_heads_learned, n_tokens, \
n_tokens)

    Returns
    -------
    matched : ndarray of shape (n_heads_true,)
        ``matched[i]`` is the learned head matched to true head ``i``, or -1.
    distances : ndarray of shape (n_heads_true,)
        The pattern distance of each matched pair (NaN when unmatched).

    Examples
    --------
    >>> import numpy as np
    >>> P = np.array([[[[1.0, 0.0], [0.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]]])
    >>> _match_heads(P, P[:, ::-1])
    (array([1, 0]), array([0., 0.]))
    """
    cost = _pattern_distances(patterns_true, patterns_learned)
    rows, cols = linear_sum_assignment(cost)
    matched = np.full(cost.shape[0], -1, dtype=np.intp)
    matched[rows] = cols
    distances = np.full(cost.shape[0], np.nan)
    distances[rows] = cost[rows, cols]
    return matched, distances


def _check_sample(sample, n_samples):
    if not isinstance(sample, Integral) or not 0 <= sample < n_samples:
        raise ValueError(
            f"sample must be an integer in [0, {n_samples}) (X has {n_samples} "
            f"sequences), got {sample!r}."
        )
    return int(sample)


def _check_heads(heads, n_heads):
    if heads is None:
        return np.arange(n_heads)
    if isinstance(heads, Integral):
        heads = [heads]
    heads = np.asarray(heads)
    if (
        heads.ndim != 1
        or heads.size == 0
        or not np.issubdtype(heads.dtype, np.integer)
        or heads.min() < 0
        or heads.max() >= n_heads
        or len(np.unique(heads)) != heads.size
    ):
        raise ValueError(
            f"heads must be distinct head indices in [0, {n_heads}), got "
            f"{heads.tolist()!r}."
        )
    return heads.astype(np.intp)


class AttentionPatternDisplay:
    """Attention patterns of a true and a learned layer, side by side.

    One column per (true) head; the top row shows the true layer's pattern
    ``softmax(x_l^T Theta_i x_a)`` on one input sequence, the bottom row the
    pattern of the learned head matched to it.  Heads are unordered, so they are
    matched first on the patterns of all the given inputs: the assignment
    minimising the summed mean total-variation distances between matched
    heads' attention rows (the distance of
    :func:`~skattn.metrics.attention_pattern_error`), by the Hungarian
    algorithm.  All heatmaps share the colour scale ``[0, 1]``.

    Create it with :meth:`from_layers` or :meth:`from_estimator`; all parameters
    are stored as attributes.

    Parameters
    ----------
    patterns_true : ndarray of shape (n_shown, n_tokens, n_tokens) or None
        The true layer's patterns on the displayed sequence, one per shown head;
        ``None`` draws the learned patterns only.
    patterns_learned : ndarray of shape (n_shown, n_tokens, n_tokens)
        The matched learned patterns on the displayed sequence (NaN for an
        unmatched head).
    heads_true : ndarray of shape (n_shown,) or None
        Index of each shown true head.
    heads_learned : ndarray of shape (n_shown,)
        Index of each shown learned head (-1 when unmatched).
    distances : ndarray of shape (n_shown,) or None
        Mean total-variation distance of each matched pair over all inputs.
    sample : int, default=0
        Index of the displayed sequence, used in the title.

    Attributes
    ----------
    images_ : ndarray of matplotlib AxesImage of shape (n_rows, n_shown)
        The heatmaps (``None`` where a head is unmatched).
    colorbar_ : matplotlib Colorbar or None
        The shared colour bar, if drawn.
    ax_ : ndarray of matplotlib Axes of shape (n_rows, n_shown)
        The axes: row 0 the true heads, row 1 the learned ones (only one row
        without a true layer).
    figure_ : matplotlib Figure
        Figure containing the heatmaps.

    See Also
    --------
    RecoveryCurveDisplay : Recovery error against the number of examples.
    skattn.AttentionLayer.attention_patterns : The patterns drawn here.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> from skattn.metrics import AttentionPatternDisplay
    >>> rng = np.random.default_rng(0)
    >>> true = AttentionLayer(rng.normal(size=(2, 4, 4)), np.ones((2, 4, 4)))
    >>> swapped = AttentionLayer(true.attention[::-1], true.projection)
    >>> X = rng.choice([-1.0, 1.0], size=(50, 3, 4))
    >>> display = AttentionPatternDisplay.from_layers(true, swapped, X)
    >>> display.heads_learned
    array([1, 0])
    >>> display.ax_.shape
    (2, 2)
    """

    def __init__(
        self,
        *,
        patterns_true,
        patterns_learned,
        heads_true,
        heads_learned,
        distances=None,
        sample=0,
    ):
        self.patterns_true = patterns_true
        self.patterns_learned = patterns_learned
        self.heads_true = heads_true
        self.heads_learned = heads_learned
        self.distances = distances
        self.sample = sample

    def plot(self, ax=None, *, cmap="viridis", colorbar=True, imshow_kwargs=None):
        """Draw the heatmaps.

        Parameters
        ----------
        ax : ndarray of matplotlib Axes, default=None
            ``n_rows * n_shown`` axes (any shape; a single Axes when only one
            panel is drawn).  ``None`` creates a new figure.
        cmap : str or matplotlib Colormap, default="viridis"
            Colour map of the heatmaps.
        colorbar : bool, default=True
            Whether to add one colour bar shared by all heatmaps.
        imshow_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.imshow``.

        Returns
        -------
        display : AttentionPatternDisplay
            The object, with ``images_``, ``colorbar_``, ``ax_`` and
            ``figure_`` set.
        """
        _check_matplotlib(f"{self.__class__.__name__}.plot")
        import matplotlib.pyplot as plt

        learned = np.asarray(self.patterns_learned, dtype=float)
        rows = [learned]
        if self.patterns_true is not None:
            rows.insert(0, np.asarray(self.patterns_true, dtype=float))
        n_rows, n_cols = len(rows), learned.shape[0]
        if ax is None:
            fig, ax = plt.subplots(
                n_rows,
                n_cols,
                figsize=(2.4 * n_cols + 1.0, 2.4 * n_rows),
                squeeze=False,
                constrained_layout=True,
            )
        else:
            ax = np.asarray(ax, dtype=object)
            if ax.size != n_rows * n_cols:
                raise ValueError(
                    f"ax must hold {n_rows * n_cols} axes ({n_rows} rows x {n_cols} "
                    f"heads), got {ax.size}."
                )
            ax = ax.reshape(n_rows, n_cols)
            fig = ax[0, 0].figure

        default_imshow = {"cmap": cmap, "vmin": 0.0, "vmax": 1.0}
        imshow_kwargs = {**default_imshow, **(imshow_kwargs or {})}
        images = np.empty((n_rows, n_cols), dtype=object)
        for r, patterns in enumerate(rows):
            is_true = self.patterns_true is not None and r == 0
            for c in range(n_cols):
                axis = ax[r, c]
                if is_true:
                    title = f"true head {self.heads_true[c]}"
                elif self.heads_learned[c] < 0:
                    title = "unmatched"
                else:
                    title = f"learned head {self.heads_learned[c]}"
                    if self.distances is not None and np.isfinite(self.distances[c]):
                        title += f"\nTV {self.distances[c]:.2g}"
                axis.set_title(title, fontsize="medium")
                if np.all(np.isnan(patterns[c])):
                    axis.set_axis_off()
                    images[r, c] = None
                    continue
                images[r, c] = axis.imshow(patterns[c], **imshow_kwargs)
                k = patterns.shape[-1]
                axis.set_xticks(range(k))
                axis.set_yticks(range(k))
                if r == n_rows - 1:
                    axis.set_xlabel("key token")
                if c == 0:
                    axis.set_ylabel("query token")
        drawn = [image for image in images.ravel() if image is not None]
        self.colorbar_ = (
            fig.colorbar(drawn[0], ax=ax.ravel().tolist(), shrink=0.8)
            if colorbar and drawn
            else None
        )
        fig.suptitle(f"attention patterns on sequence {self.sample}")
        self.images_ = images
        self.ax_ = ax
        self.figure_ = fig
        return self

    @classmethod
    def from_layers(
        cls,
        true_layer,
        learned,
        X,
        *,
        sample=0,
        heads=None,
        ax=None,
        cmap="viridis",
        colorbar=True,
        imshow_kwargs=None,
    ):
        """Compare the patterns of a true layer and a learned one on inputs X.

        The heads are matched on the patterns of all sequences of X; the
        sequence ``X[sample]`` is drawn.

        Parameters
        ----------
        true_layer : AttentionLayer
            The planted (true) layer.
        learned : AttentionLayer or fitted estimator
            The learned layer, or a fitted estimator with ``layer_`` or
            ``attention_`` and ``projection_`` (any skattn regressor).
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences (token-major when 2-D).
        sample : int, default=0
            Index of the sequence of X to draw.
        heads : int or array-like of int, default=None
            The true heads to show; ``None`` shows all.
        ax : ndarray of matplotlib Axes, default=None
            ``2 * n_shown`` axes; ``None`` creates a new figure.
        cmap : str or matplotlib Colormap, default="viridis"
            Colour map of the heatmaps.
        colorbar : bool, default=True
            Whether to add a shared colour bar.
        imshow_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.imshow``.

        Returns
        -------
        display : AttentionPatternDisplay
            The drawn display.

        Examples
        --------
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import numpy as np
        >>> from skattn import AttentionLayer
        >>> from skattn.metrics import AttentionPatternDisplay
        >>> rng = np.random.default_rng(0)
        >>> true = AttentionLayer(rng.normal(size=(3, 4, 4)), np.ones((3, 4, 2)))
        >>> X = rng.choice([-1.0, 1.0], size=(20, 12))  # 3 tokens of 4 features
        >>> display = AttentionPatternDisplay.from_layers(true, true, X, heads=[0, 2])
        >>> display.distances
        array([0., 0.])
        """
        _check_matplotlib(f"{cls.__name__}.from_layers")
        true_layer = as_layer(true_layer, "true_layer")
        learned_layer = as_layer(learned, "learned")
        if true_layer.n_features != learned_layer.n_features:
            raise ValueError(
                f"true_layer acts on {true_layer.n_features} features per token but "
                f"learned on {learned_layer.n_features}; both must fit X."
            )
        P_true = true_layer.attention_patterns(X)
        P_learned = learned_layer.attention_patterns(X)
        sample = _check_sample(sample, P_true.shape[0])
        heads = _check_heads(heads, P_true.shape[1])
        matched, distances = _match_heads(P_true, P_learned)
        matched, distances = matched[heads], distances[heads]
        shown = np.full((len(heads),) + P_true.shape[2:], np.nan)
        shown[matched >= 0] = P_learned[sample, matched[matched >= 0]]
        display = cls(
            patterns_true=P_true[sample, heads],
            patterns_learned=shown,
            heads_true=heads,
            heads_learned=matched,
            distances=distances,
            sample=sample,
        )
        return display.plot(
            ax=ax, cmap=cmap, colorbar=colorbar, imshow_kwargs=imshow_kwargs
        )

    @classmethod
    def from_estimator(
        cls,
        estimator,
        X,
        *,
        true_layer=None,
        sample=0,
        heads=None,
        ax=None,
        cmap="viridis",
        colorbar=True,
        imshow_kwargs=None,
    ):
        """Draw the patterns a fitted estimator learned, against the truth if known.

        Parameters
        ----------
        estimator : fitted estimator
            A fitted skattn regressor (with ``layer_`` or ``attention_`` and
            ``projection_``), or an AttentionLayer.
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            Input sequences (token-major when 2-D).
        true_layer : AttentionLayer, default=None
            The planted layer.  When given, the learned heads are matched to its
            heads and drawn below them (see :meth:`from_layers`); ``None`` draws
            the learned heads alone.
        sample : int, default=0
            Index of the sequence of X to draw.
        heads : int or array-like of int, default=None
            The heads to show (of ``true_layer`` when given, else of the
            estimator); ``None`` shows all.
        ax : ndarray of matplotlib Axes, default=None
            One axis per panel; ``None`` creates a new figure.
        cmap : str or matplotlib Colormap, default="viridis"
            Colour map of the heatmaps.
        colorbar : bool, default=True
            Whether to add a shared colour bar.
        imshow_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.imshow``.

        Returns
        -------
        display : AttentionPatternDisplay
            The drawn display.

        Examples
        --------
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import numpy as np
        >>> from sklearn.base import BaseEstimator, RegressorMixin
        >>> from skattn.metrics import AttentionPatternDisplay
        >>> class Fitted(RegressorMixin, BaseEstimator):  # any fitted regressor
        ...     def fit(self, X, y=None):
        ...         self.attention_ = np.zeros((2, 3, 3))
        ...         self.projection_ = np.ones((2, 3, 3))
        ...         self.n_tokens_ = 4
        ...         return self
        >>> X = np.ones((5, 12))
        >>> display = AttentionPatternDisplay.from_estimator(Fitted().fit(X), X)
        >>> display.patterns_learned[0]  # zero logits attend uniformly
        array([[0.25, 0.25, 0.25, 0.25],
               [0.25, 0.25, 0.25, 0.25],
               [0.25, 0.25, 0.25, 0.25],
               [0.25, 0.25, 0.25, 0.25]])
        """
        _check_matplotlib(f"{cls.__name__}.from_estimator")
        if true_layer is not None:
            return cls.from_layers(
                true_layer,
                estimator,
                X,
                sample=sample,
                heads=heads,
                ax=ax,
                cmap=cmap,
                colorbar=colorbar,
                imshow_kwargs=imshow_kwargs,
            )
        layer = as_layer(estimator, "estimator")
        P = layer.attention_patterns(X)
        sample = _check_sample(sample, P.shape[0])
        heads = _check_heads(heads, P.shape[1])
        display = cls(
            patterns_true=None,
            patterns_learned=P[sample, heads],
            heads_true=None,
            heads_learned=heads,
            distances=None,
            sample=sample,
        )
        return display.plot(
            ax=ax, cmap=cmap, colorbar=colorbar, imshow_kwargs=imshow_kwargs
        )


def _check_curves(x, errors):
    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(
            f"x must be a non-empty 1-D array of finite values, got shape {x.shape}."
        )
    if not isinstance(errors, dict) or not errors:
        raise TypeError(
            f"errors must be a non-empty dict mapping a learner's name to its "
            f"errors, got {type(errors).__name__}."
        )
    checked = {}
    for name, values in errors.items():
        values = np.asarray(values, dtype=float)
        if values.ndim == 1:
            values = values[None]
        if values.ndim != 2 or values.shape[1] != x.size:
            raise ValueError(
                f"errors[{name!r}] must have shape ({x.size},) or (n_repeats, "
                f"{x.size}) to match x, got {np.shape(errors[name])}."
            )
        if np.any(np.isinf(values)) or np.any(values < 0):
            raise ValueError(
                f"errors[{name!r}] must hold non-negative finite errors (NaN marks "
                f"a missing run), got values in [{np.nanmin(values)}, "
                f"{np.nanmax(values)}]."
            )
        checked[str(name)] = values
    return x, checked


def _check_scales(display):
    """Refuse an axis scale of a curve display other than "log" or "linear"."""
    _check_matplotlib(f"{display.__class__.__name__}.plot")
    for name in ("xscale", "yscale"):
        if getattr(display, name) not in ("log", "linear"):
            raise ValueError(
                f"{name} must be 'log' or 'linear', got {getattr(display, name)!r}."
            )


def _plot_curves(display, curves, *, ax, line_kwargs, band_kwargs, x_ticks=None):
    """Draw a curve display: one line per name, and a band around it.

    The one drawing of :class:`RecoveryCurveDisplay` and of
    :class:`skattn.experiments.SweepCurveDisplay`.

    Parameters
    ----------
    display : RecoveryCurveDisplay or SweepCurveDisplay
        Gives ``xscale``, ``yscale``, ``xlabel`` and ``ylabel``; gets ``lines_``,
        ``bands_`` (``None`` where a curve has no band), ``ax_`` and ``figure_``.
    curves : dict of str to tuple
        ``{name: (x, center, lower, upper)}``; ``lower`` and ``upper`` None: no
        band.
    ax : matplotlib Axes or None
        Axes to draw on; ``None`` creates a new figure.
    line_kwargs, band_kwargs : dict or None
        Extra keyword arguments of ``Axes.plot`` and ``Axes.fill_between``.
    x_ticks : ndarray or None, default=None
        On a log x axis, label these values (the measured x) instead of
        matplotlib's ticks.

    Returns
    -------
    display : RecoveryCurveDisplay or SweepCurveDisplay
        ``display``, drawn.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(constrained_layout=True)
    else:
        fig = ax.figure
    line_kwargs = {"marker": "o", **(line_kwargs or {})}
    band_kwargs = {"alpha": 0.2, **(band_kwargs or {})}
    display.lines_, display.bands_ = {}, {}
    for name, (x, center, lower, upper) in curves.items():
        (line,) = ax.plot(x, center, label=name, **line_kwargs)
        display.lines_[name] = line
        display.bands_[name] = None
        if lower is not None:
            display.bands_[name] = ax.fill_between(
                x, lower, upper, color=line.get_color(), **band_kwargs
            )
    ax.set_xscale(display.xscale)
    ax.set_yscale(display.yscale)
    if x_ticks is not None and display.xscale == "log":
        from matplotlib.ticker import NullFormatter

        ax.set_xticks(x_ticks, [f"{v:g}" for v in x_ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(display.xlabel)
    ax.set_ylabel(display.ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    display.ax_, display.figure_ = ax, fig
    return display


class RecoveryCurveDisplay:
    """Recovery error against the number of examples, one line per learner.

    Each learner is a line through its errors at the points ``x`` (numbers of
    examples, attention scales, noise levels...).  With several repeats per
    point, the line is their median and a shaded band spans their range.  NaN
    marks a missing run.

    Create it with :meth:`from_results`; all parameters are stored as
    attributes.

    Parameters
    ----------
    x : ndarray of shape (n_points,)
        The x values shared by all learners.
    errors : dict of str to ndarray of shape (n_points,) or (n_repeats, n_points)
        The errors of each learner.
    xlabel : str, default="number of examples"
        Label of the x axis.
    ylabel : str, default="relative error"
        Label of the y axis.
    xscale : {"log", "linear"}, default="log"
        Scale of the x axis.
    yscale : {"log", "linear"}, default="log"
        Scale of the y axis.

    Attributes
    ----------
    lines_ : dict of str to matplotlib Line2D
        The median line of each learner.
    bands_ : dict of str to matplotlib PolyCollection or None
        The min-max band of each learner (``None`` with a single repeat).
    ax_ : matplotlib Axes
        Axes with the curves.
    figure_ : matplotlib Figure
        Figure containing the curves.

    See Also
    --------
    AttentionPatternDisplay : Learned attention patterns against the true ones.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np
    >>> from skattn.metrics import RecoveryCurveDisplay
    >>> n = np.array([100, 1000, 10000])
    >>> display = RecoveryCurveDisplay.from_results(
    ...     n, {"phased": 1 / np.sqrt(n), "gradient": [[0.3, 0.1, 0.02],
    ...                                             [0.5, 0.2, 0.04]]}
    ... )
    >>> sorted(display.lines_)
    ['gradient', 'phased']
    >>> display.ax_.get_xscale()
    'log'
    """

    def __init__(
        self,
        *,
        x,
        errors,
        xlabel="number of examples",
        ylabel="relative error",
        xscale="log",
        yscale="log",
    ):
        self.x = x
        self.errors = errors
        self.xlabel = xlabel
        self.ylabel = ylabel
        self.xscale = xscale
        self.yscale = yscale

    def plot(self, ax=None, *, line_kwargs=None, band_kwargs=None):
        """Draw the curves.

        Parameters
        ----------
        ax : matplotlib Axes, default=None
            Axes to draw on; ``None`` creates a new figure.
        line_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.plot``, for every
            line.
        band_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.fill_between``,
            for every band.

        Returns
        -------
        display : RecoveryCurveDisplay
            The object, with ``lines_``, ``bands_``, ``ax_`` and ``figure_``
            set.
        """
        _check_scales(self)
        x, errors = _check_curves(self.x, self.errors)
        if self.xscale == "log" and np.any(x <= 0):
            raise ValueError(
                f"x must be positive on a log scale, got min(x)={x.min()}; pass "
                f"xscale='linear'."
            )
        curves = {}
        order = np.argsort(x)
        for name, values in errors.items():
            values = values[:, order]
            observed = ~np.all(np.isnan(values), axis=0)
            xs, values = x[order][observed], values[:, observed]
            band = (None, None)
            if values.shape[0] > 1:
                band = (np.nanmin(values, axis=0), np.nanmax(values, axis=0))
            curves[name] = (xs, np.nanmedian(values, axis=0), *band)
        return _plot_curves(
            self,
            curves,
            ax=ax,
            line_kwargs=line_kwargs,
            band_kwargs=band_kwargs,
            x_ticks=np.unique(x),
        )

    @classmethod
    def from_results(
        cls,
        x,
        errors,
        *,
        xlabel="number of examples",
        ylabel="relative error",
        xscale="log",
        yscale="log",
        ax=None,
        line_kwargs=None,
        band_kwargs=None,
    ):
        """Draw recovery curves from measured errors.

        Parameters
        ----------
        x : array-like of shape (n_points,)
            The x values (e.g. numbers of examples), positive on a log scale.
        errors : dict of str to array-like of shape (n_points,) or \
(n_repeats, n_points)
            The errors of each learner at each x; non-negative, NaN for a
            missing run.  With repeats, the line is their median and a band
            their range.
        xlabel : str, default="number of examples"
            Label of the x axis.
        ylabel : str, default="relative error"
            Label of the y axis.
        xscale : {"log", "linear"}, default="log"
            Scale of the x axis.
        yscale : {"log", "linear"}, default="log"
            Scale of the y axis.
        ax : matplotlib Axes, default=None
            Axes to draw on; ``None`` creates a new figure.
        line_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.plot``.
        band_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.fill_between``.

        Returns
        -------
        display : RecoveryCurveDisplay
            The drawn display.

        Examples
        --------
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> from skattn.metrics import RecoveryCurveDisplay
        >>> display = RecoveryCurveDisplay.from_results(
        ...     [1, 2, 4], {"noise": [0.4, 0.8, 1.6]}, xlabel="noise level",
        ...     xscale="linear",
        ... )
        >>> display.lines_["noise"].get_ydata()
        array([0.4, 0.8, 1.6])
        """
        _check_matplotlib(f"{cls.__name__}.from_results")
        x, errors = _check_curves(x, errors)
        display = cls(
            x=x,
            errors=errors,
            xlabel=xlabel,
            ylabel=ylabel,
            xscale=xscale,
            yscale=yscale,
        )
        return display.plot(ax=ax, line_kwargs=line_kwargs, band_kwargs=band_kwargs)
