"""How concentrated each real head's attention is, layer by layer, on real text.

For every head of all-MiniLM-L6-v2 layers ``--layers`` (the teacher of
``bench_minilm_teacher.py --text``: hidden states of the standard library's
docstrings entering the layer, windows of 16 tokens), on ``--n-samples`` training
windows: the median over query rows of the row's largest attention weight, and
the share of rows whose largest weight is above 0.99.  Sharp heads (a median near
one) are the ones whose one-head problems converge slowly or not at all in the
decoupled refinement (benchmarks/HISTORY.md), since a softmax row's derivative is
about its off-argmax mass.

Example::

    python benchmarks/studies/study_head_sharpness.py --layers 0 1 2 3 4 5
"""

import argparse
import os
import sys

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(range(6)))
    parser.add_argument("--n-samples", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # bench_minilm_teacher.py is in benchmarks/, one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_minilm_teacher

    print("| layer | per head: median largest weight (share of rows above 0.99) |")
    print("|---|---|")
    for layer_index in args.layers:
        teacher_args = argparse.Namespace(
            bert_base_like=False,
            planted=None,
            text=True,
            layer=layer_index,
            n_tokens=16,
            heads=None,
            n_heads=12,
        )
        layer, dist, _, _ = bench_minilm_teacher.teacher(teacher_args)
        X = dist.sample(args.n_samples, random_state=args.seed)
        largest = layer.attention_patterns(X).max(axis=-1)  # (n, m, k)
        median = np.median(largest, axis=(0, 2))
        sharp = (largest > 0.99).mean(axis=(0, 2))
        cells = " ".join(
            f"{a:.2f} ({b:.2f})" for a, b in zip(median, sharp, strict=True)
        )
        print(f"| {layer_index} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
