"""The object of study: a multi-head attention layer.

``F(X) = sum_i softmax(X Theta_i X^T) X W_i`` (plus optional key biases and an
intercept):

* :class:`AttentionLayer`, a fixed (planted or learned) layer as a scikit-learn
  transformer, with its converters to and from query/key/value/output
  projections, torch modules and checkpoints (``from_projections``,
  ``from_torch``, ``to_torch``; torch imported lazily);
* decoder layers: a causal mask, rotary position embeddings (RoPE, "half" and
  "interleaved" layouts) and grouped-query heads (``causal``, ``rotary_query``,
  ``rotary_key``, ``rope_theta``, ``rope_layout``, ``n_kv_heads``), their math
  in the private module ``skattn.layer._positions``, and transformers'
  GPT-2, Llama, Mistral and Qwen2 attention modules in and out
  (``from_torch`` / ``to_torch(module=...)``; the maps, on arrays and
  ``config.json`` dictionaries, in ``skattn.layer._hf``);
* :func:`as_layer`, the one coercion of a layer or a fitted estimator;
* :func:`save_layer` and :func:`load_layer`, a layer's file (``.safetensors``
  or ``.npz``: what ``skattn fit`` writes), in ``skattn.layer._files``;
* ``check_layer_parameters``, ``check_layer_biases`` and
  ``check_decoder_parameters``, the validation of the parameter arrays;
* the math of F as pure functions on arrays (softmax, logits, patterns, per-head
  features, the forward pass, the loss gradient, the balanced low-rank factors
  of each head's matrices and the separation of the heads) in the private module
  ``skattn.layer._math``, which every other part of skattn computes with.
"""

from ._attention_layer import (
    AttentionLayer,
)
from ._attention_layer import (
    check_decoder_parameters as check_decoder_parameters,
)
from ._attention_layer import (
    check_layer_biases as check_layer_biases,
)
from ._attention_layer import (
    check_layer_parameters as check_layer_parameters,
)
from ._coerce import as_layer
from ._files import load_layer, save_layer

__all__ = ["AttentionLayer", "as_layer", "load_layer", "save_layer"]
