"""Test R^2 of RandomFeatureAttentionRegressor's defaults, before and after issue 13.

The task of the issue: Gaussian sequences of a query and 5 keys, d = 8, 2000 train /
1000 test sequences, and the key-permutation-invariant target of Fu et al.,
``y = mean_i ReLU(<x_0, x_i>) / d``.  The "before" rows spell out the old defaults
(softmax attention, mean 0, keys "all", no value bias, alpha 1) explicitly, so the
script runs on the current code.  Then the new defaults on the Boolean version (the
gallery example's task) and on other key-permutation-invariant targets.

Run by hand (a few minutes on one core)::

    python benchmarks/studies/bench_random_features_defaults.py [--seeds 5]

Each cell is the test R^2 for data seed 0 (and random_state=0), and the ridge
penalty used; with ``--seeds S`` also [min, max] over data seed = random_state =
0..S-1.
"""

import argparse

import numpy as np

from skattn import RandomFeatureAttentionRegressor

OLD = dict(attention="softmax", mean=0.0, keys="all", value_bias=False, alpha=1.0)
ISSUE_ROWS = [
    ("old defaults (softmax, mean 0, keys all, no value bias, alpha 1)", OLD),
    ("old defaults + mean 2", {**OLD, "mean": 2.0}),
    (
        "relu + value_bias, rest old default",
        {**OLD, "attention": "relu", "value_bias": True},
    ),
    (
        "gallery: relu, mean 2, keys others, value_bias, alpha 100",
        dict(attention="relu", mean=2.0, keys="others", value_bias=True, alpha=100.0),
    ),
    (
        "gallery with mean 0",
        dict(attention="relu", mean=0.0, keys="others", value_bias=True, alpha=100.0),
    ),
    ("NEW defaults", {}),
    ("new defaults + mean 0", {"mean": 0.0}),
    ("new defaults + softmax", {"attention": "softmax"}),
]


def inner_products(n_samples, rng, *, n_features=8, n_keys=5, boolean=False):
    shape = (n_samples, n_keys + 1, n_features)
    X = rng.choice([-1.0, 1.0], size=shape) if boolean else rng.standard_normal(shape)
    return X, np.einsum("nd,nkd->nk", X[:, 0], X[:, 1:])


# name -> (distribution kwargs, target of the query-key inner products t (n, N), d)
TASKS = {
    "Gaussian d=8 N=5, mean_i relu(t_i)/d (the issue)": (
        dict(),
        lambda t, d: np.maximum(t, 0).mean(axis=1) / d,
    ),
    "Boolean d=8 N=8, mean_i relu(t_i/sqrt d) (gallery)": (
        dict(n_keys=8, boolean=True),
        lambda t, d: np.maximum(t / np.sqrt(d), 0).mean(axis=1),
    ),
    "Gaussian d=8 N=5, max_i t_i/d": (dict(), lambda t, d: t.max(axis=1) / d),
    "Gaussian d=8 N=5, mean_i tanh(t_i/sqrt d)": (
        dict(),
        lambda t, d: np.tanh(t / np.sqrt(d)).mean(axis=1),
    ),
    "Gaussian d=8 N=5, mean_i |t_i|/d": (
        dict(),
        lambda t, d: np.abs(t).mean(axis=1) / d,
    ),
}


def r2(params, task, seed, n_train=2000, n_test=1000):
    kwargs, target = TASKS[task]
    rng = np.random.default_rng(seed)
    X, t = inner_products(n_train + n_test, rng, **kwargs)
    y = target(t, X.shape[2])
    reg = RandomFeatureAttentionRegressor(random_state=seed, **params)
    reg.fit(X[:n_train], y[:n_train])
    return reg.score(X[n_train:], y[n_train:]), reg.alpha_


def cell(params, task, seeds):
    score, alpha = r2(params, task, 0)
    text = f"{score:6.3f}"
    if seeds > 1:
        scores = [score] + [r2(params, task, s)[0] for s in range(1, seeds)]
        text += f" [{min(scores):6.3f}, {max(scores):6.3f}]"
    return text + f" alpha_={alpha:.3g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    seeds = parser.parse_args().seeds
    issue_task = next(iter(TASKS))
    print(f"## {issue_task}: test R^2")
    for name, params in ISSUE_ROWS:
        print(f"{name:66s} {cell(params, issue_task, seeds)}")
    print("\n## new defaults on other tasks: test R^2")
    for task in list(TASKS)[1:]:
        row = [
            f"{name} {cell(params, task, seeds)}"
            for name, params in [("defaults", {}), ("mean 0", {"mean": 0.0})]
        ]
        print(f"{task:52s} " + " | ".join(row))


if __name__ == "__main__":
    main()
