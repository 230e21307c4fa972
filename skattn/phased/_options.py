"""The options of the phased learner: one frozen object per stage, defaults
written once.

:class:`PhasedOptions` gathers them and maps every parameter of
:class:`~skattn.MultiHeadAttentionRegressor` that the learner reads to the one
field it sets (:data:`PARAMETERS`); :meth:`PhasedOptions.from_params` builds them
once, rejecting any other name, and each stage reads its own object.  The phase
functions take their keyword defaults from these objects, so a default is
written here and nowhere else (the estimator's signature repeats them, checked
by a test).
"""

from dataclasses import dataclass, field, replace

from ..solvers._options import PolishOptions, RandomStartOptions


@dataclass(frozen=True)
class HullOptions:
    """Phases 2-4: certify rows, refine ``sum_i W_i``, sculpt the affine hull
    (:func:`~skattn.phased.sculpt_hull`).

    Parameters
    ----------
    tol : float, default=0.3
        ``certify_tol``: the first round's certification tolerance.
    tol_final : float, default=0.02
        ``certify_tol_final``: the last round's.
    n_rounds : int, default=5
        ``n_rounds``: rounds of phases 2-4.
    refine_iter : int, default=2
        ``refine_iter``: Gauss-Newton iterations of phase 3 per round.
    p_min : float, default=0.05
        ``min_pattern_prob``: smallest attention weight a constraint uses.
    confidence_floor : float or None, default=None
        ``confidence_floor``.
    max_rows : int, default=20000
        ``max_rows``: rows examined per round.
    method : {"lstsq", "slab", "mve"}, default="lstsq"
        ``hull_method``.
    solver : {"auto", "dense", "matrix-free"}, default="auto"
        ``hull_solver``.
    batch_size : int, default=4096
        ``batch_size``: sequences per batch of an out-of-core scan.
    max_heads : int, default=6
        ``max_heads``: the largest number of heads the hull (and the head
        search) considers.

    Examples
    --------
    >>> HullOptions(tol=0.5).tol_final
    0.02
    """

    tol: float = 0.3
    tol_final: float = 0.02
    n_rounds: int = 5
    refine_iter: int = 2
    p_min: float = 0.05
    confidence_floor: float | None = None
    max_rows: int = 20000
    method: str = "lstsq"
    solver: str = "auto"
    batch_size: int = 4096
    max_heads: int = 6


@dataclass(frozen=True)
class NetOptions:
    """Phase 6's epsilon-net on the hull (:func:`~skattn.phased.fit_from_hull`).

    Parameters
    ----------
    resolution : int or None, default=None
        ``net_resolution``: points per hull coordinate (None: from the data).
    radius : float or None, default=None
        ``net_radius``: half-width of the net's box (None: from the data).
    n_samples : int, default=1000
        ``net_samples``: examples the net's candidates are scored on.
    max_candidates : int, default=20000
        ``max_net_candidates``.

    Examples
    --------
    >>> NetOptions().n_samples
    1000
    """

    resolution: int | None = None
    radius: float | None = None
    n_samples: int = 1000
    max_candidates: int = 20000


@dataclass(frozen=True)
class HeadSearchOptions:
    """The search for the number of heads, ``n_heads="auto"``
    (:func:`~skattn.phased.select_n_heads`).

    Parameters
    ----------
    validation_fraction : float, default=0.2
        ``validation_fraction``: examples held out to compare head counts.
    n_fit_samples : int, default=400
        ``selection_samples``: examples each candidate is fitted on.

    Notes
    -----
    The largest head count is :attr:`HullOptions.max_heads`.

    Examples
    --------
    >>> HeadSearchOptions().n_fit_samples
    400
    """

    validation_fraction: float = 0.2
    n_fit_samples: int = 400


