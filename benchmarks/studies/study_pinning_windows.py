"""How many windows of real text pin each head of MiniLM layers 0 and 1, by the
counting bound, at window lengths k = 16, 64, 128 (issue 51).

For each layer and k: the windows of the standard library's docstrings
(``skattn.datasets.stdlib_docstring_tokens``, the corpus of
``bench_minilm_teacher.py --text``) run through all-MiniLM-L6-v2's own encoder
(``BertEncoder``, numpy, float64); on a random sample of ``--n-windows`` of them,
:func:`skattn.metrics.sharp_head_pinning` counts each head's rows that split its
attention (largest weight <= 0.99) against the rows the counting bound asks for
(``ceil(u / (k - 1))``, u = 23 936 for a head of rank 32 with key bias at
d = 384), and scales to the windows that would give them.  Printed per (layer,
k): the split share of rows and the windows needed, per head; and the windows
the corpus has.

    python benchmarks/studies/study_pinning_windows.py [--layers 0 1]
        [--n-tokens 16 64 128] [--n-windows 2000] [--out pinning.json]

The fits that check the bound are separate runs (``skattn layer --n-tokens K``).
"""

import argparse
import json
import math
import sys
import time

import numpy as np

from skattn.datasets import (
    BertEncoder,
    load_bert_attention,
    minilm_checkpoint_path,
    stdlib_docstring_tokens,
)
from skattn.datasets._encoder import _load_tokenizer, _text_windows
from skattn.metrics import sharp_head_pinning


def study(layer, k, n_windows, seed, encoder, tokens):
    tok = _load_tokenizer(encoder.tokenizer)
    special = (tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"))
    windows = _text_windows(tokens, k, special)
    rng = np.random.default_rng(seed)
    take = rng.choice(len(windows), size=min(n_windows, len(windows)), replace=False)
    ids = windows[np.sort(take)]
    X = encoder.hidden_states(ids, layer)
    teacher, _ = load_bert_attention(
        minilm_checkpoint_path(), layer=layer, n_heads=encoder.n_heads, n_tokens=k
    )
    pinning = sharp_head_pinning(
        teacher, X, head_rank=encoder.n_features // encoder.n_heads
    )
    rows = pinning.n_rows
    return {
        "layer": layer,
        "n_tokens": k,
        "corpus_windows": int(len(windows)),
        "sample_windows": int(len(ids)),
        "rows_needed": int(pinning.n_needed[0]),
        "split_share": [float(s) / rows for s in pinning.n_split_rows],
        "windows_needed": [
            None if not math.isfinite(n) else int(n) for n in pinning.sequences_needed
        ],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--n-tokens", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--n-windows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    encoder = BertEncoder.from_safetensors(minilm_checkpoint_path())
    tokens = stdlib_docstring_tokens(encoder.tokenizer)
    rows = []
    for layer in args.layers:
        for k in args.n_tokens:
            start = time.perf_counter()
            row = study(layer, k, args.n_windows, args.seed, encoder, tokens)
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            needed = [n if n is not None else "none" for n in row["windows_needed"]]
            print(
                f"layer {layer} k={k}: corpus {row['corpus_windows']} windows, "
                f"rows needed {row['rows_needed']} a head; split share per head "
                + " ".join(f"{s:.3f}" for s in row["split_share"])
                + "; windows needed per head "
                + " ".join(str(n) for n in needed)
                + f" ({row['seconds']:.0f} s)",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
