"""The number of heads from data: fit m = 1, 2, ... and stop at the noise floor.

Pure functions on token tensors (``X`` of shape ``(n, k, d)``, ``Y`` of shape
``(n, k, d_out)``); :class:`skattn.MultiHeadAttentionRegressor` with
``n_heads="auto"`` orchestrates them and keeps what they report in
``model_selection_``.

The search (:func:`select_n_heads`):

1. split the examples into a training and a held-out part (:func:`split_indices`);
2. for m = 1, 2, ... up to ``max_heads``: start from the fit with m - 1 heads plus
   one new head (:func:`add_head`: the best of a few random candidates, scored by
   the least-squares W), polish all heads jointly on (a subset of) the training
   part (Levenberg-Marquardt on the variable-projection problem), and measure the
   relative error on the held-out part
   (:func:`skattn.diagnostics.held_out_error`);
3. stop at the first m whose held-out error is at machine precision (noise-free
   data: a zero residual is a global minimum, more heads cannot help), or whose
   successor m + 1 brings no significant drop (:func:`significant_drop`: a one-sided
   paired test on the per-example held-out losses);
4. drop the heads of the selected fit that the certificate's redundancy test
   (:func:`skattn.diagnostics.head_redundancy`) calls negligible or duplicate, one
   at a time, re-polishing the others, while the smaller fit stays exact
   (noise-free) or not significantly worse (:func:`drop_redundant_heads`).

Step 4 is there because warm starts can stall: a head of the m - 1 fit stuck in a
poor place can hold the m-head fit at a local minimum (measured: m = 5, Gaussian,
d = 8, k = 2, noise-free, the 5-head warm start converged to 0.12 relative error
after 64 iterations), and the (m + 1)-head fit then reaches the optimum by making
the stuck head negligible.  Dropping that head and re-polishing gives an exact fit
with m heads in one or two iterations; more iterations for the m-head fit do not.

The look-ahead fit (m + 1 heads after an m-head fit whose polish converged) gets
only ``lookahead_iter`` iterations first: a missing head shows as a significant
drop within them, and only then is the polish resumed with the rest of the budget.
Without a missing head the extra head fits noise, converges slowly, and would spend
the whole budget on a fit that is thrown away.

Why here and not in a public ``skattn.model_selection``: the functions follow the
phase contract of :mod:`skattn.phased` (arrays in, estimate and an info dict out,
recorded by the estimator), and a public module of that name would suggest
scikit-learn's cross-validation tools, which work unchanged on skattn's estimators
(``GridSearchCV(est, {"n_heads": [1, 2, 3]})`` selects the same m).  All polishing
goes through :func:`_polish_once`, the only caller of :func:`skattn.solvers.polish`
in this module.
"""

import math
import time

import numpy as np
from sklearn.utils import check_random_state

from ..layer._math import forward
from ..metrics._held_out import held_out_error
from ..metrics._redundancy import head_redundancy
from ..solvers import polish as _polish
from ..solvers import solve_projections
from ..solvers.kernels._loss import REALISABLE_RESIDUAL
from ..solvers.kernels._loss import relative_residual as _relative_rms
from ..solvers.stages._polish import _WARM_DAMPING
from ..utils._validation import _normalized_weights
from ._options import HeadSearchOptions, HullOptions

# the defaults of the head search (written once, in the options objects)
_HULL, _HEADS = HullOptions(), HeadSearchOptions()

# Iterations (Jacobian evaluations) of the look-ahead fit (m + 1 heads after a
# converged, inexact m-head fit) before it must show a significant drop to be
# polished further.  The previous implementation observed 11 to be enough to detect a
# missing head; benchmarks/bench_auto_heads.py reports where the cap applied.
LOOKAHEAD_ITER = 12


