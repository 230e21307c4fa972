"""PyTorch interoperability of :class:`skattn.AttentionLayer` (torch is optional).

torch is imported lazily, only by the functions here; without it they raise an
ImportError naming the ``skattn[torch]`` extra.
"""

import functools

import numpy as np

from ..utils._optional import require
from ._convert import parameters_to_projections, projections_to_parameters


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


def parameters_to_torch(
    attention, projection, key_bias, intercept, *, batch_first, dtype, force_module
):
    """A torch module computing the layer (see ``AttentionLayer.to_torch``)."""
    torch = import_torch()
    m, d, _ = projection.shape
    weights = None
    if not force_module:
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
    return _layer_module_class()(
        *(
            torch.as_tensor(np.asarray(a, float), dtype=dtype)
            for a in (attention, projection, key_bias, intercept)
        ),
        batch_first=batch_first,
    )


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
        Masks are not supported.
        """

        def __init__(self, attention, projection, key_bias, intercept, batch_first):
            super().__init__()
            self.attention = torch.nn.Parameter(attention)
            self.projection = torch.nn.Parameter(projection)
            self.key_bias = torch.nn.Parameter(key_bias)
            self.intercept = torch.nn.Parameter(intercept)
            self.batch_first = batch_first

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
            logits = torch.einsum("nkd,mde,nae->nmka", X, self.attention, X)
            logits = logits + torch.einsum("nad,md->nma", X, self.key_bias)[:, :, None]
            patterns = torch.softmax(logits, dim=-1)
            out = torch.einsum("nmka,nad,mdo->nko", patterns, X, self.projection)
            out = out + self.intercept
            if not self.batch_first:
                out = out.transpose(0, 1)
            weights = patterns.mean(dim=1) if need_weights else None
            return out, weights

    return AttentionLayerModule
