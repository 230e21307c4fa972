"""The command line: ``skattn demo``, ``fit``, ``sweep`` and ``layer``.

``skattn demo`` plants a multi-head attention layer, samples examples, learns it back
with the phased learner of Chen & Li and with the gradient baseline, and prints what
each phase did and how well each learner recovered the layer.  It exits with status 1
when the phased learner fails to recover the layer.

``skattn fit X.npy y.npy --n-tokens K --n-heads M --out layer.npz`` learns a layer
from arrays on disk and saves it to an ``.npz`` file (:func:`save_layer`), which
:func:`load_layer` reads back as an :class:`~skattn.AttentionLayer`.

``skattn sweep CONFIG.toml`` runs :func:`skattn.experiments.recovery_sweep` over the
grid of a TOML config (see :func:`skattn.experiments.load_sweep_config` and the user
guide's *Experiments at scale*), on local processes or the config's Dask scheduler,
writing one row per fit to the config's output file; rerun it to resume.  It exits
with status 1 when a cell failed, printing each failed cell's reason.

``skattn layer [CHECKPOINT] --layer L --text FILE [FILE ...]`` learns layer L of a
BERT-style checkpoint folder (by default the packaged all-MiniLM-L6-v2), or of a
GPT-2, Llama, Mistral or Qwen2 one (its examples from transformers' own model, the
layer written in the checkpoint's own tensor names), back from the hidden states of
the given text files entering it, and writes the learned layer
(``layer.safetensors``), a JSON report (``report.json``: held-out error, per-head
errors and sharpness, time, memory) and with ``--plot`` the real and learned
attention patterns (``patterns.png``) into ``--out``: see
:func:`skattn.experiments.learn_layer`.  Every input is checked before the model is
loaded.

Bad input never ends in a Python traceback: argparse refuses malformed options
(status 2, with the usage), and any other error -- a missing or unreadable file, an
output folder that does not exist, an invalid config -- is one line ``skattn:
error: ...`` on stderr with status 1, found before any fit starts where it can be.
"""

import argparse
import inspect
import math
import os
import re
import shlex
import sys
import tempfile
import time
import warnings
from numbers import Integral
from pathlib import Path

import numpy as np

from .layer._files import SAFETENSORS_FORMAT, read_safetensors, write_safetensors

# Recovery threshold of ``skattn demo`` (head-matched relative parameter error).
RECOVERY_TOLERANCE = 1e-6
# Arrays of a layer file (see save_layer): the parameters of AttentionLayer.
LAYER_FILE_ARRAYS = (
    "attention",
    "projection",
    "key_bias",
    "intercept",
    "n_tokens",
    "head_rank",
)
# The layer files save_layer writes and load_layer reads.
LAYER_FILE_SUFFIXES = (".npz", ".safetensors")
# Options of ``skattn fit`` passed to MultiHeadAttentionRegressor: option -> parameter.
FIT_OPTIONS = {
    "n_tokens": "n_tokens",
    "n_heads": "n_heads",
    "distribution": "input_distribution",
    "fit_intercept": "fit_intercept",
    "head_rank": "head_rank",
    "init": "init",
    "certify_tol": "certify_tol",
    "certify_tol_final": "certify_tol_final",
    "polish_tol": "polish_tol",
    "polish_max_iter": "polish_max_iter",
    "random_state": "random_state",
    "cache": "memory",
}
# Failed cells of a sweep listed one by one; beyond, a count and the results file.
_MAX_FAILED_SHOWN = 20


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default (flags and options without one
    excepted: their help says what absence means)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        if isinstance(action, argparse._StoreConstAction):  # --quiet: a switch
            return action.help
        return super()._get_help_string(action)


