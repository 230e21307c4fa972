"""A certificate of a fitted attention layer: is this fit the truth or just a fit?

:func:`certify` measures, for a layer (or fitted estimator) and its training data:

1. **exactness**: the relative training residual ``sqrt(sum ||F(X) - Y||^2 /
   sum ||Y||^2)``, and whether it is at machine precision (``<= exact_tol``); in the
   realisable case a zero residual is a global minimum of the squared loss;
2. **local identifiability**: the singular values of the Jacobian of the outputs in
   the products ``(Theta_i, W_i)`` at the fit (restricted to the rank-r tangent
   space for low-rank heads, which removes the ``2 r^2`` gauge directions of the
   factors per head), on a subset of the examples.  Head permutations are
   discrete and leave the rank unchanged; any other null direction is a
   parameter change the data cannot see (e.g. inputs confined to a subspace, a
   head with zero projection).  Full rank: the fit is locally unique (up to the
   ``m!`` head permutations);
3. the **held-out error** with a delta-method confidence interval (held-out data
   given, or the held-out part of ``n_heads="auto"``'s selection);
4. **redundancy**: a head is redundant when dropping it (and re-solving the other
   heads' W) leaves the residual within ``max(redundancy_tol, 2 * residual)``;
   it is a *duplicate* of the head whose attention is closest, or *negligible*
   when its own output share is that small.  Over-parameterised fits (more heads
   than the truth) show up here;
5. the **non-degeneracy conditions** of the fitted layer
   (:func:`skattn.check_conditions`);
6. the **sharp heads**: per head, how many training rows split its attention
   (largest weight at most 0.99) against the number a counting bound asks for to
   pin its logits (:func:`skattn.metrics.sharp_head_pinning`: a necessary
   condition, a heuristic): "pinned" or "not pinned", and about how many
   sequences would pin it.

The verdict is one of ``"exact and identifiable"``, ``"exact but not
identifiable"`` (exact, but the Jacobian is rank deficient or a head is
redundant) and ``"not exact"``; the sharp-head verdict is a separate field
(``sharp_head_verdicts``).

Cost: the Jacobian has ``P = m (d^2 + d d_out)`` columns (fewer for low-rank heads)
and about ``4 P`` rows; its QR costs ``O(P^3)``: about 0.2 s at P = 400 and several
seconds at P = 1200 on one core.  Above ``max_parameters`` identifiability is not
computed (the verdict then says so); ``P`` is counted before any basis of the
parameter directions is built (that basis alone is ``O(m d^4)`` floats).
"""

import math
from dataclasses import dataclass, field

import numpy as np
from sklearn.utils import check_random_state

from ..layer import as_layer
from ..metrics._held_out import held_out_error
from ..metrics._redundancy import head_redundancy
from ..metrics._sharpness import _describe_pinning, sharp_head_pinning
from ..solvers.kernels._loss import relative_residual as _relative_rms
from ..utils._validation import check_finite, flatten_tokens, layer_sequences
from ._conditions import check_conditions
from ._jacobian import jacobian_singular_values, parameter_basis

__all__ = ["Certificate", "certify"]

VERDICTS = ("exact and identifiable", "exact but not identifiable", "not exact")


