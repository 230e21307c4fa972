"""The steps of the pipeline for BERT-style encoders (BERT, MiniLM, ...).

:class:`EncoderSource` is what :func:`~skattn.experiments.learn_layer` and
:func:`~skattn.experiments.learn_model` need of an encoder checkpoint: its
folder checked (``model.safetensors``, ``config.json``, ``tokenizer.json``; by
default the packaged all-MiniLM-L6-v2), the text cut into windows ``[CLS]``
text ``[SEP]``, the hidden states entering layer ``L`` computed by skattn's
own numpy encoder (:class:`skattn.datasets.BertEncoder`) and layer ``L``'s
attention sub-layer on them as the teacher
(:func:`skattn.datasets.load_bert_attention`), the pre-fit verdict per head
(the count and the rows that split each head's attention), the learner of
``benchmarks/bench_minilm_teacher.py``'s settings, the measures (head-matched
errors, sharpness), and the files (``layer.safetensors`` in skattn's layer
format, the pattern plot).
"""

import json
from numbers import Integral
from pathlib import Path

import numpy as np

from ..datasets import BertEncoder, load_bert_attention, minilm_checkpoint_path
from ..datasets._encoder import _load_tokenizer, _text_windows
from ..estimators import MultiHeadAttentionRegressor
from ..layer import AttentionLayer
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
from ..utils._optional import require
from ._pipeline import _FIT_ANYWAY, _held_out_count, compare_outputs

# The learned layer's tensors in layer.safetensors: AttentionLayer's arguments.
_LAYER_TENSORS = ("attention", "projection", "key_bias", "intercept")

# Heads drawn by the pattern plot (the first ones), and sequences it matches on.
_PLOT_HEADS = 4

_PLOT_SAMPLES = 500

_CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json")


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


def _teacher(encoder, model, layer, n_heads, n_tokens):
    """Layer ``layer``'s attention restricted to its first heads."""
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
    return AttentionLayer(
        full.attention[heads],
        full.projection[heads],
        key_bias=full.key_bias[heads],
        intercept=full.intercept,
        n_tokens=n_tokens,
    )


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


# A learned layer is written in BERT's shapes cut to head_dim directions per head
# (bert_attention_tensors' rtol): what a fit that did not converge has beyond
# them is dropped, and the models' comparison measures what is written.
_CUT = 1.0


