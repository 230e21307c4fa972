"""The steps of ``learn_layer`` for decoder checkpoints (GPT-2, Llama, Mistral, Qwen2).

:func:`skattn.experiments.learn_layer` dispatches on ``config.json``'s
``model_type``: a BERT-style encoder runs through skattn's own numpy encoder, a
decoder through transformers' own model (:mod:`skattn.datasets._decoder_checkpoint`).
For a decoder the text is cut into consecutive windows of ``n_tokens`` tokens
(no special tokens, positions from 0), the learner is
``MultiHeadAttentionRegressor(causal=True, rope=..., n_kv_heads=...,
head_rank=<head_dim>)`` configured from the config (:func:`decoder_learner`),
the count of equations against unknowns is the pre-fit verdict
(:func:`decoder_verdict`), and the learned layer is measured against
transformers' outputs (:func:`decoder_measure`), written in the checkpoint's
own tensor names and loaded back into the model (:func:`load_back_error`).
"""

import json
from pathlib import Path

import numpy as np
from sklearn.base import clone

from ..datasets._decoder_checkpoint import (
    _load_model,
    attention_module,
    check_decoder_checkpoint,
    decoder_examples,
    module_ranks,
    run_attention,
    write_decoder_layer,
)
from ..datasets._encoder import _load_tokenizer, _text_windows
from ..estimators import MultiHeadAttentionRegressor
from ..layer import AttentionLayer
from ..layer._hf import ARCHITECTURES, decoder_weights
from ..metrics import data_verdict
from ..metrics._identifiability import (
    SEARCH_MARGIN,
    SLOW_MIXING_PRECISION,
    describe_verdict,
    slow_mixing_pinning,
)
from ..solvers._memory import _size_text, available_memory, decoder_fit_memory
from ..utils._optional import require
from ._pipeline import _FIT_ANYWAY, _held_out_count, compare_outputs

__all__ = [
    "decoder_learner",
    "decoder_measure",
    "decoder_verdict",
    "decoder_windows",
    "load_back_error",
    "model_tables_difference",
    "prediction_gap",
]

# A layer whose held-out relative error is at most this is reported exact.
EXACT_LAYER = 1e-6
# Held-out windows on which learn_model compares two decoders (their
# log-probabilities take windows x tokens x vocabulary floats).
COMPARED_WINDOWS = 256