# The flags of ``skattn layer`` for learn_layer's parameters; those of ``skattn
# fit`` are FIT_OPTIONS'.  Library messages (errors, warnings) name parameters; a
# command's user sets flags: main rewrites them (_in_flags).
_LAYER_FLAGS = {
    "layer": "--layer",
    "texts": "--text",
    "n_tokens": "--n-tokens",
    "n_windows": "--n-windows",
    "held_out": "--held-out",
    "n_heads": "--n-heads",
    "random_state": "--random-state",
    "memory": "--cache",
    "device": "--device",
    "out": "--out",
    "plot": "--plot",
    "fit_anyway": "--fit-anyway",
}
# What a command's user can do about a learner parameter it has no flag for
# (said in the command's terms: no Python parameters, issue 64).
_UNSET_HINTS = {
    "fit": "skattn fit cannot set it; its flags are in skattn fit --help",
    "layer": "skattn layer cannot set it: the command fits the default learner",
}
# (flags, hint) of the command running (main sets it); None: messages as they are.
_WORDS = None
_VALUE = r"""'[^']*'|"[^"]*"|[\w.+-]*\w"""


def _command_words(command):
    """The (flags, hint) of ``command`` for :func:`_in_flags`; None for the
    commands whose messages name parameters on purpose (sweep: config keys)."""
    if command == "fit":
        flags = {p: "--" + o.replace("_", "-") for o, p in FIT_OPTIONS.items()}
        return {**flags, "device": "--device"}, _UNSET_HINTS["fit"]
    if command == "layer":
        return _LAYER_FLAGS, _UNSET_HINTS["layer"]
    return None


def _learner_parameters():
    from .estimators import MultiHeadAttentionRegressor

    return set(inspect.signature(MultiHeadAttentionRegressor).parameters)


def _in_flags(message, flags, hint=None):
    """A library message in the words of a command.

    ``name=value`` becomes ``--flag value`` and a bare ``name_with_underscores``
    becomes ``--flag`` for the parameters the command has a flag for (``flags``:
    parameter -> flag); the learner parameters it has none for are named as
    such, with ``hint``: where to set them.

    Examples
    --------
    >>> _in_flags('use input_distribution="gaussian".',
    ...           {"input_distribution": "--distribution"})
    'use --distribution gaussian.'
    >>> _in_flags("held_out=0.2 of 9 windows", {"held_out": "--held-out"})
    '--held-out 0.2 of 9 windows'
    >>> _in_flags("raise polish_max_iter.", {}, "set it in Python")
    'raise polish_max_iter. (polish_max_iter: a learner parameter that this command does not have; set it in Python)'
    """  # noqa: E501
    message = str(message)

    def assigned(match):
        value = match.group(2)
        if len(value) > 1 and value[0] in "'\"" and value[-1] == value[0]:
            value = value[1:-1]
        return f"{flags[match.group(1)]} {value}"

    if flags:
        names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
        message = re.sub(rf"(?<![\w-])({names})=({_VALUE})", assigned, message)
        bare = sorted((n for n in flags if "_" in n), key=len, reverse=True)
        if bare:
            pattern = "|".join(map(re.escape, bare))
            message = re.sub(
                rf"(?<![\w-])({pattern})\b", lambda m: flags[m.group(1)], message
            )
    if hint is None:
        return message
    unset = sorted(
        name
        for name in _learner_parameters() - set(flags)
        if re.search(
            rf"(?<![\w-]){re.escape(name)}" + ("\\b" if "_" in name else "="), message
        )
    )
    if unset:
        what = (
            "a learner parameter that this command does not have"
            if len(unset) == 1
            else "learner parameters that this command does not have"
        )
        message += f" ({', '.join(unset)}: {what}; {hint})"
    return message


