"""PyTorch interoperability of :class:`skattn.AttentionLayer` (torch is optional).

torch is imported lazily, only by the functions here; without it they raise an
ImportError naming the ``skattn[torch]`` extra.
"""

import functools

import numpy as np

from ..utils._optional import require
from ._convert import parameters_to_projections, projections_to_parameters
from ._hf import (
    MODULE_CLASSES,
    decoder_parameters,
    decoder_settings,
    decoder_weights,
)


def import_torch():
    """Import torch, or raise an ImportError that names the pip extra.

    Examples
    --------
    >>> import_torch().__name__
    'torch'
    """
    return require("torch", extra="torch", feature="This feature")


def _numpy(tensor):
    return None if tensor is None else tensor.detach().cpu().double().numpy()


def torch_parameters(module):
    """skattn parameters of a ``torch.nn.MultiheadAttention`` (or skattn) module.

    Parameters
    ----------
    module : torch.nn.MultiheadAttention or the module returned by ``to_torch``

    Returns
    -------
    attention, projection, key_bias, intercept : ndarray
        As in :func:`skattn.layer._convert.projections_to_parameters`.

    Raises
    ------
    TypeError
        If ``module`` is not a supported module.
    ValueError
        For ``add_bias_kv=True``, ``add_zero_attn=True`` or ``kdim``/``vdim``
        different from ``embed_dim``, naming the option.
    """
    torch = import_torch()
    if isinstance(module, _layer_module_class()):
        return tuple(
            _numpy(p)
            for p in (
                module.attention,
                module.projection,
                module.key_bias,
                module.intercept,
            )
        )
    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(
            f"module must be a torch.nn.MultiheadAttention (or a module returned by "
            f"AttentionLayer.to_torch), got {type(module).__name__}."
        )
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError(
            "module was built with add_bias_kv=True: its learned key/value bias "
            "tokens are extra sequence positions, which AttentionLayer does not "
            "represent; use a module with add_bias_kv=False."
        )
    if module.add_zero_attn:
        raise ValueError(
            "module was built with add_zero_attn=True: the extra all-zero key/value "
            "position is not part of AttentionLayer's model; use add_zero_attn=False."
        )
    if not module._qkv_same_embed_dim:
        raise ValueError(
            f"module has kdim={module.kdim}, vdim={module.vdim} different from "
            f"embed_dim={module.embed_dim}: AttentionLayer is self-attention on one "
            f"token sequence, so keys and values must have the queries' width; use "
            f"kdim=vdim=embed_dim (or None)."
        )
    E = module.embed_dim
    w = _numpy(module.in_proj_weight)
    b = _numpy(module.in_proj_bias)
    biases = None
    if b is not None or module.out_proj.bias is not None:
        zeros = np.zeros(3 * E) if b is None else b
        biases = {
            "query": zeros[:E],
            "key": zeros[E : 2 * E],
            "value": zeros[2 * E :],
            "output": _numpy(module.out_proj.bias),
        }
    return projections_to_parameters(
        w[:E],
        w[E : 2 * E],
        w[2 * E :],
        _numpy(module.out_proj.weight),
        module.num_heads,
        biases=biases,
    )


def hf_architecture(module):
    """The architecture (``"gpt2"``, ``"llama"``, ``"mistral"``, ``"qwen2"``) of
    a transformers attention module (or a subclass), else None."""
    for cls in type(module).__mro__:
        if cls.__name__ in MODULE_CLASSES and cls.__module__.startswith("transformers"):
            return MODULE_CLASSES[cls.__name__]
    return None


def _hf_settings(module):
    """:func:`~skattn.layer._hf.decoder_settings` of a transformers attention
    module, refusing what the module itself does beyond its config."""
    name = type(module).__name__
    if getattr(module, "is_cross_attention", False):
        raise ValueError(
            f"{name} is a cross-attention module (is_cross_attention=True); only "
            f"self-attention is supported."
        )
    for attr, what in (
        ("sinks", "attention sinks"),
        ("q_norm", "query/key norms"),
        ("k_norm", "query/key norms"),
    ):
        if getattr(module, attr, None) is not None:
            raise ValueError(f"{name} has {attr} ({what}); not supported.")
    if getattr(module, "sliding_window", None) is not None:
        raise ValueError(
            f"{name} has sliding_window={module.sliding_window!r}; sliding-window "
            f"attention is not supported."
        )
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{name} has no config; cannot read its settings.")
    settings = decoder_settings(config.to_dict(), getattr(module, "layer_idx", None))
    settings["scale"] = float(getattr(module, "scaling", settings["scale"]))
    head_dim = getattr(module, "head_dim", settings["head_dim"])
    if head_dim != settings["head_dim"]:
        raise ValueError(
            f"{name} has head_dim={head_dim} but its config gives "
            f"{settings['head_dim']}."
        )
    return settings


def hf_module_parameters(module):
    """The :class:`~skattn.AttentionLayer` keywords of a transformers GPT-2,
    Llama, Mistral or Qwen2 attention module (see :mod:`skattn.layer._hf`)."""
    settings = _hf_settings(module)
    weights = {name: _numpy(t) for name, t in module.state_dict().items()}
    return decoder_parameters(weights, settings)


def hf_write(layer, module):
    """Write ``layer`` into a transformers attention module (in place, strict
    ``load_state_dict``); the module in eval mode."""
    torch = import_torch()
    settings = _hf_settings(module)
    state = module.state_dict()
    weights = decoder_weights(layer, settings, state)
    module.load_state_dict(
        {
            name: torch.as_tensor(weights[name], dtype=state[name].dtype)
            for name in state
        },
        strict=True,
    )
    return module.eval()


