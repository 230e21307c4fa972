"""``skattn model`` on tiny decoders trained briefly (issue 64).

For each architecture a checkpoint is made offline
(:func:`skattn.datasets._decoder_checkpoint.save_random_decoder`: 2 layers,
hidden 64, 4 query heads, 2 key/value heads for Llama, a BPE tokenizer and
``--train-steps`` AdamW steps of next-token prediction on the docstrings of
some standard-library modules), then every attention layer is learned back by
:func:`skattn.experiments.learn_model` with its defaults from windows of
``--n-tokens`` tokens of the docstrings of *other* modules (text the training
did not see), and the learned model is compared with the original on the
held-out windows.  Printed per architecture: the layer x head table, the
comparison (final hidden states, next-token log-probabilities, perplexity),
the wall and CPU seconds of the whole command.

    python benchmarks/bench_model.py [--arch gpt2 llama] [--train-steps 300]
        [--n-tokens 32] [--rope-theta 500000] [--threads 2] [--out F.json]
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from threadpoolctl import threadpool_limits  # noqa: E402

from skattn.datasets._decoder_checkpoint import save_random_decoder  # noqa: E402
from skattn.datasets._encoder import _stdlib_docstrings  # noqa: E402
from skattn.experiments import learn_model  # noqa: E402

TRAINED_ON = ("argparse", "collections", "email", "json", "logging")
LEARNED_ON = ("pathlib", "typing", "inspect", "functools", "subprocess")


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--n-tokens", type=int, default=32)
    parser.add_argument("--rope-theta", type=float, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--verbose", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    train = _stdlib_docstrings(TRAINED_ON)
    learn = _stdlib_docstrings(LEARNED_ON)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp, "held-out-docstrings.txt")
        text.write_text("\n\n".join(learn), encoding="utf-8")
        for arch in args.arch:
            with threadpool_limits(args.threads):
                folder, _ = save_random_decoder(
                    Path(tmp, arch),
                    arch,
                    train,
                    n_features=64,
                    n_heads=4,
                    n_kv_heads=2,
                    n_layers=2,
                    rope_theta=None if arch == "gpt2" else args.rope_theta,
                    train_steps=args.train_steps,
                    train_tokens=args.n_tokens,
                )
            start, cpu = time.perf_counter(), _cpu_seconds()
            with threadpool_limits(args.threads):
                result = learn_model(
                    folder,
                    texts=text,
                    n_tokens=args.n_tokens,
                    out=Path(tmp, f"out-{arch}"),
                    verbose=args.verbose,
                )
            seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
            print(f"{arch}: {seconds:.0f} s wall, {cpu:.0f} s CPU", flush=True)
            print(result.table, flush=True)
            everything = result.report["model"]["all"]
            print(json.dumps(everything, indent=1), flush=True)
            rows.append(
                {
                    "arch": arch,
                    "train_steps": args.train_steps,
                    "rope_theta": args.rope_theta,
                    "seconds": seconds,
                    "cpu_seconds": cpu,
                    "layers": result.report["layers"],
                    "model": result.report["model"],
                    "n_windows_fit": result.report["n_windows_fit"],
                    "n_windows_held_out": result.report["n_windows_held_out"],
                }
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
