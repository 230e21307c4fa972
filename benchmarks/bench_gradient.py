"""Where does gradient training recover a planted attention layer?

GradientAttentionRegressor (L-BFGS, one random start by default) on planted layers
(Boolean tokens by default, d=8, k=4, m=2, d_out=8, ||Theta_i||_F = attention_scale,
W ~ N(0, 1/d), no noise), over a grid of attention scales and sample sizes.

For each run it reports: the head-matched relative parameter errors, the relative
prediction error on fresh examples, the final training loss, the iterations, the
time, and an outcome:

* ``recovered``: max(attention_error, projection_error) <= 1e-4;
* ``stalled``: not recovered and max_iter ran out (more iterations might help);
* ``local-min``: not recovered and L-BFGS stopped on its own (a spurious
  stationary point, or too few samples to identify the layer).

Run (2 single-threaded cores, a few minutes for the default grid)::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_gradient.py
    python benchmarks/bench_gradient.py --scales 2 4 --n-samples 1000 --seeds 3
"""

import argparse
import time
import warnings

import numpy as np
from sklearn.exceptions import ConvergenceWarning

from skattn.datasets import make_attention_regression
from skattn.estimators import GradientAttentionRegressor
from skattn.metrics import parameter_error, prediction_error


def run(
    n_samples,
    attention_scale,
    seed,
    *,
    max_iter,
    n_tokens=4,
    n_features=8,
    n_heads=2,
    init_scale=1.0,
    n_restarts=1,
    distribution="boolean",
    n_test=2000,
):
    """One planted instance, one random start; returns a dict of measurements."""
    X, y, layer = make_attention_regression(
        n_samples + n_test,
        n_tokens,
        n_features,
        n_heads,
        attention_scale=attention_scale,
        distribution=distribution,
        random_state=seed,
        return_layer=True,
    )
    X_train, y_train, X_test = X[:n_samples], y[:n_samples], X[n_samples:]
    reg = GradientAttentionRegressor(
        n_heads=n_heads,
        n_tokens=n_tokens,
        tol=1e-10,
        max_iter=max_iter,
        init_scale=init_scale,
        n_restarts=n_restarts,
        random_state=seed,
    )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        reg.fit(X_train, y_train)
    seconds = time.perf_counter() - start
    hit_max_iter = any(issubclass(w.category, ConvergenceWarning) for w in caught)
    errors = parameter_error(layer, reg)
    worst = max(errors.attention_error, errors.projection_error)
    if worst <= 1e-4:
        outcome = "recovered"
    elif hit_max_iter:
        outcome = "stalled"
    else:
        outcome = "local-min"
    return {
        "n": n_samples,
        "scale": attention_scale,
        "seed": seed,
        "attention_error": errors.attention_error,
        "projection_error": errors.projection_error,
        "test_error": float(prediction_error(layer, reg, X_test)),
        "loss": reg.loss_,
        "n_iter": reg.n_iter_,
        "seconds": seconds,
        "outcome": outcome,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--n-samples", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--max-iter", type=int, default=2000)
    parser.add_argument("--n-tokens", type=int, default=4)
    parser.add_argument("--n-features", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=2)
    parser.add_argument("--init-scale", type=float, default=1.0)
    parser.add_argument("--n-restarts", type=int, default=1)
    parser.add_argument(
        "--distribution", choices=["boolean", "gaussian"], default="boolean"
    )
    args = parser.parse_args(argv)
    shape = dict(
        n_tokens=args.n_tokens,
        n_features=args.n_features,
        n_heads=args.n_heads,
        init_scale=args.init_scale,
        n_restarts=args.n_restarts,
        distribution=args.distribution,
    )
    print(
        f"k={args.n_tokens} d={args.n_features} m={args.n_heads} "
        f"init_scale={args.init_scale} max_iter={args.max_iter} "
        f"n_restarts={args.n_restarts} distribution={args.distribution}"
    )

    header = (
        f"{'n':>5} {'scale':>5} {'seed':>4} {'att_err':>9} {'proj_err':>9} "
        f"{'test_err':>9} {'loss':>9} {'iters':>5} {'sec':>6}  outcome"
    )
    print(header)
    rows = []
    for n in args.n_samples:
        for scale in args.scales:
            for seed in range(args.seeds):
                r = run(n, scale, seed, max_iter=args.max_iter, **shape)
                rows.append(r)
                print(
                    f"{r['n']:>5} {r['scale']:>5g} {r['seed']:>4} "
                    f"{r['attention_error']:>9.1e} {r['projection_error']:>9.1e} "
                    f"{r['test_error']:>9.1e} {r['loss']:>9.1e} {r['n_iter']:>5} "
                    f"{r['seconds']:>6.1f}  {r['outcome']}",
                    flush=True,
                )
    print("\nsuccess rate (recovered / seeds), median seconds")
    for n in args.n_samples:
        for scale in args.scales:
            group = [r for r in rows if r["n"] == n and r["scale"] == scale]
            ok = sum(r["outcome"] == "recovered" for r in group)
            secs = np.median([r["seconds"] for r in group])
            print(f"n={n:>5} scale={scale:>4g}: {ok}/{len(group)}  {secs:5.1f} s")


if __name__ == "__main__":
    main()
