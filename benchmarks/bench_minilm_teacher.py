"""A pretrained teacher: learn heads of all-MiniLM-L6-v2's layer 0 back from examples.

The teacher is the real attention sub-layer (self-attention plus output dense, with
all its biases, exactly: ``AttentionLayer`` with ``key_bias`` and ``intercept``)
restricted to ``--n-heads`` of its 12 heads; the inputs are sequences of
``--n-tokens`` i.i.d. vocabulary tokens embedded by the model itself (word +
position + token type 0, then LayerNorm).  A learner with ``fit_intercept=True``
fits ``--n-samples`` labelled sequences; the script prints

* ``check_conditions`` of the real heads;
* the held-out relative prediction error ``||F_hat(X) - F(X)|| / ||F(X)||`` on
  fresh sequences;
* head-matched relative errors of Theta_i, W_i, the key biases and the intercept
  measured on the subspace the inputs reach (``parameter_error(..., X=X_test)``:
  LayerNorm outputs lie on an affine hyperplane ``mu + range(R)``, R of rank
  d - 1, and the errors compare ``R Theta_i R``, ``R W_i``, the effective key bias
  ``R (Theta_i^T mu + u_i)`` and the effective intercept ``sum_i W_i^T mu + c``,
  exactly what the outputs on such inputs determine);
* the wall time; and, with ``--plot FILE``, real vs learned attention patterns.

``--text`` replaces the embedded random tokens by real text: windows of the
standard library's docstrings (``PretrainedHiddenStates``) as the hidden states
entering layer ``--layer`` (the model's own encoder in numpy), and layer
``--layer``'s attention as the teacher.  The last tenth of the windows (in corpus
order) is held out for the test error; the fit draws ``--n-samples`` windows from
the rest with replacement (the distinct ones are reported).

At d = 384 the phased learner's ``init="auto"`` skips phases 1-5 (their hull
system has ``(d+1)^2`` unknowns) and polishes from random starts with the
matrix-free Levenberg-Marquardt solver; ``--head-rank R`` (default: the model's
head dimension, 32, for the real teacher) learns heads ``Theta_i = Q_i K_i^T`` of
rank R on the augmented tokens ``[x, 1]`` (the real augmented heads
``[W_q^T; b_q^T] [W_k, 0] / sqrt(32)`` have rank 32 exactly).  ``--planted D``
replaces the teacher by a random planted layer with biases on a random
D-dimensional embedding table with LayerNorm (the same pipeline at a size
the dense solver handles), for checking the script end to end.

Examples::

    OMP_NUM_THREADS=1 python benchmarks/bench_minilm_teacher.py --n-heads 2 \
        --n-samples 20000 --max-time 600 --plot minilm.png
    OMP_NUM_THREADS=1 python benchmarks/bench_minilm_teacher.py --planted 6 \
        --n-heads 2 --n-tokens 4 --n-samples 3000 --max-time 120
    OMP_NUM_THREADS=2 python benchmarks/bench_minilm_teacher.py --text --layer 3 \
        --n-heads 12 --n-samples 20000 --max-time 900
"""

import argparse
import resource
import signal
import time
import warnings

import numpy as np

from skattn import (
    AttentionLayer,
    GradientAttentionRegressor,
    MultiHeadAttentionRegressor,
    check_conditions,
)
from skattn.datasets import (
    EmbeddedTokens,
    PretrainedHiddenStates,
    load_bert_attention,
    load_bert_hidden_states,
    make_attention_layer,
)
from skattn.metrics import (
    attention_pattern_error,
    parameter_error,
    prediction_error,
    reached_directions,
)


class _Timeout(Exception):
    pass


def _decoupled_summary(info):
    """The decoupled refinement's work from a polish report, or ``""``."""
    decoupled = (info.get("start_search") or {}).get("decoupled")
    if not decoupled:
        return ""
    heads = decoupled["heads"]
    return (
        f"{max(h['n_iter'] for h in heads)}, {decoupled['n_products']}, "
        f"{sum(h['seconds'] for h in heads):.0f} (residual "
        f"{decoupled['residual_start']:.2g} -> {decoupled['residual']:.2g})"
    )


