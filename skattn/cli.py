"""The command line: ``skattn demo``, ``skattn fit`` and ``skattn sweep``.

``skattn demo`` plants a multi-head attention layer, samples examples, learns it back
with the phased learner of Chen & Li and with the gradient baseline, and prints what
each phase did and how well each learner recovered the layer.  It exits with status 1
when the phased learner fails to recover the layer.

``skattn fit X.npy y.npy --n-tokens K --n-heads M --out layer.npz`` learns a layer
from arrays on disk and saves its parameters.

``skattn sweep CONFIG.toml`` runs :func:`skattn.experiments.recovery_sweep` over the
grid of a TOML config (see :mod:`skattn.experiments._config`), on local processes or
the config's Dask scheduler, writing one row per fit to the config's output file;
rerun it to resume.
"""

import argparse
import sys
import time

import numpy as np

# Recovery threshold of ``skattn demo`` (head-matched relative parameter error).
RECOVERY_TOLERANCE = 1e-6


def _parser():
    parser = argparse.ArgumentParser(
        prog="skattn",
        description="Learn multi-head attention layers from examples.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="plant a layer, sample, learn it back, print the recovery table",
        description="Plant a multi-head attention layer, sample examples, fit the "
        "phased learner and the gradient baseline, and print the recovery table.",
    )
    demo.add_argument("--heads", type=int, default=2, help="heads m (default 2)")
    demo.add_argument("--tokens", type=int, default=4, help="tokens k (default 4)")
    demo.add_argument(
        "--features", type=int, default=8, help="features per token d (default 8)"
    )
    demo.add_argument(
        "--outputs",
        type=int,
        default=None,
        help="output features per token d_out (default: 2d)",
    )
    demo.add_argument(
        "--samples", type=int, default=20000, help="training examples (default 20000)"
    )
    demo.add_argument(
        "--distribution", choices=["boolean", "gaussian"], default="boolean"
    )
    demo.add_argument("--scale", type=float, default=2.0, help="attention scale")
    demo.add_argument("--noise", type=float, default=0.0, help="label noise std")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.add_argument(
        "--no-gradient", action="store_true", help="skip the gradient baseline"
    )
    demo.add_argument(
        "--plot", metavar="FILE.png", help="save true vs learned attention patterns"
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    fit = sub.add_parser(
        "fit",
        help="learn a layer from .npy/.npz arrays and save it",
        description="Fit MultiHeadAttentionRegressor to X and y read from .npy files "
        "(or one .npz holding arrays 'X' and 'y') and save the learned layer "
        "(attention, projection) to an .npz file.",
    )
    fit.add_argument("X", help="X.npy, or data.npz with arrays X and y")
    fit.add_argument("y", nargs="?", help="y.npy (omit when X is an .npz)")
    fit.add_argument("--n-tokens", type=int, required=True)
    fit.add_argument("--n-heads", default="1", help="an integer or 'auto'")
    fit.add_argument(
        "--distribution",
        choices=["boolean", "gaussian"],
        default="gaussian",
        help="'boolean' also checks that X is +-1 (default: gaussian, any real X)",
    )
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--out", default="layer.npz", help="output file (.npz)")
    fit.add_argument("--quiet", action="store_true")

    sweep = sub.add_parser(
        "sweep",
        help="run a grid of planted recoveries from a TOML config",
        description="Fit the config's learners on every cell of its grid (planted "
        "layer x n_samples x noise x seed) through joblib, on local processes or "
        "the config's Dask scheduler; append one row per fit to the config's "
        "output file (.csv or .parquet) and skip the cells already there.",
    )
    sweep.add_argument("config", help="CONFIG.toml")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _timed_fit(estimator, X, y):
    start = time.perf_counter()
    estimator.fit(X, y)
    return time.perf_counter() - start


def _demo(args):
    from .datasets import make_attention_layer, sample_inputs
    from .estimators import GradientAttentionRegressor, MultiHeadAttentionRegressor
    from .metrics import parameter_error, prediction_error
    from .phased import format_reports

    n_outputs = args.outputs or 2 * args.features
    rng = np.random.default_rng(args.seed)
    layer = make_attention_layer(
        args.heads,
        args.features,
        n_outputs=n_outputs,
        attention_scale=args.scale,
        random_state=args.seed,
    )
    X = sample_inputs(
        args.distribution, args.samples, args.tokens, args.features, random_state=rng
    )
    X_test = sample_inputs(
        args.distribution, 2000, args.tokens, args.features, random_state=rng
    )
    y = layer.transform(X)
    if args.noise:
        y = y + args.noise * rng.standard_normal(y.shape)
    y_test = layer.transform(X_test)
    print(
        f"Planted layer: m={args.heads} heads, k={args.tokens} tokens, "
        f"d={args.features} features, d_out={n_outputs}, attention scale "
        f"{args.scale}, {args.distribution} inputs, {args.samples} examples, "
        f"noise {args.noise}"
    )

    verbose = 0 if args.quiet else 1
    learners = {
        "phased (Chen-Li)": MultiHeadAttentionRegressor(
            n_heads=args.heads,
            n_tokens=args.tokens,
            input_distribution=args.distribution,
            random_state=args.seed,
            verbose=verbose,
        )
    }
    if not args.no_gradient:
        learners["gradient (L-BFGS)"] = GradientAttentionRegressor(
            n_heads=args.heads,
            n_tokens=args.tokens,
            random_state=args.seed,
            verbose=verbose,
        )

    rows = []
    for name, learner in learners.items():
        try:
            seconds = _timed_fit(learner, X, y)
        except ValueError as exc:
            print(
                f"\nRecovery FAILED: the {name} learner could not fit: {exc}",
                file=sys.stderr,
            )
            return 1
        errors = parameter_error(layer, learner)
        rows.append(
            (
                name,
                seconds,
                errors.attention_error,
                errors.projection_error,
                prediction_error(layer, learner, X_test),
                learner.score(X_test, y_test),
            )
        )
        if hasattr(learner, "phase_report_"):
            print(f"\nWhat each phase of the {name} learner did:")
            print(format_reports(learner.phase_report_))

    print("\nRecovery (head-matched relative errors; test set of 2000 examples):")
    header = f"{'learner':<20}{'time s':>9}{'Theta err':>12}{'W err':>12}"
    print(header + f"{'pred err':>12}{'test R2':>12}")
    for name, seconds, att, proj, pred, r2 in rows:
        print(
            f"{name:<20}{seconds:>9.2f}{att:>12.2e}{proj:>12.2e}{pred:>12.2e}"
            f"{r2:>12.6f}"
        )

    if args.plot:
        from .metrics import AttentionPatternDisplay

        display = AttentionPatternDisplay.from_layers(
            layer, learners["phased (Chen-Li)"], X_test
        )
        display.figure_.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"\nSaved true vs learned attention patterns to {args.plot}")

    att_error, proj_error = rows[0][2], rows[0][3]
    tolerance = RECOVERY_TOLERANCE if not args.noise else 10 * args.noise
    if max(att_error, proj_error) > tolerance:
        print(
            f"\nRecovery FAILED: phased learner's parameter error "
            f"{max(att_error, proj_error):.2e} > {tolerance:.0e}",
            file=sys.stderr,
        )
        return 1
    print(f"\nRecovered: parameter errors below {tolerance:.0e}.")
    return 0