def decoder_windows(tokenizer, paths, contents, n_tokens, n_windows, held_out):
    """Token-id windows of ``n_tokens`` consecutive tokens of one file (no
    special tokens; a file's last incomplete window dropped), all of them,
    and how many to hold out; one-line ValueErrors for too little text."""
    tok = _load_tokenizer(tokenizer)
    encodings = tok.encode_batch(contents, add_special_tokens=False)
    tokens = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
    available = int(sum(len(t) // n_tokens for t in tokens))
    wanted = available if n_windows is None else n_windows
    if available < max(wanted, 2):
        need = (
            f"n_windows={n_windows} asks for more"
            if n_windows is not None
            else "at least 2 are needed (one to fit, one to hold out)"
        )
        raise ValueError(
            f"the text is too short: {len(paths)} file(s) of "
            f"{sum(map(len, tokens))} tokens make {available} windows of "
            f"n_tokens={n_tokens}; {need}. Give more text, or ask for fewer or "
            f"shorter windows."
        )
    n_held = _held_out_count(held_out, wanted)
    return _text_windows([t for t in tokens if len(t)], n_tokens), n_held


def decoder_learner(settings, n_tokens, *, random_state=0, verbose=0, memory=None):
    """The learner of a decoder's attention, configured from its settings.

    ``causal=True``; rotary positions (``rope``, ``rope_theta``, the
    ``"half"`` layout of ``rotate_half``) for Llama, Mistral and Qwen2;
    ``n_kv_heads`` for grouped-query heads; ``head_rank`` the head dimension
    (the rank of each ``Q_i K_g^T`` and of each head's values); an intercept
    (a constant coordinate of the tokens: query, key and value biases) when
    the module has biases.  ``memory``: where it keeps its finished stages
    (the estimator's ``memory``).

    Examples
    --------
    >>> from skattn.layer._hf import decoder_settings
    >>> s = decoder_settings({"model_type": "qwen2", "hidden_size": 64,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2})
    >>> est = decoder_learner(s, 32)
    >>> est.rope, est.n_kv_heads, est.head_rank, est.fit_intercept
    (True, 2, 16, True)
    """
    rotary = settings["rope_theta"] is not None
    m, m_kv = settings["n_heads"], settings["n_kv_heads"]
    return MultiHeadAttentionRegressor(
        n_heads=m,
        n_tokens=n_tokens,
        head_rank=settings["head_dim"],
        fit_intercept=bool(settings["biases"]),
        causal=True,
        rope=rotary,
        rope_theta=settings["rope_theta"] if rotary else 10000.0,
        rope_layout="half",
        n_kv_heads=None if m_kv == m else m_kv,
        random_state=random_state,
        verbose=verbose,
        memory=None if memory is None else str(memory),
    )


def fit_memory_line(settings, n_tokens, n_fit, available):
    """The first line's account of the memory a decoder layer's fit needs at its
    peak (:func:`~skattn.solvers._memory.decoder_fit_memory` of the layer's
    shapes), its largest stage named; a ``MemoryError`` of one line where
    ``available`` bytes (None: unknown) are fewer.

    Examples
    --------
    >>> from skattn.layer._hf import decoder_settings
    >>> s = decoder_settings({"model_type": "llama", "hidden_size": 4096,
    ...     "num_attention_heads": 32, "num_key_value_heads": 8,
    ...     "rope_theta": 500000.0})
    >>> print(fit_memory_line(s, 32, 320, None))
    about 25.0 GiB of memory at the peak (the slow rotary pairs' lift 18.0 GiB)
    >>> fit_memory_line(s, 32, 320, 16 * 2**30)
    Traceback (most recent call last):
    ...
    MemoryError: The fit of 320 windows of 32 tokens needs about 25.0 GiB of memory at the peak (the slow rotary pairs' lift 18.0 GiB); this machine has 16.0 GiB available: fit fewer windows (n_windows) or shorter ones (n_tokens), or run on a machine with more memory.
    """  # noqa: E501
    d = settings["n_features"] + bool(settings["biases"])  # [x, 1] with biases
    need = decoder_fit_memory(
        n_fit,
        n_tokens,
        d,
        settings["n_features"],
        settings["n_heads"],
        settings["head_dim"],
        n_kv_heads=settings["n_kv_heads"],
        rope_theta=settings["rope_theta"],
    )
    stage = max(("search", "polish", "lift"), key=need.get)
    name = {"search": "the search", "polish": "the polish"}.get(
        stage, "the slow rotary pairs' lift"
    )
    line = (
        f"about {_size_text(need['peak'])} of memory at the peak ({name} "
        f"{_size_text(need[stage])})"
    )
    if available is not None and need["peak"] > available:
        raise MemoryError(
            f"The fit of {n_fit} windows of {n_tokens} tokens needs {line}; this "
            f"machine has {_size_text(available)} available: fit fewer windows "
            f"(n_windows) or shorter ones (n_tokens), or run on a machine with "
            f"more memory."
        )
    return line


def _unknowns(settings, n_in):
    """Free parameters of a decoder attention on tokens of width ``n_in``: query
    maps per query head, key and value maps per key/value group, output maps per
    query head, less the gauge of each group (``A`` with ``K_g A``, ``Q_i
    A^{-T}``: ``h^2``, or ``h`` with rotary positions, where ``A`` must commute
    with the rotations; ``B`` with ``V_g B``, ``B^{-1} O_i``: ``h^2``)."""
    d, m, m_kv, h = (
        settings[key] for key in ("n_features", "n_heads", "n_kv_heads", "head_dim")
    )
    gauge = (h if settings["rope_theta"] is not None else h * h) + h * h
    return (m + 2 * m_kv) * n_in * h + m * h * d - m_kv * gauge


def decoder_verdict(n_fit, n_tokens, settings, intercept):
    """What ``n_fit`` windows can pin, by counting: the equations ``n k d``
    of the outputs against the layer's unknowns (:func:`_unknowns`), and the
    logit differences of the causal rows against the counting bound of heads of
    rank ``head_dim`` (:func:`skattn.metrics.data_verdict`): a causal row ``l``
    sees ``l + 1`` tokens, so ``l`` differences, ``k (k - 1) / 2`` a window
    where unmasked rows give ``k (k - 1)``; ``count["rows"]`` is that, in rows
    of ``k - 1`` differences (``n k / 2``).  With rotary positions, the slow
    pairs' mixings are weakly pinned directions
    (:func:`skattn.metrics._identifiability.slow_mixing_pinning`, from the
    window's smallest turn): ``slow_mixings`` says how weakly and ``note`` says
    it in a line; where the window is too short to pin them to
    ``SLOW_MIXING_PRECISION``, no head is pinned and the message says what
    window length would (more windows of this length would not).

    Examples
    --------
    >>> from skattn.layer._hf import decoder_settings
    >>> s = decoder_settings({"model_type": "llama", "hidden_size": 64,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2})
    >>> v = decoder_verdict(5, 32, s, intercept=False)
    >>> v["determined"], v["count"]["samples_needed"]
    (False, 6)
    """
    d, m, h = settings["n_features"], settings["n_heads"], settings["head_dim"]
    n_in = d + 1 if intercept else d
    count = data_verdict(n_fit, n_tokens, n_in, d, m, head_rank=h)
    unknowns = _unknowns(settings, n_in)
    equations = n_fit * n_tokens * d
    rows = n_fit * n_tokens // 2  # causal rows, in rows of k - 1 differences
    needed = max(
        -(-unknowns // (n_tokens * d)), -(-2 * count["rows_needed"] // n_tokens)
    )
    count.update(
        unknowns=unknowns,
        equations=equations,
        rows=rows,
        samples_needed=int(needed),
        search_samples_needed=max(
            int(needed), -(-SEARCH_MARGIN * unknowns // (n_tokens * d))
        ),
        determined=bool(equations >= unknowns and rows >= count["rows_needed"]),
        counted="decoder unknowns (shared key/value groups, gauges removed)",
    )
    message = ""
    if not count["determined"]:
        message = describe_verdict(count, "windows") + f" Give more text {_FIT_ANYWAY}."
    slow, note, windows_needed = None, "", needed
    if settings["rope_theta"] is not None:
        slow = slow_mixing_pinning(h, settings["rope_theta"], n_tokens)
        note = _slow_note(slow, h, n_tokens)
        if not slow["pinned"]:
            count["determined"] = False
            windows_needed = None  # longer windows pin them, not more
            longer = (
                f"{note}: windows of at least {slow['tokens_needed']} tokens "
                f"would pin them {_FIT_ANYWAY}."
            )
            message = f"{message} {longer}" if message else longer
    heads = [
        {"head": i, "pinned": count["determined"], "windows_needed": windows_needed}
        for i in range(m)
    ]
    return {
        "determined": count["determined"],
        "heads": heads,
        "count": count,
        "slow_mixings": slow,
        "note": note,
        "message": message,
    }


def _slow_note(slow, head_dim, n_tokens):
    """The verdict's line on a rotary head's slow mixings."""
    precision = "" if slow["pinned"] else f", above {SLOW_MIXING_PRECISION:g}"
    return (
        f"{slow['slow_pairs']} of each head's {head_dim // 2} rotary pairs turn "
        f"by at most pi/2 over {n_tokens} tokens, the slowest by "
        f"{slow['smallest_turn']:.1e} rad: their mixings are pinned only to "
        f"about {slow['pinned_to']:.0e}{precision}"
    )


def _relative(predicted, target):
    norm = np.linalg.norm(target)
    return float(np.linalg.norm(predicted - target) / norm) if norm else 0.0


def prediction_gap(layer, X, y):
    """``||layer(X) - y||_F / ||y||_F`` on windows ``X`` ``(n, k, d)`` and
    outputs ``y`` ``(n, k, d_out)``."""
    n = len(X)
    return _relative(layer.transform(X.reshape(n, -1)), y.reshape(n, -1))


def decoder_measure(teacher, learned, X_fit, y_fit, X_held, y_held, verdict):
    """The errors of the learned layer against transformers' outputs.

    ``teacher`` is the module read as a skattn layer
    (:meth:`~skattn.AttentionLayer.from_torch`): its agreement with the
    outputs checks the data path.  Returns the report's entries
    ``held_out_relative_error``, ``train_relative_error``,
    ``teacher_agreement`` and ``verdict``."""
    held = prediction_gap(learned, X_held, y_held)
    train = prediction_gap(learned, X_fit, y_fit)
    agreement = prediction_gap(teacher, X_held, y_held)
    if not verdict["determined"]:
        state = "not pinned by this data"
    elif np.isfinite(held) and held <= EXACT_LAYER:
        state = "exact"
    else:
        state = "not converged"
    return {
        "held_out_relative_error": held,
        "train_relative_error": train,
        "teacher_agreement": agreement,
        "attention_pattern_error": None,
        "parameter_errors": None,
        "heads": [],
        "verdict": {
            "determined": verdict["determined"],
            "heads": [{**h, "verdict": state} for h in verdict["heads"]],
            "count": verdict["count"],
            "slow_mixings": verdict.get("slow_mixings"),
            "summary": f"{len(verdict['heads'])} {state} (the layer as a whole)",
            "message": verdict["message"],
        },
    }


def model_tables_difference(model, module, ids, settings, y):
    """The relative change of the module's outputs on ``ids`` when it gets the
    model's own RoPE tables (float32) instead of float64 ones: the floor under
    any float64 comparison with the model as it runs.  None for GPT-2."""
    if settings["rope_theta"] is None:
        return None
    _, own = run_attention(model, module, ids, settings=settings, rope="model")
    return _relative(own, y)


def load_back_error(model, checkpoint, tensors, ids, y):
    """Load the written ``tensors`` (the checkpoint's own names) into the
    transformers ``model`` with ``load_state_dict(strict=False)`` and return
    the relative error of layer L's attention outputs on ``ids`` against
    ``y``; a ValueError if a key is not the model's.  The model's own tensors
    are put back afterwards (the model stays the original)."""
    torch = require("torch", extra="transformers", feature="Decoder checkpoints")
    state = model.state_dict()
    keys = [key for key in tensors if key not in state]
    if keys:
        raise ValueError(f"the written tensors {keys} are not keys of the model.")
    original = {key: state[key].clone() for key in tensors}
    result = model.load_state_dict(
        {
            key: torch.as_tensor(value, dtype=state[key].dtype)
            for key, value in tensors.items()
        },
        strict=False,
    )
    if result.unexpected_keys:
        raise ValueError(
            f"the model did not take the tensors {result.unexpected_keys}."
        )
    try:
        _, module = attention_module(model, checkpoint)
        _, back = run_attention(model, module, ids, settings=checkpoint["settings"])
    finally:
        model.load_state_dict(original, strict=False)
    return _relative(back, y)


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


class DecoderSource:
    """A decoder checkpoint as the pipeline reads it (see the module).

    Built from the checkpoint's config and safetensors headers alone
    (:func:`check_decoder_checkpoint`, per layer); transformers' model is
    loaded by the first step that needs it and kept for the next layers (a
    layer's written tensors are loaded back into it and then undone)."""

    kind = "decoder"

    def __init__(self, folder, *, n_tokens):
        self.folder = Path(folder)
        self.n_tokens = n_tokens
        self.n_layers = check_decoder_checkpoint(folder, layer=0)["n_layers"]
        self._checked = {}
        self._model = None
        self._written = {}

    def checkpoint(self, layer):
        """The checked checkpoint of layer ``layer``."""
        if layer not in self._checked:
            self._checked[layer] = check_decoder_checkpoint(
                self.folder, layer=layer, n_tokens=self.n_tokens
            )
        return self._checked[layer]

    def settings(self, layer):
        return self.checkpoint(layer)["settings"]

    def check(self, layer, n_heads, plot):
        """The layer and window length against the checkpoint; no heads or plot
        (a decoder layer is learned whole)."""
        settings = self.settings(layer)
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

    def windows(self, paths, contents, n_windows, held_out):
        """Every window of ``n_tokens`` consecutive tokens of one file."""
        tokenizer = self.checkpoint(0)["tokenizer"]
        ids, _ = decoder_windows(
            tokenizer, paths, contents, self.n_tokens, n_windows, held_out
        )
        return ids

    def windows_wanted(self, layer, n_heads):
        """The count's windows with the search's margin."""
        settings = self.settings(layer)
        count = decoder_verdict(1, self.n_tokens, settings, bool(settings["biases"]))
        return count["count"]["search_samples_needed"]

    def describe(self, layer, n_heads, n_fit):
        """The first line's account of what is fitted, and the memory its fit
        needs at the peak (:func:`fit_memory_line`; refused where the host lacks
        it)."""
        s = self.settings(layer)
        return (
            f"layer {layer} of a {s['architecture']} checkpoint: {s['n_heads']} "
            f"query heads ({s['n_kv_heads']} key/value) of dimension "
            f"{s['head_dim']}",
            fit_memory_line(s, self.n_tokens, n_fit, available_memory()),
        )

    @property
    def model(self):
        if self._model is None:
            self._model = _load_model(self.checkpoint(0))
        return self._model

    def teacher(self, layer, n_heads):
        """The attention module read as a skattn layer (checks the data path)."""
        _, module = attention_module(self.model, self.checkpoint(layer))
        return AttentionLayer.from_torch(module).set_params(n_tokens=self.n_tokens)

    def examples(self, layer, teacher, ids, memory):
        """``(X3, y, False)``: layer ``layer``'s attention inputs and outputs by
        transformers' own model (not kept: the learner's stages are)."""
        X, y, _ = decoder_examples(self.checkpoint(layer), ids, model=self.model)
        return X, y, False

    def verdict(self, layer, teacher, X3_fit):
        """The count of :func:`decoder_verdict`."""
        settings = self.settings(layer)
        return decoder_verdict(
            len(X3_fit), self.n_tokens, settings, bool(settings["biases"])
        )

    def learner(self, layer, teacher, *, random_state, memory, verbose):
        """:func:`decoder_learner` of the layer's settings."""
        return decoder_learner(
            self.settings(layer),
            self.n_tokens,
            random_state=random_state,
            verbose=verbose,
            memory=memory,
        )

    def fit_inputs(self, X3, default):
        return X3

    def measure(self, teacher, learned, data, verdict):
        """:func:`decoder_measure`, the RoPE tables' floor, and the error of
        what the module can hold of the learned layer (kept for :meth:`write`)."""
        X3, y, fit, held = data.X3, data.y, data.fit, data.held
        checkpoint = self.checkpoint(data.layer)
        settings = checkpoint["settings"]
        report = decoder_measure(
            teacher, learned, X3[fit], y[fit], X3[held], y[held], verdict
        )
        _, module = attention_module(self.model, checkpoint)
        report["rope_tables"] = {
            "teacher": None if settings["rope_theta"] is None else "float64",
            "model_float32_tables_relative_difference": model_tables_difference(
                self.model, module, data.ids[held], settings, y[held]
            ),
        }
        # what the module holds of it: values cut to head_dim directions per group
        written = module_ranks(clone(learned), settings, X3[fit])
        self._written[data.layer] = written
        report["written_held_out_relative_error"] = prediction_gap(
            written, X3[held], y[held]
        )
        report["certificate"] = None
        return report

    def facts(self, layer, teacher):
        """The report's ``checkpoint`` entry."""
        checkpoint = self.checkpoint(layer)
        settings = checkpoint["settings"]
        return {
            "folder": str(self.folder),
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
        }

    def write(self, files, learned, layer, teacher, data, report):
        """``layer.safetensors`` in the checkpoint's own tensor names, loaded
        back into the model (and undone)."""
        checkpoint = self.checkpoint(layer)
        tensors = write_decoder_layer(
            files["layer"],
            self._written[layer],
            checkpoint,
            {"n_tokens": str(self.n_tokens)},
        )
        report["loaded_back_held_out_relative_error"] = load_back_error(
            self.model, checkpoint, tensors, data.ids[data.held], data.y[data.held]
        )

    def tensors(self, layer):
        """The learned layer ``layer`` in the checkpoint's own tensor names."""
        checkpoint = self.checkpoint(layer)
        weights = decoder_weights(
            module_ranks(clone(self._written[layer]), checkpoint["settings"]),
            checkpoint["settings"],
            checkpoint["shapes"],
        )
        return {checkpoint["prefix"] + name: w for name, w in weights.items()}

    def _run(self, ids):
        """Final hidden states and next-token log-probabilities on ``ids``."""
        torch = require("torch", extra="transformers", feature="Decoder checkpoints")
        hidden, log_probs = [], []
        with torch.no_grad():
            for start in range(0, len(ids), 64):
                batch = torch.as_tensor(np.asarray(ids[start : start + 64]))
                output = self.model(input_ids=batch, output_hidden_states=True)
                hidden.append(output.hidden_states[-1].numpy())
                log_probs.append(torch.log_softmax(output.logits, -1).numpy())
        return np.concatenate(hidden), np.concatenate(log_probs)

    def compare_models(self, learned, ids):
        """The original model against the model with each learned layer alone
        in place of its attention, and all of them (``"all"``), on the token
        windows ``ids`` (at most ``COMPARED_WINDOWS``): final hidden states,
        next-token log-probabilities and perplexity
        (:func:`~skattn.experiments._pipeline.compare_outputs`)."""
        torch = require("torch", extra="transformers", feature="Decoder checkpoints")

        ids = np.asarray(ids)[:COMPARED_WINDOWS]
        base_hidden, base_log_probs = self._run(ids)
        state = self.model.state_dict()

        def compare(which):
            tensors = {}
            for layer in which:
                tensors.update(self.tensors(layer))
            original = {key: state[key].clone() for key in tensors}
            self.model.load_state_dict(
                {
                    key: torch.as_tensor(value, dtype=state[key].dtype)
                    for key, value in tensors.items()
                },
                strict=False,
            )
            try:
                hidden, log_probs = self._run(ids)
            finally:
                self.model.load_state_dict(original, strict=False)
            return compare_outputs(
                base_hidden, hidden, log_probs=(base_log_probs, log_probs), ids=ids
            )

        result = {str(layer): compare(which=[layer]) for layer in learned}
        result["all"] = compare(list(learned))
        result["n_windows"] = len(ids)
        return result

    def write_model(self, folder, learned):
        """The learned model: the checkpoint's files with the learned layers'
        attention in its own tensor names and dtypes, loadable by
        transformers' ``AutoModelForCausalLM.from_pretrained`` as the original."""
        from safetensors import safe_open
        from safetensors.numpy import save_file

        from ..datasets._encoder_checkpoint import _copy_small_files

        files = self.checkpoint(0)["weight_files"]
        if len(files) != 1:
            raise ValueError(
                f"{str(self.folder)!r} is a sharded checkpoint: writing the learned "
                f"model back needs one model.safetensors (learn its layers with "
                f"skattn layer instead)."
            )
        with safe_open(files[0], framework="numpy") as handle:
            metadata = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        for layer in learned:
            for key, value in self.tensors(layer).items():
                if key not in tensors:
                    raise ValueError(f"the checkpoint has no tensor {key!r}.")
                # C order: safetensors writes the buffer as it lies in memory
                tensors[key] = np.ascontiguousarray(value, dtype=tensors[key].dtype)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        _copy_small_files(self.folder, folder)
        save_file(tensors, folder / "model.safetensors", metadata=metadata)
