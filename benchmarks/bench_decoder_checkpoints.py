"""``skattn layer`` on tiny GPT-2, Llama and Qwen2 checkpoints made offline (issue 50).

For each architecture a random checkpoint is saved in a temporary folder
(:func:`skattn.datasets._decoder_checkpoint.save_random_decoder`: 2 layers,
hidden 64, 4 query heads, 2 key/value heads for Llama and Qwen2, every weight
drawn with std 0.2, a BPE tokenizer trained on the text; with ``--train-steps
N`` then trained N AdamW steps of next-token prediction on windows of
``--n-tokens`` tokens of that text, so that its attention is a trained one's,
not a random one's), and layer 1 is
learned by :func:`skattn.experiments.learn_layer` from windows of 32 tokens of
the standard library's docstrings (the hidden states and the teacher from
transformers' own model classes).  Printed per architecture: the held-out
relative error, the fit's time, and the held-out error of the written layer
loaded back into the transformers model; the wall and CPU seconds (on a
shared machine the CPU seconds say what the run itself cost), and the seconds
the checkpoint took to make (its training included).

    python benchmarks/bench_decoder_checkpoints.py [--arch gpt2 llama qwen2]
        [--n-windows 400|default] [--n-tokens 32] [--threads 2]
        [--hidden 64 --heads 4 --kv-heads 2] [--rope-theta 500000]
        [--train-steps 300]
        [--polish-max-iter I] [--restarts R] [--out F.json]
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
from skattn.datasets._encoder import (  # noqa: E402
    _stdlib_docstrings,
    _stdlib_modules,
    _stdlib_root,
)
from skattn.experiments import learn_layer  # noqa: E402
from skattn.experiments._decoder_layer import decoder_learner  # noqa: E402
from skattn.layer._hf import decoder_settings  # noqa: E402

MODULES = ("argparse", "collections", "email", "json", "logging", "pathlib", "typing")


def _cpu_seconds():
    """User and system CPU seconds of this process so far (all its threads): on
    a shared machine the wall time counts the other processes' load too."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["gpt2", "llama", "qwen2"])
    parser.add_argument(
        "--n-windows",
        type=lambda text: None if text == "default" else int(text),
        default=400,
        help="windows fitted and held out; 'default': skattn layer's own choice "
        "(the count's windows with its margin fitted, the rest held out)",
    )
    parser.add_argument("--n-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument(
        "--rope-theta",
        type=float,
        default=None,
        help="rotary base of the checkpoint (default: transformers'); "
        "not GPT-2's, which has none",
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="AdamW steps of next-token prediction on the text before the layer "
        "is learned (default 0: the random checkpoint)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--polish-max-iter",
        type=int,
        default=None,
        help="cap the learner's polish iterations (a cap on the fit's time; "
        "default: the learner's own)",
    )
    parser.add_argument(
        "--restarts", type=int, default=None, help="the learner's n_restarts"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    assert set(MODULES) <= set(_stdlib_modules(_stdlib_root()))
    docs = _stdlib_docstrings(MODULES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp, "docstrings.txt")
        text.write_text("\n\n".join(docs), encoding="utf-8")
        for arch in args.arch:
            start = time.perf_counter()
            with threadpool_limits(args.threads):
                folder, _ = save_random_decoder(
                    Path(tmp, arch),
                    arch,
                    docs,
                    n_features=args.hidden,
                    n_heads=args.heads,
                    n_kv_heads=args.kv_heads,
                    n_layers=2,
                    std=0.2,
                    # a released model's base (GPT-2 has learned positions)
                    rope_theta=None if arch == "gpt2" else args.rope_theta,
                    train_steps=args.train_steps,
                    train_tokens=args.n_tokens if args.train_steps else None,
                    random_state=args.seed,
                )
            checkpoint_seconds = time.perf_counter() - start
            config = json.loads((folder / "config.json").read_text())
            learner = decoder_learner(
                decoder_settings(config, 1),
                args.n_tokens,
                random_state=args.seed,
                verbose=args.verbose,
            )
            if args.polish_max_iter is not None:
                learner.set_params(polish_max_iter=args.polish_max_iter)
            if args.restarts is not None:
                learner.set_params(n_restarts=args.restarts)
            start = time.perf_counter()
            cpu = _cpu_seconds()
            with threadpool_limits(args.threads):
                result = learn_layer(
                    folder,
                    layer=1,
                    texts=[text],
                    n_tokens=args.n_tokens,
                    n_windows=args.n_windows,
                    out=Path(tmp, f"out-{arch}"),
                    estimator=learner,
                    random_state=args.seed,
                    verbose=args.verbose,
                )
            report = result.report
            row = {
                "arch": arch,
                "train_steps": args.train_steps,
                "checkpoint_seconds": checkpoint_seconds,
                "held_out_relative_error": report["held_out_relative_error"],
                "train_relative_error": report["train_relative_error"],
                "loaded_back_held_out_relative_error": report[
                    "loaded_back_held_out_relative_error"
                ],
                "teacher_agreement": report["teacher_agreement"],
                "model_float32_tables_relative_difference": report["rope_tables"][
                    "model_float32_tables_relative_difference"
                ],
                "fit_seconds": report["fit_seconds"],
                "total_seconds": time.perf_counter() - start,
                "cpu_seconds": _cpu_seconds() - cpu,
                "n_windows_fit": report["n_windows_fit"],
                "n_windows_held_out": report["n_windows_held_out"],
                "verdict": report["verdict"]["summary"],
                "estimator": report["estimator"],
                "warnings": report["warnings"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
