"""
=================================================
Recovery versus the number of examples
=================================================

How many examples does each learner need to recover a planted two-head layer?
We plant layers, draw ``n`` examples for a range of ``n``, fit

* the phased learner of Chen & Li,
  :class:`~skattn.estimators.MultiHeadAttentionRegressor`, with its final polish
  (the default) and without it (``polish=False``: the estimate of the phases and
  the epsilon-net alone);
* gradient training from a random start,
  :class:`~skattn.estimators.GradientAttentionRegressor` (L-BFGS),

and draw the head-matched attention error (:func:`~skattn.metrics.parameter_error`)
against ``n`` with :class:`~skattn.metrics.RecoveryCurveDisplay`, once on exact
labels and once on noisy ones.

To keep the whole script within a minute on a laptop core, the problem is small
(``k = 3`` Gaussian tokens of ``d = 6`` features, ``d_out = 12``), the sample
sizes stop at 3200 and each point has two repeats (a new layer and sample each
time).  The curves of larger problems, where the phases need far more examples
(with ``k = 4`` Boolean tokens of ``d = 6`` features, 10000 examples still gave
no clear spectral gap for two heads in our runs), belong in ``benchmarks/``.
"""

# %%
# The experiment
# --------------
import warnings

import matplotlib.pyplot as plt
import numpy as np
from sklearn.exceptions import ConvergenceWarning

from skattn.datasets import make_attention_regression
from skattn.estimators import GradientAttentionRegressor, MultiHeadAttentionRegressor
from skattn.metrics import RecoveryCurveDisplay, parameter_error

N_TOKENS, N_FEATURES, N_OUTPUTS, N_HEADS = 3, 6, 12, 2
SAMPLE_SIZES = [200, 500, 1250, 3200]
N_REPEATS = 2

LEARNERS = {
    "phased, polish": lambda seed: MultiHeadAttentionRegressor(
        n_heads=N_HEADS, n_tokens=N_TOKENS, random_state=seed
    ),
    "phased, net only": lambda seed: MultiHeadAttentionRegressor(
        n_heads=N_HEADS, n_tokens=N_TOKENS, polish=False, random_state=seed
    ),
    "gradient (L-BFGS)": lambda seed: GradientAttentionRegressor(
        n_heads=N_HEADS, n_tokens=N_TOKENS, random_state=seed
    ),
}


def recovery_curves(noise):
    """Attention errors of each learner, shape (N_REPEATS, len(SAMPLE_SIZES))."""
    errors = {
        name: np.full((N_REPEATS, len(SAMPLE_SIZES)), np.nan) for name in LEARNERS
    }
    for repeat in range(N_REPEATS):
        for j, n in enumerate(SAMPLE_SIZES):
            X, y, layer = make_attention_regression(
                n,
                N_TOKENS,
                N_FEATURES,
                N_HEADS,
                n_outputs=N_OUTPUTS,
                distribution="gaussian",
                noise=noise,
                random_state=100 * repeat + j,
                return_layer=True,
            )
            for name, make in LEARNERS.items():
                with warnings.catch_warnings():
                    # weak spectral evidence on small samples: read it in the
                    # phase report (see the phase diagnostics example)
                    warnings.simplefilter("ignore", ConvergenceWarning)
                    warnings.simplefilter("ignore", UserWarning)
                    try:
                        est = make(repeat).fit(X, y)
                    except ValueError as exc:  # too few certified rows
                        print(f"{name}, n={n}: {str(exc)[:80]}...")
                        continue
                errors[name][repeat, j] = parameter_error(layer, est).attention_error
    return errors


def show(errors):
    for name, values in errors.items():
        medians = " ".join(f"{v:8.1e}" for v in np.nanmedian(values, axis=0))
        print(f"{name:>18}: {medians}")


print(f"{'n':>18}: " + " ".join(f"{n:8d}" for n in SAMPLE_SIZES))
exact = recovery_curves(noise=0.0)
show(exact)

# %%
# On exact labels, the polished phased learner and gradient training recover
# the layer from the smallest sample: the problem has 2 * (36 + 72) = 216
# parameters and 200 examples carry 200 * 36 labels.  They stop at their
# numerical floors (machine precision for the phased learner's
# Levenberg-Marquardt polish, the ``tol`` of L-BFGS for gradient training).  The
# net's estimate without the polish improves with ``n``, unevenly with only two
# repeats, from tens of percent to a few percent: more examples certify more
# rows, so the hull of the ``Theta_i`` is located better, and the net searches
# around a better point.
#
# Noisy labels
# ------------
# With Gaussian noise of standard deviation 0.1 on every label entry, no learner
# can be exact; the polished phased learner and gradient training converge to
# the same least-squares fit, whose error decreases like ``n^(-1/2)``.  The
# phases alone suffer more: noise blurs certification, whose tolerance is a
# relative residual.
noisy = recovery_curves(noise=0.1)
show(noisy)

# %%
# The curves
# ----------
# :class:`~skattn.metrics.RecoveryCurveDisplay` draws one line per learner (the
# median over the repeats) and a band (their range), log-log.  On noisy labels
# the polished phased learner (dashed) and gradient training lie on top of each
# other.
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
for ax, errors, title in [
    (axes[0], exact, "exact labels"),
    (axes[1], noisy, "labels + N(0, 0.1^2) noise"),
]:
    display = RecoveryCurveDisplay.from_results(
        SAMPLE_SIZES, errors, ylabel="relative attention error", ax=ax
    )
    display.lines_["phased, polish"].set(linestyle="--", zorder=3)
    ax.legend()
    ax.set_title(title)
plt.show()