@dataclass(frozen=True)
class PhasedOptions:
    """Every option of the phased learner, one object per stage.

    Parameters
    ----------
    init : {"auto", "phased", "random"}, default="auto"
        ``init``: where the polish starts.
    fit_intercept : bool, default=False
        ``fit_intercept``: the tokens' last coordinate is the constant 1.
    verbose : int, default=0
        ``verbose``.
    hull : HullOptions
    net : NetOptions
    heads : HeadSearchOptions
    polish : PolishOptions
    starts : RandomStartOptions

    Examples
    --------
    >>> options = PhasedOptions.from_params(certify_tol=0.5, n_restarts=2)
    >>> options.hull.tol, options.starts.n_starts, options.polish.max_iter
    (0.5, 2, 100)
    """

    init: str = "auto"
    fit_intercept: bool = False
    verbose: int = 0
    hull: HullOptions = field(default_factory=HullOptions)
    net: NetOptions = field(default_factory=NetOptions)
    heads: HeadSearchOptions = field(default_factory=HeadSearchOptions)
    polish: PolishOptions = field(default_factory=PolishOptions)
    starts: RandomStartOptions = field(default_factory=RandomStartOptions)

    @classmethod
    def from_params(cls, **params):
        """The options set by the estimator's parameters.

        Parameters
        ----------
        **params : dict
            Parameters of :class:`~skattn.MultiHeadAttentionRegressor` by name
            (the keys of :data:`PARAMETERS`); any other name raises
            ``TypeError``.

        Returns
        -------
        options : PhasedOptions

        Examples
        --------
        >>> PhasedOptions.from_params(polish_tol=1e-12).polish.tol
        1e-12
        """
        unknown = set(params) - set(PARAMETERS)
        if unknown:
            raise TypeError(
                f"Unknown option(s) {sorted(unknown)} of the phased learner; the "
                f"options are {sorted(PARAMETERS)}."
            )
        parts = {"": {}}
        for name, value in params.items():
            part, attribute = PARAMETERS[name]
            parts.setdefault(part, {})[attribute] = value
        top = parts.pop("")
        # derived: the polish reads the intercept and its verbosity from the top
        polish = parts.setdefault("polish", {})
        polish["intercept"] = top.get("fit_intercept", cls.fit_intercept)
        polish["verbose"] = 2 if top.get("verbose", cls.verbose) > 1 else 0
        defaults = cls()
        built = {
            part: replace(getattr(defaults, part), **values)
            for part, values in parts.items()
        }
        return cls(**top, **built)


# Each estimator parameter the learner reads -> (stage, field); "" is the top.
PARAMETERS = {
    "init": ("", "init"),
    "fit_intercept": ("", "fit_intercept"),
    "verbose": ("", "verbose"),
    "certify_tol": ("hull", "tol"),
    "certify_tol_final": ("hull", "tol_final"),
    "n_rounds": ("hull", "n_rounds"),
    "refine_iter": ("hull", "refine_iter"),
    "min_pattern_prob": ("hull", "p_min"),
    "confidence_floor": ("hull", "confidence_floor"),
    "max_rows": ("hull", "max_rows"),
    "hull_method": ("hull", "method"),
    "hull_solver": ("hull", "solver"),
    "batch_size": ("hull", "batch_size"),
    "max_heads": ("hull", "max_heads"),
    "validation_fraction": ("heads", "validation_fraction"),
    "selection_samples": ("heads", "n_fit_samples"),
    "net_resolution": ("net", "resolution"),
    "net_radius": ("net", "radius"),
    "net_samples": ("net", "n_samples"),
    "max_net_candidates": ("net", "max_candidates"),
    "polish": ("polish", "enabled"),
    "polish_samples": ("polish", "n_samples"),
    "polish_max_iter": ("polish", "max_iter"),
    "polish_tol": ("polish", "tol"),
    "polish_solver": ("polish", "solver"),
    "head_rank": ("polish", "head_rank"),
    "n_restarts": ("starts", "n_starts"),
    "whiten": ("starts", "whiten"),
    "start_search": ("starts", "start_search"),
}


def default_of(name):
    """The default of the estimator parameter ``name``, from the options.

    Examples
    --------
    >>> default_of("certify_tol"), default_of("polish")
    (0.3, True)
    """
    part, attribute = PARAMETERS[name]
    owner = PhasedOptions() if part == "" else getattr(PhasedOptions(), part)
    return getattr(owner, attribute)
