"""The learner of two source trees on the same data, side by side.

For a regression check after a change: every setting of
``bench_phased_vs_gradient.py`` (``--grid phased-vs-gradient``), of the recovery
grid of ``bench_recovery_grid.py`` (``--grid recovery``, polished fits) or of
low-rank heads on the random-start path (``--grid random-start``: 2 and 8 heads
of rank 4, d = 32, k = 8, 4000 sequences) is fitted by
``MultiHeadAttentionRegressor`` (default parameters; ``head_rank`` and
``init="random"`` for the last) imported from the ``--before``
tree and from the ``--after`` tree, each fit in its own process, the order
alternating from setting to setting so that slow phases of a shared machine hit
both alike.  Printed per setting: both wall times, their ratio (after / before),
both head-matched parameter errors and whether the fitted parameters are the same
bits (a SHA-256 of ``attention_`` and ``projection_``); then the median and largest
ratio.

    git worktree add /tmp/before <commit>
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/compare_versions.py \\
        --before /tmp/before --after . --grid phased-vs-gradient

(A change of threading is compared with the threads it is about: leave BLAS's.)
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# (distribution, m, d, k, d_out, n, attention scale, noise, head rank), as in the
# benchmarks; a head rank: the random-start path (init="random"), the planted
# layer's defaults for None
PHASED_VS_GRADIENT = [
    ("boolean", 1, 8, 4, 16, 20000, 2.0, 0.0, None),
    ("boolean", 2, 8, 4, 16, 20000, 2.0, 0.0, None),
    ("gaussian", 2, 8, 4, 16, 20000, 2.0, 0.0, None),
    ("boolean", 3, 8, 4, 16, 30000, 2.0, 0.0, None),
    ("boolean", 2, 8, 4, 16, 20000, 4.0, 0.0, None),
    ("boolean", 2, 8, 4, 16, 20000, 2.0, 0.01, None),
    ("boolean", 2, 16, 8, 32, 20000, 2.0, 0.0, None),
]
RECOVERY = [
    (dist, m, d, k, d_out, 30000, 2.0, 0.0, None)
    for dist in ("boolean", "gaussian")
    for d, k in ((8, 4), (16, 4), (16, 8))
    for d_out in (d, 2 * d)
    for m in (1, 2, 3)
]
# the random-start path of low-rank heads (issue 49's 8 heads of rank 4 among them),
# whose polish takes its products in jobs
RANDOM_START = [
    (dist, m, 32, 8, 32, 4000, None, 0.0, 4)
    for dist, m in (("boolean", 2), ("boolean", 8), ("gaussian", 8))
]


_FIT = """
import hashlib, json, sys, time, warnings
import numpy as np
from skattn import MultiHeadAttentionRegressor, make_attention_regression
from skattn import parameter_error
dist, m, d, k, d_out, n, scale, noise, rank, seed = json.loads(sys.argv[1])
drawn = dict(distribution=dist, attention_scale=scale, head_rank=rank)
X, y, layer = make_attention_regression(
    n, k, d, m, n_outputs=d_out, noise=noise, random_state=seed, return_layer=True,
    **{key: value for key, value in drawn.items() if value is not None})
learner = dict(input_distribution=dist) if rank is None else dict(
    head_rank=rank, init="random")
est = MultiHeadAttentionRegressor(
    n_heads=m, n_tokens=k, random_state=seed, **learner)
start = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    est.fit(X, y)
seconds = time.perf_counter() - start
errors = parameter_error(layer, est)
digest = hashlib.sha256(est.attention_.tobytes() + est.projection_.tobytes())
print(json.dumps(dict(seconds=seconds, theta=float(errors.attention_error),
                      w=float(errors.projection_error),
                      digest=digest.hexdigest()[:16])))
"""


def fit(tree, setting, seed):
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    out = subprocess.run(
        [sys.executable, "-c", _FIT, json.dumps([*setting, seed])],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(Path(tree).resolve()),
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(lines[-1])


def _median_run(runs):
    """The run of median time (or the first error)."""
    errors = [run for run in runs if "error" in run]
    if errors:
        return errors[0]
    return sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="source tree of the old code")
    parser.add_argument("--after", default=".", help="source tree of the new code")
    parser.add_argument(
        "--grid",
        choices=["phased-vs-gradient", "recovery", "random-start"],
        default="recovery",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="fit each setting this many times per tree, alternating; the times "
        "printed are the medians (a recheck of noisy ratios)",
    )
    parser.add_argument(
        "--only",
        type=int,
        nargs="+",
        metavar="ROW",
        help="run only these rows of the grid (0-based, in the printed order)",
    )
    args = parser.parse_args()
    settings = {
        "phased-vs-gradient": PHASED_VS_GRADIENT,
        "recovery": RECOVERY,
        "random-start": RANDOM_START,
    }[args.grid]
    if args.only:
        settings = [settings[i] for i in args.only]
    print(
        "| dist | m | d | k | d_out | n | scale | noise | rank | before s | after s | "
        "after/before | before Theta, W err | after Theta, W err | same bits |"
    )
    print("|---" * 15 + "|")
    ratios, n_same = [], 0
    for i, setting in enumerate(settings):
        runs = {"before": [], "after": []}
        for j in range(args.repeat):
            order = ("before", "after") if (i + j) % 2 == 0 else ("after", "before")
            for which in order:
                runs[which].append(fit(getattr(args, which), setting, args.seed))
        b, a = (_median_run(runs[which]) for which in ("before", "after"))
        cells = [str(v) for v in setting]
        if "error" in a or "error" in b:
            print("| " + " | ".join(cells) + f" | {b} | {a} |", flush=True)
            continue
        ratio = a["seconds"] / b["seconds"]
        ratios.append(ratio)
        same = a.get("digest") is not None and a.get("digest") == b.get("digest")
        n_same += same
        cells += [
            f"{b['seconds']:.2f}",
            f"{a['seconds']:.2f}",
            f"{ratio:.2f}",
            f"{b['theta']:.1e}, {b['w']:.1e}",
            f"{a['theta']:.1e}, {a['w']:.1e}",
            "yes" if same else "NO",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    if ratios:
        print(
            f"\nafter/before: median {sorted(ratios)[len(ratios) // 2]:.2f}, "
            f"max {max(ratios):.2f} over {len(ratios)} settings; fitted parameters "
            f"bit-identical in {n_same} of {len(ratios)}"
        )


if __name__ == "__main__":
    main()
