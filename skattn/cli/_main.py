"""``main`` and the commands: ``skattn demo``, ``fit``, ``sweep``, ``layer``,
``model``."""

import os
import shlex
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from ..experiments._pipeline import voice
from ..layer._files import LAYER_FILE_SUFFIXES, save_layer
from . import _messages
from ._messages import _command_words, _error, _in_flags, _show_warning
from ._parser import FIT_OPTIONS, _parser

# Recovery threshold of ``skattn demo`` (head-matched relative parameter error).
RECOVERY_TOLERANCE = 1e-6

# Failed cells of a sweep listed one by one; beyond, a count and the results file.
_MAX_FAILED_SHOWN = 20


def _timed_fit(estimator, X, y, device=None):
    from ..experiments._pipeline import _fit_on

    start = time.perf_counter()
    _fit_on(estimator, X, y, device)
    return time.perf_counter() - start


def _training_r2(estimator, X, y, device=None):
    """The estimator's R2 on its training data, computed where it was fitted."""
    if device is None:
        return estimator.score(X, y)
    import torch
    from sklearn import config_context

    with config_context(array_api_dispatch=True):
        score = estimator.score(
            torch.asarray(X, device=device), torch.asarray(y, device=device)
        )
    return float(score)


def _demo(args):
    from ..datasets import make_attention_layer, sample_inputs
    from ..estimators import GradientAttentionRegressor, MultiHeadAttentionRegressor
    from ..metrics import parameter_error, prediction_error
    from ..phased import format_reports

    if args.plot is not None:
        _check_output(args.plot, "--plot", ".png")
    n_outputs = args.outputs or 2 * args.features
    rng = np.random.default_rng(args.random_state)
    layer = make_attention_layer(
        args.heads,
        args.features,
        n_outputs=n_outputs,
        attention_scale=args.scale,
        random_state=args.random_state,
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
            random_state=args.random_state,
            verbose=verbose,
        )
    }
    if not args.no_gradient:
        learners["gradient (L-BFGS)"] = GradientAttentionRegressor(
            n_heads=args.heads,
            n_tokens=args.tokens,
            random_state=args.random_state,
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
        from ..metrics import AttentionPatternDisplay

        display = AttentionPatternDisplay.from_layers(
            layer, learners["phased (Chen-Li)"], X_test
        )
        _make_folder(args.plot)
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


def _load_error(path, what, exc):
    """The error of a file that ``np.load`` cannot read, naming it."""
    if isinstance(exc, FileNotFoundError):
        return _error(f"{what} file {str(path)!r} does not exist.")
    if isinstance(exc, IsADirectoryError):
        return _error(f"{what} {str(path)!r} is a folder, not a .npy or .npz file.")
    if isinstance(exc, OSError):
        return _error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}.")
    return _error(
        f"{str(path)!r} is not a numeric array file (.npy or .npz) "
        f"({type(exc).__name__}: {exc}); skattn never loads pickled data "
        f"(unpickling can run code)."
    )


def _load(path, what):
    """``np.load(path)`` (an array or an NpzFile); never unpickles."""
    if Path(path).is_dir():
        raise _error(f"{what} {str(path)!r} is a folder, not a .npy or .npz file.")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:  # untrusted bytes: any reader error is bad input
        raise _load_error(path, what, exc) from exc


def _member(data, name, path):
    try:
        return data[name]
    except Exception as exc:
        raise _load_error(path, f"array {name!r} of", exc) from exc