def _error(message):
    """The ``SystemExit`` of bad input: one line ``skattn: error: ...``, status 1,
    in the words of the running command (its flags, :func:`_in_flags`)."""
    if _WORDS is not None:
        message = _in_flags(message, *_WORDS)
    return SystemExit("skattn: error: " + " ".join(str(message).split()))


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Warnings as one line each, without the source line that looks like a
    traceback, in the words of the running command (:func:`_in_flags`)."""
    stream = sys.stderr if file is None else file
    if _WORDS is not None:
        message = _in_flags(message, *_WORDS)
    text = " ".join(str(message).split())
    print(f"skattn: warning: {category.__name__}: {text}", file=stream)


def _number(kind, text, check, expected):
    """An argparse type: ``kind(text)`` when ``check`` holds, else argparse's error."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not check(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive_int(text):
    return _number(int, text, lambda v: v >= 1, "a positive integer")


def _non_negative_int(text):
    return _number(int, text, lambda v: v >= 0, "a non-negative integer")


def _positive_float(text):
    check = lambda v: math.isfinite(v) and v > 0  # noqa: E731
    return _number(float, text, check, "a positive number")


def _non_negative_float(text):
    check = lambda v: math.isfinite(v) and v >= 0  # noqa: E731
    return _number(float, text, check, "a non-negative number")


def _share(text):
    check = lambda v: math.isfinite(v) and 0 < v < 1  # noqa: E731
    return _number(float, text, check, "a number in (0, 1)")


def _n_heads(text):
    if text == "auto":
        return text
    return _number(int, text, lambda v: v >= 1, "a positive integer or 'auto'")


def _layer_path(text):
    if Path(text).suffix.lower() not in LAYER_FILE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"expected a file name ending in .npz (a NumPy archive) or .safetensors, "
            f"got {text!r}"
        )
    return text


def _regressor_defaults():
    """MultiHeadAttentionRegressor's defaults, written once (in its signature)."""
    from .estimators import MultiHeadAttentionRegressor

    signature = inspect.signature(MultiHeadAttentionRegressor)
    return {name: p.default for name, p in signature.parameters.items()}


