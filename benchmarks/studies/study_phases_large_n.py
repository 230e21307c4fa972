"""The phases alone at large n: does the phased learner locate the hull of m heads?

Chen & Li's cost is exponential in m: a row certifies only when all m heads put
the same pattern on it, about 1 in 10^4 rows for three heads at k = 4.  This study
fits ``MultiHeadAttentionRegressor(polish=False)`` (phases 1-6 without the local
polish, i.e. the phased estimate itself) on planted data written to disk
(``write_attention_regression``, read out of core), d=8, k=4, d_out=16, Boolean
inputs, attention scale 2, for n in ``--sizes`` and m in ``--heads``.  Per cell:

* ``cert%``   rows certified in the round whose hull the phases kept, and ``tol``;
* ``gap``     the augmented gap ratio of that hull (below 3: weak evidence);
* ``hull``    max over heads of the distance from Theta_i to the estimated affine
              hull, relative to ||Theta_i||;
* ``W_sum``   relative error of the phase-3 sum of the projections;
* ``Theta``   head-matched relative error of the phases-alone Theta_i;
* ``pred``    relative prediction error on 5000 fresh examples;
* ``fit s``   wall time.

Run (about 10 minutes for the default 10^5 grid on a busy 2-core machine)::

    nice python benchmarks/studies/study_phases_large_n.py --sizes 100000

The issue's table is ``--sizes 100000 1000000 10000000`` (hours; 10^7 needs 7.7 GB
of disk per m in ``--dir``).
"""

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from skattn import MultiHeadAttentionRegressor, parameter_error, prediction_error
from skattn.datasets import sample_inputs, write_attention_regression
from skattn.phased._affine_hull import hull_distance

D, K, D_OUT = 8, 4, 16


def _cell(folder, n, m, seed, batch_size):
    path = Path(folder) / f"n{n}_m{m}.npy"
    X, y, layer = write_attention_regression(
        path, n, K, D, m, n_outputs=D_OUT, random_state=seed, return_layer=True
    )
    est = MultiHeadAttentionRegressor(
        n_heads=m, n_tokens=K, polish=False, random_state=seed, batch_size=batch_size
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        est.fit(X, y)
        seconds = time.perf_counter() - start
    selected = [r for r in est.phase_report_ if r.phase == "2-4-hull-selected"][0]
    kept = [
        r
        for r in est.phase_report_
        if r.phase == "2-4-certify-refine-hull" and r.round == selected.round
    ][0]
    W_sum = layer.projection.sum(0)
    X_test = sample_inputs("boolean", 5000, K, D, random_state=seed + 1)
    hull = hull_distance(layer.attention, est.hull_point_, est.hull_directions_)
    row = {
        "n": n,
        "m": m,
        "cert": float(selected["certified_fraction"]),
        "tol": float(kept["tol"]),
        "gap": float(selected["augmented_gap_ratio"]),
        "hull": float(np.max(hull)),
        "w_sum": float(
            np.linalg.norm(est.projection_sum_ - W_sum) / np.linalg.norm(W_sum)
        ),
        "theta": float(parameter_error(layer, est).attention_error),
        "pred": float(prediction_error(layer, est, X_test)),
        "seconds": seconds,
    }
    path_files = [path / "X.npy", path / "y.npy"]
    del X, y
    for file in path_files:
        file.unlink()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--dir", default=None, help="where the datasets go")
    args = parser.parse_args()
    print(
        f"{'n':>10}{'m':>3}{'cert%':>9}{'tol':>7}{'gap':>8}{'hull':>8}{'W_sum':>8}"
        f"{'Theta':>8}{'pred':>8}{'fit s':>8}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for n in args.sizes:
            for m in args.heads:
                r = _cell(folder, n, m, args.seed, args.batch_size)
                print(
                    f"{r['n']:>10}{r['m']:>3}{100 * r['cert']:>9.4f}{r['tol']:>7.3f} "
                    f"{r['gap']:>8.3g}{r['hull']:>8.3f}{r['w_sum']:>8.3f}"
                    f"{r['theta']:>8.3f}{r['pred']:>8.3f}{r['seconds']:>8.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
