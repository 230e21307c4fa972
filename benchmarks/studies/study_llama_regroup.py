"""Prototype fix: search decoder heads UNGROUPED (one key head per query head),
then tie the keys into the grouped-query structure, then the grouped search.

A grouped search (n_kv_heads < n_heads) from a random start can assign query heads to
the wrong key groups; then no step lowers the residual (a spurious minimum at
0.37 on the tiny Llama, 0.47 on Gaussian tokens).  The ungrouped search has no
such barrier.  Tying: for heads i, j the key maps agree up to the rotary gauge
(a scaled rotation per frequency pair); the cost of K_j M ~ K_i, minimised
over that gauge, pairs the heads into groups.

Usage: python study_llama_regroup.py DATA.npz MODE N seed=S [fit=1]
(MODE real | gauss as study_llama_search.py.)
"""

import itertools
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np

import skattn.solvers._decoder as decoder_module
from skattn.solvers._decoder import random_decoder_start
from skattn.solvers.kernels._parametrization import FactoredHeads
from skattn.solvers.stages._search import minibatch_search


def _gauge_fit(Kj, Ki, layout="half"):
    """min over M (a scaled rotation per frequency pair) of ||Kj M - Ki||, and M."""
    d, r = Ki.shape
    h = r // 2
    pairs = (
        [(p, p + h) for p in range(h)]
        if layout == "half"
        else [(2 * p, 2 * p + 1) for p in range(h)]
    )
    M = np.zeros((r, r))
    cost = 0.0
    for a_, b_ in pairs:
        A = Kj[:, [a_, b_]]
        B = Ki[:, [a_, b_]]
        J = np.array([[0.0, -1.0], [1.0, 0.0]])
        basis = np.stack([A.ravel(), (A @ J).ravel()], 1)
        coef = np.linalg.lstsq(basis, B.ravel(), rcond=None)[0]
        Mf = coef[0] * np.eye(2) + coef[1] * J
        cost += ((A @ Mf - B) ** 2).sum()
        M[np.ix_([a_, b_], [a_, b_])] = Mf
    return cost / max((Ki**2).sum(), 1e-300), M


def _partitions(items, size):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [x for x in rest if x not in others]
        for tail in _partitions(left, size):
            yield [(first,) + others] + tail


def tie_keys(params, ungrouped, grouped):
    """Grouped FactoredHeads params from ungrouped ones: heads partitioned by
    the gauge cost of their keys, the first head's key the group's, the others'
    queries moved through the gauge, heads reordered to the groups."""
    Q, K, V = (np.asarray(f) for f in ungrouped.factors(params))
    m, m_kv = grouped.n_heads, grouped.n_kv_heads
    s = m // m_kv
    cost = np.zeros((m, m))
    gauges = {}
    for i in range(m):
        for j in range(m):
            if i != j:
                cost[i, j], gauges[i, j] = _gauge_fit(K[j], K[i], grouped.rope_layout)
    best = min(
        _partitions(list(range(m)), s),
        key=lambda part: sum(cost[g[0], j] for g in part for j in g[1:]),
    )
    Qn, Kn, Vn = [], [], []
    for g in best:
        Kn.append(K[g[0]])
        for j in g:
            if j == g[0]:
                Qn.append(Q[j])
            else:  # Q_j K_j^T ~ Q_j M^{-T} K_i^T  (K_j M ~ K_i)
                Qn.append(Q[j] @ np.linalg.inv(gauges[g[0], j]).T)
            Vn.append(V[j])
    return np.concatenate([np.ravel(Qn), np.ravel(Kn), np.ravel(Vn)]), best, cost


_original_search = minibatch_search


def regrouping_search(X, Y, params, par, *, random_state=None, verbose=0, **kw):
    """minibatch_search, grouped heads searched ungrouped first then tied."""
    if par.n_kv_heads == par.n_heads:
        return _original_search(
            X, Y, params, par, random_state=random_state, verbose=verbose, **kw
        )
    rng = random_state
    free = FactoredHeads(
        par.n_heads,
        par.n_features,
        par.rank,
        causal=par.causal,
        rope_theta=par.rope_theta,
        rope_layout=par.rope_layout,
    )
    Q, K, V = par.factors(params)  # the grouped start: each query head its group's key
    start = np.concatenate(
        [
            np.ravel(Q),
            np.ravel(K[np.arange(par.n_heads) // (par.n_heads // par.n_kv_heads)]),
            np.ravel(V),
        ]
    )
    start = start + 0  # same start as the grouped search (keys duplicated)
    start = random_decoder_start(free, rng)
    p1, info1 = _original_search(
        X, Y, start, free, random_state=rng, verbose=verbose, **kw
    )
    tied, groups, cost = tie_keys(p1, free, par)
    p2, info2 = _original_search(
        X, Y, tied, par, random_state=rng, verbose=verbose, **kw
    )
    print(
        f"REGROUP ungrouped {info1['residual']:.4f} ({info1['n_steps']} steps) "
        f"groups {groups} tied start {info2['residuals'][0]:.4f} -> "
        f"{info2['residual']:.4f} ({info2['n_steps']} steps)"
    )
    info2["n_steps"] += info1["n_steps"]
    return p2, info2


if __name__ == "__main__":
    path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    opt = dict(a.split("=") for a in sys.argv[4:])
    seed = int(opt.get("seed", 0))
    D = np.load(path)
    X, Y = D["X"].astype(float), D["Y"].astype(float)
    N, k, d = X.shape
    Qt, Kt, Wt = D["rotary_query"], D["rotary_key"], D["projection"]
    m, r, m_kv = Qt.shape[0], Qt.shape[2], int(D["n_kv_heads"])
    par = FactoredHeads(
        m,
        d,
        r,
        causal=True,
        rope_theta=float(D["rope_theta"]),
        rope_layout=str(D["rope_layout"]),
        n_kv_heads=m_kv,
    )
    if mode == "gauss":
        from skattn.layer._math import softmax

        Vt = np.linalg.svd(Wt, full_matrices=False)[0][:, :, :r]
        teacher = np.concatenate([Qt.ravel(), Kt.ravel(), Vt.ravel()])
        rng = np.random.default_rng(1)
        X = rng.normal(size=X.shape) * np.sqrt((X**2).sum(-1).mean() / d)
        P = softmax(par.logits(X, teacher, par.cache(X, teacher)), axis=-1)
        Y = np.einsum("nhab,nbd,hde->nae", P, X, Wt)
    Xf, Yf, Xh, Yh = X[:n], Y[:n], X[n : n + 200], Y[n : n + 200]
    if opt.get("fit", "0") == "1":
        from skattn import MultiHeadAttentionRegressor

        if opt.get("regroup", "1") == "1":
            decoder_module.minibatch_search = regrouping_search
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
    else:
        t = time.time()
        p, info = regrouping_search(
            Xf,
            Yf,
            random_decoder_start(par, np.random.RandomState(seed)),
            par,
            n_replacements=0,
            random_state=np.random.RandomState(seed),
        )
        print(
            f"SEARCH end residual {info['residual']:.4f} steps {info['n_steps']} "
            f"seconds {time.time() - t:.1f}"
        )
