"""The options of every ``skattn`` command (:func:`_parser`), and the flags of
the library parameters they set (``FIT_OPTIONS``, ``_LAYER_FLAGS``)."""

import argparse
import inspect
import math
from pathlib import Path

from ..layer._files import LAYER_FILE_SUFFIXES

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
    "layers": "--layers",
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


def _layers(text):
    """``0-3``, ``1,4`` or ``2``: the layers, as a sorted list."""
    layers = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            low = int(low)
            high = int(high) if high else low
            if low < 0 or high < low:
                raise ValueError
            layers.update(range(low, high + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected layers as 0-3, 1,4 or 2, got {text!r}"
        ) from None
    return sorted(layers)


def _layer_path(text):
    if Path(text).suffix.lower() not in LAYER_FILE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"expected a file name ending in .npz (a NumPy archive) or .safetensors, "
            f"got {text!r}"
        )
    return text


def _regressor_defaults():
    """MultiHeadAttentionRegressor's defaults, written once (in its signature)."""
    from ..estimators import MultiHeadAttentionRegressor

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
    _seed_option(
        demo,
        "random seed (--seed: the same)",
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
    _seed_option(
        fit,
        "the learner's seed (--seed: the same)",
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
        "--layer",
        type=_non_negative_int,
        required=True,
        help="the checkpoint's layer, from 0",
    )
    layer.add_argument(
        "--n-heads",
        type=_positive_int,
        default=None,
        help="learn the layer's first N heads (default: all of them)",
    )
    _checkpoint_options(
        layer,
        "skattn-layer-L, L the layer",
        "also draw real vs learned attention patterns (needs matplotlib)",
        "fit even when the windows cannot pin some head (by default the command "
        "stops before the fit, naming the heads and the windows needed)",
    )

    model = sub.add_parser(
        "model",
        help="learn every attention layer of a model from your text files, and "
        "compare the learned model with the original",
        description="Learn each attention layer of the checkpoint (all, or "
        "--layers) as skattn layer does, each from the original model's inputs to "
        "it on the same windows, each kept in the cache (a run interrupted and "
        "started again resumes at the layer and stage it reached); a layer whose "
        "heads the windows cannot pin is not fitted unless --fit-anyway. Then "
        "write into --out a folder per layer, the learned model (checkpoint/: "
        "the checkpoint's files with every learned attention in its own tensor "
        "names, loadable as the original is), and report.json; print the layer x "
        "head table and the comparison of the original and learned models on "
        "held-out windows (final hidden states; mean-pooled embeddings for "
        "encoders; next-token log-probabilities and perplexity for decoders), "
        "each layer replaced alone and all together.",
        formatter_class=_HelpFormatter,
    )
    model.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help="the layers to learn: 0-3, 1,4 or 2 (default: every one)",
    )
    _checkpoint_options(
        model,
        "skattn-model",
        "also draw the layer x head heatmap of held-out attention errors "
        "(encoders; needs matplotlib)",
        "fit the layers whose heads the windows cannot pin too (by default such "
        "a layer is not fitted: its row names the heads and the windows needed, "
        "and the learned model keeps its original attention)",
    )
    return parser


def _seed_option(parser, help):
    """``--random-state`` (alias ``--seed``): a non-negative integer, 0 by default."""
    parser.add_argument(
        "--random-state",
        "--seed",
        dest="random_state",
        type=_non_negative_int,
        default=0,
        help=help,
    )


def _checkpoint_options(parser, default_out, plot_help, anyway_help):
    """The options of the commands that learn from a checkpoint (``skattn layer``,
    ``skattn model``): the checkpoint, the text and its windows, the output
    folder, the seed, the cache, the device, the progress."""
    parser.add_argument(
        "checkpoint",
        nargs="?",
        help="folder of a BERT-style model: model.safetensors, config.json "
        "(model_type 'bert'), tokenizer.json (default: the packaged "
        "all-MiniLM-L6-v2); or of a decoder (model_type gpt2, llama, mistral, "
        "qwen2; model.safetensors or its shards)",
    )
    parser.add_argument(
        "--text",
        nargs="+",
        required=True,
        metavar="FILE",
        help="UTF-8 text files, tokenized by the model's tokenizer; a folder gives "
        "its .txt, .md, .rst and .py files (its whole tree), a quoted glob pattern "
        "its matches ('docs/**/*.rst')",
    )
    parser.add_argument(
        "--n-tokens",
        type=_positive_int,
        default=16,
        help="tokens per window, [CLS] and [SEP] included",
    )
    parser.add_argument(
        "--n-windows",
        type=_positive_int,
        default=None,
        help="windows to use, fit and held out together (a random subset; "
        "default: as many fitted as the count asks for with the search's margin, "
        "the rest of the text held out, up to 2000 beyond --held-out's share; "
        "every window when the text has fewer)",
    )
    parser.add_argument(
        "--held-out",
        type=_share,
        default=0.2,
        help="share of the windows held out for the error",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help=f"folder to write into, created if missing (default: {default_out})",
    )
    parser.add_argument(
        "--plot",
        action="store_true",
        help=plot_help,
    )
    _seed_option(
        parser,
        "which windows are used and held out, and the learner's seed (--seed: "
        "the same)",
    )
    parser.add_argument(
        "--cache",
        metavar="DIR",
        default=None,
        help="where the fit keeps each finished stage, so that a run interrupted "
        "(killed, Ctrl-C) and started again with the same arguments resumes after "
        "the last (default: OUT/cache)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="keep no stage: a rerun starts over"
    )
    parser.add_argument(
        "--fit-anyway",
        action="store_true",
        help=anyway_help,
    )
    parser.add_argument(
        "--device",
        default=None,
        help="fit on this torch device (cuda, cuda:1, mps, cpu) through the array "
        "API: the random-start path runs there (needs torch; sets SCIPY_ARRAY_API=1 "
        "for you). Default: numpy on the host",
    )
    _progress_options(parser)