def teacher(args):
    """The teacher layer restricted to the chosen heads, its input distribution and
    the held-out one (the same, but for real text)."""
    if getattr(args, "bert_base_like", False):
        return bert_base_like(args)
    if args.planted:
        d = args.planted
        rng = np.random.default_rng(args.seed)
        base = make_attention_layer(
            args.n_heads,
            d,
            n_outputs=max(d, args.n_heads * args.n_tokens + 1),
            random_state=args.seed,
        )
        full = AttentionLayer(
            base.attention,
            base.projection,
            key_bias=rng.normal(size=(args.n_heads, d)),
            intercept=rng.normal(size=base.n_outputs),
        )
        dist = EmbeddedTokens(
            rng.normal(size=(500, d)),
            args.n_tokens,
            positions=0.3 * rng.normal(size=(args.n_tokens, d)),
            layer_norm=(rng.uniform(0.5, 1.5, d), 0.1 * rng.normal(size=d)),
        )
        heads = np.arange(args.n_heads)
        name = f"planted d={d} layer with biases"
        test = dist
    elif args.text:
        full, whole = load_bert_hidden_states(layer=args.layer, n_tokens=args.n_tokens)
        split = int(0.9 * len(whole.sequences))
        dist, test = (
            PretrainedHiddenStates(
                whole.encoder, args.n_tokens, layer=args.layer, sequences=part
            )
            for part in (whole.sequences[:split], whole.sequences[split:])
        )
        heads = np.asarray(args.heads or range(args.n_heads))
        name = (
            f"all-MiniLM-L6-v2 layer {args.layer} on real text (stdlib docstrings, "
            f"{split} training and {len(whole.sequences) - split} held-out windows), "
            f"heads {heads.tolist()}"
        )
    else:
        full, dist = load_bert_attention(layer=args.layer, n_tokens=args.n_tokens)
        heads = np.asarray(args.heads or range(args.n_heads))
        name = f"all-MiniLM-L6-v2 layer {args.layer}, heads {heads.tolist()}"
        test = dist
    layer = AttentionLayer(
        full.attention[heads],
        full.projection[heads],
        key_bias=full.key_bias[heads],
        intercept=full.intercept,
        n_tokens=args.n_tokens,
    )
    return layer, dist, test, name


def bert_base_like(args, d=768, rank=64, vocabulary=5000):
    """A planted BERT-base-sized layer (12 heads of rank 64, biases, d = 768) whose
    heads copy the spectra and bias scales of MiniLM's layer ``--layer``.

    No BERT-base checkpoint installs from the package index here, so head ``i``
    gets the 32 singular values of MiniLM's ``Theta_i`` and of ``Theta_{i+1}``
    (64 in all) on random orthonormal singular vectors of R^768, and likewise for
    ``W_i``; key bias ``i`` and the intercept keep the norms of MiniLM's
    (the intercept's per coordinate).  The tokens: ``--n-tokens`` ids drawn from a
    random ``vocabulary x 768`` table and positions, with the per-coordinate
    scales of MiniLM's word and position tables, through a LayerNorm whose
    weight and bias are MiniLM's, tiled.
    """
    full, small = load_bert_attention(layer=args.layer, n_tokens=args.n_tokens)
    rng = np.random.default_rng(args.seed)
    m, r = full.n_heads, full.attention.shape[1] // full.n_heads

    def spectrum(matrices, i):
        s = [np.linalg.svd(matrices[(i + j) % m], compute_uv=False)[:r] for j in (0, 1)]
        return np.sort(np.concatenate(s))[::-1][:rank]

    def planted(values):
        left = np.linalg.qr(rng.normal(size=(d, rank)))[0]
        right = np.linalg.qr(rng.normal(size=(d, rank)))[0]
        return (left * values) @ right.T

    attention = np.stack([planted(spectrum(full.attention, i)) for i in range(m)])
    projection = np.stack([planted(spectrum(full.projection, i)) for i in range(m)])
    key_bias = rng.normal(size=(m, d))
    key_bias *= (
        np.linalg.norm(full.key_bias, axis=1) / np.linalg.norm(key_bias, axis=1)
    )[:, None]
    intercept = rng.normal(scale=np.std(full.intercept), size=d)
    weight, bias = (np.tile(part, 2) for part in small.layer_norm)
    dist = EmbeddedTokens(
        rng.normal(scale=np.std(small.embeddings), size=(vocabulary, d)),
        args.n_tokens,
        positions=rng.normal(scale=np.std(small.positions), size=(args.n_tokens, d)),
        layer_norm=(weight, bias),
    )
    layer = AttentionLayer(
        attention[: args.n_heads],
        projection[: args.n_heads],
        key_bias=key_bias[: args.n_heads],
        intercept=intercept,
        n_tokens=args.n_tokens,
    )
    name = (
        f"planted BERT-base-sized layer (d = {d}, heads of rank {rank} with MiniLM "
        f"layer {args.layer}'s spectra), {args.n_heads} heads"
    )
    return layer, dist, dist, name