def split_indices(n_samples, validation_fraction, random_state=None):
    """A random split of ``range(n_samples)`` into training and held-out indices.

    Parameters
    ----------
    n_samples : int
    validation_fraction : float
        Share of the examples held out, in (0, 1); at least one example goes to
        each side.
    random_state : int, RandomState instance or None

    Returns
    -------
    train : ndarray of shape (n_train,)
    held_out : ndarray of shape (n_held_out,)
        Sorted, disjoint, covering ``range(n_samples)``.

    Examples
    --------
    >>> train, held_out = split_indices(10, 0.2, random_state=0)
    >>> len(train), len(held_out), sorted([*train, *held_out]) == list(range(10))
    (8, 2, True)
    """
    if n_samples < 2:
        raise ValueError(
            f"Selecting the number of heads needs at least 2 examples (one to fit, "
            f"one held out), got n_samples={n_samples}."
        )
    rng = check_random_state(random_state)
    n_held = min(n_samples - 1, max(1, int(round(validation_fraction * n_samples))))
    order = rng.permutation(n_samples)
    return np.sort(order[n_held:]), np.sort(order[:n_held])


def significant_drop(losses_before, losses_after, sample_weight=None, z=3.0):
    """Whether a second fit lowers the held-out loss significantly (paired test).

    One-sided test on the per-example differences ``D_n = before_n - after_n``:
    significant when ``mean(D) > z se(mean(D))`` (weighted) and ``mean(D) > 0``.
    With ``z = 3`` a fit that only adds parameters to noise passes with
    probability about 0.1 % (normal approximation).

    Parameters
    ----------
    losses_before, losses_after : ndarray of shape (n,)
        Per-example squared errors of the two fits on the same held-out examples.
    sample_weight : ndarray of shape (n,) or None
    z : float, default=3.0
        One-sided critical value.

    Returns
    -------
    significant : bool
    statistic : float
        ``mean(D) / se(mean(D))`` (``inf`` when every difference is equal and
        positive, 0 when they are all 0).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> noise = rng.normal(size=1000) ** 2
    >>> significant_drop(noise + 1.0, noise)[0]
    True
    >>> significant_drop(noise, rng.normal(size=1000) ** 2)[0]
    False
    """
    omega = _normalized_weights(len(losses_before), sample_weight)
    diff = np.asarray(losses_before, float) - np.asarray(losses_after, float)
    mean = float(omega @ diff)
    se = math.sqrt(float(np.sum(omega**2 * (diff - mean) ** 2)))
    if se == 0.0:
        statistic = math.inf if mean > 0 else 0.0
    else:
        statistic = mean / se
    return bool(mean > 0 and statistic > z), float(statistic)


def add_head(X, Y, attention, *, n_candidates=8, scale=None, random_state=None):
    """Warm start for m heads: the m - 1 heads of ``attention`` plus one new head.

    ``n_candidates`` random Gaussian ``Theta`` (Frobenius norm ``scale``) are each
    appended to the existing heads; the W of every head is solved by least squares
    and the candidate with the smallest residual is kept.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m - 1, d, d)
        The heads of the previous fit (``m - 1 = 0`` allowed).
    n_candidates : int, default=8
    scale : float or None
        Norm of the new head; ``None``: the mean norm of the existing heads, or 1
        when there are none.
    random_state : int, RandomState instance or None

    Returns
    -------
    attention : ndarray of shape (m, d, d)

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 3, 4))
    >>> th, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 4))
    >>> add_head(X, forward(X, th, W), th[:1], random_state=0).shape
    (2, 4, 4)
    """
    rng = check_random_state(random_state)
    d = X.shape[2]
    if scale is None:
        norms = np.linalg.norm(attention, axis=(1, 2))
        scale = float(np.mean(norms)) if len(norms) and np.mean(norms) > 0 else 1.0
    best, best_loss = None, np.inf
    for _ in range(n_candidates):
        new = rng.standard_normal((d, d))
        new *= scale / np.linalg.norm(new)
        trial = np.concatenate([attention, new[None]])
        projection = solve_projections(X, Y, trial)
        loss = float(np.sum((forward(X, trial, projection) - Y) ** 2))
        if loss < best_loss:
            best, best_loss = trial, loss
    return best


def _polish_once(X, Y, attention, sample_weight, max_iter, tol, damping=1e-3):
    """The one call of :func:`skattn.solvers.polish` (varpro LM) in this module."""
    return _polish(
        X,
        Y,
        attention,
        None,
        sample_weight=sample_weight,
        max_iter=max_iter,
        tol=tol,
        damping=damping,
    )


