"""Learn one attention layer of a pretrained model from your own text.

Decoder checkpoints (GPT-2, Llama, Mistral, Qwen2) take another route, described
in :func:`learn_layer` and :mod:`skattn.experiments._decoder_layer`: their
examples come from transformers' own model, and the learned layer is written in
the checkpoint's own tensor names.  What follows is the BERT-style route.

:func:`learn_layer` (and ``skattn layer`` on the command line) reads a checkpoint
folder (``model.safetensors``, ``config.json``, ``tokenizer.json``; by default the
packaged all-MiniLM-L6-v2), cuts the given text files into windows of
``n_tokens`` tokens, computes the hidden states entering layer ``L`` with the
model's own encoder in numpy (:class:`skattn.datasets.BertEncoder`) and layer
``L``'s attention sub-layer on them as the teacher
(:func:`skattn.datasets.load_bert_attention`), holds out a share of the windows,
fits the phased learner with the settings of ``benchmarks/bench_minilm_teacher.py``
for real layers, and measures and writes what it learned.  Every argument, file
and folder is checked before the model is loaded, so bad input fails at once.
"""

import hashlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from numbers import Integral, Real
from pathlib import Path

import numpy as np
from sklearn.base import clone
from sklearn.utils import Bunch

from ..datasets import BertEncoder, load_bert_attention, minilm_checkpoint_path
from ..datasets._decoder_checkpoint import (
    attention_module,
    check_decoder_checkpoint,
    decoder_examples,
    module_ranks,
    write_decoder_layer,
)
from ..datasets._encoder import _load_tokenizer, _text_windows
from ..estimators import MultiHeadAttentionRegressor
from ..layer import AttentionLayer, as_layer
from ..layer._files import SAFETENSORS_FORMAT, write_safetensors
from ..layer._hf import ARCHITECTURES
from ..metrics import (
    AttentionPatternDisplay,
    attention_pattern_error,
    data_verdict,
    parameter_error,
    prediction_error,
    sharp_head_pinning,
    sharpness_profile,
)
from ..metrics._identifiability import describe_margin, describe_verdict
from ..solvers._checkpoints import StageMemory, _sha256
from ..solvers.stages._search import _BATCH_SIZE
from ..utils._array_api import scipy_array_api_ignored
from ..utils._optional import require
from ._decoder_layer import (
    _FIT_ANYWAY,
    _held_out_count,
    decoder_learner,
    decoder_measure,
    decoder_verdict,
    decoder_windows,
    load_back_error,
    model_tables_difference,
    prediction_gap,
    window_plan,
)

__all__ = ["learn_layer"]

# What learn_layer writes into ``out``: role -> file name.
LAYER_FILES = {
    "layer": "layer.safetensors",
    "report": "report.json",
    "plot": "patterns.png",
}
# The learned layer's tensors in layer.safetensors: AttentionLayer's arguments.
_LAYER_TENSORS = ("attention", "projection", "key_bias", "intercept")
# Heads drawn by the pattern plot (the first ones), and sequences it matches on.
_PLOT_HEADS = 4
_PLOT_SAMPLES = 500
_CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json")


def _check_int(value, name, low):
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {kind}, got {value!r}.")
    return int(value)


def _check_arguments(layer, n_tokens, n_windows, held_out, n_heads, plot, out):
    if isinstance(layer, bool) or not isinstance(layer, Integral) or layer < 0:
        raise ValueError(f"layer must be a non-negative integer, got {layer!r}.")
    _check_int(n_tokens, "n_tokens", 1)
    if n_tokens < 3:
        raise ValueError(
            f"n_tokens={n_tokens} leaves no room for text: a window is [CLS], at "
            f"least one token of text and [SEP]; use n_tokens >= 3."
        )
    if n_windows is not None:
        _check_int(n_windows, "n_windows", 2)
    if (
        isinstance(held_out, bool)
        or not isinstance(held_out, Real)
        or not 0 < held_out < 1
    ):
        raise ValueError(
            f"held_out must be a share of the windows in (0, 1), got {held_out!r}."
        )
    if n_heads is not None:
        _check_int(n_heads, "n_heads", 1)
    if plot and out is None:
        raise ValueError("plot=True needs out, the folder to write the figure in.")


def _check_device(device, estimator):
    """The ``torch.device`` to fit on (``None`` for numpy), checked before any
    work: torch installed, the device known and seen, the array API usable."""
    if device is None:
        return None
    if not isinstance(device, str):
        raise ValueError(
            f"device must be a torch device name such as 'cuda', 'cuda:1' or "
            f"'cpu', got {device!r}."
        )
    torch = require("torch", extra="torch", feature="Fitting on a device (device=)")
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"device={device!r} is not a torch device ({exc}); use e.g. 'cuda', "
            f"'cuda:1', 'mps' or 'cpu'."
        ) from None
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (where.index or 0) >= count:
            raise ValueError(
                f"device={device!r}: torch sees {count} CUDA device(s) here. Pass "
                f"another device, or leave device out to fit with numpy."
            )
    elif where.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}: torch sees no MPS device here.")
    elif where.type not in ("cpu", "cuda", "mps"):
        raise ValueError(
            f"device={device!r}: only 'cpu', 'cuda' and 'mps' devices are supported."
        )
    if scipy_array_api_ignored():
        raise ValueError(
            f"device={device!r} fits through scikit-learn's array API, which needs "
            f"SCIPY_ARRAY_API=1 set before scipy is imported; it is set, but scipy "
            f"was imported before (scipy reads it once, when imported). Set it "
            f"before Python starts: run 'SCIPY_ARRAY_API=1 python ...' (the skattn "
            f"command sets it itself)."
        )
    if os.environ.get("SCIPY_ARRAY_API") != "1":
        raise ValueError(
            f"device={device!r} fits through scikit-learn's array API, which needs "
            f"the environment variable SCIPY_ARRAY_API=1 set before scipy is "
            f"imported: run 'SCIPY_ARRAY_API=1 python ...' (the skattn command "
            f"sets it itself)."
        )
    if estimator is not None and not estimator.__sklearn_tags__().array_api_support:
        raise ValueError(
            f"device={device!r} needs a learner that supports the array API; "
            f"{type(estimator).__name__} computes in numpy. Use the default "
            f"learner (or a MultiHeadAttentionRegressor), or leave device out."
        )
    return where


def _fit_on(learner, X, y, device):
    """``learner.fit(X, y)``; on ``device`` (a torch device) as tensors there,
    under the array API dispatch."""
    if device is None:
        learner.fit(X, y)
        return
    import torch
    from sklearn import config_context

    with config_context(array_api_dispatch=True):
        learner.fit(torch.asarray(X, device=device), torch.asarray(y, device=device))


# The files a folder given as text contributes (its tree, sorted).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