def _load_array(path, load):
    """``load()`` of a .npy/.npz file; never unpickles (``allow_pickle=False``)."""
    try:
        return load()
    except ValueError as exc:
        raise SystemExit(
            f"skattn fit: {path} is not a numeric array file ({exc}); skattn "
            f"never loads pickled data (unpickling can run code)"
        ) from exc


def _load_xy(path_x, path_y):
    if path_x.endswith(".npz"):
        if path_y is not None:
            raise SystemExit(
                "skattn fit: pass either data.npz or X.npy y.npy, not both"
            )
        with _load_array(path_x, lambda: np.load(path_x, allow_pickle=False)) as data:
            missing = {"X", "y"} - set(data.files)
            if missing:
                raise SystemExit(
                    f"skattn fit: {path_x} lacks array(s) {sorted(missing)}; save it "
                    f"with np.savez(path, X=X, y=y)"
                )
            return tuple(_load_array(path_x, lambda n=n: data[n]) for n in "Xy")
    if path_y is None:
        raise SystemExit("skattn fit: y.npy is missing (or pass one .npz with X and y)")
    return tuple(
        _load_array(p, lambda p=p: np.load(p, allow_pickle=False))
        for p in (path_x, path_y)
    )


def _fit(args):
    from .estimators import MultiHeadAttentionRegressor

    X, y = _load_xy(args.X, args.y)
    n_heads = "auto" if args.n_heads == "auto" else int(args.n_heads)
    learner = MultiHeadAttentionRegressor(
        n_heads=n_heads,
        n_tokens=args.n_tokens,
        input_distribution=args.distribution,
        random_state=args.seed,
        verbose=0 if args.quiet else 1,
    )
    try:
        seconds = _timed_fit(learner, X, y)
    except ValueError as exc:
        raise SystemExit(f"skattn fit: {exc}") from exc
    np.savez(args.out, attention=learner.attention_, projection=learner.projection_)
    print(
        f"Learned {learner.attention_.shape[0]} head(s) in {seconds:.1f} s; training "
        f"R2 {learner.score(X, y):.6f}; saved attention and projection to {args.out}"
    )
    return 0


def _sweep(args):
    from .experiments import load_sweep_config, recovery_sweep

    try:
        kwargs = load_sweep_config(args.config)
        results = recovery_sweep(**kwargs, progress=not args.quiet)
    except (ValueError, TypeError, ImportError) as exc:
        raise SystemExit(f"skattn sweep: {exc}") from exc
    ok = results["status"] == "ok"
    print(
        f"{len(results)} cells ({results.attrs['n_fitted']} fitted now, "
        f"{len(results) - results.attrs['n_fitted']} from {kwargs['output']}); "
        f"{int((~ok).sum())} failed."
    )
    for learner, group in results.groupby("learner", sort=False):
        stops = group["stop_reason"].dropna().value_counts()
        print(
            f"{learner:<20} success rate {group['success'].astype(bool).mean():.2f} "
            f"over {len(group)} fits; median precision "
            f"{group['precision'].median():.1e}; stopped: "
            + (", ".join(f"{reason} {n}" for reason, n in stops.items()) or "-")
        )
    return 0


def main(argv=None):
    """Entry point of the ``skattn`` console script and ``python -m skattn``.

    Parameters
    ----------
    argv : list of str, default=None
        Command-line arguments without the program name; ``None`` reads
        ``sys.argv``.

    Returns
    -------
    status : int
        0 on success; 1 when ``skattn demo`` did not recover the planted layer.

    Examples
    --------
    >>> from skattn.cli import main
    >>> main(["demo", "--heads", "1", "--samples", "2000", "--no-gradient",
    ...       "--quiet"])  # doctest: +ELLIPSIS
    Planted layer: m=1 heads, ...
    Recovered: parameter errors below 1e-06.
    0
    """
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "sweep":
        return _sweep(args)
    return _fit(args)
