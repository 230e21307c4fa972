"""Where the search from a random start stalls on MiniLM's real layers: by the
rows of attention it sees, not by the window length (issue 51).

The random-start path's minibatch search (:func:`skattn.solvers.minibatch_search`)
alone, as ``skattn layer`` runs it: all-MiniLM-L6-v2's layer ``--layer`` (all 12
heads, rank 32, tokens ``[x, 1]`` whitened by
:func:`skattn.solvers.whitening_map`), ``--n-windows`` random windows of
``--n-tokens`` tokens of the standard library's docstrings
(``stdlib_docstring_tokens``), the teacher from skattn's own encoder, one random
start.  Printed: the evaluation residual every 50 steps and the end (residual,
steps, step-size cuts, why it stopped, replacements, seconds).  A search that ends
above its 0.02 target leaves the per-head refinement far from every head.

    OMP_NUM_THREADS=1 python benchmarks/studies/study_search_rows.py \\
        --layer 1 --n-tokens 64 --n-windows 96 [--batch-size 256] [--seed 0]

Results (benchmarks/HISTORY.md, "Results of 2026-11-28, third session").
"""

import argparse
import json
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
from skattn.solvers import minibatch_search, whitening_map
from skattn.solvers.kernels._parametrization import FactoredHeads, random_attention
from skattn.solvers.kernels._varpro import _intercept_direction


def data(layer, n_tokens, n_windows, seed):
    """``(X, Y)``: tokens ``[x, 1]`` entering ``layer`` and the layer's output on
    ``n_windows`` random docstring windows."""
    encoder = BertEncoder.from_safetensors(minilm_checkpoint_path())
    tokens = stdlib_docstring_tokens(encoder.tokenizer)
    tokenizer = _load_tokenizer(encoder.tokenizer)
    special = (tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]"))
    windows = _text_windows(tokens, n_tokens, special)
    rng = np.random.default_rng(seed)
    ids = windows[np.sort(rng.choice(len(windows), size=n_windows, replace=False))]
    X = encoder.hidden_states(ids, layer)
    teacher, _ = load_bert_attention(
        minilm_checkpoint_path(), layer=layer, n_heads=12, n_tokens=n_tokens
    )
    Y = teacher.transform(X.reshape(n_windows, -1)).reshape(n_windows, n_tokens, -1)
    return np.concatenate([X, np.ones(X.shape[:2] + (1,))], axis=2), Y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--n-tokens", type=int, default=64)
    parser.add_argument("--n-windows", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-steps", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON of the end")
    args = parser.parse_args(argv)
    X, Y = data(args.layer, args.n_tokens, args.n_windows, args.seed)
    A, _ = whitening_map(X)
    X = X @ A
    m, r = 12, 32
    par = FactoredHeads(m, X.shape[2], r)
    rng = np.random.RandomState(args.seed)
    attention = random_attention(m, X.shape[2], rng)
    values = rng.normal(scale=1.0 / X.shape[2], size=(m, X.shape[2], r))
    start = par.from_attention(attention, values @ rng.normal(size=(m, r, Y.shape[2])))
    clock = time.perf_counter()
    _, info = minibatch_search(
        X,
        Y,
        start,
        par,
        intercept_direction=_intercept_direction(X),
        batch_size=args.batch_size,
        max_steps=args.max_steps,
        random_state=rng,
        verbose=1,
    )
    end = {
        "layer": args.layer,
        "n_tokens": args.n_tokens,
        "n_windows": args.n_windows,
        "rows": args.n_windows * args.n_tokens,
        "batch_size": args.batch_size,
        "residual": info["residual"],
        "n_steps": info["n_steps"],
        "n_decays": info["n_decays"],
        "stop_reason": info["stop_reason"],
        "replacements": info["replacements"],
        "seconds": time.perf_counter() - clock,
    }
    print(json.dumps(end))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(end, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
