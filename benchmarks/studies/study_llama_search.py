"""Why the decoder search stalls on a tiny random Llama layer's real tokens.

Data from study_llama_search_data.py (npz).  Usage:
  python study_llama_search.py DATA.npz MODE N [key=value ...]
MODE: real | gauss | white (real tokens x -> x C^{-1/2}, C = X^T X / N,
      uncentered)
      | teacher (only measure the teacher's factors)
options: lr=0.1 seed=0 fit=0 (1: the whole estimator fit, held-out error)
         start=random|teacher
"""

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np

from skattn.layer._math import softmax
from skattn.solvers._decoder import random_decoder_start
from skattn.solvers.kernels._parametrization import FactoredHeads
from skattn.solvers.stages._search import head_contributions, minibatch_search

path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
opt = dict(a.split("=") for a in sys.argv[4:])
lr = float(opt.get("lr", 0.1))
seed = int(opt.get("seed", 0))
D = np.load(path)
X, Y = D["X"].astype(float), D["Y"].astype(float)
N, k, d = X.shape
m, r = D["rotary_query"].shape[0], D["rotary_query"].shape[2]
m_kv = int(D["n_kv_heads"]) or m
Qt, Kt, Wt = D["rotary_query"], D["rotary_key"], D["projection"]
Vt = np.linalg.svd(Wt, full_matrices=False)[0][:, :, :r]
par = FactoredHeads(
    m,
    d,
    r,
    causal=True,
    rope_theta=float(D["rope_theta"]),
    rope_layout=str(D["rope_layout"]),
    n_kv_heads=m_kv,
)
teacher = np.concatenate([Qt.ravel(), Kt.ravel(), Vt.ravel()])


def outputs(Xs, p, out_factors=None):
    cache = par.cache(Xs, p)
    P = softmax(par.logits(Xs, p, cache), axis=-1)
    return P


rng = np.random.default_rng(1)
A = np.eye(d)
if mode in ("gauss", "gausscov"):
    if mode == "gauss":
        X = rng.normal(size=X.shape) * np.sqrt((X**2).sum(-1).mean() / d)
    else:  # Gaussian tokens with the real tokens' (uncentered) second moment
        C = np.einsum("nkd,nke->de", X[:n], X[:n]) / (n * k)
        X = rng.normal(size=X.shape) @ np.linalg.cholesky(C).T
    # teacher outputs: per head P (X V) out_factors with W = V out_factors
    P = outputs(X, teacher)
    Y = np.einsum("nhab,nbd,hde->nae", P, X, Wt)
elif mode in ("white", "diag"):
    C = np.einsum("nkd,nke->de", X[:n], X[:n]) / (n * k)
    if mode == "diag":  # per-feature scaling only
        C = np.diag(np.diag(C))
    w, U = np.linalg.eigh(C)
    A = U @ np.diag(w**-0.5) @ U.T  # x -> A x; teacher Q -> A^{-1} Q etc
    X = X @ A
    Ai = np.linalg.inv(A)
    Qt2 = np.einsum("de,her->hdr", Ai, Qt)
    Kt2 = np.einsum("de,her->hdr", Ai, Kt)
    Wt = np.einsum("de,hef->hdf", Ai, Wt)
    Vt = np.linalg.svd(Wt, full_matrices=False)[0][:, :, :r]
    teacher = np.concatenate([Qt2.ravel(), Kt2.ravel(), Vt.ravel()])
print(
    f"mode {mode} n {n} X mean-norm {np.linalg.norm(X[:n].mean((0, 1))):.3g} "
    f"token rms {np.sqrt((X[:n] ** 2).sum(-1).mean()):.3g}; "
    "cov eigen range "
    f"{np.linalg.eigvalsh(np.einsum('nkd,nke->de', X[:n], X[:n]) / (n * k))[[0, -1]]}"
)
Xf, Yf = X[:n], Y[:n]
Xh, Yh = X[n : n + 200], Y[n : n + 200]
res_t, without_t = head_contributions(Xf[:200], Yf[:200], teacher, par)
print("teacher residual", f"{res_t:.2e}", "without each head", np.round(without_t, 3))
Pt = outputs(Xf[:100], teacher)
print(
    "teacher median max weight per head",
    np.round(np.median(Pt.max(-1), axis=(0, 2)), 3),
    "mean weight on token 0 per head",
    np.round(Pt[:, :, 1:, 0].mean((0, 2)), 3),
)
if mode == "teacher":
    sys.exit()

