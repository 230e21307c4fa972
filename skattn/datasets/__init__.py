"""Input distributions and planted attention layers.

* :class:`BooleanTokens`, :class:`GaussianTokens`, :class:`VocabularyTokens`
  (embedded words with positions), :class:`TokenizedMixture`: input
  distributions with ``sample`` and batch-size-invariant ``iter_batches``;
* :func:`make_attention_layer`: a planted :class:`~skattn.AttentionLayer`;
* :func:`make_attention_regression`: examples ``(X, F(X) + noise)`` of one;
* :func:`sample_inputs`: draw from a distribution given by name;
* :class:`EmbeddedTokens`: embedded vocabulary tokens (real token distributions);
* :func:`load_bert_attention`: a pretrained BERT-style attention layer and its
  embedded tokens, from a ``.safetensors`` checkpoint (e.g. all-MiniLM-L6-v2,
  :func:`minilm_checkpoint_path`).
* :class:`BertEncoder`: a BERT-style encoder's forward pass in numpy;
  :func:`stdlib_docstring_tokens`: real text (the standard library's docstrings)
  as token ids; :class:`PretrainedHiddenStates`: windows of it as the hidden
  states entering layer L; :func:`load_bert_hidden_states`: layer L's attention
  with that distribution.
* :func:`write_attention_regression`, :func:`open_attention_regression`: the same
  examples written to disk in chunks (zarr, HDF5 or ``.npy`` memmaps), of any size.
"""

from ._distributions import (
    BooleanTokens,
    GaussianTokens,
    TokenDistribution,
    TokenizedMixture,
    VocabularyTokens,
    resolve_distribution,
    sample_inputs,
)
from ._encoder import (
    BertEncoder,
    PretrainedHiddenStates,
    load_bert_hidden_states,
    stdlib_docstring_tokens,
)
from ._generators import make_attention_layer, make_attention_regression
from ._pretrained import EmbeddedTokens, load_bert_attention, minilm_checkpoint_path
from ._writer import open_attention_regression, write_attention_regression

__all__ = [
    "BertEncoder",
    "BooleanTokens",
    "EmbeddedTokens",
    "GaussianTokens",
    "PretrainedHiddenStates",
    "TokenDistribution",
    "TokenizedMixture",
    "VocabularyTokens",
    "load_bert_attention",
    "load_bert_hidden_states",
    "make_attention_layer",
    "make_attention_regression",
    "minilm_checkpoint_path",
    "open_attention_regression",
    "resolve_distribution",
    "sample_inputs",
    "stdlib_docstring_tokens",
    "write_attention_regression",
]
