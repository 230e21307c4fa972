"""Displays of a sweep's results, in scikit-learn's ``*Display`` style.

* :class:`SweepCurveDisplay`: success rate or an error against ``n_samples`` (or
  any grid axis), one curve per learner, the spread over seeds as a band;
* :class:`PhaseDiagramDisplay`: a value (success rate by default) averaged over
  seeds on a grid of two axes, as a heatmap.

As in :mod:`skattn.metrics._plot`, ``from_results`` computes everything from the
``DataFrame`` of :func:`~skattn.experiments.recovery_sweep` and ``plot(ax=None)``
draws, importing matplotlib only then; the curves and their bands are drawn by the
same code as :class:`skattn.metrics.RecoveryCurveDisplay`'s.
"""

import numpy as np

from ..metrics._plot import _check_matplotlib, _check_scales, _plot_curves
from ._sweep import SETTING_COLUMNS


def _check_results(results, columns, caller):
    if not hasattr(results, "columns") or not hasattr(results, "groupby"):
        raise TypeError(
            f"{caller} needs the pandas DataFrame returned by recovery_sweep, got "
            f"{type(results).__name__}."
        )
    missing = [c for c in columns if c not in results.columns]
    if missing:
        raise ValueError(
            f"{caller}: the results have no column(s) {missing}; the columns are "
            f"{list(results.columns)}."
        )
    if len(results) == 0:
        raise ValueError(f"{caller}: the results are empty.")


def _check_one_setting(results, keep, caller):
    """Refuse to pool fits that differ in a setting other than ``keep`` and seed."""
    varying = {
        column: sorted(map(str, results[column].unique()))
        for column in SETTING_COLUMNS
        if column in results.columns
        and column not in (*keep, "seed", "estimator")
        # (None in fresh rows and NaN read back are one missing value)
        and results[column]
        .astype(object)
        .where(results[column].notna(), None)
        .nunique(dropna=False)
        > 1
    }
    if varying:
        column, values = next(iter(varying.items()))
        raise ValueError(
            f"{caller}: the results vary in {sorted(varying)} besides the plotted "
            f"axes and the seed; select one setting first, e.g. "
            f"results[results[{column!r}] == {values[0]}]."
        )


def _summarise(values, y):
    """Centre and band of one point: success rate +- its standard error, or the
    median and the range of an error (NaN ignored)."""
    if y == "success":
        rate = float(np.mean(values))
        half = float(np.sqrt(rate * (1 - rate) / len(values)))
        return rate, max(rate - half, 0.0), min(rate + half, 1.0)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return np.nan, np.nan, np.nan
    return float(np.median(values)), float(values.min()), float(values.max())


def sweep_curves(results, x="n_samples", y="success"):
    """Per learner: the x values, centre, lower and upper band of ``y``.

    Parameters
    ----------
    results : pandas.DataFrame
        Rows of :func:`~skattn.experiments.recovery_sweep`.
    x : str, default="n_samples"
        The grid axis on the x axis.
    y : str, default="success"
        ``"success"`` (rate over seeds, a failed fit counts as no success) or a
        numeric column (median over seeds, NaN ignored).

    Returns
    -------
    curves : dict of str to dict
        ``{learner: {"x", "center", "lower", "upper"}}``, arrays sorted by x.

    Examples
    --------
    >>> import pandas as pd
    >>> from skattn.experiments._plot import sweep_curves
    >>> df = pd.DataFrame({"learner": "a", "n_samples": [10, 10, 20, 20],
    ...                    "seed": [0, 1, 0, 1], "success": [0, 1, 1, 1]})
    >>> sweep_curves(df)["a"]["center"]
    array([0.5, 1. ])
    """
    caller = "sweep_curves"
    _check_results(results, ["learner", x, y], caller)
    _check_one_setting(results, ("learner", x), caller)
    curves = {}
    for learner, group in results.groupby("learner", sort=False):
        points = sorted(group[x].unique())
        stats = []
        for point in points:
            values = group.loc[group[x] == point, y].to_numpy(dtype=float)
            if y == "success":
                values = np.nan_to_num(values, nan=0.0)
            stats.append(_summarise(values, y))
        center, lower, upper = (np.array(s) for s in zip(*stats, strict=True))
        curves[str(learner)] = {
            "x": np.asarray(points, dtype=float),
            "center": center,
            "lower": lower,
            "upper": upper,
        }
    return curves


