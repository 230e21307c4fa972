"""Decoder checkpoints (GPT-2, Llama, Mistral, Qwen2): checked, then run by
transformers.

:func:`check_decoder_checkpoint` reads a checkpoint folder -- ``config.json``,
``model.safetensors`` or the shards of ``model.safetensors.index.json``, and
``tokenizer.json`` -- without loading any model: the architecture and its
attention settings (:func:`skattn.layer._hf.decoder_settings`, which refuses
sliding windows, RoPE scalings, partial rotary factors, soft-capping,
cross-attention, ...), the layer and window length against the config, and the
names and shapes of layer ``L``'s attention tensors read from the safetensors
headers alone.  Every problem is a one-line ``ValueError``.

:func:`decoder_examples` then runs token windows through transformers' own
model (``AutoModelForCausalLM`` from the folder, float64, SDPA attention) and
records, with hooks on layer ``L``'s attention module, what enters it (the
normalized hidden states of a pre-norm block: after ``input_layernorm`` or
``ln_1``) and what it returns (the attention sub-layer's output before the
residual add, ``o_proj`` / ``c_proj`` and its biases included).

transformers builds the RoPE tables (``cos``, ``sin``) in float32 even in a
float64 model, which puts a floor of about 1e-6 under any comparison with a
float64 layer; by default the hook hands the module the same tables built in
float64 (``rope_tables="float64"``, as ``LlamaRotaryEmbedding.forward`` builds
them, with the config's ``rope_theta``), and ``rope_tables="model"`` keeps the
model's own.

:func:`write_decoder_layer` writes a learned :class:`~skattn.AttentionLayer`
in the checkpoint's own tensor names and layout (``q_proj`` ... ``o_proj``,
GPT-2's fused ``c_attn``), so that ``model.load_state_dict(tensors,
strict=False)`` puts it into the model.
"""

import json
from pathlib import Path

import numpy as np
from sklearn.base import clone

from ..layer._convert import _range_basis
from ..layer._files import write_safetensors
from ..layer._hf import ARCHITECTURES, decoder_settings, decoder_weights
from ..utils._optional import require

__all__ = [
    "DECODER_FORMAT",
    "check_decoder_checkpoint",
    "save_random_decoder",
    "decoder_examples",
    "write_decoder_layer",
]