@dataclass(frozen=True)
class Certificate:
    """What a fit is: exact or not, locally unique or not, and how well it predicts.

    Returned by :func:`certify` (and stored as ``certificate_`` by
    ``MultiHeadAttentionRegressor(certificate=True)``).  Printing it gives one
    line per finding and the verdict.  Every parameter is stored as an attribute of
    the same name.

    Parameters
    ----------
    verdict : str
        ``"exact and identifiable"``, ``"exact but not identifiable"`` or ``"not
        exact"`` (with ``" (identifiability not computed)"`` appended to an exact
        fit whose Jacobian was too large).
    n_heads, n_features, n_outputs, n_tokens, n_samples : int
        Shape of the layer and the number of training examples.
    train_residual : float
        Relative RMS training residual.
    exact : bool
        ``train_residual <= exact_tol``.
    exact_tol : float
    head_rank : int or None
        Rank of the heads' parametrization (``None``: full rank).
    n_parameters : int
        Parameter directions the parametrization allows (products, gauge removed).
    jacobian_rank : int or None
        Numerical rank of the Jacobian (``None``: not computed).
    null_dimension : int or None
        ``n_parameters - jacobian_rank``: directions the data does not determine.
    smallest_singular_value : float or None
        Smallest non-zero singular value, relative to the largest.
    singular_values : ndarray or None
        All singular values, descending (absolute).
    rank_tol : float
        Relative threshold of the numerical rank.
    n_jacobian_samples : int
        Examples the Jacobian was computed on.
    locally_unique : bool or None
        Exact, full rank and no redundant head.
    held_out_error : float or None
        Relative RMS error on held-out examples.
    held_out_interval : tuple of float or None
        Its confidence interval.
    confidence_level : float
    n_held_out : int
    held_out_source : str
        Where the held-out error comes from.
    redundant_heads : tuple of int
        Heads that can be dropped without raising the residual.
    head_notes : tuple of str
        One note per head (``""``, ``"duplicate of head j"`` or ``"negligible"``).
    drop_residual : ndarray of shape (n_heads,)
        Relative training residual with each head dropped and W re-solved.
    output_share : ndarray of shape (n_heads,)
        ``||S_i X W_i|| / ||F(X)||`` per head.
    conditions : ConditionReport
        :func:`skattn.check_conditions` of the layer.
    sharp_heads : sklearn.utils.Bunch or None
        :func:`skattn.metrics.sharp_head_pinning` of the layer on the training
        inputs (``None`` with one token per sequence, where the logits do not
        matter).
    sharp_head_verdicts : tuple of str
        Per head, ``"pinned"`` or ``"not pinned"``: whether the training rows
        that split the head's attention reach the counting bound for its logits
        (empty with one token per sequence).

    Examples
    --------
    >>> from skattn import certify, make_attention_regression
    >>> X, y, layer = make_attention_regression(
    ...     300, 3, 4, 2, n_outputs=10, random_state=0, return_layer=True)
    >>> cert = certify(layer, X, y)
    >>> cert.verdict, cert.null_dimension, cert.redundant_heads
    ('exact and identifiable', 0, ())
    >>> cert.sharp_head_verdicts
    ('pinned', 'pinned')
    """

    verdict: str
    n_heads: int
    n_features: int
    n_outputs: int
    n_tokens: int
    n_samples: int
    train_residual: float
    exact: bool
    exact_tol: float
    head_rank: int | None
    n_parameters: int
    jacobian_rank: int | None
    null_dimension: int | None
    smallest_singular_value: float | None
    singular_values: np.ndarray | None = field(repr=False, compare=False)
    rank_tol: float
    n_jacobian_samples: int
    locally_unique: bool | None
    held_out_error: float | None
    held_out_interval: tuple | None
    confidence_level: float
    n_held_out: int
    held_out_source: str
    redundant_heads: tuple
    head_notes: tuple
    drop_residual: np.ndarray = field(repr=False, compare=False)
    output_share: np.ndarray = field(repr=False, compare=False)
    conditions: object = field(repr=False, compare=False)
    sharp_heads: object = field(repr=False, compare=False)
    sharp_head_verdicts: tuple

    def __str__(self):
        eps = np.finfo(float).eps
        parametrization = (
            "full-rank heads"
            if self.head_rank is None
            else f"rank-{self.head_rank} heads, products (Theta_i, W_i), gauge removed"
        )
        lines = [
            f"Certificate of a fit with m={self.n_heads} heads, d={self.n_features}, "
            f"d_out={self.n_outputs}, k={self.n_tokens} tokens, on "
            f"{self.n_samples} examples",
            f"1. training residual (relative RMS): {self.train_residual:.3g} = "
            f"{self.train_residual / eps:.3g} eps -> "
            + (
                f"exact (<= {self.exact_tol:g}): a global minimum of the loss"
                if self.exact
                else f"not exact (> {self.exact_tol:g})"
            ),
        ]
        if self.jacobian_rank is None:
            lines.append(
                f"2. local identifiability: not computed ({self.n_parameters} "
                f"parameters > max_parameters)"
            )
        else:
            unique = (
                "locally unique (up to the m! head permutations)"
                if self.null_dimension == 0
                else f"NOT locally unique: {self.null_dimension} direction(s) the "
                f"data does not determine"
            )
            lines.append(
                f"2. local identifiability ({parametrization}): Jacobian rank "
                f"{self.jacobian_rank} of {self.n_parameters} on "
                f"{self.n_jacobian_samples} examples; smallest non-zero singular "
                f"value {self.smallest_singular_value:.3g} x largest (rank "
                f"threshold {self.rank_tol:g}) -> {unique}"
            )
        if self.held_out_error is None:
            lines.append(f"3. held-out error: not measured ({self.held_out_source})")
        else:
            low, high = self.held_out_interval
            lines.append(
                f"3. held-out error (relative RMS): {self.held_out_error:.3g}, "
                f"{100 * self.confidence_level:g}% interval [{low:.3g}, {high:.3g}] "
                f"on {self.n_held_out} examples ({self.held_out_source})"
            )
        if self.redundant_heads:
            notes = "; ".join(
                f"head {i}: {self.head_notes[i]} (residual without it "
                f"{self.drop_residual[i]:.3g}, output share {self.output_share[i]:.3g})"
                for i in self.redundant_heads
            )
            lines.append(
                f"4. redundancy: {len(self.redundant_heads)} redundant head(s), "
                f"the fit is over-parameterised: {notes}"
            )
        else:
            lines.append(
                f"4. redundancy: none (dropping any head raises the residual to at "
                f"least {np.min(self.drop_residual):.3g})"
                if self.n_heads > 1
                else "4. redundancy: none (one head)"
            )
        failed = self.conditions.failed
        lines.append(
            "5. non-degeneracy conditions: "
            + ("all pass" if not failed else f"FAIL: {', '.join(failed)}")
            + f" ({len(self.conditions) - len(failed)}/{len(self.conditions)})"
        )
        lines.append(_sharp_heads_line(self.sharp_heads))
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _sharp_heads_line(pinning):
    """Finding 6 of the certificate: per head, split rows against the bound."""
    if pinning is None:
        return "6. sharp heads: not measured (one token per sequence)"
    heads = "; ".join(
        f"head {i}: {_describe_pinning(pinning, i)}" for i in range(len(pinning.pinned))
    )
    return (
        f"6. sharp heads (rows whose largest weight is <= {pinning.threshold:g} "
        f"pin a head's logits; counting bound, a heuristic): {heads}"
    )