def _load_xy(path_x, path_y):
    """X and y from ``X.npy y.npy`` or one ``data.npz`` with arrays X and y."""
    data = _load(path_x, "X")
    if not isinstance(data, np.ndarray):  # an .npz archive
        with data:
            if path_y is not None:
                raise _error(
                    f"{path_x} is an .npz archive (holding X and y); pass either "
                    f"data.npz or X.npy y.npy, not both."
                )
            missing = {"X", "y"} - set(data.files)
            if missing:
                raise _error(
                    f"{path_x} lacks array(s) {sorted(missing)} (it holds "
                    f"{sorted(data.files)}); save it with np.savez(path, X=X, y=y)."
                )
            return _member(data, "X", path_x), _member(data, "y", path_x)
    if path_y is None:
        raise _error(
            f"y.npy is missing: pass X.npy y.npy, or one .npz with arrays X and y "
            f"({path_x} holds a single array)."
        )
    y = _load(path_y, "y")
    if not isinstance(y, np.ndarray):
        y.close()
        raise _error(f"y {path_y!r} is an .npz archive; pass y as a .npy array.")
    return data, y


def _check_output(path, option="--out", suffix=".npz"):
    """Refuse an output path that cannot be written, before anything is fitted.

    A missing folder is checked in its nearest existing parent folder and
    created only when the file is written (:func:`_make_folder`), as ``skattn
    layer`` does with its ``--out``."""
    out = Path(path)
    if out.is_dir():
        raise _error(
            f"{option} {path!r} is a folder; give a file name ending in {suffix}."
        )
    from ..experiments._pipeline import _nearest_existing, _probe

    folder = _nearest_existing(out.parent)
    try:
        _probe(folder)
    except OSError as exc:
        raise _error(
            f"{option} {path!r} cannot be written in {str(folder)!r} "
            f"({exc.strerror or exc}); choose another path."
        ) from exc


def _make_folder(path):
    """Create the folder of the output file ``path`` if it is missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def _fit(args):
    from ..estimators import MultiHeadAttentionRegressor

    params = {FIT_OPTIONS[name]: getattr(args, name) for name in FIT_OPTIONS}
    learner = MultiHeadAttentionRegressor(**params, verbose=args.verbose)
    learner._validate_params()  # a ValueError naming the parameter, before any I/O
    if args.n_heads == "auto" and args.head_rank is not None:
        raise _error(
            "--head-rank needs an integer --n-heads (--n-heads auto searches "
            "full-rank heads)."
        )
    device = None
    if args.device is not None:
        from ..experiments._pipeline import _check_device

        device = _check_device(args.device, learner)
    _check_output(args.out, suffix=" or ".join(LAYER_FILE_SUFFIXES))
    X, y = _load_xy(args.X, args.y)
    try:
        seconds = _timed_fit(learner, X, y, device)
    except (ValueError, TypeError) as exc:
        raise _error(f"the fit failed: {exc}") from exc
    _make_folder(args.out)
    path = save_layer(learner, args.out)
    kept = _memory_record(learner)
    if kept and kept.get("reused"):
        print(_resumed_line(len(kept["reused"]), len(kept.get("computed", []))))
    print(
        f"Learned {learner.attention_.shape[0]} head(s) in {seconds:.1f} s; training "
        f"R2 {_training_r2(learner, X, y, device):.6f}"
        + ("" if device is None else f" (fitted on {device})")
        + f"; saved the layer (attention, projection, "
        f"key_bias, intercept, n_tokens) to {path}; load it with "
        f"skattn.cli.load_layer({str(path)!r})."
    )
    return 0


def _memory_record(learner):
    from ..experiments._pipeline import _memory_record

    return _memory_record(learner)


def _cell_text(row):
    from ..experiments._sweep import SETTING_COLUMNS

    return " ".join(f"{key}={row[key]}" for key in SETTING_COLUMNS)


def _sweep(args):
    from ..experiments import load_sweep_config, recovery_sweep

    kwargs = load_sweep_config(args.config)  # its errors name the config
    try:  # checks the planted layers and the learners' parameters before any fit
        results = recovery_sweep(**kwargs, progress=not args.quiet)
    except ValueError as exc:
        raise _error(f"{args.config}: {exc}") from exc
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
    failed = results[~ok]
    if failed.empty:
        return 0
    print(
        f"skattn: error: {len(failed)} of {len(results)} cells failed:",
        file=sys.stderr,
    )
    for _, row in failed.head(_MAX_FAILED_SHOWN).iterrows():
        reason = " ".join(str(row["error"]).split())
        print(f"  {_cell_text(row)}: {reason}", file=sys.stderr)
    if len(failed) > _MAX_FAILED_SHOWN:
        print(
            f"  ... and {len(failed) - _MAX_FAILED_SHOWN} more (column error of "
            f"{kwargs['output']}).",
            file=sys.stderr,
        )
    print(
        "Fix the cause and rerun with retry_failed = true in the config to fit the "
        "failed cells again.",
        file=sys.stderr,
    )
    return 1


def _cache_of(args):
    """The folder where the command keeps the fit's stages (None: none)."""
    if args.command == "fit":
        return args.cache
    if args.command in ("layer", "model") and not args.no_cache:
        if args.cache is not None:
            return args.cache
        return str(Path(_out_of(args)) / "cache")
    return None