# What a written decoder layer's metadata says it is.
DECODER_FORMAT = (
    "skattn decoder attention layer: the checkpoint's own tensors; "
    "model.load_state_dict(tensors, strict=False)"
)
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Where a layer's attention lives in each architecture's state dict (with or
# without the task head's prefix).
_PREFIXES = {
    "gpt2": ("transformer.h.{L}.attn.", "h.{L}.attn."),
    "llama": ("model.layers.{L}.self_attn.", "layers.{L}.self_attn."),
}
# Buffers of old GPT-2 checkpoints (the causal mask), not weights.
_GPT2_BUFFERS = ("bias", "masked_bias")
_WHAT_EXTRA = {
    "q_norm": "query/key norms",
    "k_norm": "query/key norms",
    "sinks": "attention sinks",
    "q_attn": "cross-attention",
    "crossattention": "cross-attention",
}


def _fail(folder, message):
    raise ValueError(f"checkpoint {str(folder)!r}: {message}")


def _read_json(path, folder, what):
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        _fail(folder, f"{what} cannot be read as JSON ({type(exc).__name__}: {exc}).")
    if not isinstance(value, dict):
        _fail(folder, f"{what} does not hold a JSON object.")
    return value


def _header(path, folder):
    """Names and shapes of a ``.safetensors`` file's tensors, from its header
    alone (8 bytes of length, then JSON): no tensor is read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= size - 8:
                raise ValueError("no safetensors header")
            header = json.loads(file.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        shapes = {
            name: tuple(int(s) for s in info["shape"])
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _fail(
            folder,
            f"{path.name} is not a .safetensors file that can be read "
            f"({type(exc).__name__}: {exc}).",
        )
    return shapes


def _weight_files(folder):
    """The weight files (one, or the shards an index names), all present."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if not (folder / INDEX).is_file():
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        hint = (
            f" (it holds {others}: pickled checkpoints are not loaded, as "
            f"unpickling can run code; save the model with safetensors)"
            if others
            else ""
        )
        _fail(folder, f"has neither {WEIGHTS} nor {INDEX}{hint}.")
    index = _read_json(folder / INDEX, folder, INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        _fail(folder, f"{INDEX} has no weight_map of tensor names to shard files.")
    shards = sorted(set(map(str, weight_map.values())))
    missing = [name for name in shards if not (folder / name).is_file()]
    if missing:
        _fail(
            folder,
            f"{INDEX} names shard(s) {missing} that are not in the folder.",
        )
    return [folder / name for name in shards]


def _config_int(config, names, folder, what):
    for name in names:
        value = config.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(folder, f"config.json has {name}={value!r}; {what}.")
            return name, value
    return None, None


def _expected_shapes(settings):
    """The attention module's tensors (its own names) and their shapes."""
    d, m, m_kv, h = (
        settings[key] for key in ("n_features", "n_heads", "n_kv_heads", "head_dim")
    )
    if settings["architecture"] == "gpt2":
        return {
            "c_attn.weight": (d, 3 * d),
            "c_attn.bias": (3 * d,),
            "c_proj.weight": (d, d),
            "c_proj.bias": (d,),
        }
    shapes = {
        "q_proj.weight": (m * h, d),
        "k_proj.weight": (m_kv * h, d),
        "v_proj.weight": (m_kv * h, d),
        "o_proj.weight": (d, m * h),
    }
    sizes = {"query": ("q_proj", m * h), "key": ("k_proj", m_kv * h)}
    sizes.update({"value": ("v_proj", m_kv * h), "output": ("o_proj", d)})
    for bias in settings["biases"]:
        name, size = sizes[bias]
        shapes[f"{name}.bias"] = (size,)
    return shapes


def check_decoder_checkpoint(folder, *, layer, n_tokens=None):
    """Check a decoder checkpoint folder for layer ``layer``, loading no model.

    Parameters
    ----------
    folder : str or path-like
        A folder holding ``config.json`` (``model_type`` ``"gpt2"``,
        ``"llama"``, ``"mistral"`` or ``"qwen2"``), ``model.safetensors`` (or
        ``model.safetensors.index.json`` and its shards) and ``tokenizer.json``.
    layer : int
        The decoder layer, from 0.
    n_tokens : int, default=None
        The window length, checked against the position table.

    Returns
    -------
    checkpoint : dict
        ``folder``, ``config`` (the JSON), ``settings``
        (:func:`~skattn.layer._hf.decoder_settings`), ``n_layers``, ``layer``,
        ``tokenizer`` (the ``tokenizer.json`` path), ``weight_files``,
        ``prefix`` (the attention module's name in the state dict, with a
        trailing dot, e.g. ``"model.layers.1.self_attn."``) and ``shapes`` (the
        module's tensor names, without the prefix, and their shapes).

    Raises
    ------
    ValueError
        One line naming the problem: a file missing or unreadable, an
        unsupported architecture or variant, a layer out of range, a window
        longer than the position table, a tensor of the layer missing, of the
        wrong shape, or one the layer does not represent.

    Examples
    --------
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     _ = Path(tmp, "config.json").write_text(json.dumps(
    ...         {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
    ...          "num_attention_heads": 4, "sliding_window": 4096}))
    ...     check_decoder_checkpoint(tmp, layer=0)
    Traceback (most recent call last):
    ...
    ValueError: config of model_type='mistral' has sliding_window=4096; ...
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {str(folder)!r} is not a folder.")
    if not (folder / "config.json").is_file():
        _fail(folder, "lacks config.json (the architecture).")
    config = _read_json(folder / "config.json", folder, "config.json")
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        _fail(
            folder,
            f"unsupported architecture model_type={model_type!r}; supported "
            f"decoders: {list(ARCHITECTURES)} (and BERT-style encoders).",
        )
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative integer, got {layer!r}.")
    _, n_layers = _config_int(
        config, ("n_layer", "num_hidden_layers"), folder, "a positive integer"
    )
    if n_layers is None:
        _fail(folder, "config.json gives no number of layers (num_hidden_layers).")
    if layer >= n_layers:
        raise ValueError(
            f"layer={layer}: the checkpoint {str(folder)!r} has {n_layers} layers, "
            f"numbered 0 to {n_layers - 1}."
        )
    settings = decoder_settings(config, layer)
    name, positions = _config_int(
        config,
        ("n_positions", "max_position_embeddings"),
        folder,
        "a positive integer",
    )
    if n_tokens is not None and positions is not None and n_tokens > positions:
        raise ValueError(
            f"n_tokens={n_tokens} exceeds the checkpoint's position table "
            f"({name}={positions})."
        )
    if not (folder / "tokenizer.json").is_file():
        _fail(
            folder,
            "lacks tokenizer.json (saved by the tokenizers library or a Hugging "
            "Face fast tokenizer) to cut the text into tokens.",
        )
    files = _weight_files(folder)
    shapes = {}
    for file in files:
        shapes.update(_header(file, folder))
    family = "gpt2" if model_type == "gpt2" else "llama"
    candidates = [p.format(L=layer) for p in _PREFIXES[family]]
    prefix = next(
        (p for p in candidates if any(key.startswith(p) for key in shapes)), None
    )
    if prefix is None:
        _fail(
            folder,
            f"its weights hold no tensor of layer {layer}'s attention (looked for "
            f"{' or '.join(p + '*' for p in candidates)}).",
        )
    found = {
        key[len(prefix) :]: shape
        for key, shape in shapes.items()
        if key.startswith(prefix)
    }
    if family == "gpt2":
        found = {k: v for k, v in found.items() if k not in _GPT2_BUFFERS}
    expected = _expected_shapes(settings)
    for tensor, shape in expected.items():
        if tensor not in found:
            _fail(folder, f"its weights lack {prefix + tensor} (shape {shape}).")
        if found[tensor] != shape:
            _fail(
                folder,
                f"{prefix + tensor} has shape {found[tensor]}; the config asks "
                f"for {shape}.",
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        what = sorted(
            {
                _WHAT_EXTRA[t.split(".")[0]]
                for t in extra
                if t.split(".")[0] in _WHAT_EXTRA
            }
        )
        _fail(
            folder,
            f"layer {layer}'s attention has tensors {extra}"
            + (f" ({', '.join(what)})" if what else "")
            + f" that a {model_type} attention of skattn does not represent.",
        )
    return {
        "folder": folder,
        "config": config,
        "settings": settings,
        "n_layers": n_layers,
        "layer": layer,
        "tokenizer": folder / "tokenizer.json",
        "weight_files": files,
        "prefix": prefix,
        "shapes": expected,
    }


def rope_tables(n_tokens, head_dim, theta):
    """``cos``, ``sin`` of shape ``(1, n_tokens, head_dim)`` in float64, as
    ``LlamaRotaryEmbedding.forward`` builds them (``emb = cat(freqs, freqs)``)
    for the default RoPE, positions ``0 ... n_tokens - 1``.

    Examples
    --------
    >>> cos, sin = rope_tables(3, 4, 10000.0)
    >>> cos.shape, float(cos[0, 0, 0]), float(sin[0, 1, 0])  # doctest: +ELLIPSIS
    ((1, 3, 4), 1.0, 0.841...)
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.arange(n_tokens, dtype=np.float64)[None, :, None] * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


class _Stop(Exception):
    """Raised by the hook once layer L's attention has run: the layers after it
    are not computed."""


def _load_model(checkpoint):
    torch = require("torch", extra="transformers", feature="Decoder checkpoints")
    transformers = require(
        "transformers", extra="transformers", feature="Decoder checkpoints"
    )
    # transformers' own bar of the weights it loads: not skattn's to show (a
    # --quiet run printed it on stderr)
    logging = transformers.utils.logging
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(checkpoint["folder"]), dtype=torch.float64, attn_implementation="sdpa"
        )
    finally:
        if shown:
            logging.enable_progress_bar()
    return model.eval()


def attention_module(model, checkpoint):
    """Layer L's attention module in ``model``: the one named as in the
    checkpoint's state dict, with or without the task head's prefix."""
    layer = checkpoint["layer"]
    ends = (f"h.{layer}.attn", f"layers.{layer}.self_attn")
    for name, module in model.named_modules():
        if name in ends or name.endswith(tuple("." + end for end in ends)):
            return name, module
    raise ValueError(
        f"the model loaded from {str(checkpoint['folder'])!r} has no module "
        f"{checkpoint['prefix'].rstrip('.')!r}."
    )


def run_attention(model, module, ids, *, settings, rope="float64", batch_size=64):
    """The inputs and outputs of ``module`` when ``model`` reads ``ids``.

    Each row of ``ids`` is one sequence (positions from 0, no padding); the
    model runs up to ``module`` only.  Returns ``X``, ``Y`` float64 arrays of
    shape ``(n, k, d)``.
    """
    torch = require("torch", extra="transformers", feature="Decoder checkpoints")
    k = ids.shape[1]
    tables = None
    if settings["rope_theta"] is not None and rope == "float64":
        tables = tuple(
            torch.as_tensor(t)
            for t in rope_tables(k, settings["head_dim"], settings["rope_theta"])
        )
    inputs, outputs = [], []

    def pre(mod, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs.append(hidden.detach().numpy().copy())
        if tables is not None:
            kwargs = {**kwargs, "position_embeddings": tables}
            return args, kwargs
        return None

    def post(mod, args, kwargs, out):
        outputs.append((out[0] if isinstance(out, tuple) else out).detach().numpy())
        raise _Stop

    hooks = [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            for start in range(0, len(ids), batch_size):
                batch = torch.as_tensor(ids[start : start + batch_size])
                try:
                    model(input_ids=batch, use_cache=False)
                except _Stop:
                    pass
    finally:
        for hook in hooks:
            hook.remove()
    return (
        np.concatenate(inputs).astype(np.float64),
        np.concatenate(outputs).astype(np.float64),
    )


def decoder_examples(checkpoint, ids, *, rope="float64", model=None):
    """Layer L's attention inputs X and outputs Y on token windows, by transformers.

    Parameters
    ----------
    checkpoint : dict
        From :func:`check_decoder_checkpoint`.
    ids : ndarray of int of shape (n, k)
        Token windows, each run alone from position 0.
    rope : {"float64", "model"}, default="float64"
        The RoPE tables handed to the attention module: built in float64, or
        the model's own (transformers computes them in float32).
    model : transformers model, default=None
        The model already loaded (else loaded from the folder, float64).

    Returns
    -------
    X, Y : ndarray of shape (n, k, d)
        What enters layer L's attention module and what it returns.
    model : transformers model
        The model (float64, eval mode).
    """
    model = _load_model(checkpoint) if model is None else model
    _, module = attention_module(model, checkpoint)
    X, Y = run_attention(
        model, module, np.asarray(ids), settings=checkpoint["settings"], rope=rope
    )
    return X, Y, model


def _hull_normals(X, tol=1e-10):
    """Directions ``N`` (orthonormal, ``(d, q)``) along which every token of X
    has the same coordinate, and the tokens' mean ``mu``: ``N^T x = N^T mu``
    on the data.  LayerNorm's outputs (GPT-2) lie in such a hyperplane."""
    tokens = np.asarray(X, dtype=np.float64).reshape(-1, np.shape(X)[-1])
    mu = tokens.mean(axis=0)
    d = tokens.shape[1]
    centered = tokens - mu
    if len(centered) < d:  # zero rows: the same row space, and all of Vt
        centered = np.vstack([centered, np.zeros((d - len(centered), d))])
    _, s, Vt = np.linalg.svd(centered, full_matrices=False)  # Vt: (d, d)
    return Vt[s <= tol * max(s[0], 1e-300)].T, mu


def module_ranks(layer, settings, X=None):
    """``layer`` with what the module cannot hold cut off: each head's values
    (GPT-2) or each key/value group's values (the others) projected onto their
    top ``head_dim`` directions.

    A learned layer is exact only up to its fit, so its values span the
    ``head_dim`` directions a module holds only up to that error; this keeps
    the leading ones (the written layer's error is then measured, not assumed).
    A module with value biases and no output bias (Qwen2) holds an intercept
    only in the span of its output maps: the intercept is projected there.

    With the fit's tokens ``X`` ``(..., d)`` and a module with an output bias:
    where the tokens lie in a proper affine subspace (LayerNorm's outputs,
    ``N^T x = N^T mu``), a head's values along ``N`` add a constant to the
    outputs, so the data leave them free and a fit may put anything there;
    they are moved into the intercept first (``W_i <- (I - N N^T) W_i``,
    ``c <- c + sum_i mu^T N N^T W_i``), the same function on the data.
    """
    if X is not None and "output" in settings["biases"]:
        N, mu = _hull_normals(X)
        if N.shape[1]:
            projection = np.array(layer.projection, dtype=np.float64)
            along = np.einsum("dq,mdo->mqo", N, projection)  # N^T W_i
            c = (
                np.zeros(projection.shape[2])
                if layer.intercept is None
                else (np.asarray(layer.intercept, dtype=np.float64))
            )
            layer.set_params(
                projection=projection - np.einsum("dq,mqo->mdo", N, along),
                intercept=c + np.einsum("q,mqo->o", N.T @ mu, along),
            )
    h, m, m_kv = settings["head_dim"], settings["n_heads"], settings["n_kv_heads"]
    projection = np.array(layer.projection, dtype=np.float64)
    groups = np.arange(m) // (m // m_kv)
    for g in range(m_kv):
        heads = np.flatnonzero(groups == g)
        columns = np.concatenate(projection[heads], axis=1)
        U, _, _ = np.linalg.svd(columns, full_matrices=False)
        basis = U[:, :h]
        if _range_basis(columns, h) is None:
            projection[heads] = basis @ (basis.T @ projection[heads])
    layer.set_params(projection=projection)
    if layer.intercept is None or "output" in settings["biases"]:
        return layer
    # value biases only: the intercept sum_g (sum_{i in g} O_i) b_g lies in the
    # span of the groups' summed projections' rows; keep its part there
    rows = np.concatenate(
        [projection[groups == g].sum(axis=0).T for g in range(m_kv)], axis=1
    )
    U, _, _ = np.linalg.svd(rows, full_matrices=False)
    U = U[:, : min(m_kv * h, U.shape[1])]
    intercept = np.asarray(layer.intercept, dtype=np.float64)
    return layer.set_params(intercept=U @ (U.T @ intercept))


def write_decoder_layer(path, layer, checkpoint, metadata=None):
    """Write ``layer`` in the checkpoint's own tensor names, as float64.

    The keys are the model's (``model.layers.1.self_attn.q_proj.weight``, ...;
    GPT-2's ``transformer.h.1.attn.c_attn.weight``, ...), the layout the
    module's (``Linear`` ``(out, in)``, GPT-2's ``Conv1D`` ``(in, out)``), so
    that ``model.load_state_dict(safetensors.torch.load_file(path),
    strict=False)`` loads it.  The values of each head (GPT-2) or key/value
    group are first cut to the module's ``head_dim`` directions
    (:func:`module_ranks`).

    Returns
    -------
    tensors : dict of str to ndarray
        What was written, by key.
    """
    settings = checkpoint["settings"]
    layer = module_ranks(clone(layer), settings)
    weights = decoder_weights(layer, settings, checkpoint["shapes"])
    tensors = {checkpoint["prefix"] + name: w for name, w in weights.items()}
    meta = {
        "format": DECODER_FORMAT,
        "checkpoint": str(checkpoint["folder"]),
        "layer": str(checkpoint["layer"]),
        "architecture": settings["architecture"],
    }
    meta.update(metadata or {})
    write_safetensors(path, tensors, meta)
    return tensors


# The brief training of save_random_decoder(train_steps=...): AdamW's step
# size and the windows in one step.
_TRAIN_LR = 3e-3
_TRAIN_BATCH = 16
_ROTARY = ("llama", "mistral", "qwen2")


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_save_arguments(architecture, rope_theta, train_steps, train_tokens, n):
    """The new arguments of :func:`save_random_decoder`, one-line errors."""
    if architecture not in ("gpt2",) + _ROTARY:
        raise ValueError(
            f"architecture={architecture!r} is not supported; choose one of "
            f"{['gpt2', *_ROTARY]}."
        )
    if rope_theta is not None:
        if architecture == "gpt2":
            raise ValueError(
                f"rope_theta={rope_theta!r} was given for architecture='gpt2', "
                "which has learned positions and no rotary base; pass "
                "rope_theta=None, or an architecture with RoPE "
                f"({', '.join(_ROTARY)})."
            )
        if (
            isinstance(rope_theta, bool)
            or not isinstance(rope_theta, (int, float, np.integer, np.floating))
            or not np.isfinite(rope_theta)
            or rope_theta <= 0
        ):
            raise ValueError(
                f"rope_theta must be a positive finite number (the rotary base, "
                f"e.g. 10000.0 or 500000.0) or None, got {rope_theta!r}."
            )
    if not _is_int(train_steps) or train_steps < 0:
        raise ValueError(
            f"train_steps must be a non-negative integer (0: no training, the "
            f"random model), got {train_steps!r}."
        )
    if train_tokens is not None and (
        not _is_int(train_tokens) or not 2 <= train_tokens <= n
    ):
        raise ValueError(
            f"train_tokens must be None (max_positions={n}) or an integer from 2 "
            f"(one next-token prediction) to max_positions={n}, got "
            f"{train_tokens!r}."
        )


def _train_briefly(model, ids, *, steps, window, random_state):
    """``steps`` AdamW steps of next-token prediction on random windows of
    ``window`` consecutive tokens of the stream ``ids``, in float32, dropout
    off; the sampling's own generator seeded with ``random_state``.  Returns
    the model (float64, eval mode)."""
    torch = require("torch", extra="transformers", feature="Decoder checkpoints")
    stream = torch.as_tensor(ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(int(random_state))
    offsets = torch.arange(window)
    model = model.float().eval()  # eval: no dropout (GPT-2's), the same steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=_TRAIN_LR)
    for _ in range(steps):
        starts = torch.randint(
            0, len(stream) - window + 1, (_TRAIN_BATCH,), generator=generator
        )
        batch = stream[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return model.double().eval()


def save_random_decoder(
    folder,
    architecture,
    texts,
    *,
    n_features=16,
    n_heads=2,
    n_kv_heads=1,
    n_layers=2,
    std=0.2,
    vocab_size=2000,
    max_positions=64,
    rope_theta=None,
    train_steps=0,
    train_tokens=None,
    random_state=0,
):
    """Save a random (or briefly trained) decoder checkpoint, made offline, in
    ``folder``.

    A tokenizer trained on ``texts`` (``tokenizers``' BPE with a whitespace
    pre-tokenizer, at most ``vocab_size`` tokens; ``tokenizer.json``) and a
    float64 transformers model of ``architecture`` drawn with
    ``initializer_range=std``, its attention biases (where it has them) drawn
    with std ``std`` too (``model.safetensors``, ``config.json``): a
    checkpoint for ``skattn layer`` in tests, benchmarks and examples.

    With ``train_steps > 0`` the drawn model is then trained that many steps
    on next-token prediction (``model(input_ids, labels=input_ids).loss``)
    before it is saved: AdamW (learning rate 3e-3, transformers' other
    defaults), each step on 16 windows of ``train_tokens`` consecutive tokens
    drawn at random from ``texts`` (each text tokenized by the tokenizer, all
    of them one stream), in float32 with dropout off; the model is then cast
    back to float64.  Its attention then has the structure of a trained
    model's (heads that look at tokens that matter), which a random one lacks.

    Parameters
    ----------
    folder : str or path-like
        Created if missing.
    architecture : {"gpt2", "llama", "mistral", "qwen2"}
    texts : list of str
        The text the tokenizer is trained on (and the model, with
        ``train_steps > 0``).
    n_features, n_heads, n_kv_heads, n_layers : int
        Hidden size, query heads, key/value heads (not GPT-2) and layers.
    std : float, default=0.2
    vocab_size, max_positions : int
    rope_theta : float, default=None
        The rotary base written in the config (``rope_theta``); None:
        transformers' default (10000.0).  Llama, Mistral and Qwen2 only: GPT-2
        has no rotary base and refuses one.
    train_steps : int, default=0
        AdamW steps of next-token prediction before saving; 0 saves the random
        model as drawn (the same weights, bit for bit, as without the
        argument).
    train_tokens : int, default=None
        The length of the training windows, from 2 to ``max_positions``; None:
        ``max_positions``.  Used only with ``train_steps > 0``; the texts must
        hold at least that many tokens.
    random_state : int, default=0
        The torch seed of the weights, and of the training windows' draw.

    Returns
    -------
    folder : pathlib.Path
    model : transformers model
        The model saved (float64, eval mode).

    Raises
    ------
    ValueError
        An unsupported architecture, ``rope_theta`` not a positive number or
        given for GPT-2, ``train_steps`` not a non-negative integer,
        ``train_tokens`` out of range, or (with ``train_steps > 0``) texts
        shorter than one window.

    Notes
    -----
    The same arguments give the same checkpoint: the weights' draw follows
    ``torch.manual_seed(random_state)`` and training uses no other randomness
    than its own generator's windows.  Training is float32 arithmetic on the
    CPU, so a different torch build or number of threads may round it
    differently.
    """
    _check_save_arguments(
        architecture, rope_theta, train_steps, train_tokens, max_positions
    )
    torch = require("torch", extra="transformers", feature="Decoder checkpoints")
    transformers = require(
        "transformers", extra="transformers", feature="Decoder checkpoints"
    )
    tokenizers = require(
        "tokenizers", extra="transformers", feature="Decoder checkpoints"
    )
    texts = list(texts)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        texts,
        tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["[UNK]"], show_progress=False
        ),
    )
    window = max_positions if train_tokens is None else train_tokens
    if train_steps > 0:
        ids = [i for encoding in tokenizer.encode_batch(texts) for i in encoding.ids]
        if len(ids) < window:
            raise ValueError(
                f"texts tokenize to {len(ids)} tokens, fewer than one training "
                f"window of train_tokens={window}"
                + (" (max_positions)" if train_tokens is None else "")
                + "; pass more text or a smaller train_tokens."
            )
    common = {
        "vocab_size": tokenizer.get_vocab_size(),
        "initializer_range": std,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if architecture == "gpt2":
        config = transformers.GPT2Config(
            n_embd=n_features,
            n_head=n_heads,
            n_layer=n_layers,
            n_positions=max_positions,
            **common,
        )
    else:
        cls = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig,
        }[architecture]
        extra = {"sliding_window": None} if architecture == "mistral" else {}
        if rope_theta is not None:
            extra["rope_theta"] = float(rope_theta)
        config = cls(
            hidden_size=n_features,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            num_hidden_layers=n_layers,
            intermediate_size=2 * n_features,
            max_position_embeddings=max_positions,
            **common,
            **extra,
        )
    torch.manual_seed(random_state)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (".attn." in name or ".self_attn." in name) and name.endswith("bias"):
                p.normal_(0.0, std)
    if train_steps > 0:
        model = _train_briefly(
            model, ids, steps=train_steps, window=window, random_state=random_state
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, model