def select_n_heads(
    X,
    Y,
    *,
    max_heads=_HULL.max_heads,
    sample_weight=None,
    validation_fraction=_HEADS.validation_fraction,
    n_fit_samples=_HEADS.n_fit_samples,
    n_candidates=8,
    max_iter=30,
    tol=1e-10,
    z=3.0,
    exact_residual=REALISABLE_RESIDUAL,
    lookahead_iter=LOOKAHEAD_ITER,
    prune=True,
    random_state=None,
):
    """Fit m = 1, 2, ... heads with warm starts; stop at the held-out noise floor.

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    max_heads : int, default=6
        Largest m tried.
    sample_weight : ndarray of shape (n,) or None
    validation_fraction : float, default=0.2
        Share of the examples held out.
    n_fit_samples : int or None, default=400
        Training examples used by each candidate's polish (a random subset of the
        training part; ``None``: all of it).
    n_candidates : int, default=8
        Random candidates for each new head (:func:`add_head`).
    max_iter : int, default=30
        Levenberg-Marquardt iterations per candidate m.
    tol : float, default=1e-10
        Relative step tolerance of the polish.
    z : float, default=3.0
        Critical value of :func:`significant_drop`.
    exact_residual : float, default=1e-10
        Held-out relative RMS error at or below which a fit is exact: the search
        stops there without trying m + 1.
    lookahead_iter : int or None, default=12
        Iterations of a fit with one head more than a converged, inexact fit
        before its drop is tested; only a significant drop (or an exact fit)
        earns the rest of ``max_iter``.  ``None``: no cap.
    prune : bool, default=True
        Drop the selected fit's redundant heads (:func:`drop_redundant_heads`).
    random_state : int, RandomState instance or None

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
        The selected fit (on the training part).
    info : dict
        ``n_heads`` (selected m), ``reason`` (why the search stopped),
        ``candidates`` (one dict per m tried: ``n_heads``, ``train_error``,
        ``held_out_error``, ``held_out_interval``, ``drop_statistic`` (of this m
        against m - 1), ``significant_drop``, ``exact``, ``n_iter``,
        ``converged``, ``capped`` (the look-ahead cap applied), ``resumed``
        (polished on after the cap), ``seconds``), ``pruned`` (one dict per
        redundant head dropped from the search's choice, see
        :func:`drop_redundant_heads`; the selected m is the last accepted one),
        ``held_out_error`` and ``held_out_interval`` (of the selected fit),
        ``train_indices``, ``held_out_indices``, ``held_out_losses``
        (per-example, of the selected fit) and ``validation_fraction``.

    Notes
    -----
    Noise-free (realisable) data: the fit with the planted m reaches machine
    precision on the held-out part and the search stops there.  With noise the
    held-out error of m + 1 heads is compared with that of m; the search stops at
    the first m that m + 1 does not improve significantly (``z`` standard errors
    of the paired differences), which costs one fit more than the selected m.
    After the stop, heads of the chosen fit that are redundant (negligible or
    duplicate) are dropped while the smaller fit stays exact or not significantly
    worse: a stalled warm start can otherwise make the search over-count.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(600, 3, 4))
    >>> th, W = rng.normal(size=(2, 4, 4)), rng.normal(size=(2, 4, 8))
    >>> th_hat, W_hat, info = select_n_heads(X, forward(X, th, W), random_state=0)
    >>> info["n_heads"], info["reason"]
    (2, 'exact')
    """
    rng = check_random_state(random_state)
    n = X.shape[0]
    train, held = split_indices(n, validation_fraction, rng)
    fit_rows = train
    if n_fit_samples is not None and train.size > n_fit_samples:
        fit_rows = np.sort(rng.choice(train, size=n_fit_samples, replace=False))
    Xf, Yf = X[fit_rows], Y[fit_rows]
    wf = None if sample_weight is None else sample_weight[fit_rows]
    Xh, Yh = X[held], Y[held]
    wh = None if sample_weight is None else sample_weight[held]
    d = X.shape[2]
    candidates, fits = [], []
    attention = np.zeros((0, d, d))
    reason, chosen = "max_heads", None
    for m in range(1, max_heads + 1):
        start = time.perf_counter()
        attention = add_head(
            Xf, Yf, attention, n_candidates=n_candidates, random_state=rng
        )
        capped = bool(
            fits
            and lookahead_iter is not None
            and lookahead_iter < max_iter
            and candidates[-1]["converged"]
        )
        budget = lookahead_iter if capped else max_iter
        attention, projection, pinfo = _polish_once(Xf, Yf, attention, wf, budget, tol)
        n_iter, converged = int(pinfo["n_iter"]), bool(pinfo["converged"])
        err, interval, losses = held_out_error(Xh, Yh, attention, projection, wh)
        drop = (None, np.nan)
        if fits:
            drop = significant_drop(fits[-1][2], losses, wh, z)
        resumed = capped and not converged and err > exact_residual and drop[0]
        if resumed:
            # a head was missing: finish this fit with the rest of the budget
            attention, projection, pinfo = _polish_once(
                Xf, Yf, attention, wf, max_iter - budget, tol
            )
            n_iter += int(pinfo["n_iter"])
            converged = bool(pinfo["converged"])
            err, interval, losses = held_out_error(Xh, Yh, attention, projection, wh)
            drop = significant_drop(fits[-1][2], losses, wh, z)
        record = {
            "n_heads": m,
            "train_error": _relative_rms(Xf, Yf, attention, projection, wf),
            "held_out_error": err,
            "held_out_interval": interval,
            "drop_statistic": drop[1],
            "significant_drop": drop[0],
            "exact": bool(err <= exact_residual),
            "n_iter": n_iter,
            "converged": converged,
            "capped": capped,
            "resumed": bool(resumed),
            "seconds": time.perf_counter() - start,
        }
        candidates.append(record)
        fits.append((attention, projection, losses))
        if record["exact"]:
            reason, chosen = "exact", m - 1
            break
        if len(fits) > 1 and not record["significant_drop"]:
            reason, chosen = "no_significant_drop", m - 2
            break
    if chosen is None:
        chosen = len(fits) - 1
    attention, projection, losses = fits[chosen]
    selected = candidates[chosen]
    pruned = []
    if prune:
        attention, projection, losses, pruned = drop_redundant_heads(
            Xf,
            Yf,
            Xh,
            Yh,
            attention,
            projection,
            losses,
            exact=selected["exact"],
            sample_weight=wf,
            held_out_weight=wh,
            max_iter=max_iter,
            tol=tol,
            z=z,
            exact_residual=exact_residual,
        )
        accepted = [r for r in pruned if r["accepted"]]
        if accepted:
            selected = accepted[-1]
    info = {
        "n_heads": int(attention.shape[0]),
        "reason": reason,
        "candidates": candidates,
        "pruned": pruned,
        "held_out_error": selected["held_out_error"],
        "held_out_interval": selected["held_out_interval"],
        "train_indices": train,
        "held_out_indices": held,
        "held_out_losses": losses,
        "validation_fraction": float(validation_fraction),
        "n_fit_samples": int(fit_rows.size),
    }
    return attention, projection, info