def parameters_to_torch(
    attention,
    projection,
    key_bias,
    intercept,
    *,
    batch_first,
    dtype,
    force_module,
    causal=False,
    rotary=None,
):
    """A torch module computing the layer (see ``AttentionLayer.to_torch``)."""
    torch = import_torch()
    m, d, _ = projection.shape
    weights = None
    if not force_module and not causal and rotary is None:
        weights, _ = parameters_to_projections(
            attention, projection, key_bias, intercept, m
        )
    if weights is not None:
        module = torch.nn.MultiheadAttention(
            d, m, bias=True, batch_first=batch_first, dtype=dtype
        )
        in_weight = np.concatenate([weights[n] for n in ("query", "key", "value")])
        in_bias = np.concatenate(
            [weights[n] for n in ("query_bias", "key_bias", "value_bias")]
        )
        with torch.no_grad():
            module.in_proj_weight.copy_(torch.as_tensor(in_weight, dtype=dtype))
            module.in_proj_bias.copy_(torch.as_tensor(in_bias, dtype=dtype))
            module.out_proj.weight.copy_(
                torch.as_tensor(weights["output"], dtype=dtype)
            )
            module.out_proj.bias.copy_(
                torch.as_tensor(weights["output_bias"], dtype=dtype)
            )
        return module.eval()
    tensors = [
        torch.as_tensor(np.asarray(a, float), dtype=dtype)
        for a in (attention, projection, key_bias, intercept)
    ]
    module = _layer_module_class()(*tensors, batch_first=batch_first)
    if causal or rotary is not None:
        module.set_decoder(causal, rotary, dtype)
    return module


@functools.cache
def _layer_module_class():
    """The class of skattn's own torch module (defined once torch is imported)."""
    torch = import_torch()

    class AttentionLayerModule(torch.nn.Module):
        """skattn's layer as a torch module, for heads ``nn.MultiheadAttention``
        cannot hold (rank above head_dim, ``n_outputs != n_features``, or
        ``n_heads`` not dividing ``n_features``).

        ``forward(query, key=None, value=None, need_weights=True)`` mimics
        ``nn.MultiheadAttention`` for self-attention: ``key`` and ``value`` must
        be ``None`` or the same tensor as ``query``; it returns ``(output,
        weights)`` with the head-averaged attention weights (or ``None``).
        Masks are not supported (a causal layer masks itself).
        """

        def __init__(self, attention, projection, key_bias, intercept, batch_first):
            super().__init__()
            self.attention = torch.nn.Parameter(attention)
            self.projection = torch.nn.Parameter(projection)
            self.key_bias = torch.nn.Parameter(key_bias)
            self.intercept = torch.nn.Parameter(intercept)
            self.batch_first = batch_first
            self.causal = False
            self.rotary_query = self.rotary_key = None
            self.rope_theta, self.rope_layout = 10000.0, "half"

        def set_decoder(self, causal, rotary, dtype):
            """Make it a decoder layer: the causal mask and the rotary maps."""
            self.causal = bool(causal)
            if rotary is not None:
                self.rotary_query = torch.nn.Parameter(
                    torch.as_tensor(rotary.query, dtype=dtype)
                )
                self.rotary_key = torch.nn.Parameter(
                    torch.as_tensor(rotary.key, dtype=dtype)
                )
                self.rope_theta, self.rope_layout = rotary.base, rotary.layout

        def forward(
            self,
            query,
            key=None,
            value=None,
            need_weights=True,
            attn_mask=None,
            key_padding_mask=None,
        ):
            for name, mask in (
                ("attn_mask", attn_mask),
                ("key_padding_mask", key_padding_mask),
            ):
                if mask is not None:
                    raise ValueError(
                        f"{name} is not supported: AttentionLayer attends over all "
                        f"tokens of a sequence; pass {name}=None."
                    )
            for name, other in (("key", key), ("value", value)):
                if other is not None and other is not query:
                    raise ValueError(
                        f"{name} must be None or the query tensor itself: this "
                        f"module is self-attention on one token sequence."
                    )
            X = query if self.batch_first else query.transpose(0, 1)
            if self.causal or self.rotary_query is not None:
                return self._decoder_forward(X, need_weights)
            logits = torch.einsum("nkd,mde,nae->nmka", X, self.attention, X)
            logits = logits + torch.einsum("nad,md->nma", X, self.key_bias)[:, :, None]
            patterns = torch.softmax(logits, dim=-1)
            out = torch.einsum("nmka,nad,mdo->nko", patterns, X, self.projection)
            out = out + self.intercept
            if not self.batch_first:
                out = out.transpose(0, 1)
            weights = patterns.mean(dim=1) if need_weights else None
            return out, weights

        def _decoder_forward(self, X, need_weights):
            """skattn's math on the tensors (autograd flows through it)."""
            from ._math import attention_patterns, forward
            from ._positions import Rotary

            decoder = {"causal": self.causal}
            if self.rotary_query is not None:
                decoder["rotary"] = Rotary(
                    self.rotary_query,
                    self.rotary_key,
                    self.rope_theta,
                    self.rope_layout,
                )
            out = forward(
                X,
                self.attention,
                self.projection,
                key_bias=self.key_bias,
                intercept=self.intercept,
                **decoder,
            )
            if not self.batch_first:
                out = out.transpose(0, 1)
            weights = None
            if need_weights:
                patterns = attention_patterns(
                    X, self.attention, self.key_bias, **decoder
                )
                weights = patterns.mean(dim=1)
            return out, weights

    return AttentionLayerModule