def _progress_options(parser):
    """``--quiet`` and ``--verbose``, alike in ``skattn fit`` and ``skattn layer``:
    progress bars by default (``verbose`` 1), none with ``--quiet`` (0), one line
    per polish iteration too with ``--verbose`` (2)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--quiet",
        dest="verbose",
        action="store_const",
        const=0,
        default=1,
        help="no progress bars (by default each stage of the fit shows one)",
    )
    group.add_argument(
        "--verbose",
        dest="verbose",
        action="store_const",
        const=2,
        help="also one line per polish iteration",
    )


def _parser():
    parser = argparse.ArgumentParser(
        prog="skattn",
        description="Learn multi-head attention layers from examples.",
        formatter_class=_HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="plant a layer, sample, learn it back, print the recovery table",
        description="Plant a multi-head attention layer, sample examples, fit the "
        "phased learner and the gradient baseline, and print the recovery table.",
        formatter_class=_HelpFormatter,
    )
    demo.add_argument("--heads", type=_positive_int, default=2, help="heads m")
    demo.add_argument("--tokens", type=_positive_int, default=4, help="tokens k")
    demo.add_argument(
        "--features", type=_positive_int, default=8, help="features per token d"
    )
    demo.add_argument(
        "--outputs",
        type=_positive_int,
        default=None,
        help="output features per token d_out (default: 2d)",
    )
    demo.add_argument(
        "--samples", type=_positive_int, default=20000, help="training examples"
    )
    demo.add_argument(
        "--distribution",
        choices=["boolean", "gaussian"],
        default="boolean",
        help="distribution of the input tokens",
    )
    demo.add_argument(
        "--scale",
        type=_non_negative_float,
        default=2.0,
        help="attention scale ||Theta_i||_F of the planted heads",
    )
    demo.add_argument(
        "--noise", type=_non_negative_float, default=0.0, help="label noise std"
    )
    demo.add_argument(
        "--random-state",
        "--seed",
        dest="random_state",
        type=_non_negative_int,
        default=0,
        help="random seed (--seed: the same)",
    )
    demo.add_argument(
        "--no-gradient", action="store_true", help="skip the gradient baseline"
    )
    demo.add_argument(
        "--plot", metavar="FILE.png", help="save true vs learned attention patterns"
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    defaults = _regressor_defaults()
    fit = sub.add_parser(
        "fit",
        help="learn a layer from .npy/.npz arrays and save it",
        description="Fit MultiHeadAttentionRegressor to X and y read from .npy files "
        "(or one .npz holding arrays 'X' and 'y') and save the learned layer to an "
        ".npz file with the arrays attention, projection, key_bias, intercept and "
        "n_tokens (and head_rank with --head-rank); load it back with "
        "skattn.cli.load_layer(path), an AttentionLayer.",
        formatter_class=_HelpFormatter,
    )
    fit.add_argument("X", help="X.npy, or data.npz with arrays X and y")
    fit.add_argument("y", nargs="?", help="y.npy (omit when X is an .npz)")
    fit.add_argument(
        "--n-tokens",
        type=_positive_int,
        required=True,
        help="tokens per sequence k (X has k * d columns)",
    )
    fit.add_argument(
        "--n-heads",
        type=_n_heads,
        default=defaults["n_heads"],
        help="heads m: an integer, or 'auto' to select it",
    )
    fit.add_argument(
        "--distribution",
        choices=["boolean", "gaussian"],
        default=defaults["input_distribution"],
        help="'boolean' also checks that X is +-1; 'gaussian': any real X",
    )
    fit.add_argument(
        "--fit-intercept",
        action="store_true",
        help="also learn key biases u_i and an output intercept c",
    )
    fit.add_argument(
        "--head-rank",
        type=_positive_int,
        default=defaults["head_rank"],
        help="learn heads of this rank (the head dimension of a transformer); "
        "needs an integer --n-heads (default: full rank)",
    )
    fit.add_argument(
        "--init",
        choices=["auto", "phased", "random"],
        default=defaults["init"],
        help="where the polish starts: the phased estimate or random starts",
    )
    fit.add_argument(
        "--certify-tol",
        type=_positive_float,
        default=defaults["certify_tol"],
        help="relative residual certifying a row in the first round (raise it "
        "when too few rows certify)",
    )
    fit.add_argument(
        "--certify-tol-final",
        type=_positive_float,
        default=defaults["certify_tol_final"],
        help="certification tolerance of the last round",
    )
    fit.add_argument(
        "--polish-tol",
        type=_positive_float,
        default=defaults["polish_tol"],
        help="relative tolerance of the polish",
    )
    fit.add_argument(
        "--polish-max-iter",
        type=_positive_int,
        default=defaults["polish_max_iter"],
        help="iterations of the polish",
    )
    fit.add_argument(
        "--random-state",
        "--seed",
        dest="random_state",
        type=_non_negative_int,
        default=0,
        help="the learner's seed (--seed: the same)",
    )
    fit.add_argument(
        "--cache",
        metavar="DIR",
        default=None,
        help="where the fit keeps each finished stage, so that a run interrupted "
        "(killed, Ctrl-C) and started again with the same arguments resumes after "
        "the last (default: nothing is kept)",
    )
    fit.add_argument(
        "--out",
        type=_layer_path,
        default="layer.safetensors",
        help="output file, written under exactly this name (its folder created if "
        "missing): .safetensors, the format of skattn layer (written by skattn, no "
        "extra needed), or .npz, a NumPy archive; skattn.cli.load_layer reads both",
    )
    fit.add_argument(
        "--device",
        default=None,
        help="fit on this torch device (cuda, cuda:1, mps, cpu) through the array "
        "API, as skattn layer --device does (needs torch; sets SCIPY_ARRAY_API=1 "
        "for you). Default: numpy on the host",
    )
    _progress_options(fit)

    sweep = sub.add_parser(
        "sweep",
        help="run a grid of planted recoveries from a TOML config",
        description="Fit the config's learners on every cell of its grid (planted "
        "layer x n_samples x noise x seed) through joblib, on local processes or "
        "the config's Dask scheduler; append one row per fit to the config's "
        "output file (.csv or .parquet) and skip the cells already there. The "
        "config is checked, every learner's parameters and the planted layers "
        "included, before any fit. Exits with status 1 when a cell failed, "
        "printing each failed cell's reason. The config's keys: the user guide, "
        "'Experiments at scale'.",
        formatter_class=_HelpFormatter,
    )
    sweep.add_argument("config", help="CONFIG.toml")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")

    layer = sub.add_parser(
        "layer",
        help="learn a layer of a BERT-style, GPT-2, Llama, Mistral or Qwen2 model "
        "from your text files",
        description="Cut the text files into windows of --n-tokens tokens, compute "
        "the hidden states entering layer --layer of the checkpoint and that "
        "layer's attention output on them (the teacher), hold out a share of the "
        "windows, fit MultiHeadAttentionRegressor(fit_intercept=True, "
        "head_rank=<the model's head dimension>) on the others, and write into "
        "--out the learned layer (layer.safetensors: attention, projection, "
        "key_bias, intercept), a JSON report (report.json: held-out relative "
        "error, per-head errors and sharpness, time, peak memory, windows, the "
        "arguments) and with --plot real vs learned attention patterns "
        "(patterns.png). A GPT-2, Llama, Mistral or Qwen2 checkpoint is run by "
        "transformers' own model (pip install skattn[transformers]): windows of "
        "--n-tokens tokens without special tokens, the inputs and outputs of layer "
        "--layer's attention module, a causal (rotary, grouped-query) learner, and "
        "layer.safetensors in the checkpoint's own tensor names "
        "(model.load_state_dict(..., strict=False) loads it). Every input is "
        "checked before the model is loaded.",
        formatter_class=_HelpFormatter,
    )
    layer.add_argument(
        "checkpoint",
        nargs="?",
        help="folder of a BERT-style model: model.safetensors, config.json "
        "(model_type 'bert'), tokenizer.json (default: the packaged "
        "all-MiniLM-L6-v2); or of a decoder (model_type gpt2, llama, mistral, "
        "qwen2; model.safetensors or its shards)",
    )
    layer.add_argument(
        "--layer",
        type=_non_negative_int,
        required=True,
        help="the checkpoint's layer, from 0",
    )
    layer.add_argument(
        "--text",
        nargs="+",
        required=True,
        metavar="FILE",
        help="UTF-8 text files, tokenized by the model's tokenizer; a folder gives "
        "its .txt, .md, .rst and .py files (its whole tree), a quoted glob pattern "
        "its matches ('docs/**/*.rst')",
    )
    layer.add_argument(
        "--n-tokens",
        type=_positive_int,
        default=16,
        help="tokens per window, [CLS] and [SEP] included",
    )
    layer.add_argument(
        "--n-windows",
        type=_positive_int,
        default=None,
        help="windows to use, fit and held out together (a random subset; "
        "default: as many fitted as the count asks for with the search's margin, "
        "the rest of the text held out, up to 2000 beyond --held-out's share; "
        "every window when the text has fewer)",
    )
    layer.add_argument(
        "--held-out",
        type=_share,
        default=0.2,
        help="share of the windows held out for the error",
    )
    layer.add_argument(
        "--n-heads",
        type=_positive_int,
        default=None,
        help="learn the layer's first N heads (default: all of them)",
    )
    layer.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="folder to write into, created if missing (default: skattn-layer-L, "
        "L the layer)",
    )
    layer.add_argument(
        "--plot",
        action="store_true",
        help="also draw real vs learned attention patterns (needs matplotlib)",
    )
    layer.add_argument(
        "--random-state",
        "--seed",
        dest="random_state",
        type=_non_negative_int,
        default=0,
        help="which windows are used and held out, and the learner's seed (--seed: "
        "the same)",
    )
    layer.add_argument(
        "--cache",
        metavar="DIR",
        default=None,
        help="where the fit keeps each finished stage, so that a run interrupted "
        "(killed, Ctrl-C) and started again with the same arguments resumes after "
        "the last (default: OUT/cache)",
    )
    layer.add_argument(
        "--no-cache", action="store_true", help="keep no stage: a rerun starts over"
    )
    layer.add_argument(
        "--fit-anyway",
        action="store_true",
        help="fit even when the windows cannot pin some head (by default the "
        "command stops before the fit, naming the heads and the windows needed)",
    )
    layer.add_argument(
        "--device",
        default=None,
        help="fit on this torch device (cuda, cuda:1, mps, cpu) through the array "
        "API: the random-start path runs there (needs torch; sets SCIPY_ARRAY_API=1 "
        "for you). Default: numpy on the host",
    )
    _progress_options(layer)
    return parser


def _timed_fit(estimator, X, y, device=None):
    from .experiments._pipeline import _fit_on

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
    from .datasets import make_attention_layer, sample_inputs
    from .estimators import GradientAttentionRegressor, MultiHeadAttentionRegressor
    from .metrics import parameter_error, prediction_error
    from .phased import format_reports

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
        from .metrics import AttentionPatternDisplay

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
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(20, f"{str(folder)!r} is a file")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".skattn-probe-"):
            pass
    except OSError as exc:
        raise _error(
            f"{option} {path!r} cannot be written in {str(folder)!r} "
            f"({exc.strerror or exc}); choose another path."
        ) from exc


def _make_folder(path):
    """Create the folder of the output file ``path`` if it is missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def _atomic_write(path, write):
    """``write(file)`` into a temporary file of ``path``'s folder, renamed over
    ``path``: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_layer(layer, path):
    """Save a layer, or a fitted estimator's layer, to an ``.npz`` or a
    ``.safetensors`` file.

    An ``.npz`` file is a NumPy archive (no pickles) holding the arguments of
    :class:`~skattn.AttentionLayer`: ``attention`` (n_heads, d, d),
    ``projection`` (n_heads, d, d_out), ``key_bias`` (n_heads, d; zeros without
    biases), ``intercept`` (d_out,; zeros without), and ``n_tokens`` and
    ``head_rank`` (0-d integer arrays) when known.  A ``.safetensors`` file,
    the format ``skattn layer`` writes, holds the same four tensors (float64)
    and ``n_tokens`` and ``head_rank`` in its metadata, the same bytes for the
    same layer (:func:`write_safetensors`).  :func:`load_layer` reads both.  The
    file is written under exactly the given name, atomically (a temporary file
    renamed over it).  ``skattn fit`` writes its layer with this function.

    Parameters
    ----------
    layer : AttentionLayer or fitted estimator
        What to save (see :func:`skattn.layer.as_layer`).
    path : str or path-like
        The file to write; its name must end in ``.npz`` or ``.safetensors``.
        Overwritten if it exists.

    Returns
    -------
    path : pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If ``path`` ends otherwise, or its folder does not exist.

    See Also
    --------
    load_layer : read the file back.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> from skattn.cli import load_layer, save_layer
    >>> layer = AttentionLayer(np.zeros((1, 2, 2)), np.ones((1, 2, 3)), n_tokens=4)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = save_layer(layer, os.path.join(tmp, "layer.npz"))
    ...     with np.load(path) as data:
    ...         print(sorted(data.files))
    ...     print(load_layer(path).n_tokens)
    ...     path = save_layer(layer, os.path.join(tmp, "layer.safetensors"))
    ...     print(load_layer(path).n_tokens)
    ['attention', 'intercept', 'key_bias', 'n_tokens', 'projection']
    4
    4
    """
    from .layer import as_layer

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in LAYER_FILE_SUFFIXES:
        raise ValueError(
            f"path={str(path)!r} must end in .npz (a NumPy archive) or .safetensors; "
            f"the layer is saved under exactly the given name."
        )
    if not path.parent.is_dir():
        raise ValueError(
            f"path={str(path)!r}: the folder {str(path.parent)!r} does not exist; "
            f"create it first."
        )
    from .utils._array_api import to_numpy

    learned = as_layer(layer)
    attention, projection, key_bias, intercept, n_tokens = learned._arrays()
    arrays = {  # host copies of a layer fitted on a device
        "attention": to_numpy(attention),
        "projection": to_numpy(projection),
        "key_bias": to_numpy(key_bias),
        "intercept": to_numpy(intercept),
    }
    head_rank = learned.head_rank
    if head_rank is None:
        head_rank = getattr(layer, "head_rank", None)
    integers = {
        name: int(value)
        for name, value in (("n_tokens", n_tokens), ("head_rank", head_rank))
        if isinstance(value, Integral) and not isinstance(value, bool)
    }
    if suffix == ".safetensors":
        metadata = {"format": SAFETENSORS_FORMAT, **integers}
        return write_safetensors(path, arrays, metadata)
    arrays.update({name: np.asarray(value) for name, value in integers.items()})
    # a file object: np.savez appends no .npz to the name
    _atomic_write(path, lambda file: np.savez(file, **arrays))
    return path


def _file_int(value, name, path):
    """A layer file's ``n_tokens`` or ``head_rank`` (a 0-d integer array of an
    ``.npz``, a metadata string of a ``.safetensors``) as an int; None: absent."""
    if value is None:
        return None
    if isinstance(value, str):
        number = int(value) if value.strip().isdigit() else 0
    elif value.shape == () and value.dtype.kind in "iu":
        number = int(value)
    else:
        number = 0
    if number < 1:
        raise ValueError(
            f"{str(path)!r}: {name} must be a positive integer, got {value!r}."
        )
    return number


def _read_layer_file(path, expected):
    """``(arrays, n_tokens, head_rank)`` of a layer file, by its suffix; the
    errors name the file and ``expected``."""
    if path.suffix.lower() == ".safetensors":
        try:
            tensors, metadata = read_safetensors(path)
        except FileNotFoundError:
            raise
        except Exception as exc:  # untrusted bytes: any reader error is bad input
            raise ValueError(
                f"{str(path)!r} cannot be read as a .safetensors layer file "
                f"({type(exc).__name__}: {exc}); {expected}."
            ) from exc
        files = {"arrays": sorted(tensors), "metadata": metadata}
        get = metadata.get
    else:
        try:
            data = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise
        except Exception as exc:  # untrusted bytes: any reader error is bad input
            raise ValueError(
                f"{str(path)!r} cannot be read as a layer file ({type(exc).__name__}: "
                f"{exc}); {expected}."
            ) from exc
        if isinstance(data, np.ndarray):
            raise ValueError(f"{str(path)!r} holds a single array; {expected}.")
        with data:
            try:
                tensors = {n: data[n] for n in data.files if n in LAYER_FILE_ARRAYS}
            except Exception as exc:
                raise ValueError(
                    f"{str(path)!r} cannot be read as a layer file "
                    f"({type(exc).__name__}: {exc}); {expected}."
                ) from exc
            files = {"arrays": sorted(data.files)}
        get = tensors.get
    missing = [name for name in ("attention", "projection") if name not in tensors]
    if missing:
        raise ValueError(
            f"{str(path)!r} lacks the array(s) {missing} (it holds "
            f"{files['arrays']}); {expected}."
        )
    n_tokens = _file_int(get("n_tokens"), "n_tokens", path)
    head_rank = _file_int(get("head_rank"), "head_rank", path)
    return tensors, n_tokens, head_rank


def load_layer(path):
    """Read a layer saved by ``skattn fit``, ``skattn layer`` or :func:`save_layer`.

    Parameters
    ----------
    path : str or path-like
        An ``.npz`` file: arrays ``attention`` and ``projection``, and optionally
        ``key_bias``, ``intercept``, ``n_tokens`` and ``head_rank`` (loaded with
        ``allow_pickle=False``: nothing in the file can run code); or a
        ``.safetensors`` file (``skattn layer``'s ``layer.safetensors``): the
        same tensors, ``n_tokens`` and ``head_rank`` in its metadata (read by
        skattn itself: the ``safetensors`` extra is not needed).  See
        :func:`save_layer`.

    Returns
    -------
    layer : AttentionLayer
        The saved layer; its ``transform`` equals the fitted estimator's
        ``predict``.

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        If it is a folder, neither an ``.npz`` archive nor a ``.safetensors``
        file (random bytes, a pickle, a single ``.npy`` array), lacks
        ``attention`` or ``projection``, or holds arrays of shapes that do not
        make a layer; the message names the file.

    See Also
    --------
    save_layer : write such a file.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> from skattn import MultiHeadAttentionRegressor, make_attention_regression
    >>> from skattn.cli import load_layer, save_layer
    >>> X, y = make_attention_regression(500, 2, 3, 1, random_state=0)
    >>> est = MultiHeadAttentionRegressor(n_tokens=2).fit(X, y)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     layer = load_layer(save_layer(est, os.path.join(tmp, "layer.npz")))
    >>> bool(np.allclose(layer.transform(X), est.predict(X)))
    True
    """
    from .layer import AttentionLayer

    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{str(path)!r} is a folder, not a layer file (.npz or .safetensors)."
        )
    expected = (
        "expected the .npz archive that skattn fit or skattn.cli.save_layer writes "
        "(arrays attention, projection, key_bias, intercept, n_tokens), or the "
        ".safetensors file of skattn layer (tensors attention, projection, "
        "key_bias, intercept)"
    )
    arrays, n_tokens, head_rank = _read_layer_file(path, expected)
    layer = AttentionLayer(
        arrays["attention"],
        arrays["projection"],
        key_bias=arrays.get("key_bias"),
        intercept=arrays.get("intercept"),
        n_tokens=n_tokens,
        head_rank=head_rank,
    )
    try:
        layer._parameters()  # shapes and finiteness, now rather than at transform
    except ValueError as exc:
        raise ValueError(f"{str(path)!r} does not hold a valid layer: {exc}") from exc
    return layer


def _fit(args):
    from .estimators import MultiHeadAttentionRegressor

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
        from .experiments._pipeline import _check_device

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
    from .experiments._pipeline import _memory_record

    return _memory_record(learner)


def _cell_text(row):
    from .experiments._sweep import SETTING_COLUMNS

    return " ".join(f"{key}={row[key]}" for key in SETTING_COLUMNS)


def _sweep(args):
    from .experiments import load_sweep_config, recovery_sweep

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
    if args.command == "layer" and not args.no_cache:
        if args.cache is not None:
            return args.cache
        out = args.out if args.out is not None else f"skattn-layer-{args.layer}"
        return str(Path(out) / "cache")
    return None


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


def _layer(args):
    from .experiments import learn_layer

    out = args.out if args.out is not None else f"skattn-layer-{args.layer}"
    cache = _cache_of(args)
    result = learn_layer(
        args.checkpoint,
        layer=args.layer,
        texts=args.text,
        n_tokens=args.n_tokens,
        n_windows=args.n_windows,
        held_out=args.held_out,
        n_heads=args.n_heads,
        out=out,
        plot=args.plot,
        random_state=args.random_state,
        memory=cache,
        device=args.device,
        fit_anyway=args.fit_anyway,
        verbose=args.verbose,
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
    global _WORDS
    command = {"demo": _demo, "fit": _fit, "sweep": _sweep, "layer": _layer}
    command = command[args.command]
    words, _WORDS = _WORDS, _command_words(args.command)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return command(args)
        except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status 130
            raise _interrupted(args) from None
        except ValueError as exc:  # bad input that the library named
            raise _error(exc) from exc
        except (OSError, ImportError) as exc:  # a file, a folder, a missing extra
            raise _error(f"{type(exc).__name__}: {exc}") from exc
        finally:
            _WORDS = words