class SweepCurveDisplay:
    """Success rate or error against the number of examples, one line per learner.

    Each learner's line runs through the success rate over seeds (band: +- its
    binomial standard error) or the median error over seeds (band: their range).
    Create it with :meth:`from_results`; all parameters are stored as attributes.

    Parameters
    ----------
    curves : dict of str to dict
        ``{learner: {"x", "center", "lower", "upper"}}`` (see :meth:`from_results`).
    xlabel : str, default="number of examples"
        Label of the x axis.
    ylabel : str, default="success rate"
        Label of the y axis.
    xscale : {"log", "linear"}, default="log"
        Scale of the x axis.
    yscale : {"log", "linear"}, default="linear"
        Scale of the y axis.

    Attributes
    ----------
    lines_ : dict of str to matplotlib Line2D
        The line of each learner.
    bands_ : dict of str to matplotlib PolyCollection
        The band of each learner.
    ax_ : matplotlib Axes
        Axes with the curves.
    figure_ : matplotlib Figure
        Figure containing the curves.

    See Also
    --------
    PhaseDiagramDisplay : a value over two axes of the grid.
    skattn.metrics.RecoveryCurveDisplay : curves from arrays of errors.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import pandas as pd
    >>> from skattn.experiments import SweepCurveDisplay
    >>> df = pd.DataFrame({"learner": ["a"] * 4 + ["b"] * 4,
    ...                    "n_samples": [10, 10, 20, 20] * 2, "seed": [0, 1] * 4,
    ...                    "success": [0, 1, 1, 1, 0, 0, 0, 1]})
    >>> display = SweepCurveDisplay.from_results(df)
    >>> sorted(display.lines_), display.lines_["a"].get_ydata().tolist()
    (['a', 'b'], [0.5, 1.0])
    """

    def __init__(
        self,
        *,
        curves,
        xlabel="number of examples",
        ylabel="success rate",
        xscale="log",
        yscale="linear",
    ):
        self.curves = curves
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
            Extra keyword arguments of ``matplotlib.axes.Axes.plot``.
        band_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.fill_between``.

        Returns
        -------
        display : SweepCurveDisplay
            The object, with ``lines_``, ``bands_``, ``ax_`` and ``figure_`` set.
        """
        _check_scales(self)
        curves = {
            name: (curve["x"], curve["center"], curve["lower"], curve["upper"])
            for name, curve in self.curves.items()
        }
        return _plot_curves(
            self, curves, ax=ax, line_kwargs=line_kwargs, band_kwargs=band_kwargs
        )

    @classmethod
    def from_results(
        cls,
        results,
        *,
        x="n_samples",
        y="success",
        xscale="log",
        yscale=None,
        ax=None,
        line_kwargs=None,
        band_kwargs=None,
    ):
        """Draw success rate or error against a grid axis from a sweep's results.

        Parameters
        ----------
        results : pandas.DataFrame
            Rows of :func:`~skattn.experiments.recovery_sweep`, varying only in
            the learner, ``x`` and the seed (select one setting first).
        x : str, default="n_samples"
            The grid axis on the x axis.
        y : str, default="success"
            ``"success"`` or a numeric column, e.g. ``"attention_error"``.
        xscale : {"log", "linear"}, default="log"
            Scale of the x axis.
        yscale : {"log", "linear"}, default=None
            ``None``: linear for the success rate, log for an error.
        ax : matplotlib Axes, default=None
            Axes to draw on; ``None`` creates a new figure.
        line_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.plot``.
        band_kwargs : dict, default=None
            Extra keyword arguments of ``matplotlib.axes.Axes.fill_between``.

        Returns
        -------
        display : SweepCurveDisplay
            The drawn display.
        """
        _check_matplotlib(f"{cls.__name__}.from_results")
        curves = sweep_curves(results, x=x, y=y)
        if yscale is None:
            yscale = "linear" if y == "success" else "log"
        display = cls(
            curves=curves,
            xlabel="number of examples" if x == "n_samples" else x,
            ylabel="success rate over seeds" if y == "success" else f"{y} (median)",
            xscale=xscale,
            yscale=yscale,
        )
        return display.plot(ax=ax, line_kwargs=line_kwargs, band_kwargs=band_kwargs)


def phase_table(results, x="n_samples", y="n_heads", value="success"):
    """Mean of ``value`` over seeds on the grid of ``x`` by ``y``.

    Parameters
    ----------
    results : pandas.DataFrame
        Rows of :func:`~skattn.experiments.recovery_sweep` for one learner.
    x, y : str
        The two grid axes (columns and rows of the table).
    value : str, default="success"
        The averaged column; for ``"success"`` a failed fit counts as 0.

    Returns
    -------
    table : ndarray of shape (n_y, n_x)
        NaN where no fit ran.
    x_values, y_values : list
        The sorted values of the axes.

    Examples
    --------
    >>> import pandas as pd
    >>> from skattn.experiments._plot import phase_table
    >>> df = pd.DataFrame({"learner": "a", "n_samples": [10, 20, 10, 20],
    ...                    "n_heads": [1, 1, 2, 2], "success": [1, 1, 0, 1]})
    >>> phase_table(df)[0]
    array([[1., 1.],
           [0., 1.]])
    """
    caller = "phase_table"
    _check_results(results, ["learner", x, y, value], caller)
    if results["learner"].nunique() > 1:
        names = sorted(map(str, results["learner"].unique()))
        raise ValueError(
            f"{caller}: the results hold the learners {names}; pass learner= (one "
            f"diagram per learner)."
        )
    _check_one_setting(results, ("learner", x, y), caller)
    x_values, y_values = sorted(results[x].unique()), sorted(results[y].unique())
    table = np.full((len(y_values), len(x_values)), np.nan)
    values = results[value].to_numpy(dtype=float)
    if value == "success":
        values = np.nan_to_num(values, nan=0.0)
    for i, yv in enumerate(y_values):
        for j, xv in enumerate(x_values):
            cell = values[(results[y] == yv).to_numpy() & (results[x] == xv).to_numpy()]
            if value != "success":
                cell = cell[~np.isnan(cell)]
            if cell.size:
                table[i, j] = cell.mean()
    return table, list(x_values), list(y_values)


class PhaseDiagramDisplay:
    """A value averaged over seeds on two axes of a sweep's grid, as a heatmap.

    Create it with :meth:`from_results`; all parameters are stored as attributes.

    Parameters
    ----------
    table : ndarray of shape (n_y, n_x)
        The value in each cell (NaN where no fit ran).
    x_values : list
        Values of the x axis (columns of ``table``).
    y_values : list
        Values of the y axis (rows of ``table``).
    xlabel : str
        Label of the x axis.
    ylabel : str
        Label of the y axis.
    title : str, default=""
        Title of the axes.

    Attributes
    ----------
    image_ : matplotlib AxesImage
        The heatmap.
    ax_ : matplotlib Axes
        Axes with the heatmap.
    figure_ : matplotlib Figure
        Figure containing the heatmap.

    See Also
    --------
    SweepCurveDisplay : one axis, one curve per learner.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import pandas as pd
    >>> from skattn.experiments import PhaseDiagramDisplay
    >>> df = pd.DataFrame({"learner": "a", "n_samples": [10, 20, 10, 20],
    ...                    "n_heads": [1, 1, 2, 2], "success": [1, 1, 0, 1]})
    >>> display = PhaseDiagramDisplay.from_results(df)
    >>> display.image_.get_array().tolist()
    [[1.0, 1.0], [0.0, 1.0]]
    """

    def __init__(self, *, table, x_values, y_values, xlabel, ylabel, title=""):
        self.table = table
        self.x_values = x_values
        self.y_values = y_values
        self.xlabel = xlabel
        self.ylabel = ylabel
        self.title = title

    def plot(self, ax=None, *, cmap="viridis", colorbar=True, annotate=True):
        """Draw the heatmap.

        Parameters
        ----------
        ax : matplotlib Axes, default=None
            Axes to draw on; ``None`` creates a new figure.
        cmap : str, default="viridis"
            Colormap.
        colorbar : bool, default=True
            Add a colorbar.
        annotate : bool, default=True
            Write each cell's value in it.

        Returns
        -------
        display : PhaseDiagramDisplay
            The object, with ``image_``, ``ax_`` and ``figure_`` set.
        """
        _check_matplotlib(f"{self.__class__.__name__}.plot")
        import matplotlib.pyplot as plt

        table = np.asarray(self.table, dtype=float)
        if ax is None:
            fig, ax = plt.subplots(constrained_layout=True)
        else:
            fig = ax.figure
        self.image_ = ax.imshow(table, origin="lower", aspect="auto", cmap=cmap)
        ax.set_xticks(range(len(self.x_values)), [f"{v:g}" for v in self.x_values])
        ax.set_yticks(range(len(self.y_values)), [f"{v:g}" for v in self.y_values])
        if annotate:
            for (i, j), v in np.ndenumerate(table):
                if np.isfinite(v):
                    ax.text(j, i, f"{v:.2g}", ha="center", va="center", color="w")
        if colorbar:
            fig.colorbar(self.image_, ax=ax)
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel(self.ylabel)
        ax.set_title(self.title)
        self.ax_, self.figure_ = ax, fig
        return self

    @classmethod
    def from_results(
        cls,
        results,
        *,
        x="n_samples",
        y="n_heads",
        value="success",
        learner=None,
        ax=None,
        cmap="viridis",
    ):
        """Draw the mean of a value over seeds on two grid axes of a sweep.

        Parameters
        ----------
        results : pandas.DataFrame
            Rows of :func:`~skattn.experiments.recovery_sweep`.
        x : str, default="n_samples"
            Grid axis of the columns.
        y : str, default="n_heads"
            Grid axis of the rows.
        value : str, default="success"
            The averaged column (``"success"``: the success rate).
        learner : str, default=None
            The learner shown; needed when the results hold several.
        ax : matplotlib Axes, default=None
            Axes to draw on; ``None`` creates a new figure.
        cmap : str, default="viridis"
            Colormap.

        Returns
        -------
        display : PhaseDiagramDisplay
            The drawn display.
        """
        _check_matplotlib(f"{cls.__name__}.from_results")
        if learner is not None:
            _check_results(results, ["learner"], "PhaseDiagramDisplay")
            if learner not in set(results["learner"]):
                raise ValueError(
                    f"learner={learner!r} is not in the results; they hold "
                    f"{sorted(map(str, results['learner'].unique()))}."
                )
            results = results[results["learner"] == learner]
        table, x_values, y_values = phase_table(results, x=x, y=y, value=value)
        name = str(results["learner"].iloc[0])
        display = cls(
            table=table,
            x_values=x_values,
            y_values=y_values,
            xlabel="number of examples" if x == "n_samples" else x,
            ylabel=y,
            title=f"{name}: {'success rate' if value == 'success' else value}",
        )
        return display.plot(ax=ax, cmap=cmap)