def drop_redundant_heads(
    X,
    Y,
    X_held_out,
    Y_held_out,
    attention,
    projection,
    held_out_losses,
    *,
    exact,
    sample_weight=None,
    held_out_weight=None,
    max_iter=30,
    tol=1e-10,
    z=3.0,
    exact_residual=REALISABLE_RESIDUAL,
    redundancy_tol=1e-6,
):
    """Drop redundant heads one at a time while the smaller fit is as good.

    A head is redundant by the certificate's test
    (:func:`skattn.diagnostics.head_redundancy` on the training examples, with
    tolerance ``max(redundancy_tol, 2 * residual)``): the relative residual
    without it, the other heads' W re-solved, stays at that tolerance.  The
    redundant head whose removal costs least is dropped, the other heads are
    polished from where they are, and the result is accepted when it is exact on
    the held-out examples (if the fit it replaces was exact) or else not
    significantly worse there (:func:`significant_drop` of the smaller fit's
    losses against the larger's); then the test is repeated on it.  With two
    tokens, when no head is redundant, a head is also dropped when negating
    another one absorbs it (:func:`sign_flip_redundancy`).

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
        Training examples.
    X_held_out : ndarray of shape (n_held_out, k, d)
    Y_held_out : ndarray of shape (n_held_out, k, d_out)
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
        The fit to prune.
    held_out_losses : ndarray of shape (n_held_out,)
        Its per-example held-out squared errors.
    exact : bool
        Whether the fit is exact on the held-out examples (then only an exact
        smaller fit is accepted).
    sample_weight, held_out_weight : ndarray or None
    max_iter : int, default=30
        Levenberg-Marquardt iterations of each re-polish.
    tol : float, default=1e-10
    z : float, default=3.0
    exact_residual : float, default=1e-10
    redundancy_tol : float, default=1e-6

    Returns
    -------
    attention : ndarray of shape (m', d, d)
    projection : ndarray of shape (m', d, d_out)
    held_out_losses : ndarray of shape (n_held_out,)
        The last accepted fit (``m' <= m``) and its held-out losses.
    records : list of dict
        One per head dropped and tried: ``n_heads`` (after the drop),
        ``dropped_head`` (index in the fit it was dropped from), ``note``
        (``"negligible"``, ``"duplicate of head j"`` or, k = 2 only,
        ``"uniform part, absorbed by negating head j (k = 2)"``), ``train_error``,
        ``held_out_error``, ``held_out_interval``, ``exact``, ``n_iter``,
        ``converged``, ``accepted``, ``seconds``.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(400, 3, 4))
    >>> th, W = rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 4, 4))
    >>> Y = forward(X, th, W)
    >>> th2 = np.concatenate([th, rng.normal(size=(1, 4, 4))])
    >>> W2 = np.concatenate([W, np.zeros((1, 4, 4))])
    >>> losses = np.zeros(100)
    >>> out = drop_redundant_heads(
    ...     X[:300], Y[:300], X[300:], Y[300:], th2, W2, losses, exact=True
    ... )
    >>> out[0].shape[0], out[3][0]["note"], out[3][0]["accepted"]
    (1, 'negligible', True)
    """
    records = []
    while attention.shape[0] > 1:
        start = time.perf_counter()
        residual = _relative_rms(X, Y, attention, projection, sample_weight)
        threshold = max(redundancy_tol, 2 * residual)
        redundant, notes, drop, _ = head_redundancy(
            X, Y, attention, projection, threshold
        )
        if redundant:
            head = min(redundant, key=lambda i: drop[i])
            note, reduced = notes[head], np.delete(attention, head, axis=0)
        elif X.shape[1] == 2:
            head, flipped, flip_residual = sign_flip_redundancy(
                X, Y, attention, sample_weight
            )
            if flip_residual > threshold:
                break
            note = f"uniform part, absorbed by negating head {flipped} (k = 2)"
            reduced = attention.copy()
            reduced[flipped] *= -1.0
            reduced = np.delete(reduced, head, axis=0)
        else:
            break
        trial, trial_projection, pinfo = _polish_once(
            X, Y, reduced, sample_weight, max_iter, tol, damping=_WARM_DAMPING
        )
        err, interval, losses = held_out_error(
            X_held_out, Y_held_out, trial, trial_projection, held_out_weight
        )
        if exact:
            accepted = err <= exact_residual
        else:
            accepted = not significant_drop(
                losses, held_out_losses, held_out_weight, z
            )[0]
        records.append(
            {
                "n_heads": int(trial.shape[0]),
                "dropped_head": int(head),
                "note": note,
                "train_error": _relative_rms(
                    X, Y, trial, trial_projection, sample_weight
                ),
                "held_out_error": err,
                "held_out_interval": interval,
                "exact": bool(err <= exact_residual),
                "n_iter": int(pinfo["n_iter"]),
                "converged": bool(pinfo["converged"]),
                "accepted": bool(accepted),
                "seconds": time.perf_counter() - start,
            }
        )
        if not accepted:
            break
        attention, projection, held_out_losses = trial, trial_projection, losses
    return attention, projection, held_out_losses, records


