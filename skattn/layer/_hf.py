"""Decoder attention modules of transformers: GPT-2, Llama, Mistral and Qwen2.

Maps, as pure functions of arrays and of the configuration dictionary
(``config.json`` or ``PretrainedConfig.to_dict()``; no torch or transformers
needed), between the weights of an attention sub-layer, in the module's own
tensor names, and the parameters of :class:`skattn.AttentionLayer`:

* GPT-2 (``GPT2Attention``): causal, no positions in the layer (GPT-2 adds its
  position embeddings to the tokens before), one fused ``c_attn`` of
  ``Conv1D`` layout ``(in, out)`` holding the query, key and value weights and
  biases, and ``c_proj``.  The layer is the position-free products ``Theta_i``,
  ``u_i``, ``W_i``, ``c`` of :mod:`skattn.layer._convert`, with
  ``causal=True`` and the module's scale.
* Llama, Mistral, Qwen2 (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` of
  ``Linear`` layout ``(out, in)``): causal, rotary positions on the whole head
  (``rotate_half``), grouped-query heads (``num_key_value_heads``), query, key
  and value biases for Qwen2 (and all four for Llama with
  ``attention_bias=True``).  The layer holds the rotary maps ``rotary_query``
  (the scale folded in) and ``rotary_key`` with a bias row, zero
  ``attention``, and the products ``W_i`` and ``c`` of the value and output
  weights.

transformers computes the RoPE tables in float32 (``LlamaRotaryEmbedding``
casts the frequencies and the angles to float32 even in a float64 model); skattn
computes them in float64, so a float64 model agrees with skattn to rounding when
it is handed float64 tables (``position_embeddings``), and to float32 rounding of
the angles (about 1e-6 relative) with its own.

What these modules may do that the layer does not represent is refused with a
one-line ValueError naming it (:func:`decoder_settings`): RoPE scalings other
than the default, partial rotary factors, sliding windows, attention logit
soft-capping, cross-attention, attention sinks, query/key norms, head counts
that do not divide.
"""

import numpy as np

from ._convert import _range_basis, parameters_to_projections, projections_to_parameters
from ._positions import layout_permutation

# transformers class name -> architecture; model_type -> architecture
MODULE_CLASSES = {
    "GPT2Attention": "gpt2",
    "LlamaAttention": "llama",
    "MistralAttention": "mistral",
    "Qwen2Attention": "qwen2",
}
ARCHITECTURES = ("gpt2", "llama", "mistral", "qwen2")


def _positive_int(config, name, model_type):
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(
            f"config of model_type={model_type!r} has {name}={value!r}; a positive "
            f"integer is required."
        )
    return int(value)


def _rope(config, model_type):
    """``rope_theta`` of a config, refusing every RoPE variant but the default."""
    params = config.get("rope_parameters")
    if params is None:  # transformers 4: rope_theta and rope_scaling
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ValueError(
            f"config of model_type={model_type!r} has rope_parameters={params!r}; "
            f"a dictionary is expected."
        )
    if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"config of model_type={model_type!r} has RoPE parameters per layer type "
            f"({sorted(params)}); only one RoPE for every layer is supported."
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(
            f"config of model_type={model_type!r} has rope_type={rope_type!r} "
            f"(rope_scaling); only the default RoPE (rope_type='default', no "
            f"scaling) is supported."
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"config of model_type={model_type!r} has partial_rotary_factor="
            f"{partial!r}; its attention rotates the whole head, so only 1.0 is "
            f"supported."
        )
    theta = params.get("rope_theta", 10000.0)
    if (
        isinstance(theta, bool)
        or not isinstance(theta, int | float)
        or not np.isfinite(theta)
        or theta <= 0
    ):
        raise ValueError(
            f"config of model_type={model_type!r} has rope_theta={theta!r}; a "
            f"positive number is required."
        )
    return float(theta)