def _out_of(args):
    """The output folder of ``skattn layer`` or ``skattn model``."""
    if args.out is not None:
        return args.out
    return f"skattn-layer-{args.layer}" if args.command == "layer" else "skattn-model"


def _folder_bytes(folder):
    """The bytes of the files under ``folder`` (0 when it does not exist)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:  # removed meanwhile
                pass
    return total


def _resumed_line(reused, computed, seconds_all=None):
    """The line a run that read kept stages back prints."""
    line = f"resumed: {reused} stages reused ({computed} computed now)"
    if seconds_all is not None:
        line += f"; fit time over all pieces {seconds_all:.1f} s"
    return line


def _checkpoint_arguments(args, cache):
    """The keywords of ``learn_layer`` and ``learn_model`` that their commands'
    shared options give (see ``_parser._checkpoint_options``)."""
    return {
        "texts": args.text,
        "n_tokens": args.n_tokens,
        "n_windows": args.n_windows,
        "held_out": args.held_out,
        "out": _out_of(args),
        "plot": args.plot,
        "random_state": args.random_state,
        "memory": cache,
        "device": args.device,
        "fit_anyway": args.fit_anyway,
        "verbose": args.verbose,
    }


def _layer(args):
    from ..experiments import learn_layer

    cache = _cache_of(args)
    result = learn_layer(
        args.checkpoint,
        layer=args.layer,
        n_heads=args.n_heads,
        **_checkpoint_arguments(args, cache),
    )
    report = result.report
    error = report["held_out_relative_error"]
    memory = report["peak_memory_mb"]
    print(
        f"Learned layer {args.layer} ({report['checkpoint']['folder']}), "
        f"{len(report['checkpoint']['heads_learned'])} head(s), on "
        f"{report['n_windows_fit']} windows of {args.n_tokens} tokens in "
        f"{report['fit_seconds']:.1f} s (peak memory "
        + ("unknown" if memory is None else f"{memory:.0f} MB")
        + f"); held-out relative error on {report['n_windows_held_out']} windows: "
        + ("not finite" if error is None else f"{error:.3g}")
        + "."
    )
    for role, path in result.files.items():
        print(f"  {role}: {path}")
    resume = report.get("resume") or {}
    if resume.get("stages_reused"):
        recorded = resume.get("earlier_pieces_seconds")
        print(
            _resumed_line(
                resume["stages_reused"],
                resume["stages_computed"],
                resume["fit_seconds_all_pieces"] if recorded else None,
            )
        )
    if cache is not None and Path(cache).is_dir():
        size = _folder_bytes(cache) / 1e6
        print(
            f"cache: {cache} ({size:.1f} MB), kept so that a rerun reuses the fit; "
            f"remove it with: rm -r {shlex.quote(str(cache))}"
        )
    return 0


def _model(args):
    from ..experiments import learn_model

    result = learn_model(
        args.checkpoint,
        layers=args.layers,
        **_checkpoint_arguments(args, _cache_of(args)),
    )
    report = result.report
    print(
        f"Learned {len(result.layers)} of {len(report['layers'])} layer(s) of "
        f"{report['checkpoint']} on {report['n_windows_fit']} windows of "
        f"{args.n_tokens} tokens in {report['total_seconds']:.1f} s:"
    )
    print(result.table)
    for name, entry in report["model"].items():
        if not isinstance(entry, dict):
            continue
        which = "all layers" if name == "all" else f"layer {name}"
        line = (
            f"{which} replaced: final hidden states "
            f"{entry['hidden_states_relative_difference']:.3g}, embeddings "
            f"{entry['embedding_relative_difference']:.3g} (cosine >= "
            f"{entry['embedding_cosine_min']:.12f})"
        )
        if "perplexity_learned" in entry:
            line += (
                f", log-probabilities {entry['log_probs_relative_difference']:.3g}, "
                f"perplexity {entry['perplexity_learned']:.8g} (original "
                f"{entry['perplexity_original']:.8g})"
            )
        print(f"  {line}")
    for role, path in result.files.items():
        print(f"  {role}: {path}")
    return 0


def _interrupted(args):
    """The ``SystemExit`` of Ctrl-C: one line on stderr, status 130 (128 +
    SIGINT), and where the finished stages are when a cache is in use."""
    sys.stdout.flush()
    cache = _cache_of(args)
    if cache is not None and Path(cache).is_dir():
        print(
            f"skattn: interrupted; run the same command again to resume from {cache}",
            file=sys.stderr,
        )
    else:
        print("skattn: interrupted", file=sys.stderr)
    return SystemExit(130)


def _with_array_api(argv):
    """Run this command again in a fresh interpreter with ``SCIPY_ARRAY_API=1``
    unless it is set: scipy reads it once, when imported, and ``--device`` fits
    through scikit-learn's array API, which needs it (scipy is imported by now)."""
    if os.environ.get("SCIPY_ARRAY_API") == "1":
        return
    env = {**os.environ, "SCIPY_ARRAY_API": "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "skattn", *argv], env)


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
        0 on success; 1 when ``skattn demo`` did not recover the planted layer or
        a cell of ``skattn sweep`` failed.

    Raises
    ------
    SystemExit
        On bad input: status 2 with argparse's usage for a malformed option,
        else the one-line message ``skattn: error: ...`` (status 1 when it
        reaches the interpreter).  On Ctrl-C: status 130, after the one line
        ``skattn: interrupted`` (with where to resume from when the fit keeps
        its stages, ``--cache``).

    Examples
    --------
    >>> from skattn.cli import main
    >>> main(["demo", "--heads", "1", "--samples", "2000", "--no-gradient",
    ...       "--quiet"])  # doctest: +ELLIPSIS
    Planted layer: m=1 heads, ...
    Recovered: parameter errors below 1e-06.
    0
    >>> main(["fit", "missing.npy", "y.npy", "--n-tokens", "2"])
    Traceback (most recent call last):
    ...
    SystemExit: skattn: error: X file 'missing.npy' does not exist.
    """
    args = _parser().parse_args(argv)
    if getattr(args, "device", None) is not None:
        _with_array_api(sys.argv[1:] if argv is None else list(argv))
    command = {
        "demo": _demo,
        "fit": _fit,
        "sweep": _sweep,
        "layer": _layer,
        "model": _model,
    }
    command = command[args.command]
    words, _messages._WORDS = _messages._WORDS, _command_words(args.command)
    reword = None
    if _messages._WORDS is not None:
        reword = lambda line: _in_flags(line, *_messages._WORDS)  # noqa: E731
    with warnings.catch_warnings(), voice(f"skattn {args.command}", reword):
        warnings.showwarning = _show_warning
        try:
            return command(args)
        except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status 130
            raise _interrupted(args) from None
        except ValueError as exc:  # bad input that the library named
            raise _error(exc) from exc
        except (OSError, ImportError) as exc:  # a file, a folder, a missing extra
            raise _error(f"{type(exc).__name__}: {exc}") from exc
        except MemoryError as exc:  # refused before the fit, or out of memory
            raise _error(exc) from exc
        finally:
            _messages._WORDS = words
