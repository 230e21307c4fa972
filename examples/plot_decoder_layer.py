"""
=====================================================
A decoder layer: causal, rotary, grouped-query heads
=====================================================

A decoder's attention (Llama, Mistral, Qwen2) masks the tokens after the query
(causal), rotates queries and keys by their positions (RoPE) and lets several
query heads share one key/value head (grouped-query attention).  Here a planted
layer of that kind, 4 query heads sharing 2 key/value heads of dimension 2 in
d = 8, on sequences of k = 6 Gaussian tokens, is learned back by
:class:`~skattn.MultiHeadAttentionRegressor`, and, beside it, by Adam on a
PyTorch decoder attention module of the same shape from a random init (skipped
with a note when torch is not installed).  The user guide's *Decoder layers*
page explains the model; ``benchmarks/bench_torch_anchors.py --teacher decoder``
runs the same comparison with transformers' own ``LlamaAttention``, Adam and
L-BFGS, at the size of a small Llama layer.
"""

# %%
# A planted decoder layer
# -----------------------
# Head i's logit between query token l and key token a <= l is
# ``x_l^T Q_i R((a - l) omega) K_g^T x_a``, with ``g = i // 2`` the key/value
# head its group shares and ``R`` the rotation of RoPE; keys after the query are
# masked.  1000 sequences to learn from, 500 more held out.
import time

import matplotlib.pyplot as plt
import numpy as np

from skattn import MultiHeadAttentionRegressor
from skattn.datasets import make_attention_regression

n_heads, n_kv_heads, d, r, k = 4, 2, 8, 2, 6
X, y, true = make_attention_regression(
    1500,
    k,
    d,
    n_heads,
    head_rank=r,
    causal=True,
    rope=True,
    n_kv_heads=n_kv_heads,
    distribution="gaussian",
    random_state=0,
    return_layer=True,
)
X_train, y_train, X_test, y_test = X[:1000], y[:1000], X[1000:], y[1000:]
print(true.rotary_query.shape, true.rotary_key.shape, true.projection.shape)


def held_out_error(prediction):
    """The held-out relative prediction error ||F_hat(X) - Y|| / ||Y||."""
    return np.linalg.norm(prediction - y_test) / np.linalg.norm(y_test)


# %%
# skattn
# ------
# ``causal=True, rope=True, n_kv_heads=2`` with the head dimension as
# ``head_rank``.  The phases of Chen & Li assume position-free inputs, so the
# estimator takes its random-start path (a minibatch search, then the joint
# Levenberg-Marquardt polish) and says so in ``phase_report_``.
est = MultiHeadAttentionRegressor(
    n_heads=n_heads,
    n_tokens=k,
    head_rank=r,
    causal=True,
    rope=True,
    n_kv_heads=n_kv_heads,
    random_state=0,
)
start = time.perf_counter()
est.fit(X_train, y_train)
skattn_seconds = time.perf_counter() - start
skattn_error = held_out_error(est.predict(X_test))
print(est.phase_report_[0].info["reason"])
print(f"skattn: held-out relative error {skattn_error:.1e} in {skattn_seconds:.1f} s")

# %%
# Adam on a PyTorch decoder attention
# -----------------------------------
# The module computes what transformers' ``LlamaAttention`` computes (query,
# key, value and output maps without biases, ``rotate_half`` RoPE on queries and
# keys, each key/value head repeated for its group, causal scaled dot-product
# attention), from PyTorch's default init, trained by Adam (float32, minibatches
# of 64, learning rate 3e-3) for 10 s; its held-out error is read every 0.25 s of
# training.  In float32 its error cannot fall much below float32's rounding
# (about 1e-7); skattn fits in float64.
try:
    import torch
except ImportError:
    torch = None
    print("torch is not installed: the Adam comparison is skipped (pip install torch)")

adam_trace = []
if torch is not None:
    torch.manual_seed(0)

    class DecoderAttention(torch.nn.Module):
        def __init__(self, theta=10000.0):
            super().__init__()
            self.q_proj = torch.nn.Linear(d, n_heads * r, bias=False)
            self.k_proj = torch.nn.Linear(d, n_kv_heads * r, bias=False)
            self.v_proj = torch.nn.Linear(d, n_kv_heads * r, bias=False)
            self.o_proj = torch.nn.Linear(n_heads * r, d, bias=False)
            frequencies = theta ** (-torch.arange(0, r, 2) / r)
            angles = torch.arange(k)[:, None] * frequencies
            angles = torch.cat([angles, angles], dim=-1)  # rotate_half's layout
            self.register_buffer("cos", angles.cos())
            self.register_buffer("sin", angles.sin())

        def rotate(self, t):
            first, second = t.chunk(2, dim=-1)
            return t * self.cos + torch.cat([-second, first], dim=-1) * self.sin

        def heads(self, proj, X, count):
            return proj(X).view(len(X), k, count, r).transpose(1, 2)

        def forward(self, X):
            q = self.rotate(self.heads(self.q_proj, X, n_heads))
            key = self.rotate(self.heads(self.k_proj, X, n_kv_heads))
            value = self.heads(self.v_proj, X, n_kv_heads)
            group = n_heads // n_kv_heads
            key, value = (
                key.repeat_interleave(group, 1),
                value.repeat_interleave(group, 1),
            )
            out = torch.nn.functional.scaled_dot_product_attention(
                q, key, value, is_causal=True
            )
            return self.o_proj(out.transpose(1, 2).reshape(len(X), k, n_heads * r))

    model = DecoderAttention()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    X_torch = torch.as_tensor(X_train.reshape(-1, k, d), dtype=torch.float32)
    Y_torch = torch.as_tensor(y_train.reshape(-1, k, d), dtype=torch.float32)
    X_test_torch = torch.as_tensor(X_test.reshape(-1, k, d), dtype=torch.float32)

    def adam_error():
        with torch.no_grad():
            out = model(X_test_torch).double().numpy().reshape(len(X_test), -1)
        return held_out_error(out)

    trained, next_read = 0.0, 0.0  # seconds of training (the reads excluded)
    while trained < 10.0:
        for batch in torch.randperm(len(X_torch)).split(64):
            if trained >= next_read:
                adam_trace.append((trained, adam_error()))
                next_read += 0.25
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(X_torch[batch]), Y_torch[batch])
            loss.backward()
            optimizer.step()
            trained += time.perf_counter() - start
    adam_trace.append((trained, adam_error()))
    at_skattn = [e for t, e in adam_trace if t <= skattn_seconds][-1]
    print(
        f"Adam: held-out relative error {at_skattn:.1e} after skattn's "
        f"{skattn_seconds:.1f} s, {adam_trace[-1][1]:.1e} after {trained:.0f} s"
    )

# %%
# Held-out error against training time
# ------------------------------------
fig, ax = plt.subplots(figsize=(6, 4))
if adam_trace:
    seconds, errors = zip(*adam_trace, strict=True)
    ax.plot(seconds, errors, ".-", label="Adam, PyTorch decoder attention")
ax.plot([skattn_seconds], [max(skattn_error, 1e-16)], "*", ms=14, label="skattn")
ax.set_yscale("log")
ax.set_xlabel("training time [s]")
ax.set_ylabel("held-out relative error")
ax.set_title("4 query heads sharing 2 key/value heads, causal, RoPE")
ax.legend()
plt.show()