def _n_parameters(m, d, d_out, head_rank):
    """Parameter directions of the parametrization, without building its basis:
    per head, the dimension of the rank-r ``d x d`` and ``d x d_out`` matrices,
    ``r (p + q - r)`` (``p q`` when ``r >= min(p, q)``), as
    :func:`low_rank_tangent_basis` spans them."""
    if head_rank is None:
        return m * (d * d + d * d_out)

    def dim(p, q):
        return p * q if head_rank >= min(p, q) else head_rank * (p + q - head_rank)

    return m * (dim(d, d) + dim(d, d_out))


def _check_xy(X, Y, attention, projection, k_layer, n_tokens, name_x, name_y):
    """Validated token tensors ``(X3, Y3)`` of a layer's data."""
    d, d_out = attention.shape[1], projection.shape[2]
    X2, k3 = flatten_tokens(X)
    X2 = np.asarray(X2, dtype=float)
    if X2.ndim != 2:
        raise ValueError(
            f"{name_x} must be 2-D or 3-D, got an array of shape {np.shape(X)}."
        )
    check_finite(X2, name_x)
    k = n_tokens if n_tokens is not None else k_layer
    X3 = layer_sequences(X2, k, k3, d)
    n, k = X3.shape[:2]
    Y = np.asarray(Y, dtype=float)
    if Y.ndim == 3:
        Y = Y.reshape(len(Y), -1)
    if Y.ndim == 1 and k * d_out == 1:
        Y = Y[:, None]
    if Y.ndim != 2 or Y.shape != (n, k * d_out):
        raise ValueError(
            f"{name_y} must have shape ({n}, {k * d_out}) (n_samples, n_tokens * "
            f"n_outputs) for {name_x} of {n} sequences of {k} tokens and a layer "
            f"with {d_out} outputs per token, got shape {np.shape(Y)}."
        )
    check_finite(Y, name_y)
    return X3, Y.reshape(n, k, d_out)