def sign_flip_redundancy(X, Y, attention, sample_weight=None, n_rows=300):
    """With two tokens: the best head to drop after negating another head.

    For k = 2 each attention row is ``(p, 1 - p)`` with ``p`` a sigmoid, so
    ``softmax(-X Theta X^T) = 2 U - softmax(X Theta X^T)`` with ``U`` the uniform
    pattern: a head ``(Theta, W)`` equals ``(-Theta, -W)`` plus the uniform head
    ``(0, 2 W)``.  A fit with one head more than the layer can thus be exact with
    no head redundant on its own: a uniform head (``Theta = 0``), or a pair
    ``Theta, -Theta``, carries the uniform part of a head fitted with the opposite
    sign.  Negating that head makes the uniform part superfluous.  This tries
    every (head to drop, head to negate) pair, the W re-solved by least squares.

    Parameters
    ----------
    X : ndarray of shape (n, 2, d)
    Y : ndarray of shape (n, 2, d_out)
    attention : ndarray of shape (m, d, d)
    sample_weight : ndarray of shape (n,) or None
    n_rows : int, default=300
        Examples used (the first ones); enough to tell an exact fit.

    Returns
    -------
    head : int
        The head to drop.
    flipped : int
        The head to negate.
    residual : float
        Relative RMS residual after both, W re-solved (``inf`` when m < 2).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 2, 3))
    >>> th, W = rng.normal(size=(1, 3, 3)), rng.normal(size=(1, 3, 4))
    >>> fit = np.concatenate([-th, np.zeros((1, 3, 3))])  # -Theta and uniform
    >>> head, flipped, residual = sign_flip_redundancy(X, forward(X, th, W), fit)
    >>> head, flipped, bool(residual < 1e-12)
    (1, 0, True)
    """
    X, Y = X[:n_rows], Y[:n_rows]
    weight = None if sample_weight is None else sample_weight[:n_rows]
    m = attention.shape[0]
    best = (0, 0, math.inf)
    for head in range(m):
        for flipped in range(m):
            if flipped == head:
                continue
            trial = attention.copy()
            trial[flipped] *= -1.0
            trial = np.delete(trial, head, axis=0)
            projection = solve_projections(X, Y, trial, weight)
            residual = _relative_rms(X, Y, trial, projection, weight)
            if residual < best[2]:
                best = (head, flipped, residual)
    return best