def learner(args):
    common = {"n_heads": args.n_heads, "n_tokens": args.n_tokens}
    if args.learner == "phased":
        return MultiHeadAttentionRegressor(
            **common,
            fit_intercept=True,
            head_rank=args.head_rank,
            verbose=args.verbose,
            random_state=args.seed,
        )
    return GradientAttentionRegressor(
        **common,
        fit_intercept=True,
        max_iter=args.max_iter,
        tol=1e-12,
        random_state=args.seed,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-heads", type=int, default=2, help="heads learned")
    parser.add_argument("--heads", type=int, nargs="*", help="which real heads")
    parser.add_argument("--n-samples", type=int, default=20000)
    parser.add_argument("--n-test", type=int, default=2000)
    parser.add_argument("--n-tokens", type=int, default=16)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--max-time", type=float, default=600.0, help="seconds")
    parser.add_argument("--learner", choices=["phased", "gradient"], default="phased")
    parser.add_argument("--max-iter", type=int, default=2000, help="gradient only")
    parser.add_argument("--planted", type=int, default=0, metavar="D")
    parser.add_argument(
        "--text",
        action="store_true",
        help="inputs: hidden states of real text entering --layer",
    )
    parser.add_argument(
        "--bert-base-like",
        action="store_true",
        help="teacher: a planted d = 768 layer, heads of rank 64 with MiniLM's "
        "spectra (--head-rank defaults to 64)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE.png")
    parser.add_argument(
        "--head-rank",
        type=int,
        default=None,
        help="rank of the learned heads (phased only; default: 32 for the real "
        "teacher, full rank with --planted; 0 means full rank)",
    )
    parser.add_argument("--verbose", type=int, default=0)
    args = parser.parse_args(argv)
    if args.heads:
        args.n_heads = len(args.heads)
    if args.head_rank is None:
        args.head_rank = 64 if args.bert_base_like else None if args.planted else 32
    elif args.head_rank == 0:
        args.head_rank = None

    start = time.perf_counter()
    true, dist, test, name = teacher(args)
    d = true.n_features
    print(f"# teacher: {name}; d={d}, d_out={true.n_outputs}, k={args.n_tokens}")
    print(check_conditions(true, n_tokens=args.n_tokens))
    X = dist.sample(args.n_samples, random_state=args.seed)
    y = true.transform(X)
    X_test = test.sample(args.n_test, random_state=args.seed + 1)
    distinct = len(np.unique(X.reshape(len(X), -1), axis=0))
    print(
        f"\n{args.n_samples} training sequences ({distinct} distinct), "
        f"{args.n_test} held out; data made in {time.perf_counter() - start:.0f} s"
    )
    mean, R = reached_directions(X_test, d)
    print(
        f"\ninputs reach an affine subspace of dimension {int(round(np.trace(R)))} "
        f"(of d={d}); ||mean token|| = {np.linalg.norm(mean):.3g}"
    )

    est = learner(args)

    def alarm(signum, frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(max(1, int(args.max_time)))
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(X, y)
    except _Timeout:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"\nfit did not finish within --max-time {args.max_time:g} s; peak "
            f"resident memory {peak:.0f} MB"
        )
        return None
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - start
    for w in caught:
        print(f"warning: {w.category.__name__}: {str(w.message)[:200]}")

    err = parameter_error(true, est, X=X_test)
    raw = parameter_error(true, est)
    polish = [r for r in getattr(est, "phase_report_", []) if r.phase == "6-polish"]
    rows = [
        ("learner", args.learner),
        ("head rank", args.head_rank if args.learner == "phased" else "full"),
        (
            "polish: solver, iterations, Jacobian products",
            ", ".join(
                str(polish[-1].info.get(key))
                for key in ("solver", "n_iter", "n_products")
            )
            if polish
            else "",
        ),
        (
            "decoupled heads: iterations (most), products, seconds (sum)",
            _decoupled_summary(polish[-1].info if polish else {}),
        ),
        ("n_samples (distinct)", f"{args.n_samples} ({distinct})"),
        ("time [s]", f"{seconds:.1f}"),
        (
            "peak resident memory of the process [MB]",
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}",
        ),
        (
            "held-out relative prediction error",
            f"{prediction_error(true, est, X_test):.2e}",
        ),
        ("Theta error (reached subspace)", f"{err.attention_error:.2e}"),
        ("W error (reached subspace)", f"{err.projection_error:.2e}"),
        ("key-bias error (effective)", f"{err.key_bias_error:.2e}"),
        ("intercept error (effective)", f"{err.intercept_error:.2e}"),
        (
            "Theta / W error (raw parameters)",
            f"{raw.attention_error:.2e} / {raw.projection_error:.2e}",
        ),
        (
            "attention pattern error (mean TV)",
            f"{attention_pattern_error(true, est, X_test):.2e}",
        ),
    ]
    print("\n| quantity | value |\n|---|---|")
    for key, value in rows:
        print(f"| {key} | {value} |")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from skattn.metrics import AttentionPatternDisplay

        display = AttentionPatternDisplay.from_layers(
            true, est, X_test, heads=list(range(min(args.n_heads, 4)))
        )
        display.figure_.suptitle(f"{name}: real (top) vs learned (bottom)")
        display.figure_.savefig(args.plot, dpi=120)
        plt.close(display.figure_)
        print(f"\npatterns written to {args.plot}")
    return err


if __name__ == "__main__":
    main()
