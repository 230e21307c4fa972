"""The options of the random-start path's stages: frozen, defaults written once.

The estimator (:class:`skattn.MultiHeadAttentionRegressor`) builds them once from
its parameters (:class:`skattn.phased.PhasedOptions`, which maps each parameter
to the field it sets) and the stages read them; a stage never sees a bag of
keyword arguments.  Each field says which estimator parameter sets it.
"""

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PolishOptions:
    """The joint polish (:func:`~skattn.solvers.polish`, on a warm-up subset and
    then on all examples), after phase 6 or after the random starts.

    Parameters
    ----------
    enabled : bool, default=True
        ``polish``: run the polish at all (without it the phases' estimate is
        returned).
    n_samples : int or None, default=None
        ``polish_samples``: examples of the polish set (a random subset);
        ``None``: all.
    max_iter : int, default=100
        ``polish_max_iter``: Levenberg-Marquardt iterations per stage.
    tol : float, default=1e-10
        ``polish_tol``: the step tolerance.
    solver : {"auto", "dense", "matrix-free"}, default="auto"
        ``polish_solver``: the Levenberg-Marquardt's linear algebra.
    head_rank : int or None, default=None
        ``head_rank``: heads of this rank (``Q_i K_i^T``); ``None``: full rank.
    intercept : bool, default=False
        ``fit_intercept``: the tokens' last coordinate is the constant 1.
    verbose : int, default=0
        2 prints one line per Levenberg-Marquardt iteration (``verbose > 1``).
    factor_values : {"auto", True, False}, default="auto"
        With ``head_rank``: also factor the values ``W_i = V_i O_i``
        (:func:`~skattn.solvers.choose_factor_values`).  Not an estimator
        parameter.

    Examples
    --------
    >>> PolishOptions(max_iter=30).polish_kwargs()["max_iter"]
    30
    """

    enabled: bool = True
    n_samples: int | None = None
    max_iter: int = 100
    tol: float = 1e-10
    solver: str = "auto"
    head_rank: int | None = None
    intercept: bool = False
    verbose: int = 0
    factor_values: str | bool = "auto"

    def polish_kwargs(self):
        """The keyword arguments of :func:`~skattn.solvers.polish` they set."""
        kwargs = asdict(self)
        del kwargs["enabled"], kwargs["n_samples"]
        return kwargs


@dataclass(frozen=True)
class RandomStartOptions:
    """The random starts and the stages before the joint polish
    (:func:`~skattn.solvers.fit_from_random_starts`).

    Parameters
    ----------
    n_starts : int, default=3
        ``n_restarts``: random starts tried, the first exact one ending the loop.
    whiten : {"auto", True, False}, default="auto"
        ``whiten``: fit on whitened tokens and map the layer back; ``"auto"``
        when their second moment is ill-conditioned or singular.
    start_search : {"auto", "minibatch", "none"}, default="auto"
        ``start_search``: the minibatch search before the polish (low-rank
        heads); ``"auto"`` when the polish factors the values (many heads) or,
        above 16 features, the searched heads are then refined alone
        (``m r <= d_out``).
    decouple : {"auto", True, False}, default="auto"
        After the search, refine every head on its own one-head problem;
        ``"auto"``: when the heads' output factors fit in the outputs.  Not an
        estimator parameter.
    rank_free : {"auto", True, False}, default="auto"
        Before the search, polish each start's heads at full rank and keep their
        truncation where they fit (:func:`~skattn.solvers._driver._rank_free`);
        ``"auto"``: low-rank heads of a small layer, the search left to
        ``"auto"``.  Not an estimator parameter.

    Examples
    --------
    >>> RandomStartOptions().n_starts
    3
    """

    n_starts: int = 3
    whiten: str | bool = "auto"
    start_search: str = "auto"
    decouple: str | bool = "auto"
    rank_free: str | bool = "auto"

    def __post_init__(self):
        if self.whiten not in ("auto", True, False):
            raise ValueError(
                f"whiten must be 'auto', True or False, got {self.whiten!r}."
            )
        if self.start_search not in ("auto", "minibatch", "none"):
            raise ValueError(
                "start_search must be 'auto', 'minibatch' or 'none', got "
                f"{self.start_search!r}."
            )
        if self.decouple not in ("auto", True, False):
            raise ValueError(
                f"decouple must be 'auto', True or False, got {self.decouple!r}."
            )
        if self.rank_free not in ("auto", True, False):
            raise ValueError(
                f"rank_free must be 'auto', True or False, got {self.rank_free!r}."
            )