def decoder_settings(config, layer_idx=None):
    """The attention settings of a decoder config, or a one-line ValueError.

    Parameters
    ----------
    config : dict
        ``config.json`` of a GPT-2, Llama, Mistral or Qwen2 checkpoint (or
        ``PretrainedConfig.to_dict()``).
    layer_idx : int, default=None
        The layer (for per-layer settings: GPT-2's
        ``scale_attn_by_inverse_layer_idx``, Qwen2's layer types).

    Returns
    -------
    settings : dict
        ``architecture``, ``n_features``, ``n_heads``, ``n_kv_heads``,
        ``head_dim``, ``scale`` (the logit scale), ``rope_theta`` (None for
        GPT-2) and ``biases`` (the set of ``"query"``, ``"key"``, ``"value"``,
        ``"output"`` the module has).

    Examples
    --------
    >>> s = decoder_settings({"model_type": "qwen2", "hidden_size": 64,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2})
    >>> s["head_dim"], s["n_kv_heads"], sorted(s["biases"])
    (16, 2, ['key', 'query', 'value'])
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}.")
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture model_type={model_type!r}; supported decoder "
            f"attention: {list(ARCHITECTURES)}."
        )
    if config.get("add_cross_attention") or config.get("is_encoder_decoder"):
        raise ValueError(
            f"config of model_type={model_type!r} has cross-attention "
            f"(add_cross_attention / is_encoder_decoder); only self-attention "
            f"decoders are supported."
        )
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if config.get(name) is not None:
            raise ValueError(
                f"config of model_type={model_type!r} has {name}={config[name]!r} "
                f"(Gemma-style soft-capping of the attention logits); not supported."
            )
    if model_type == "gpt2":
        d = _positive_int(config, "n_embd", model_type)
        m = _positive_int(config, "n_head", model_type)
        if d % m:
            raise ValueError(
                f"config of model_type='gpt2' has n_head={m}, which does not divide "
                f"n_embd={d}."
            )
        scale = (d // m) ** -0.5 if config.get("scale_attn_weights", True) else 1.0
        if config.get("scale_attn_by_inverse_layer_idx", False):
            if layer_idx is None:
                raise ValueError(
                    "config of model_type='gpt2' has scale_attn_by_inverse_layer_idx="
                    "True; pass layer_idx (the scale depends on the layer)."
                )
            scale /= float(layer_idx + 1)
        return {
            "architecture": "gpt2",
            "n_features": d,
            "n_heads": m,
            "n_kv_heads": m,
            "head_dim": d // m,
            "scale": scale,
            "rope_theta": None,
            "biases": {"query", "key", "value", "output"},
        }
    d = _positive_int(config, "hidden_size", model_type)
    m = _positive_int(config, "num_attention_heads", model_type)
    if config.get("num_key_value_heads") is None:
        m_kv = m
    else:
        m_kv = _positive_int(config, "num_key_value_heads", model_type)
    if m % m_kv:
        raise ValueError(
            f"config of model_type={model_type!r} has num_key_value_heads={m_kv}, "
            f"which does not divide num_attention_heads={m}."
        )
    head_dim = config.get("head_dim") or d // m
    if not isinstance(head_dim, int | np.integer) or head_dim < 1:
        raise ValueError(
            f"config of model_type={model_type!r} has head_dim={head_dim!r}; a "
            f"positive integer is required."
        )
    if head_dim % 2:
        raise ValueError(
            f"config of model_type={model_type!r} has head_dim={head_dim}, odd: "
            f"the rotary dimension (the whole head) must be even."
        )
    if model_type == "mistral" and config.get("sliding_window") is not None:
        raise ValueError(
            f"config of model_type='mistral' has sliding_window="
            f"{config['sliding_window']!r}; sliding-window attention is not "
            f"supported (set sliding_window=None)."
        )
    if model_type == "qwen2" and config.get("use_sliding_window"):
        raise ValueError(
            "config of model_type='qwen2' has use_sliding_window=True; "
            "sliding-window attention is not supported."
        )
    types = config.get("layer_types")
    if types is not None:
        chosen = types if layer_idx is None else [types[layer_idx]]
        other = sorted({t for t in chosen if t != "full_attention"})
        if other:
            raise ValueError(
                f"config of model_type={model_type!r} has layer_types {other}; only "
                f"'full_attention' layers are supported."
            )
    theta = _rope(config, model_type)
    if model_type == "qwen2":
        biases = {"query", "key", "value"}
    elif model_type == "llama" and config.get("attention_bias", False):
        biases = {"query", "key", "value", "output"}
    else:
        biases = set()
    return {
        "architecture": model_type,
        "n_features": d,
        "n_heads": m,
        "n_kv_heads": m_kv,
        "head_dim": int(head_dim),
        "scale": float(head_dim) ** -0.5,
        "rope_theta": theta,
        "biases": biases,
    }


def _weight(weights, name, shape):
    """``weights[name]`` as float64 of ``shape``, or a one-line ValueError."""
    if name not in weights:
        raise ValueError(f"the attention weights lack {name!r}.")
    arr = np.asarray(weights[name], dtype=np.float64)
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}; expected {shape}.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} has NaN or infinite values.")
    return arr


def _bias(weights, name, size):
    return None if name not in weights else _weight(weights, name, (size,))


_LINEAR = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}


def decoder_parameters(weights, settings):
    """The :class:`~skattn.AttentionLayer` keywords of a decoder's attention.

    Parameters
    ----------
    weights : dict of array-like
        The attention module's tensors in its own names (``c_attn.weight``, ...
        for GPT-2; ``q_proj.weight``, ``q_proj.bias``, ... otherwise).
    settings : dict
        From :func:`decoder_settings`.

    Returns
    -------
    params : dict
        ``attention``, ``projection``, ``key_bias``, ``intercept``, ``causal``
        and, for the rotary architectures, ``rotary_query``, ``rotary_key``,
        ``rope_theta``, ``rope_layout`` and ``n_kv_heads``.

    Examples
    --------
    >>> import numpy as np
    >>> s = decoder_settings({"model_type": "llama", "hidden_size": 4,
    ...     "num_attention_heads": 2, "num_key_value_heads": 1})
    >>> w = {"q_proj.weight": np.ones((4, 4)), "k_proj.weight": np.ones((2, 4)),
    ...      "v_proj.weight": np.ones((2, 4)), "o_proj.weight": np.ones((4, 4))}
    >>> p = decoder_parameters(w, s)
    >>> p["rotary_query"].shape, p["rotary_key"].shape, p["projection"].shape
    ((2, 4, 2), (1, 4, 2), (2, 4, 4))
    """
    d, m, m_kv = settings["n_features"], settings["n_heads"], settings["n_kv_heads"]
    h, scale = settings["head_dim"], settings["scale"]
    if settings["architecture"] == "gpt2":
        fused = _weight(weights, "c_attn.weight", (d, 3 * d))
        fused_bias = _bias(weights, "c_attn.bias", 3 * d)
        out = _weight(weights, "c_proj.weight", (d, d)).T
        out_bias = _bias(weights, "c_proj.bias", d)
        b = np.zeros(3 * d) if fused_bias is None else fused_bias
        attention, projection, key_bias, intercept = projections_to_parameters(
            fused[:, :d].T,
            fused[:, d : 2 * d].T,
            fused[:, 2 * d :].T,
            out,
            m,
            biases={
                "query": b[:d],
                "key": b[d : 2 * d],
                "value": b[2 * d :],
                "output": out_bias,
            },
            scale=scale,
        )
        return {
            "attention": attention,
            "projection": projection,
            "key_bias": key_bias,
            "intercept": intercept,
            "causal": True,
        }
    rows = {"query": m * h, "key": m_kv * h, "value": m_kv * h}
    W = {n: _weight(weights, f"{_LINEAR[n]}.weight", (r, d)) for n, r in rows.items()}
    d_out = np.shape(weights.get("o_proj.weight", np.zeros((0, 0))))[0]
    W["output"] = _weight(weights, "o_proj.weight", (d_out, m * h))
    sizes = {**rows, "output": d_out}
    b = {n: _bias(weights, f"{_LINEAR[n]}.bias", sizes[n]) for n in _LINEAR}
    zero = {n: np.zeros(sizes[n]) if b[n] is None else b[n] for n in _LINEAR}
    query = W["query"].reshape(m, h, d).transpose(0, 2, 1)
    key = W["key"].reshape(m_kv, h, d).transpose(0, 2, 1)
    if b["query"] is not None or b["key"] is not None:
        query = np.concatenate([query, zero["query"].reshape(m, 1, h)], axis=1)
        key = np.concatenate([key, zero["key"].reshape(m_kv, 1, h)], axis=1)
    group = np.arange(m) // (m // m_kv)
    value = W["value"].reshape(m_kv, h, d)[group]  # (m, h, d)
    out = W["output"].reshape(d_out, m, h).transpose(1, 0, 2)  # (m, d_out, h)
    projection = np.einsum("mhd,moh->mdo", value, out)
    intercept = None
    if b["value"] is not None or b["output"] is not None:
        value_bias = zero["value"].reshape(m_kv, h)[group].reshape(-1)
        intercept = W["output"] @ value_bias + zero["output"]
    return {
        "attention": np.zeros((m, d, d)),
        "projection": projection,
        "key_bias": None,
        "intercept": intercept,
        "causal": True,
        "rotary_query": scale * query,
        "rotary_key": key,
        "rope_theta": settings["rope_theta"],
        "rope_layout": "half",
        "n_kv_heads": m_kv,
    }


def _refuse(settings, why):
    raise ValueError(
        f"this layer does not fit a {settings['architecture']} attention module: {why}."
    )


def decoder_weights(layer, settings, names):
    """A decoder module's tensors (its own names) computing ``layer``, exactly.

    The inverse of :func:`decoder_parameters` up to the gauge of each head's
    factors.  ``names`` are the module's tensor names (its ``state_dict``
    keys): every one is returned (zero biases where the layer has none), and a
    bias the layer needs but the module lacks is a ValueError, as is a layer
    the module cannot hold (positions, mask, head counts, ranks above the head
    dimension), naming the reason.

    Parameters
    ----------
    layer : AttentionLayer
    settings : dict
        From :func:`decoder_settings` (of the module's config).
    names : iterable of str

    Returns
    -------
    weights : dict of ndarray

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> s = decoder_settings({"model_type": "gpt2", "n_embd": 4, "n_head": 2})
    >>> names = ["c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"]
    >>> layer = AttentionLayer(np.zeros((2, 4, 4)), np.zeros((2, 4, 4)), causal=True)
    >>> decoder_weights(layer, s, names)["c_attn.weight"].shape
    (4, 12)
    """
    names = set(names)
    attention, projection, key_bias, intercept = layer._parameters()
    decoder = layer._decoder(attention)
    d, m, m_kv = settings["n_features"], settings["n_heads"], settings["n_kv_heads"]
    h, scale = settings["head_dim"], settings["scale"]
    if projection.shape != (m, d, d):
        _refuse(
            settings,
            f"its attention and projection have shape {attention.shape}, "
            f"{projection.shape}; the module has {m} heads of {d} features in and out",
        )
    if not decoder.get("causal"):
        _refuse(settings, "the module is causal but the layer is not (causal=False)")
    rotary = decoder.get("rotary")
    if settings["architecture"] == "gpt2":
        if rotary is not None:
            _refuse(
                settings, "the layer has rotary positions; GPT-2's attention has none"
            )
        if layer.n_kv_heads not in (None, m):
            _refuse(settings, f"n_kv_heads={layer.n_kv_heads}; GPT-2 has {m} key heads")
        weights, reason = parameters_to_projections(
            attention,
            projection,
            np.zeros((m, d)) if key_bias is None else key_bias,
            np.zeros(d) if intercept is None else intercept,
            m,
            scale=scale,
        )
        if weights is None:
            _refuse(settings, reason)
        out = {
            "c_attn.weight": np.concatenate(
                [weights["query"], weights["key"], weights["value"]]
            ).T,
            "c_attn.bias": np.concatenate(
                [weights["query_bias"], weights["key_bias"], weights["value_bias"]]
            ),
            "c_proj.weight": weights["output"].T,
            "c_proj.bias": weights["output_bias"],
        }
        return _only(out, names, settings)
    if rotary is None:
        _refuse(settings, "the layer has no rotary positions (rotary_query=None)")
    if rotary.query.shape[2] != h:
        _refuse(
            settings,
            f"its rotary dimension is {rotary.query.shape[2]}; the module rotates "
            f"whole heads of head_dim={h}",
        )
    if rotary.key.shape[0] != m_kv:
        _refuse(
            settings,
            f"it has {rotary.key.shape[0]} key heads; the module has "
            f"num_key_value_heads={m_kv}",
        )
    if rotary.base != settings["rope_theta"]:
        _refuse(
            settings,
            f"its rope_theta={rotary.base!r} differs from the module's "
            f"{settings['rope_theta']!r}",
        )
    if np.any(attention) or (key_bias is not None and np.any(key_bias)):
        _refuse(
            settings,
            "it has position-free logits (attention or key_bias not zero), which "
            "a module rotating whole heads cannot hold",
        )
    perm = layout_permutation(h, rotary.layout, "half")
    query, key = rotary.query[..., perm], rotary.key[..., perm]
    out = {
        "q_proj.weight": (query[:, :d] / scale).transpose(0, 2, 1).reshape(m * h, d),
        "q_proj.bias": query[:, d].reshape(-1) / scale,
        "k_proj.weight": key[:, :d].transpose(0, 2, 1).reshape(m_kv * h, d),
        "k_proj.bias": key[:, d].reshape(-1),
    }
    group = np.arange(m) // (m // m_kv)
    value = np.zeros((m_kv, h, d))
    output = np.zeros((m, d, h))  # per head, (d_out, h)
    for g in range(m_kv):  # per group: a shared value basis, no loop over samples
        heads = np.flatnonzero(group == g)
        basis = _range_basis(np.concatenate(projection[heads], axis=1), h)
        if basis is None:
            _refuse(
                settings,
                f"the projections of key/value group {g} (heads {heads.tolist()}) "
                f"span more than head_dim={h} dimensions",
            )
        r = basis.shape[1]
        value[g, :r] = basis.T
        for i in heads:
            output[i, :, :r] = (basis.T @ projection[i]).T
    out["v_proj.weight"] = value.reshape(m_kv * h, d)
    out["o_proj.weight"] = output.transpose(1, 0, 2).reshape(d, m * h)
    c = np.zeros(d) if intercept is None else intercept
    out["v_proj.bias"], out["o_proj.bias"] = np.zeros(m_kv * h), np.zeros(d)
    if "o_proj.bias" in names:
        out["o_proj.bias"] = c
    elif np.any(c):
        if "v_proj.bias" not in names:
            _refuse(
                settings,
                "it has an intercept; the module has no value or output biases",
            )
        # c = sum_g (sum_{i in g} Wo_i) bv_g: value biases that give it
        A = np.stack(
            [output[group == g].sum(axis=0) for g in range(m_kv)], axis=1
        ).reshape(d, m_kv * h)
        bv, *_ = np.linalg.lstsq(A, c, rcond=None)
        if np.abs(A @ bv - c).max() > 1e-10 * max(1.0, np.abs(c).max()):
            _refuse(
                settings,
                "its intercept is not in the span of the output weights, and the "
                "module has value biases only (no o_proj.bias)",
            )
        out["v_proj.bias"] = bv
    return _only(out, names, settings)


def _only(weights, names, settings):
    """``weights`` restricted to ``names``; a nonzero bias the module lacks, or a
    name it has that is not here, raises."""
    for name, arr in weights.items():
        if name not in names and np.any(arr):
            _refuse(
                settings,
                f"it needs {name} (nonzero), which the module does not have",
            )
    missing = sorted(names - set(weights))
    if missing:
        _refuse(settings, f"the module has tensors {missing} this layer has no map for")
    return {name: weights[name] for name in names}