def polish_on_all(X, Y, attention, sample_weight=None, max_iter=100, tol=1e-10):
    """Refit the selected heads on all examples, from the selection's fit.

    Skipped when the fit is already exact on all of them (relative RMS residual
    at most ``REALISABLE_RESIDUAL``: only a forward pass is paid); otherwise a
    Levenberg-Marquardt polish with little initial damping (a warm start).

    Parameters
    ----------
    X : ndarray of shape (n, k, d)
    Y : ndarray of shape (n, k, d_out)
    attention : ndarray of shape (m, d, d)
    sample_weight : ndarray of shape (n,) or None
    max_iter : int, default=100
    tol : float, default=1e-10

    Returns
    -------
    attention : ndarray of shape (m, d, d)
    projection : ndarray of shape (m, d, d_out)
    info : dict
        ``ran`` (whether the polish ran), ``residual`` (relative RMS on all
        examples before it), and the polish's info when it ran.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.layer._math import forward
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(300, 3, 4))
    >>> th, W = rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 4, 4))
    >>> polish_on_all(X, forward(X, th, W), th)[2]["ran"]
    False
    """
    projection = solve_projections(X, Y, attention, sample_weight)
    residual = _relative_rms(X, Y, attention, projection, sample_weight)
    if residual <= REALISABLE_RESIDUAL:
        return attention, projection, {"ran": False, "residual": residual}
    attention, projection, pinfo = _polish_once(
        X, Y, attention, sample_weight, max_iter, tol, damping=_WARM_DAMPING
    )
    return attention, projection, {"ran": True, "residual": residual, **pinfo}