def _expand_texts(texts):
    """The text files of ``texts``: files as given, a folder's files with a
    suffix of ``TEXT_SUFFIXES`` (its whole tree, sorted), and the matches of a
    glob pattern (``*``, ``?``, ``[...]``; ``**`` for any depth), sorted."""
    import glob

    files = []
    for entry in texts:
        path = Path(entry)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
            )
            if not found:
                raise ValueError(
                    f"text folder {str(path)!r} holds no text file (files ending "
                    f"in {', '.join(TEXT_SUFFIXES)})."
                )
            files.extend(found)
        elif not path.exists() and glob.has_magic(str(entry)):
            found = sorted(
                Path(p)
                for p in glob.glob(str(entry), recursive=True)
                if Path(p).is_file()
            )
            if not found:
                raise FileNotFoundError(f"no text file matches {str(entry)!r}.")
            files.extend(found)
        else:
            files.append(path)
    return files


def _read_texts(texts):
    """The contents of the text files (folders and glob patterns expanded, see
    :func:`_expand_texts`), each checked before anything else."""
    if isinstance(texts, str | os.PathLike):
        texts = [texts]
    if not texts:
        raise ValueError("texts is empty: give at least one text file.")
    texts = _expand_texts(texts)
    contents = []
    for path in texts:
        if not path.exists():
            raise FileNotFoundError(f"text file {str(path)!r} does not exist.")
        try:
            contents.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"text file {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}); give plain text files."
            ) from exc
        except OSError as exc:
            raise OSError(
                f"cannot read text file {str(path)!r}: {exc.strerror or exc}."
            ) from exc
    return texts, contents


def _check_out(out):
    """Refuse an output folder that cannot be made or written in, creating nothing.

    An existing folder gets a probe file; a missing one is checked in its nearest
    existing parent folder, and created only when the results are written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"out {str(out)!r} is a file; give a folder (created if missing)."
        )
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(20, f"{str(parent)!r} is a file")
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".skattn-probe-"):
            pass
    except OSError as exc:
        raise ValueError(
            f"out {str(out)!r} is not a folder skattn can write in "
            f"({exc.strerror or exc}); choose another folder."
        ) from exc
    return out


def _checkpoint(checkpoint):
    """``(folder, model file, config)`` of a BERT-style checkpoint, all checked."""
    if checkpoint is None:
        model = minilm_checkpoint_path()
        folder = model.parent
    else:
        folder = Path(checkpoint)
        if folder.is_file() and folder.suffix == ".safetensors":
            folder, model = folder.parent, folder
        elif not folder.is_dir():
            raise FileNotFoundError(
                f"checkpoint {str(checkpoint)!r} is not a folder; give the folder of "
                f"a BERT-style model holding {', '.join(_CHECKPOINT_FILES)}."
            )
        else:
            model = folder / "model.safetensors"
    missing = [
        name
        for name, path in zip(
            _CHECKPOINT_FILES,
            (model, folder / "config.json", folder / "tokenizer.json"),
            strict=True,
        )
        if not path.is_file()
    ]
    if missing:
        what = {
            "model.safetensors": "the weights (model.safetensors)",
            "config.json": "the architecture (config.json)",
            "tokenizer.json": "the tokenizer (tokenizer.json, saved by the "
            "tokenizers library or a Hugging Face fast tokenizer) to cut the text",
        }
        raise ValueError(
            f"checkpoint folder {str(folder)!r} lacks "
            f"{'; '.join(what[name] for name in missing)}; a checkpoint folder "
            f"holds {', '.join(_CHECKPOINT_FILES)}."
        )
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{folder / 'config.json'} cannot be read as JSON "
            f"({type(exc).__name__}: {exc})."
        ) from exc
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'config.json'} does not hold a JSON object.")
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    bert = model_type == "bert" or (
        model_type is None
        and bool(architectures)
        and all(str(a).startswith("Bert") for a in architectures)
    )
    if not bert:
        raise ValueError(
            f"unsupported architecture: {folder / 'config.json'} has model_type="
            f"{model_type!r} (architectures {architectures}); skattn runs the "
            f"text through a BERT encoder of its own (absolute positions from 0, "
            f"post-LayerNorm, GELU), so only BERT-style checkpoints (model_type "
            f"'bert': BERT, MiniLM, ...) and the decoders {list(ARCHITECTURES)} "
            f"are supported."
        )
    return folder, model, config


def _decoder_folder(checkpoint):
    """The folder of a decoder checkpoint (``config.json``'s ``model_type`` one
    of GPT-2, Llama, Mistral, Qwen2), else None (the BERT path checks the rest)."""
    if checkpoint is None:
        return None
    folder = Path(checkpoint)
    if folder.is_file() and folder.suffix == ".safetensors":
        folder = folder.parent
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("model_type") in ARCHITECTURES:
        return folder
    return None


def _learn_decoder(
    folder,
    *,
    layer,
    paths,
    contents,
    n_tokens,
    n_windows,
    held_out,
    n_heads,
    out,
    plot,
    estimator,
    random_state,
    device,
    fit_anyway,
    verbose,
    arguments,
    start,
    memory,
):
    """``learn_layer`` on a decoder checkpoint: transformers' own model gives
    the examples, the learner fits a causal (rotary, grouped) layer (its stages
    kept in ``memory``), and the layer is written in the checkpoint's own tensor
    names and loaded back."""
    checkpoint = check_decoder_checkpoint(folder, layer=layer, n_tokens=n_tokens)
    settings = checkpoint["settings"]
    if n_heads is not None and n_heads != settings["n_heads"]:
        raise ValueError(
            f"n_heads={n_heads}: a decoder layer is learned whole (its "
            f"{settings['n_heads']} query heads share key/value heads); leave "
            f"n_heads out."
        )
    if plot:
        raise ValueError(
            "plot=True: the pattern plot matches heads of position-free layers; "
            "a decoder layer has none to draw yet (leave plot out)."
        )
    require("tokenizers", extra="transformers", feature="Decoder checkpoints")
    require("transformers", extra="transformers", feature="Decoder checkpoints")
    ids, _ = decoder_windows(
        checkpoint["tokenizer"], paths, contents, n_tokens, n_windows, held_out
    )
    n_available = len(ids)
    intercept = bool(settings["biases"])
    count = decoder_verdict(1, n_tokens, settings, intercept)["count"]
    n_total, n_held, why = window_plan(
        n_available, n_windows, held_out, count["search_samples_needed"]
    )
    ids, fit, held = _sample_windows(ids, n_total, n_held, random_state)
    verdict = decoder_verdict(len(fit), n_tokens, settings, intercept)
    if not verdict["determined"] and not fit_anyway:
        raise UnidentifiableDataError(verdict["message"])
    if not verdict["determined"]:
        _say(verbose, _fitting_anyway(verdict["message"]))
    _say(
        verbose,
        f"layer {layer} of a {settings['architecture']} checkpoint: "
        f"{settings['n_heads']} query heads ({settings['n_kv_heads']} key/value) "
        f"of dimension {settings['head_dim']} to fit on {len(fit)} windows of "
        f"{n_tokens} tokens ({len(held)} held out) of the text's {n_available}: "
        f"{_why(why)}.",
    )

    # -- transformers' own model: the examples ------------------------------------
    X, y, model = decoder_examples(checkpoint, ids)
    _, module = attention_module(model, checkpoint)
    teacher = AttentionLayer.from_torch(module).set_params(n_tokens=n_tokens)
    tables = model_tables_difference(model, module, ids[held], settings, y[held])
    _say(verbose, f"layer {layer}'s attention inputs and outputs recorded.")

    # -- the fit ------------------------------------------------------------------
    if estimator is None:
        learner = decoder_learner(
            settings,
            n_tokens,
            random_state=random_state,
            verbose=verbose,
            memory=memory,
        )
    else:
        learner = clone(estimator)
    pieces = None if memory is None else _Pieces(memory, arguments)
    fit_start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit_on(learner, X[fit], y[fit].reshape(len(fit), -1), device)
    except KeyboardInterrupt:  # this piece's time, for the run that resumes it
        if pieces is not None:
            pieces.record(time.perf_counter() - fit_start)
        raise
    fit_seconds = time.perf_counter() - fit_start
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    _say(verbose, f"fitted in {fit_seconds:.1f} s; measuring.")
    learned = as_layer(learner, "estimator")
    report = decoder_measure(
        teacher, learned, X[fit], y[fit], X[held], y[held], verdict
    )
    report["rope_tables"] = {
        "teacher": None if settings["rope_theta"] is None else "float64",
        "model_float32_tables_relative_difference": tables,
    }
    # what the module holds of it: values cut to head_dim directions per group
    written = module_ranks(clone(learned), settings, X[fit])
    report["written_held_out_relative_error"] = prediction_gap(
        written, X[held], y[held]
    )
    files = {}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        files = {role: out / LAYER_FILES[role] for role in ("layer", "report")}
        tensors = write_decoder_layer(
            files["layer"], written, checkpoint, {"n_tokens": str(n_tokens)}
        )
        report["loaded_back_held_out_relative_error"] = load_back_error(
            model, checkpoint, tensors, ids[held], y[held]
        )
    report["certificate"] = None
    report.update(
        _run_record(
            fit_seconds=fit_seconds,
            resume=_resume_record(learner, pieces, fit_seconds),
            fit=fit,
            held=held,
            paths=paths,
            n_available=n_available,
            ids=ids,
            checkpoint={
                "folder": str(folder),
                "model_type": settings["architecture"],
                "n_layers": checkpoint["n_layers"],
                "n_heads": settings["n_heads"],
                "n_kv_heads": settings["n_kv_heads"],
                "n_features": settings["n_features"],
                "head_dim": settings["head_dim"],
                "rope_theta": settings["rope_theta"],
                "layer": layer,
                "heads_learned": list(range(settings["n_heads"])),
                "module": checkpoint["prefix"].rstrip("."),
            },
            learner=learner,
            device=device,
            caught=caught,
            files=files,
            arguments=arguments,
        )
    )
    report = _finish_report(report, files, start, verbose)
    return Bunch(
        report=report,
        estimator=learner,
        teacher=teacher,
        learned=learned,
        X_held_out=X[held].reshape(len(held), -1),
        y_held_out=y[held].reshape(len(held), -1),
        files=files,
    )


def _check_against_config(config, folder, layer, n_heads, n_tokens):
    """Layer, heads and window length against the checkpoint's config.json."""
    n_layers = config.get("num_hidden_layers")
    if isinstance(n_layers, Integral) and not layer < n_layers:
        raise ValueError(
            f"layer={layer}: the checkpoint {str(folder)!r} has {n_layers} "
            f"layers, numbered 0 to {n_layers - 1}."
        )
    heads = config.get("num_attention_heads")
    if isinstance(heads, Integral) and n_heads is not None and n_heads > heads:
        raise ValueError(
            f"n_heads={n_heads}: layer {layer} of the checkpoint has {heads} heads."
        )
    positions = config.get("max_position_embeddings")
    if isinstance(positions, Integral) and n_tokens > positions:
        raise ValueError(
            f"n_tokens={n_tokens} exceeds the checkpoint's position table "
            f"(max_position_embeddings={positions})."
        )


