"""How well a sharp head's patterns are read off its outputs, and its logits fitted.

The restart from patterns of the decoupled refinement (``solvers/stages/
_sharp_heads.py``) on all-MiniLM-L6-v2 layer 0's previous-token head (real head
2, median largest weight 0.99993), embedded random tokens, the head alone: its
one-head problem on the augmented tokens ``[x, 1]`` (``Theta`` with the key bias
in its last row, rank 32 exactly; the values ``W`` of rank 32, the intercept left
out), exact outputs.  From a start whose ``Q`` is ``--sharper`` times too large
(every row's largest weight in place, the small weights several nats too small,
as the search leaves this head) it reads the patterns on ``--n-samples``
sequences for each of ``--rounds`` (``invert_patterns``, every round run) and
prints the seconds, the read residual and the error of the small weights'
logarithms against the real ones; with ``--fit``, the logits are then fitted to
the last reading (``fit_logits``, ``--fit`` stages of 20 evaluations) and the
held-out pattern error of the fitted head is printed after each stage.
``--fista`` reads with the former solver of each round's rows (accelerated
projected gradient, 1000 iterations) instead of the active-set one.

Example::

    OMP_NUM_THREADS=1 python benchmarks/studies/study_pattern_reading.py \\
        --n-samples 3384 --rounds 10 30 --fit 1
"""

import argparse
import os
import sys
import time

import numpy as np


def one_head_problem(n, seed=0, n_test=500):
    """Layer 0's head 2 as a one-head problem on augmented tokens: ``X, Y`` (n
    sequences), held-out tokens, the parametrization and the true parameters."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_minilm_teacher

    from skattn.solvers import FactoredHeads

    teacher_args = argparse.Namespace(
        bert_base_like=False, planted=0, text=False, heads=[2], n_heads=1,
        n_tokens=16, layer=0, seed=0,
    )  # fmt: skip
    layer, dist, test, _ = bench_minilm_teacher.teacher(teacher_args)

    def augmented(Z, count):
        Z = Z.reshape(count, 16, -1)
        return np.concatenate([Z, np.ones((count, 16, 1))], axis=2)

    X = augmented(dist.sample(n, random_state=seed), n)
    X_test = augmented(test.sample(n_test, random_state=seed + 1), n_test)
    d, r = X.shape[2], 32
    theta = np.zeros((d, d))
    theta[:-1, :-1] = layer.attention[0]
    theta[-1, :-1] = layer.key_bias[0]
    U, S, Vt = np.linalg.svd(theta)
    Q, K = U[:, :r] * np.sqrt(S[:r]), Vt[:r].T * np.sqrt(S[:r])
    W = np.zeros((d, layer.projection.shape[2]))
    W[:-1] = layer.projection[0]
    Uw, Sw, Vwt = np.linalg.svd(W, full_matrices=False)
    V, outputs = Uw[:, :r] * Sw[:r], Vwt[:r]
    par = FactoredHeads(1, d, r)
    truth = np.concatenate([Q.ravel(), K.ravel(), V.ravel()])
    Y = patterns_of(par, truth, X) @ (X @ V @ outputs)
    return X, Y, X_test, par, truth


def patterns_of(par, params, X):
    from skattn.layer._math import softmax

    return softmax(par.logits(X, params), axis=-1)[:, 0]


def log_error(found, real, low, high):
    """Median and 90 % quantile of ``|log found - log real|`` over the real
    weights in ``(low, high)``."""
    mask = (real > low) & (real < high)
    error = np.abs(np.log(np.maximum(found[mask], 1e-300)) - np.log(real[mask]))
    return np.median(error), np.quantile(error, 0.9)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-samples", type=int, default=3384)
    parser.add_argument("--rounds", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--sharper", type=float, default=1.6)
    parser.add_argument("--fit", type=int, default=0, help="stages of the logit fit")
    parser.add_argument("--fista", action="store_true")
    args = parser.parse_args(argv)

    import skattn.solvers.kernels._patterns as kernels
    from skattn.solvers.kernels._patterns import invert_patterns
    from skattn.solvers.stages._sharp_heads import fit_logits

    if args.fista:

        def fista(targets, images, start, max_iter=None, tol=1e-13):
            gram = images @ np.swapaxes(images, 1, 2)
            linear = targets @ np.swapaxes(images, 1, 2)
            return kernels._projected_gradient(linear, gram, start, 1000, tol)

        kernels.simplex_least_squares = fista
    X, Y, X_test, par, truth = one_head_problem(args.n_samples)
    Q, K, V = par.factors(truth)
    start = np.concatenate([(args.sharper * Q).ravel(), K.ravel(), V.ravel()])
    real, real_test = patterns_of(par, truth, X), patterns_of(par, truth, X_test)
    print(
        f"layer 0 head 2, {args.n_samples} sequences, start {args.sharper:g} times "
        f"too sharp, {'FISTA' if args.fista else 'active set'}"
    )
    print("| rounds | seconds | read residual | log error, weights 1e-5-1e-4 "
          "(median, 90 %) | weights 1e-4-1e-2 |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for rounds in args.rounds:
        clock = time.perf_counter()
        found, info = invert_patterns(X, Y, start, par, 0, n_rounds=rounds)
        seconds = time.perf_counter() - clock
        small = log_error(found, real, 1e-5, 1e-4)
        large = log_error(found, real, 1e-4, 1e-2)
        print(
            f"| {rounds} | {seconds:.1f} | {info['residuals'][-1]:.2e} | "
            f"{small[0]:.2g}, {small[1]:.2g} | {large[0]:.2g}, {large[1]:.2g} |",
            flush=True,
        )
    params = start
    for stage in range(args.fit):
        clock = time.perf_counter()
        params, fit = fit_logits(X, found, params, par, 0)
        fitted = patterns_of(par, params, X_test)
        error = np.linalg.norm(fitted - real_test) / np.linalg.norm(real_test)
        print(
            f"logit fit stage {stage + 1}: {time.perf_counter() - clock:.0f} s, "
            f"cost {fit['logit_cost']:.3g}, held-out pattern error {error:.3g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