def _verdict(exact, locally_unique):
    if not exact:
        return VERDICTS[2]
    if locally_unique is None:
        return f"{VERDICTS[0].split(' and')[0]} (identifiability not computed)"
    return VERDICTS[0] if locally_unique else VERDICTS[1]


def certify(
    estimator_or_layer,
    X,
    y,
    *,
    X_test=None,
    y_test=None,
    n_tokens=None,
    head_rank=None,
    exact_tol=1e-10,
    rank_tol=1e-8,
    redundancy_tol=1e-6,
    n_jacobian_samples=None,
    max_parameters=2000,
    confidence_level=0.95,
    random_state=0,
):
    """Certify a fitted layer: exactness, local identifiability, held-out error.

    Parameters
    ----------
    estimator_or_layer : AttentionLayer or fitted estimator
        The fit, as :func:`skattn.layer.as_layer` reads it (an estimator must be
        fitted: its ``layer_``, else its ``attention_`` and ``projection_``).
    X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
        The training inputs.
    y : array-like of shape (n_samples, n_tokens * n_outputs)
        The training targets.
    X_test, y_test : array-like, default=None
        Held-out examples for the error and its interval.  ``None``: the held-out
        part of ``n_heads="auto"``'s selection when the estimator has one, else
        not measured.
    n_tokens : int, default=None
        Tokens per sequence; ``None``: from the layer, a 3-D X, or
        ``width / n_features``.
    head_rank : int, default=None
        Rank r of a low-rank parametrization ``Theta_i = Q_i K_i^T``,
        ``W_i = V_i O_i``; ``None`` reads ``head_rank`` from the estimator or
        layer when it has one, else full-rank heads.
    exact_tol : float, default=1e-10
        Relative RMS training residual at or below which the fit is exact.
    rank_tol : float, default=1e-8
        Singular values below ``rank_tol`` times the largest count as zero.
        Measured on planted layers (d = 8, k = 4): identifiable fits have a
        smallest ratio of 0.01-0.1, null directions 1e-15 or less.
    redundancy_tol : float, default=1e-6
        A head is redundant when dropping it leaves the relative residual at most
        ``max(redundancy_tol, 2 * train_residual)``.
    n_jacobian_samples : int, default=None
        Examples for the Jacobian and the redundancy test; ``None``: enough for
        about four rows per parameter (at least 50, at most all).
    max_parameters : int, default=2000
        Largest number of parameters for which the Jacobian is computed.
    confidence_level : float, default=0.95
        Of the held-out error's interval.
    random_state : int, RandomState instance or None, default=0
        Choice of the Jacobian's examples.

    Returns
    -------
    certificate : Certificate

    See Also
    --------
    skattn.check_conditions : the non-degeneracy conditions alone.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer, certify, make_attention_regression
    >>> X, y, layer = make_attention_regression(
    ...     300, 3, 4, 2, n_outputs=10, random_state=0, return_layer=True)
    >>> print(certify(layer, X, y).verdict)
    exact and identifiable
    >>> th = np.concatenate([layer.attention[:1]] * 2)  # two identical heads
    >>> twin = AttentionLayer(th, layer.projection)
    >>> cert = certify(twin, X, twin.transform(X))
    >>> cert.verdict, cert.redundant_heads
    ('exact but not identifiable', (0, 1))
    """
    attention, projection, _, _, k_layer = as_layer(
        estimator_or_layer, "layer"
    )._arrays()
    for name, value in (
        ("exact_tol", exact_tol),
        ("rank_tol", rank_tol),
        ("redundancy_tol", redundancy_tol),
    ):
        if not (isinstance(value, int | float) and value > 0):
            raise ValueError(f"{name} must be a positive float, got {value!r}.")
    if not 0 < confidence_level < 1:
        raise ValueError(
            f"confidence_level must be in (0, 1), got {confidence_level!r}."
        )
    X3, Y3 = _check_xy(X, y, attention, projection, k_layer, n_tokens, "X", "y")
    n, k, d = X3.shape
    m, _, d_out = projection.shape
    if head_rank is None:
        head_rank = getattr(estimator_or_layer, "head_rank", None)
    residual = _relative_rms(X3, Y3, attention, projection)
    exact = bool(residual <= exact_tol)

    # counted first: the basis (a kron of d^2 x d^2 per head) would not fit in
    # memory at d = 384 before max_parameters could say no
    n_params = _n_parameters(m, d, d_out, head_rank)
    if n_jacobian_samples is None:
        n_jacobian_samples = max(50, math.ceil(4 * n_params / (k * d_out)))
    rng = check_random_state(random_state)
    n_sub = min(n, int(n_jacobian_samples))
    rows = np.sort(rng.choice(n, size=n_sub, replace=False)) if n_sub < n else None
    Xs, Ys = (X3, Y3) if rows is None else (X3[rows], Y3[rows])
    rank = null = smallest = values = unique_rank = None
    if n_params <= max_parameters:
        basis = parameter_basis(attention, projection, head_rank)
        values = jacobian_singular_values(Xs, attention, projection, basis)
        top = values[0] if values.size and values[0] > 0 else 1.0
        nonzero = values > rank_tol * top
        rank = int(np.sum(nonzero))
        null = n_params - rank
        smallest = float(values[nonzero][-1] / top) if rank else 0.0
        unique_rank = null == 0

    redundant, notes, drop, share = head_redundancy(
        Xs, Ys, attention, projection, max(redundancy_tol, 2 * residual)
    )
    locally_unique = None if unique_rank is None else bool(unique_rank and exact)
    if redundant and exact:
        locally_unique = False

    held, interval, n_held, source = None, None, 0, ""
    if X_test is not None or y_test is not None:
        if X_test is None or y_test is None:
            raise ValueError(
                "Pass both X_test and y_test (held-out examples), or neither."
            )
        Xt, Yt = _check_xy(
            X_test, y_test, attention, projection, k, None, "X_test", "y_test"
        )
        held, interval, _ = held_out_error(
            Xt, Yt, attention, projection, level=confidence_level
        )
        n_held, source = Xt.shape[0], "X_test, y_test"
    else:
        selection = getattr(estimator_or_layer, "model_selection_", None)
        if selection is not None and selection.get("held_out_error") is not None:
            held = selection["held_out_error"]
            interval = tuple(selection["held_out_interval"])
            n_held = selection["n_held_out"]
            confidence_level = selection["confidence_level"]
            source = "held-out part of the head selection, fit on its training part"
        else:
            source = "no held-out data: pass X_test and y_test"

    pinning = None
    if k > 1:  # on all the training inputs: one pass of logits, as the residual
        pinning = sharp_head_pinning(estimator_or_layer, X3, head_rank=head_rank)

    return Certificate(
        verdict=_verdict(exact, locally_unique),
        n_heads=m,
        n_features=d,
        n_outputs=d_out,
        n_tokens=k,
        n_samples=n,
        train_residual=residual,
        exact=exact,
        exact_tol=float(exact_tol),
        head_rank=head_rank,
        n_parameters=int(n_params),
        jacobian_rank=rank,
        null_dimension=null,
        smallest_singular_value=smallest,
        singular_values=values,
        rank_tol=float(rank_tol),
        n_jacobian_samples=int(n_sub),
        locally_unique=locally_unique,
        held_out_error=held,
        held_out_interval=interval,
        confidence_level=float(confidence_level),
        n_held_out=int(n_held),
        held_out_source=source,
        redundant_heads=redundant,
        head_notes=notes,
        drop_residual=drop,
        output_share=share,
        conditions=check_conditions(estimator_or_layer, n_tokens=k),
        sharp_heads=pinning,
        sharp_head_verdicts=()
        if pinning is None
        else tuple("pinned" if p else "not pinned" for p in pinning.pinned),
    )
