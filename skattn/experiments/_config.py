"""The TOML configuration of ``skattn sweep CONFIG.toml``.

A config file holds the same things as the arguments of
:func:`~skattn.experiments.recovery_sweep`::

    output = "results.csv"            # .csv or .parquet, relative to this file
    scheduler = "tcp://host:8786"     # optional: run the fits on a Dask cluster
    n_jobs = 2                        # optional: local processes (default: all)
    n_test = 1000                     # optional: test examples per fit
    success_tol = 1e-6                # optional: parameter error counted a success
    tighten_tol = true                # optional: learners to their precision floor
    retry_failed = false              # optional: rerun the failed cells

    [planted]                         # a value or a list of values (a grid axis)
    n_heads = [1, 2]
    n_tokens = 4
    n_features = 4
    n_outputs = 8

    [grid]
    n_samples = [200, 1000]
    noise = [0.0]
    seeds = [0, 1, 2]                 # the seeds; an int n means n seeds: 0 .. n-1

    [learners.phased]                 # a name, the estimator class, its parameters
    estimator = "MultiHeadAttentionRegressor"
    n_heads = "planted"               # "planted": the cell's planted value

Every key is checked before any fit starts: an unknown key, learner or parameter
is a ``ValueError`` naming it and listing what is allowed; a renamed parameter
(``solver`` of ``GradientAttentionRegressor``, now ``optimizer``) is one naming
its new name; a top-level value of the wrong kind is one naming the key here, and
:func:`~skattn.experiments.recovery_sweep` checks the planted values and every
learner's parameter values before its first fit.  The user guide (*Experiments
at scale*, *The sweep's config file*) lists every table and key.
"""

import tomllib
from numbers import Integral
from pathlib import Path

# Keys of the planted layer: the arguments of make_attention_regression (n_samples
# and noise are grid axes).
PLANTED_KEYS = (
    "n_heads",
    "n_tokens",
    "n_features",
    "n_outputs",
    "attention_scale",
    "distribution",
    "structure",
    "head_rank",
)
GRID_KEYS = ("n_samples", "noise", "seeds")
# The largest count of seeds ``seeds = N`` may ask for (one fit per seed and cell).
_MAX_SEEDS = 10**6
# The largest seed: a random_state of numpy and scikit-learn.
_MAX_SEED = 2**32 - 1
_TOP_KEYS = (
    "output",
    "scheduler",
    "n_jobs",
    "n_test",
    "success_tol",
    "tighten_tol",
    "retry_failed",
    "planted",
    "grid",
    "learners",
)
# Learner parameters that were renamed: estimator -> {old name: new name}.  A config
# that still sets the old name is refused with a message that names the new one.
_RENAMED_PARAMETERS = {
    "GradientAttentionRegressor": {"solver": "optimizer"},
}