class EncoderSource:
    """A BERT-style checkpoint as the pipeline reads it (see the module).

    Built from the checkpoint's files alone (checked, nothing loaded); the
    encoder is loaded by the first step that needs it and kept for the next
    layers."""

    kind = "encoder"

    def __init__(self, checkpoint, *, n_tokens):
        self.folder, self.model_file, self.config = _checkpoint(checkpoint)
        self.n_tokens = n_tokens
        self._encoder = None

    def check(self, layer, n_heads, plot):
        """The layer, heads and window length against ``config.json``."""
        _check_against_config(self.config, self.folder, layer, n_heads, self.n_tokens)
        require("safetensors.numpy", extra="pretrained", feature="Reading checkpoints")

    def windows(self, paths, contents, n_windows, held_out):
        """Every window ``[CLS] text [SEP]`` of the text (token ids)."""
        ids, _ = _windows(
            paths,
            contents,
            self.folder / "tokenizer.json",
            self.n_tokens,
            n_windows,
            held_out,
        )
        return ids

    def _shape(self, n_heads):
        d = int(self.config["hidden_size"])
        heads = int(self.config["num_attention_heads"])
        return d, heads if n_heads is None else n_heads, d // heads

    def windows_wanted(self, layer, n_heads):
        """The count's windows with the search's margin."""
        d, m, rank = self._shape(n_heads)
        count = data_verdict(1, self.n_tokens, d + 1, d, m, head_rank=rank)
        return count["search_samples_needed"]

    def describe(self, layer, n_heads, n_fit):
        """The first line's account of what is fitted, and how long it takes."""
        d, m, rank = self._shape(n_heads)
        minutes = _rough_minutes(n_fit, m, self.n_tokens, d, rank)
        return f"layer {layer}: {m} head(s) of rank {rank}", f"roughly {minutes}"

    @property
    def n_layers(self):
        """The encoder's layers (``config.json``'s count, else the weights')."""
        n_layers = self.config.get("num_hidden_layers")
        return n_layers if isinstance(n_layers, Integral) else self.encoder.n_layers

    @property
    def encoder(self):
        if self._encoder is None:
            self._encoder = BertEncoder.from_safetensors(self.model_file)
        return self._encoder

    def teacher(self, layer, n_heads):
        """Layer ``layer``'s attention sub-layer, its first ``n_heads`` heads."""
        return _teacher(self.encoder, self.model_file, layer, n_heads, self.n_tokens)

    def examples(self, layer, teacher, ids, memory):
        """``(X3, y, reused)`` (:func:`_examples`)."""
        return _examples(self.encoder, teacher, ids, layer, memory, self.model_file)

    def verdict(self, layer, teacher, X3_fit):
        """What the fit's windows pin, per head (:func:`_pinning_verdict`)."""
        rank = self.encoder.n_features // self.encoder.n_heads
        return _pinning_verdict(teacher, X3_fit, rank, self.n_tokens, layer)

    def learner(self, layer, teacher, *, random_state, memory, verbose):
        """The default learner: the settings of ``bench_minilm_teacher.py``."""
        return MultiHeadAttentionRegressor(
            n_heads=teacher.n_heads,
            n_tokens=self.n_tokens,
            fit_intercept=True,
            head_rank=self.encoder.n_features // self.encoder.n_heads,
            random_state=random_state,
            memory=None if memory is None else str(memory),
            verbose=verbose,
        )

    def fit_inputs(self, X3, default):
        """The default learner takes the windows flattened, another as 3-D."""
        return X3.reshape(len(X3), -1) if default else X3

    def measure(self, teacher, learned, data, verdict):
        """Head-matched errors and sharpness, and each head's verdict."""
        X = data.X3.reshape(len(data.X3), -1)
        report = _measure(teacher, learned, X[data.fit], X[data.held])
        report["verdict"] = _final_verdicts(verdict, report)
        return report

    def facts(self, layer, teacher):
        """The report's ``checkpoint`` entry."""
        encoder = self.encoder
        return {
            "folder": str(self.folder),
            "model_type": self.config.get("model_type"),
            "n_layers": encoder.n_layers,
            "n_heads": encoder.n_heads,
            "n_features": encoder.n_features,
            "head_dim": encoder.n_features // encoder.n_heads,
            "layer": layer,
            "heads_learned": list(range(teacher.n_heads)),
        }

    def write(self, files, learned, layer, teacher, data, report):
        """``layer.safetensors`` (skattn's layer format) and the plot."""
        _write_layer(learned, files["layer"], self.n_tokens, layer, self.folder)
        if "plot" in files:
            X = data.X3.reshape(len(data.X3), -1)
            _plot(teacher, learned, X[data.held], files["plot"], layer)

    def compare_models(self, learned, ids):
        """The original model against the model with each learned layer alone
        in place of its attention, and all of them (``"all"``), on the token
        windows ``ids``: final hidden states and mean-pooled embeddings
        (:func:`~skattn.experiments._pipeline.compare_outputs`).  The learned
        tensors enter in float64, each head cut to the module's ``head_dim``
        directions (a fit that did not converge may have more), as written."""
        from safetensors.numpy import load_file

        from ..datasets._encoder_checkpoint import bert_attention_tensors

        original = load_file(self.model_file)
        name = next(name for name in original if "encoder.layer." in name)
        prefix = name[: name.index("encoder.layer.")]
        encoder = self.encoder
        eps = self.config.get("layer_norm_eps", 1e-12)
        base = encoder.hidden_states(ids, encoder.n_layers)

        def replaced(which):
            tensors = dict(original)
            for layer in which:
                tensors.update(
                    {
                        prefix + key: value
                        for key, value in bert_attention_tensors(
                            learned[layer], layer_index=layer, rtol=_CUT
                        ).items()
                    }
                )
            model = BertEncoder(tensors, encoder.n_heads, eps=eps)
            return model.hidden_states(ids, encoder.n_layers)

        result = {
            str(layer): compare_outputs(base, replaced([layer])) for layer in learned
        }
        result["all"] = compare_outputs(base, replaced(list(learned)))
        return result

    def write_model(self, folder, learned):
        """The learned model: the checkpoint folder with the learned layers'
        attention in its own tensor names and dtypes
        (:func:`~skattn.datasets._encoder_checkpoint.write_encoder_checkpoint`)."""
        from ..datasets._encoder_checkpoint import write_encoder_checkpoint

        write_encoder_checkpoint(folder, self.folder, learned, rtol=_CUT)