if opt.get("fit", "0") == "1":
    from skattn import MultiHeadAttentionRegressor

    est = MultiHeadAttentionRegressor(
        n_heads=m,
        n_tokens=k,
        head_rank=r,
        causal=True,
        rope=True,
        rope_theta=float(D["rope_theta"]),
        rope_layout="half",
        n_kv_heads=m_kv,
        random_state=seed,
        n_restarts=int(opt.get("restarts", 1)),
        verbose=1,
    )
    t = time.time()
    est.fit(Xf.reshape(n, -1), Yf.reshape(n, -1))
    Ph = est.predict(Xh.reshape(len(Xh), -1))
    print(
        "FIT held out "
        f"{np.linalg.norm(Ph - Yh.reshape(len(Xh), -1)) / np.linalg.norm(Yh):.4f}"
        f" seconds {time.time() - t:.1f}"
    )
    sys.exit()

m_kv_learn = int(opt.get("kv", m_kv))
teacher_par = par
if m_kv_learn != m_kv:  # search with another number of key heads (kv=4: ungrouped)
    par = FactoredHeads(
        m,
        d,
        r,
        causal=True,
        rope_theta=float(D["rope_theta"]),
        rope_layout=str(D["rope_layout"]),
        n_kv_heads=m_kv_learn,
    )
start = random_decoder_start(par, np.random.RandomState(seed))
if opt.get("start") == "teacher":
    start = (
        teacher
        + 0.01 * np.random.default_rng(seed).normal(size=teacher.size) * teacher.std()
    )
t = time.time()
p, info = minibatch_search(
    Xf,
    Yf,
    start,
    par,
    n_replacements=0,
    learning_rate=lr,
    random_state=np.random.RandomState(seed),
    verbose=0,
    max_steps=int(opt.get("max_steps", 5000)),
)
sec = time.time() - t
print(
    f"SEARCH end residual {info['residual']:.4f} steps {info['n_steps']} "
    f"cuts {info['n_decays']} stop {info['stop_reason']} seconds {sec:.1f}"
)
print("residuals", np.round(info["residuals"], 3).tolist())
res, without = head_contributions(Xf[:200], Yf[:200], p, par)
print("learned residual", f"{res:.3f}", "without each head", np.round(without, 3))
# held-out residual of the search's heads (out_factors fitted on the fit set)
Pl = softmax(par.logits(Xf[:100], p, par.cache(Xf[:100], p)), axis=-1)
print(
    "learned median max weight per head",
    np.round(np.median(Pl.max(-1), axis=(0, 2)), 3),
    "mean weight on token 0",
    np.round(Pl[:, :, 1:, 0].mean((0, 2)), 3),
)
# pattern similarity: mean |P_t - P_l|_1 / 2 per row, teacher head i vs learned head j
tv = 0.5 * np.abs(Pt[:, :, None] - Pl[:, None, :]).sum(-1).mean((0, 3))
print("total variation teacher(row) x learned(col)\n", np.round(tv, 3))
match = tv.argmin(1)  # learned head of each teacher head
group = np.arange(m) // (m // m_kv)
learned_group = np.arange(m) // (m // m_kv_learn)
ok = all(len(set(learned_group[match[group == g]])) == 1 for g in range(m_kv))
print(
    f"GROUPING teacher->learned {match.tolist()} grouping {'right' if ok else 'WRONG'}"
    f" (best TV per teacher head {np.round(tv.min(1), 3).tolist()})"
)
# by row position: how much of the residual sits in the first tokens
Q, K, V = par.factors(p)
b = min(200, n)
cache = par.cache(Xf[:b], p)
Pa = softmax(par.logits(Xf[:b], p, cache), axis=-1)
F = np.einsum("nhab,nbd,hdr->nahr", Pa, Xf[:b], V).reshape(b * k, m * r)
T = Yf[:b].reshape(b * k, -1)
R = (F @ np.linalg.lstsq(F, T, rcond=None)[0] - T).reshape(b, k, -1)
e_pos = (R**2).sum((0, 2)) / (Yf[:b] ** 2).sum((0, 2))
print("relative residual by position", np.round(np.sqrt(e_pos), 3).tolist())
np.save(f"/tmp/wt_llama_p_{mode}_{n}_{seed}.npy", p)