def _windows(texts, contents, tokenizer, n_tokens, n_windows, held_out):
    """Token-id windows ``[CLS] text [SEP]`` of the texts, and how many there are."""
    tok = _load_tokenizer(tokenizer)
    special = (tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"))
    if None in special:
        raise ValueError(
            f"the tokenizer {str(tokenizer)!r} has no [CLS] or [SEP] token: not a "
            f"BERT-style tokenizer."
        )
    encodings = tok.encode_batch(contents, add_special_tokens=False)
    tokens = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
    inner = n_tokens - 2
    available = int(sum(len(t) // inner for t in tokens))
    wanted = available if n_windows is None else n_windows
    if available < max(wanted, 2):
        per_file = ", ".join(
            f"{p.name}: {len(t)}" for p, t in zip(texts[:5], tokens, strict=False)
        ) + (", ..." if len(texts) > 5 else "")
        need = (
            f"n_windows={n_windows} asks for more"
            if n_windows is not None
            else "at least 2 are needed (one to fit, one to hold out)"
        )
        raise ValueError(
            f"the text is too short: {len(texts)} file(s) of {sum(map(len, tokens))} "
            f"tokens ({per_file}) make {available} windows of n_tokens={n_tokens} "
            f"([CLS], {inner} tokens of one file, [SEP]); {need}. Give more text, "
            f"or ask for fewer or shorter windows."
        )
    n_held = _held_out_count(held_out, wanted)
    return _text_windows([t for t in tokens if len(t)], n_tokens, special), n_held


def _why(why):
    """The first line's reason for the windows of :func:`window_plan`."""
    return "as asked" if why == "n_windows" else why


def _unpinned_heads(verdict):
    """The heads a pinning verdict finds unpinned, as a comma-separated list."""
    return ", ".join(str(h["head"]) for h in verdict["heads"] if not h["pinned"])


def _windows_to_pin(verdict, n_fit, n_windows):
    """The fit windows that the heads the verdict finds unpinned ask for (the
    counting bound's, from the rows these windows split), when the window count
    was left to the count (``n_windows`` None) and they ask for more; else
    None."""
    if verdict["determined"] or n_windows is not None:
        return None
    needed = [h["windows_needed"] for h in verdict["heads"] if not h["pinned"]]
    if not needed or None in needed or max(needed) <= n_fit:
        return None
    return int(max(needed))


def _sample_windows(ids, n_windows, n_held, random_state):
    """``(ids, fit, held)``: ``n_windows`` of the windows ``ids`` (all when None)
    drawn at random, kept in text order, and ``n_held`` of them held out."""
    rng = np.random.default_rng(random_state)
    n_available = len(ids)
    n_total = n_available if n_windows is None else n_windows
    ids = ids[np.sort(rng.choice(n_available, size=n_total, replace=False))]
    order = rng.permutation(n_total)
    return ids, np.sort(order[n_held:]), np.sort(order[:n_held])


def _peak_memory_mb():
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _jsonable(value):
    """Plain JSON values: numpy scalars and arrays to lists, non-finite to None."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | np.ndarray):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.bool_ | bool):
        return bool(value)
    if isinstance(value, np.integer | Integral):
        return int(value)
    if isinstance(value, np.floating | Real):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return str(value)
    return value


def _profile_rows(profile, order=None):
    """Per head, the sharpness profile as a dict (heads in ``order``)."""
    order = range(len(profile.median_largest_weight)) if order is None else order
    return [
        {
            "median_largest_weight": profile.median_largest_weight[j],
            "sharp_share": profile.sharp_share[j],
            "margin_quantiles": dict(
                zip(
                    (f"{q:g}" for q in profile.quantiles),
                    profile.margin_quantiles[j],
                    strict=True,
                )
            ),
        }
        for j in order
    ]


def _certificate_summary(cert):
    return {
        "verdict": cert.verdict,
        "train_residual": cert.train_residual,
        "exact": cert.exact,
        "jacobian_rank": cert.jacobian_rank,
        "n_parameters": cert.n_parameters,
        "null_dimension": cert.null_dimension,
        "held_out_error": cert.held_out_error,
        "held_out_interval": cert.held_out_interval,
        "redundant_heads": list(cert.redundant_heads),
        "conditions_failed": list(cert.conditions.failed),
        "sharp_head_verdicts": list(cert.sharp_head_verdicts),
        "text": str(cert),
    }


def _run_record(
    *,
    fit_seconds,
    resume,
    fit,
    held,
    paths,
    n_available,
    ids,
    checkpoint,
    learner,
    device,
    caught,
    files,
    arguments,
):
    """The report's record of a run, the same for every checkpoint: time, memory,
    windows, text, the checkpoint's facts, the learner, its warnings, files and
    the arguments."""
    return {
        "fit_seconds": fit_seconds,
        "resume": resume,
        "peak_memory_mb": _peak_memory_mb(),
        "n_windows_fit": len(fit),
        "n_windows_held_out": len(held),
        "text": {
            "files": [str(p) for p in paths],
            "n_windows_available": n_available,
            "n_distinct_windows_fit": len(np.unique(ids[fit], axis=0)),
        },
        "checkpoint": checkpoint,
        "estimator": repr(learner),
        "device": None if device is None else str(device),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "files": {role: str(path) for role, path in files.items()},
        "arguments": arguments,
    }


def _finish_report(report, files, start, verbose):
    """The report with its total time, as JSON values, written to
    ``files["report"]`` when there is one, and its held-out error said."""
    report["total_seconds"] = time.perf_counter() - start
    report = _jsonable(report)
    if "report" in files:
        files["report"].write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    _say(verbose, f"held-out relative error {report['held_out_relative_error']}.")
    return report


def _say(verbose, message):
    if verbose:
        print(f"skattn layer: {message}", file=sys.stderr, flush=True)


def learn_layer(
    checkpoint=None,
    *,
    layer,
    texts,
    n_tokens=16,
    n_windows=None,
    held_out=0.2,
    n_heads=None,
    out=None,
    plot=False,
    estimator=None,
    random_state=0,
    memory=None,
    device=None,
    fit_anyway=False,
    verbose=0,
):
    """Learn layer L of a BERT-style model back from its behaviour on your text.

    The text files are tokenized by the model's tokenizer and cut into
    consecutive, non-overlapping windows ``[CLS]``, ``n_tokens - 2`` tokens of
    one file, ``[SEP]`` (the last incomplete window of a file is dropped).  Each
    window runs alone through the model's encoder in numpy (positions ``0, ...,
    n_tokens - 1``, no padding, no mask, float64); the hidden states entering
    layer ``layer`` are the inputs X, and the layer's attention sub-layer
    (self-attention and output dense with all their biases, before the residual
    and LayerNorm), restricted to its first ``n_heads`` heads, gives the targets
    y.  A random share ``held_out`` of the windows is held out; the others fit
    ``MultiHeadAttentionRegressor(n_heads=n_heads, n_tokens=n_tokens,
    fit_intercept=True, head_rank=<the model's head dimension>)`` (the settings
    of ``benchmarks/bench_minilm_teacher.py`` for real layers).

    Everything is checked before the model is loaded: the arguments, the text
    files, the output folder, the plotting extra, the checkpoint's files, its
    architecture, the layer and heads it has, and that the text makes enough
    windows.

    **Decoders.** A checkpoint whose ``config.json`` has ``model_type``
    ``"gpt2"``, ``"llama"``, ``"mistral"`` or ``"qwen2"`` is checked from its
    config and the safetensors headers alone
    (:func:`skattn.datasets._decoder_checkpoint.check_decoder_checkpoint`:
    sliding windows, RoPE scalings, partial rotary factors, soft-capping,
    cross-attention, query/key norms, attention sinks, missing or misshapen
    tensors are one-line errors), then run by transformers' own model
    (``AutoModelForCausalLM``, float64, needs ``pip install
    "skattn[transformers]"``): windows of ``n_tokens`` consecutive tokens (no
    special tokens, positions from 0), X the inputs of layer ``layer``'s
    attention module (after ``input_layernorm`` / ``ln_1``), y its outputs
    (``o_proj`` / ``c_proj`` and biases included, before the residual), the
    RoPE tables handed to it in float64 (transformers builds them in float32:
    ``report["rope_tables"]`` says by how much that changes the outputs).  The
    learner is ``MultiHeadAttentionRegressor(causal=True, rope=..., n_kv_heads=...,
    head_rank=<head_dim>, fit_intercept=<the module has biases>)``
    (:func:`~skattn.experiments._decoder_layer.decoder_learner`); the pre-fit
    verdict is the count of output values against the layer's unknowns
    (:func:`~skattn.experiments._decoder_layer.decoder_verdict`).  ``out``
    receives ``layer.safetensors`` in the checkpoint's own tensor names
    (``model.layers.L.self_attn.q_proj.weight``, ..., GPT-2's
    ``transformer.h.L.attn.c_attn.weight``, ...; ``model.load_state_dict(
    tensors, strict=False)`` loads it), which is loaded back into the model:
    ``report["loaded_back_held_out_relative_error"]``.  ``n_heads`` and
    ``plot`` do not apply (the layer is learned whole); ``memory`` keeps the
    decoder learner's stages as it keeps an encoder's.

    Parameters
    ----------
    checkpoint : str or path-like, default=None
        A folder holding ``model.safetensors``, ``config.json`` (``model_type``
        ``"bert"``) and ``tokenizer.json``, or the ``.safetensors`` file of such
        a folder; ``None``: the packaged all-MiniLM-L6-v2
        (:func:`skattn.datasets.minilm_checkpoint_path`).  Or a decoder's
        folder (above).
    layer : int
        The encoder layer to learn, from 0.
    texts : str, path-like or sequence of them
        UTF-8 text files; a folder gives its files ending in ``.txt``, ``.md``,
        ``.rst`` or ``.py`` (its whole tree, sorted), a glob pattern (``*``,
        ``?``, ``[...]``, ``**`` for any depth) its matching files.
    n_tokens : int, default=16
        Tokens per window, ``[CLS]`` and ``[SEP]`` included (at least 3).
    n_windows : int, default=None
        Windows to use, fit and held out together: a random subset of all the
        windows of the text (an error when the text has fewer).  ``None``: the
        fit takes as many as the count asks for with the search's margin
        (``search_samples_needed`` of :func:`skattn.metrics.data_verdict`; for an
        encoder, more where its sharp heads' split rows ask for more) and the
        rest of the text is held out (at most
        :data:`~skattn.experiments._decoder_layer.MAX_HELD_OUT` beyond the
        ``held_out`` share), so that more text does not make the fit slower;
        every window when the text has fewer (:func:`~skattn.experiments.
        _decoder_layer.window_plan`).  The first line says which.
    held_out : float, default=0.2
        Share of the windows held out for the error, in ``(0, 1)`` (with
        ``n_windows=None`` and more text than the fit needs, at least that
        share).
    n_heads : int, default=None
        Learn the layer restricted to its first ``n_heads`` heads (the teacher
        is then their outputs plus the layer's output bias); ``None``: all.
    out : str or path-like, default=None
        Folder to write into (created if missing): the learned layer
        (``layer.safetensors``: tensors ``attention``, ``projection``,
        ``key_bias``, ``intercept``, the arguments of
        :class:`~skattn.AttentionLayer`), the report (``report.json``) and with
        ``plot`` the figure (``patterns.png``); ``None``: nothing is written.
    plot : bool, default=False
        Draw real (top) against learned (bottom) attention patterns of the first
        heads on a held-out window (:class:`~skattn.metrics.AttentionPatternDisplay`;
        needs matplotlib, ``pip install "skattn[plot]"``, and ``out``).
    estimator : estimator, default=None
        Fit a clone of this instead (any skattn regressor; it is fitted on X of
        shape ``(n_windows, n_tokens, n_features)``); ``None``: the default above.
        Its ``certificate_``, when it has one (``certificate=True``), is
        summarised in the report.
    random_state : int, default=0
        Which windows are used and held out, and the learner's seed.
    memory : str, joblib.Memory or None, default=None
        The default learner's ``memory``: where it keeps each finished stage, so
        that a fit interrupted (killed, Ctrl-C) and run again with the same
        arguments resumes after the last one (``skattn layer`` keeps them in
        ``<out>/cache`` unless ``--no-cache``).  The teacher's examples (hidden
        states and outputs) are kept there too, keyed by the windows' token ids
        and the checkpoint's bytes, so that a run with another number of threads
        (whose floats round otherwise) still resumes.
    device : str or None, default=None
        A torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``, ``"mps"``) to fit
        on: the windows become torch tensors there and the learner fits them
        under ``sklearn.config_context(array_api_dispatch=True)`` (the user
        guide's *On a GPU*: the random-start path on the device, the phases on
        host copies).  Needs torch (``pip install "skattn[torch]"``), a learner
        that supports the array API (the default does), and the environment
        variable ``SCIPY_ARRAY_API=1`` set before scipy was imported (``skattn
        layer --device`` sets it for you).  ``None``: numpy on the host.
    fit_anyway : bool, default=False
        Before the fit, the windows are counted against what the layer's heads
        need (:func:`skattn.metrics.data_verdict`, and per head the rows that
        split the teacher's attention against the counting bound of
        :func:`skattn.metrics.sharp_head_pinning`).  When some head cannot be
        pinned by them, ``learn_layer`` raises at once, naming the heads and
        about how many windows would pin them; ``fit_anyway=True`` fits anyway,
        and the report says which heads this data does not pin.  Windows that
        pass the count with less room than the search from random starts needs
        (``search_samples_needed`` of :func:`skattn.metrics.data_verdict`) are
        fitted, and said first (the report's ``verdict["margin"]``).
    verbose : int, default=0
        Print each step to stderr when positive, and pass it to the learner
        (a progress bar per stage; from 2, one line per polish iteration).

    Returns
    -------
    result : sklearn.utils.Bunch
        report : dict
            What ``report.json`` holds: ``held_out_relative_error``,
            ``train_relative_error``, ``attention_pattern_error``,
            ``parameter_errors`` (head-matched, on the directions the held-out
            hidden states reach), ``heads`` (per real head: the matched learned
            head, its errors and both heads' sharpness,
            :func:`skattn.metrics.sharpness_profile`), ``certificate`` (the
            summary of the learner's ``certificate_``, else ``None``),
            ``device`` (the torch device fitted on, else ``None``),
            ``verdict`` (what the windows pin, counted before the fit: per
            head its split rows, those the counting bound asks for, the
            windows that would pin it, and after the fit ``exact``, ``not
            converged`` or ``not pinned by this data``; ``summary``, e.g.
            ``"10 exact, 2 not pinned by this data"``),
            ``fit_seconds`` (this run's fit), ``resume`` (with ``memory``:
            ``stages_reused`` and ``stages_computed`` by this run, the ``cache``
            folder, ``earlier_pieces_seconds`` of the runs interrupted by
            Ctrl-C before it and ``fit_seconds_all_pieces``, their sum with
            this run's, or for a finished fit run again the earlier run's
            total with this run's, and a ``note`` saying which; else
            ``None``), ``total_seconds``, ``peak_memory_mb``,
            ``n_windows_fit``, ``n_windows_held_out``, ``text``, ``checkpoint``,
            ``estimator``, ``warnings``, ``files`` and ``arguments``.
            Non-finite numbers are ``None``.
        estimator : estimator
            The fitted learner.
        teacher : AttentionLayer
            The real layer (its first ``n_heads`` heads).
        learned : AttentionLayer
            The learned layer.
        X_held_out, y_held_out : ndarray
            The held-out windows' hidden states ``(n, n_tokens * n_features)``
            and the teacher's outputs on them.
        files : dict
            Paths written: ``"layer"``, ``"report"`` and ``"plot"`` (those
            written).

    Raises
    ------
    FileNotFoundError
        If a text file or the checkpoint folder does not exist.
    ValueError
        On a bad argument; an output folder that cannot be written; a checkpoint
        folder lacking a file, of another architecture than BERT's, or without
        that layer or that many heads; text too short for the windows asked; a
        device that torch does not know or does not see, or asked without
        ``SCIPY_ARRAY_API=1``.
    ImportError
        If ``tokenizers`` or ``safetensors`` (``pip install "skattn[pretrained]"``),
        with ``plot`` matplotlib (``skattn[plot]``), or with ``device`` torch
        (``skattn[torch]``) is missing; for a decoder checkpoint, torch,
        transformers or tokenizers (``pip install "skattn[transformers]"``).

    See Also
    --------
    skattn.datasets.load_bert_hidden_states : the same teacher on the standard
        library's docstrings.

    Examples
    --------
    A tiny, fast run (a few windows, one head, a learner capped at a few
    iterations: the error says nothing about what a real run reaches; so few
    windows cannot pin a head, hence ``fit_anyway``):

    >>> import tempfile
    >>> from pathlib import Path
    >>> import safetensors, tokenizers  # the pretrained extra
    >>> from skattn import MultiHeadAttentionRegressor
    >>> from skattn.experiments import learn_layer
    >>> learner = MultiHeadAttentionRegressor(
    ...     n_heads=1, fit_intercept=True, head_rank=32, init="random",
    ...     polish_max_iter=2, start_search="none", random_state=0)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     text = Path(tmp, "text.txt")
    ...     _ = text.write_text("The cat sat on the mat. " * 40)
    ...     result = learn_layer(layer=2, texts=[text], n_tokens=8, n_heads=1,
    ...                          estimator=learner, out=Path(tmp, "out"),
    ...                          fit_anyway=True)
    ...     written = sorted(p.name for p in Path(tmp, "out").iterdir())
    >>> result.report["n_windows_fit"], result.report["n_windows_held_out"]
    (37, 9)
    >>> result.report["verdict"]["summary"]
    '1 not pinned by this data'
    >>> written
    ['layer.safetensors', 'report.json']
    """
    start = time.perf_counter()
    arguments = {
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "layer": layer,
        "texts": (
            [str(texts)]
            if isinstance(texts, str | os.PathLike)
            else [str(t) for t in texts]
        ),
        "n_tokens": n_tokens,
        "n_windows": n_windows,
        "held_out": held_out,
        "n_heads": n_heads,
        "out": None if out is None else str(out),
        "plot": bool(plot),
        "estimator": None if estimator is None else repr(estimator),
        "random_state": random_state,
        "device": None if device is None else str(device),
        "fit_anyway": bool(fit_anyway),
    }
    # -- every check, before the model is loaded --------------------------------
    _check_arguments(layer, n_tokens, n_windows, held_out, n_heads, plot, out)
    device = _check_device(device, estimator)
    paths, contents = _read_texts(texts)
    if out is not None:
        out = _check_out(out)
    if plot:
        require("matplotlib", extra="plot", feature="The pattern plot (plot=True)")
    decoder = _decoder_folder(checkpoint)
    if decoder is not None:
        return _learn_decoder(
            decoder,
            layer=layer,
            paths=paths,
            contents=contents,
            n_tokens=n_tokens,
            n_windows=n_windows,
            held_out=held_out,
            n_heads=n_heads,
            out=out,
            plot=plot,
            estimator=estimator,
            random_state=random_state,
            device=device,
            fit_anyway=fit_anyway,
            verbose=verbose,
            arguments=arguments,
            start=start,
            memory=memory,
        )
    folder, model, config = _checkpoint(checkpoint)
    _check_against_config(config, folder, layer, n_heads, n_tokens)
    require("safetensors.numpy", extra="pretrained", feature="Reading checkpoints")
    all_ids, _ = _windows(
        paths, contents, folder / "tokenizer.json", n_tokens, n_windows, held_out
    )
    n_available = len(all_ids)
    d_model = int(config["hidden_size"])
    n_fit_heads = int(config["num_attention_heads"]) if n_heads is None else n_heads
    rank = d_model // int(config["num_attention_heads"])
    count = data_verdict(1, n_tokens, d_model + 1, d_model, n_fit_heads, head_rank=rank)
    n_total, n_held, why = window_plan(
        n_available, n_windows, held_out, count["search_samples_needed"]
    )
    ids, fit, held = _sample_windows(all_ids, n_total, n_held, random_state)
    _say(
        verbose,
        f"layer {layer}: {n_fit_heads} head(s) of rank {rank} to fit on "
        f"{len(fit)} windows of {n_tokens} tokens ({len(held)} held out) of the "
        f"{n_available} of {len(paths)} text file(s): {_why(why)}; roughly "
        f"{_rough_minutes(len(fit), n_fit_heads, n_tokens, d_model, rank)}.",
    )

    # -- the teacher and its examples -------------------------------------------
    encoder, teacher = _teacher(model, layer, n_heads, n_tokens)
    n_heads = teacher.n_heads
    head_dim = encoder.n_features // encoder.n_heads
    X3, y, reused = _examples(encoder, teacher, ids, layer, memory, model)
    X = X3.reshape(len(ids), -1)
    _say(
        verbose,
        f"hidden states entering layer {layer} "
        + ("read back from the cache." if reused else "computed."),
    )

    # -- what these windows can pin, before the long fit ---------------------------
    verdict = _pinning_verdict(teacher, X3[fit], head_dim, n_tokens, layer)
    more = _windows_to_pin(verdict, len(fit), n_windows)
    if more is not None:  # the text has the windows that a sharp head asks for
        n_total, n_held, why = window_plan(n_available, None, held_out, more)
        if n_total - n_held > len(fit):
            ids, fit, held = _sample_windows(all_ids, n_total, n_held, random_state)
            _say(
                verbose,
                f"layer {layer}: the windows split too few rows of head(s) "
                f"{_unpinned_heads(verdict)}: fitting on {len(fit)} windows "
                f"({len(held)} held out) of the text's {n_available}.",
            )
            X3, y, reused = _examples(encoder, teacher, ids, layer, memory, model)
            X = X3.reshape(len(ids), -1)
            verdict = _pinning_verdict(teacher, X3[fit], head_dim, n_tokens, layer)
    if not verdict["determined"] and not fit_anyway:
        raise UnidentifiableDataError(verdict["message"])
    if not verdict["determined"]:  # fit_anyway
        _say(verbose, _fitting_anyway(verdict["message"]))
    elif verdict["margin"]:  # a thin margin: said, not stopped (a measured rule)
        _say(verbose, verdict["margin"])

    # -- the fit ------------------------------------------------------------------
    if estimator is None:
        learner = MultiHeadAttentionRegressor(
            n_heads=n_heads,
            n_tokens=n_tokens,
            fit_intercept=True,
            head_rank=head_dim,
            random_state=random_state,
            memory=None if memory is None else str(memory),
            verbose=verbose,
        )
        X_fit = X[fit]
    else:
        learner = clone(estimator)
        X_fit = X3[fit]
    pieces = None if memory is None else _Pieces(memory, arguments)
    fit_start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit_on(learner, X_fit, y[fit], device)
    except KeyboardInterrupt:  # this piece's time, for the run that resumes it
        if pieces is not None:
            pieces.record(time.perf_counter() - fit_start)
        raise
    fit_seconds = time.perf_counter() - fit_start
    for w in caught:  # shown after all, and recorded in the report
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    _say(verbose, f"fitted in {fit_seconds:.1f} s; measuring.")

    # -- what it learned, and the files -------------------------------------------
    learned = as_layer(learner, "estimator")
    X_held, y_held = X[held], y[held]
    report = _measure(teacher, learned, X[fit], X_held)
    report["verdict"] = _final_verdicts(verdict, report)
    cert = getattr(learner, "certificate_", None)
    report["certificate"] = None if cert is None else _certificate_summary(cert)
    files = {}
    if out is not None:
        files = {role: out / LAYER_FILES[role] for role in ("layer", "report")}
        if plot:
            files["plot"] = out / LAYER_FILES["plot"]
    report.update(
        _run_record(
            fit_seconds=fit_seconds,
            resume=_resume_record(learner, pieces, fit_seconds),
            fit=fit,
            held=held,
            paths=paths,
            n_available=n_available,
            ids=ids,
            checkpoint={
                "folder": str(folder),
                "model_type": config.get("model_type"),
                "n_layers": encoder.n_layers,
                "n_heads": encoder.n_heads,
                "n_features": encoder.n_features,
                "head_dim": head_dim,
                "layer": layer,
                "heads_learned": list(range(n_heads)),
            },
            learner=learner,
            device=device,
            caught=caught,
            files=files,
            arguments=arguments,
        )
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _write_layer(learned, files["layer"], n_tokens, layer, folder)
        if plot:
            _plot(teacher, learned, X_held, files["plot"], layer)
    report = _finish_report(report, files, start, verbose)
    return Bunch(
        report=report,
        estimator=learner,
        teacher=teacher,
        learned=learned,
        X_held_out=X_held,
        y_held_out=y_held,
        files=files,
    )


class _Pieces:
    """The fit seconds of the runs of one ``learn_layer`` call, kept in the
    memory folder (``skattn-layer-pieces.json``): those interrupted by Ctrl-C,
    so that the run that resumes them reports the time of all the pieces, and
    the total of the last run that finished, for a later run that reuses its
    stages.  A killed run records nothing."""

    FILE = "skattn-layer-pieces.json"

    def __init__(self, memory, arguments):
        self.path = Path(str(memory)) / self.FILE
        same = {k: v for k, v in arguments.items() if k not in ("out", "plot")}
        text = json.dumps(same, sort_keys=True, default=str)
        self.key = hashlib.sha256(text.encode()).hexdigest()[:16]

    def _read(self):
        try:
            ledger = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: start afresh
            return {}
        return ledger if isinstance(ledger, dict) else {}

    def _entry(self, ledger):
        entry = ledger.get(self.key)
        if not isinstance(entry, dict):
            entry = {}
        interrupted = entry.get("interrupted")
        finished = entry.get("finished")
        return {
            "interrupted": [
                float(x) for x in interrupted or [] if isinstance(x, int | float)
            ],
            "finished": float(finished) if isinstance(finished, int | float) else None,
        }

    def _update(self, change):
        """Apply ``change`` to this call's entry and write the ledger back (an
        interruption or a finished fit must not fail on its bookkeeping)."""
        try:
            ledger = self._read()
            entry = self._entry(ledger)
            change(entry)
            ledger[self.key] = entry
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass

    def record(self, seconds):
        """Add an interrupted piece of ``seconds``."""
        self._update(lambda entry: entry["interrupted"].append(round(seconds, 3)))

    def earlier(self):
        """``(interrupted pieces before this run, last finished total or None)``."""
        entry = self._entry(self._read())
        return entry["interrupted"], entry["finished"]

    def finish(self, total):
        """This run finished: forget the pieces, keep ``total``."""

        def change(entry):
            entry["interrupted"], entry["finished"] = [], round(total, 3)

        self._update(change)


def _memory_record(learner):
    """The learner's ``info["memory"]`` (stages reused and computed), or None."""
    for phase in reversed(getattr(learner, "phase_report_", None) or []):
        kept = getattr(phase, "info", {}).get("memory")
        if kept:
            return kept
    return None


def _resume_record(learner, pieces, fit_seconds):
    """``report["resume"]``: what this run reused and the time of all pieces."""
    kept = _memory_record(learner)
    if pieces is None and kept is None:
        return None
    earlier, finished = ([], None) if pieces is None else pieces.earlier()
    reused = 0 if kept is None else len(kept.get("reused", []))
    computed = 0 if kept is None else len(kept.get("computed", []))
    record = {
        "cache": None if kept is None else kept.get("folder"),
        "stages_reused": reused,
        "stages_computed": computed,
        "earlier_pieces_seconds": earlier,
        "fit_seconds_all_pieces": sum(earlier) + fit_seconds,
    }
    if reused and not earlier:
        if finished is not None:  # a finished fit run again: its stages read back
            record["fit_seconds_all_pieces"] = finished + fit_seconds
            record["note"] = (
                f"the stages reused were computed by an earlier run of the same "
                f"arguments that took {finished:.1f} s in all, counted here"
            )
        else:
            record["note"] = (
                "stages were reused from a run whose time is not recorded (killed "
                "before it finished): fit_seconds_all_pieces counts this run only"
            )
    if pieces is not None:
        total = record["fit_seconds_all_pieces"]
        pieces.finish(total if computed or finished is None else finished)
    return record


def _teacher(model, layer, n_heads, n_tokens):
    """The encoder and layer ``layer``'s attention restricted to its first heads."""
    encoder = BertEncoder.from_safetensors(model)
    layer = encoder._check_layer(layer, attention=True)
    n_heads = encoder.n_heads if n_heads is None else n_heads
    if n_heads > encoder.n_heads:
        raise ValueError(
            f"n_heads={n_heads}: layer {layer} of {model} has {encoder.n_heads} heads."
        )
    full, _ = load_bert_attention(
        model, layer=layer, n_heads=encoder.n_heads, n_tokens=n_tokens
    )
    heads = np.arange(n_heads)
    teacher = AttentionLayer(
        full.attention[heads],
        full.projection[heads],
        key_bias=full.key_bias[heads],
        intercept=full.intercept,
        n_tokens=n_tokens,
    )
    return encoder, teacher


def _examples(encoder, teacher, ids, layer, memory, model):
    """``(X3, y, reused)``: the hidden states entering ``layer`` (windows x k x d),
    the layer's outputs, and whether they were read back from ``memory``.

    Kept in ``memory`` under a key of what decides them exactly (the windows'
    token ids, the checkpoint's bytes, the layer, the heads), not of the floats:
    the encoder's products round differently with another number of threads, and
    the fit's stages, keyed by ``X`` and ``y``, would then all be missed; read
    back, the examples are the first run's to the bit, and so is the fit's key.
    """

    def compute():
        X3 = encoder.hidden_states(ids, layer)
        return X3, teacher.transform(X3.reshape(len(ids), -1))

    if memory is None:
        return (*compute(), False)
    key = {
        "examples": "hidden states entering the layer, and its outputs",
        "checkpoint": _sha256(model),
        "config": _sha256(model.parent / "config.json"),
        "layer": layer,
        "n_heads": teacher.n_heads,
    }
    kept_examples = StageMemory(memory, key, (ids,))
    X3, y = kept_examples.stage("examples-1", compute)
    return X3, y, bool(kept_examples.reused)


class UnidentifiableDataError(ValueError):
    """The windows cannot pin some head of the layer (raised before the fit)."""


def _fitting_anyway(message):
    """The verdict's line when ``fit_anyway`` goes on: no hint to set it."""
    return message.replace(_FIT_ANYWAY, "(fitting all the same)")


# A head whose head-matched attention error (on the directions the held-out
# hidden states reach) is at most this is reported exact.
_EXACT_HEAD = 1e-6


def _pinning_verdict(teacher, X_fit, head_rank, n_tokens, layer):
    """What the fit's windows can pin, per head: the count of
    :func:`~skattn.metrics.data_verdict` and the rows that split the teacher's
    attention against the counting bound (:func:`sharp_head_pinning`)."""
    n = X_fit.shape[0]
    d = X_fit.shape[2]
    count = data_verdict(
        n, n_tokens, d + 1, teacher.n_outputs, teacher.n_heads, head_rank=head_rank
    )
    pinning = sharp_head_pinning(teacher, X_fit, head_rank=head_rank)
    heads = []
    for i in range(teacher.n_heads):
        needed = pinning.sequences_needed[i]
        heads.append(
            {
                "head": i,
                "split_rows": int(pinning.n_split_rows[i]),
                "split_rows_needed": int(pinning.n_needed[i]),
                "pinned": bool(pinning.pinned[i]) and count["determined"],
                "windows_needed": (
                    None
                    if not np.isfinite(needed)
                    else max(int(needed), count["samples_needed"])
                ),
            }
        )
    unpinned = [head for head in heads if not head["pinned"]]
    message = ""
    if unpinned and all(pinning.pinned):  # only the overall count fails
        message = describe_verdict(count, "windows") + f" Give more text {_FIT_ANYWAY}."
    elif unpinned:
        unpinned = [head for head in unpinned if not pinning.pinned[head["head"]]]
        counts = [h["windows_needed"] for h in unpinned if h["windows_needed"]]
        more = (
            f"about {max(counts)} windows like these would pin them"
            if len(counts) == len(unpinned)
            else "no window of this text splits the attention of some of them: "
            "text of another kind is needed"
        )
        message = (
            f"{n} windows cannot pin head(s) "
            f"{', '.join(str(h['head']) for h in unpinned)} of layer {layer} "
            f"(split rows {', '.join(str(h['split_rows']) for h in unpinned)} where "
            f"the counting bound asks for {unpinned[0]['split_rows_needed']} a "
            f"head): {more}; give more text {_FIT_ANYWAY}."
        )
    return {
        "determined": not unpinned,
        "heads": heads,
        "count": count,
        "message": message,
        "margin": describe_margin(count, "windows"),
    }


def _final_verdicts(verdict, report):
    """Per head: ``exact`` (attention error at most ``_EXACT_HEAD``), ``not
    converged``, or ``not pinned by this data``; and the summary line."""
    errors = {h["real_head"]: h.get("attention_error") for h in report["heads"]}
    heads = []
    for head in verdict["heads"]:
        error = errors.get(head["head"])
        if not head["pinned"]:
            state = "not pinned by this data"
        elif error is not None and np.isfinite(error) and error <= _EXACT_HEAD:
            state = "exact"
        else:
            state = "not converged"
        heads.append({**head, "verdict": state})
    tally = {}
    for head in heads:
        tally[head["verdict"]] = tally.get(head["verdict"], 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in tally.items())
    return {
        "determined": verdict["determined"],
        "heads": heads,
        "summary": summary,
        "message": verdict["message"],
        "margin": verdict["margin"],
    }


def _rough_minutes(n_windows, n_heads, n_tokens, n_features, head_rank):
    """A rough time: MiniLM layer 3 (4000 windows of 16 tokens, 12 heads of rank
    32, d = 384) took 8.6 minutes on 2 cores, scaled in heads and ``d r``, and in
    windows and tokens by the larger of two terms: linear in the tokens (the
    polish's) and the search's and refinement's, whose steps take a batch of at
    most ``_BATCH_SIZE`` windows (not fewer than 256 windows' work at k = 16)
    with logits growing as ``k`` per token.  Sharp layers take several times
    longer.  Measured on real text (2026-11-28): layer 1 at k = 64 on 96 windows,
    a search of 8 minutes and a refinement round of 19; layer 0 at k = 128, 21
    minutes of search."""
    per_token = (1 + n_tokens / n_features) / (1 + 16 / n_features)
    linear = n_windows * n_tokens / (4000 * 16)
    batched = min(n_windows, _BATCH_SIZE) * n_tokens * per_token / (256 * 16)
    scale = (
        max(linear, batched) * (n_heads / 12) * (n_features * head_rank / (384 * 32))
    )
    minutes = 8.6 * scale
    if minutes < 1:
        return "under a minute on 2 cores (sharp heads take several times longer)"
    whole = round(minutes)
    return (
        f"{whole} minute{'' if whole == 1 else 's'} on 2 cores (a scaling of MiniLM "
        "layer 3's 8.6; sharp heads take several times longer)"
    )


def _measure(teacher, learned, X_fit, X_held):
    """Errors of the learned layer against the teacher, and both heads' sharpness."""
    report = {
        "held_out_relative_error": prediction_error(teacher, learned, X_held),
        "train_relative_error": prediction_error(teacher, learned, X_fit),
        "attention_pattern_error": None,
        "parameter_errors": None,
    }
    real_rows = _profile_rows(sharpness_profile(teacher, X_held))
    if learned.n_heads < teacher.n_heads:  # a learner that chose fewer heads
        report["heads"] = [
            {"real_head": i, "real_sharpness": row} for i, row in enumerate(real_rows)
        ]
        return report
    errors = parameter_error(teacher, learned, X=X_held)
    report["attention_pattern_error"] = attention_pattern_error(
        teacher, learned, X_held
    )
    report["parameter_errors"] = {
        "measured_on": "the directions the held-out hidden states reach",
        "attention_error": errors.attention_error,
        "projection_error": errors.projection_error,
        "key_bias_error": errors.key_bias_error,
        "intercept_error": errors.intercept_error,
    }
    learned_rows = _profile_rows(sharpness_profile(learned, X_held), errors.assignment)
    report["heads"] = [
        {
            "real_head": i,
            "learned_head": errors.assignment[i],
            "attention_error": errors.attention_errors[i],
            "projection_error": errors.projection_errors[i],
            "real_sharpness": real_rows[i],
            "learned_sharpness": learned_rows[i],
        }
        for i in range(teacher.n_heads)
    ]
    return report


def _write_layer(learned, path, n_tokens, layer, folder):
    """``layer.safetensors``: the same bytes for the same layer (sorted header)."""
    arrays = learned._arrays()[:4]
    metadata = {
        "format": SAFETENSORS_FORMAT,
        "n_tokens": str(n_tokens),
        "layer": str(layer),
        "checkpoint": str(folder),
    }
    if learned.head_rank is not None:
        metadata["head_rank"] = str(learned.head_rank)
    write_safetensors(path, dict(zip(_LAYER_TENSORS, arrays, strict=True)), metadata)


def _plot(teacher, learned, X_held, path, layer):
    import matplotlib.pyplot as plt

    heads = list(range(min(teacher.n_heads, _PLOT_HEADS)))
    display = AttentionPatternDisplay.from_layers(
        teacher, learned, X_held[:_PLOT_SAMPLES], heads=heads
    )
    display.figure_.suptitle(f"layer {layer}: real (top) vs learned (bottom)")
    display.figure_.savefig(path, dpi=120)
    plt.close(display.figure_)