def seed_list(seeds):
    """The seeds of a sweep as a list: an int is a count, an iterable the seeds.

    ``seeds=n`` (an int, in Python as in a TOML config) means n seeds, ``0 .. n-1``;
    any other iterable of non-negative ints (a list, a tuple, a ``range``, an
    array) is the seeds themselves.  A single seed ``s`` is ``[s]``.

    Parameters
    ----------
    seeds : int or iterable of int
        A count of seeds, or the seeds.

    Returns
    -------
    seeds : list of int
        Distinct non-negative seeds, in the given order.

    Examples
    --------
    >>> from skattn.experiments._config import seed_list
    >>> seed_list(3), seed_list(range(2, 4)), seed_list([7])
    ([0, 1, 2], [2, 3], [7])
    """
    if isinstance(seeds, bool) or isinstance(seeds, str | bytes):
        raise ValueError(
            f"seeds must be a number of seeds (an int) or an iterable of "
            f"non-negative ints, got {seeds!r}."
        )
    if isinstance(seeds, Integral):
        if seeds < 1:
            raise ValueError(
                f"seeds={seeds!r}: an int is the number of seeds (seeds=n runs the "
                f"seeds 0 .. n-1), so it must be >= 1; to run the single seed "
                f"{seeds!r}, pass seeds=[{seeds!r}]."
            )
        if seeds > _MAX_SEEDS:
            raise ValueError(
                f"seeds={seeds!r} asks for seeds 0 .. {seeds - 1}; give a count "
                f"between 1 and {_MAX_SEEDS} or a list of seeds."
            )
        return list(range(int(seeds)))
    try:
        values = list(seeds)
    except TypeError:
        raise ValueError(
            f"seeds must be a number of seeds (an int) or an iterable of "
            f"non-negative ints, got {type(seeds).__name__} {seeds!r}."
        ) from None
    if not values:
        raise ValueError("seeds is an empty list; give at least one seed.")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
            raise ValueError(
                f"seeds must hold non-negative ints, got {value!r} in {seeds!r}."
            )
        if value > _MAX_SEED:
            raise ValueError(
                f"seeds must hold ints up to {_MAX_SEED} (numpy's seeds), got "
                f"{value!r}."
            )
    repeated = sorted({int(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(
            f"seeds holds {repeated} more than once; a seed is a cell of the grid, "
            f"give each once."
        )
    return [int(v) for v in values]


def _check_keys(table, allowed, where, path):
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ValueError(
            f"{path}: unknown key(s) {unknown} in {where}; allowed keys are "
            f"{list(allowed)}."
        )


def _estimator_class(name, learner, path):
    from ..utils.discovery import all_estimators

    classes = dict(all_estimators("regressor"))
    if name not in classes:
        raise ValueError(
            f"{path}: learner {learner!r} has estimator={name!r}, which is not a "
            f"skattn regressor; use one of {sorted(classes)}."
        )
    return classes[name]


def load_sweep_config(path):
    """Read a sweep configuration (TOML) into arguments of ``recovery_sweep``.

    Parameters
    ----------
    path : str or path-like
        The TOML file (see the module docstring for its keys).

    Returns
    -------
    kwargs : dict
        Keyword arguments of :func:`~skattn.experiments.recovery_sweep`: the
        learners as unfitted estimators, the planted settings, the grid, the
        output path and the engine.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from skattn.experiments import load_sweep_config
    >>> text = '''
    ... output = "out.csv"
    ... [planted]
    ... n_heads = [1, 2]
    ... n_tokens = 2
    ... n_features = 3
    ... [grid]
    ... n_samples = [100, 200]
    ... seeds = 2
    ... [learners.phased]
    ... estimator = "MultiHeadAttentionRegressor"
    ... n_heads = "planted"
    ... '''
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     config = pathlib.Path(tmp) / "sweep.toml"
    ...     _ = config.write_text(text)
    ...     kwargs = load_sweep_config(config)
    >>> kwargs["learners"]["phased"].n_heads, kwargs["seeds"]
    ('planted', [0, 1])
    """
    path = Path(path)
    try:
        with path.open("rb") as file:
            config = tomllib.load(file)
    except OSError as exc:
        raise ValueError(f"cannot read the sweep config {str(path)!r}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    _check_keys(config, _TOP_KEYS, "the top level", path)
    for required in ("output", "learners", "grid"):
        if required not in config:
            raise ValueError(
                f"{path}: the key {required!r} is missing; a sweep needs an output "
                f"file, a [grid] with n_samples and at least one [learners.NAME]."
            )
    planted = config.get("planted", {})
    grid = config["grid"]
    for name, table, allowed in (
        ("[planted]", planted, PLANTED_KEYS),
        ("[grid]", grid, GRID_KEYS),
    ):
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {name} must be a table, got {table!r}.")
        _check_keys(table, allowed, name, path)
    if "n_samples" not in grid:
        raise ValueError(f"{path}: [grid] needs n_samples (an int or a list).")
    learners = {}
    if not isinstance(config["learners"], dict) or not config["learners"]:
        raise ValueError(
            f"{path}: [learners] must hold at least one [learners.NAME] table with "
            f"an estimator key."
        )
    for learner, spec in config["learners"].items():
        if not isinstance(spec, dict) or "estimator" not in spec:
            raise ValueError(
                f"{path}: [learners.{learner}] needs an estimator key, e.g. "
                f'estimator = "MultiHeadAttentionRegressor".'
            )
        params = dict(spec)
        cls = _estimator_class(params.pop("estimator"), learner, path)
        for old, new in _RENAMED_PARAMETERS.get(cls.__name__, {}).items():
            if old in params:
                raise ValueError(
                    f"{path}: [learners.{learner}] sets {old!r}, which "
                    f"{cls.__name__} now calls {new!r}; rename the key to {new} "
                    f"(same values)."
                )
        unknown = sorted(set(params) - set(cls().get_params()))
        if unknown:
            raise ValueError(
                f"{path}: [learners.{learner}] has unknown parameter(s) {unknown} "
                f"for {cls.__name__}; its parameters are "
                f"{sorted(cls().get_params())}."
            )
        learners[learner] = cls(**params)
    try:
        seeds = seed_list(grid.get("seeds", [0]))
    except ValueError as exc:
        raise ValueError(f"{path}: [grid] {exc}") from None
    _check_top_level(config, path)
    kwargs = {
        "learners": learners,
        "planted": planted,
        "n_samples": grid["n_samples"],
        "noise": grid.get("noise", [0.0]),
        "seeds": seeds,
        "output": str(path.parent / config["output"]),
    }
    engine = ("scheduler", "n_jobs", "n_test", "success_tol", "tighten_tol")
    for key in (*engine, "retry_failed"):
        if key in config:
            kwargs[key] = config[key]
    return kwargs


# What each top-level key of a config must be, when it is set.
_TOP_LEVEL_KINDS = {
    "output": ("a file name ending in .csv or .parquet", lambda v: isinstance(v, str)),
    "scheduler": ('an address such as "tcp://host:8786"', lambda v: isinstance(v, str)),
    "n_jobs": (
        "a non-zero integer (-1: all processors)",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v != 0,
    ),
    "n_test": (
        "a positive integer",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    ),
    "success_tol": (
        "a non-negative number",
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v >= 0,
    ),
    "tighten_tol": ("true or false", lambda v: isinstance(v, bool)),
    "retry_failed": ("true or false", lambda v: isinstance(v, bool)),
}


def _check_top_level(config, path):
    for key, (kind, check) in _TOP_LEVEL_KINDS.items():
        if key in config and not check(config[key]):
            raise ValueError(f"{path}: {key} must be {kind}, got {config[key]!r}.")
