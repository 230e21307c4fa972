"""Non-degeneracy diagnostics of a multi-head attention layer.

:func:`check_conditions` measures, for a layer ``F(X) = sum_i softmax(X Theta_i X^T)
X W_i`` and a sequence length k, the quantities the phased learner depends on and
compares each with a documented threshold. The thresholds are our reading of what
makes the phases well posed with margin (the analysis of Chen & Li states its
assumptions asymptotically, without constants), calibrated so that layers drawn by
:func:`skattn.datasets.make_attention_layer` with ``n_features >= 4`` pass and the
degenerate cases the learner cannot handle fail. The report is a diagnostic, not a
proof: a layer that passes can still be hard to learn from few samples, and a
failed line says which assumption lacks margin, not that learning must fail.

The quantities (``m`` heads, ``d`` features, ``d_out`` outputs, ``k`` tokens;
norms are Frobenius unless marked ``_2`` for the spectral norm):

=============================== ===================================================
``attention_incoherence``       ``max_{i != j} |<Theta_i, Theta_j>| /
                                (||Theta_i|| ||Theta_j||)``, must be ``<= 0.8``.
``attention_independence``      ``sqrt(lambda_min(C))`` with ``C_ij`` the cosines
                                above (``C_ii = 1``); must be ``>= 0.2``.
``attention_separation``        ``min_{i != j} ||Theta_i - Theta_j|| /
                                max(||Theta_i||, ||Theta_j||)``; ``>= 0.2``.
``projection_incoherence``      the incoherence of the ``W_i``; ``<= 0.95``.
``attention_stable_rank``       ``min_i ||Theta_i||^2 / ||Theta_i||_2^2``; ``>= 1.1``.
``projection_stable_rank``      ``min_i ||W_i||^2 / ||W_i||_2^2``; ``>= 1.1``.
``diagonal_weight``             ``max_i Tr(Theta_i)^2 / ||Theta_i||^2``; ``<= 4``.
``projection_column_share``     ``max_i max_j ||W_i[:, j]||^2 / ||W_i||^2``;
                                ``<= 0.8`` (``<= 1``, i.e. vacuous, if d_out = 1).
``attention_norm_ratio``        ``max_i ||Theta_i|| / min_i ||Theta_i||``; ``<= 10``.
``projection_norm_ratio``       ``max_i ||W_i|| / min_i ||W_i||``; ``<= 10``.
``projection_sum_conditioning`` ``sigma_k(W_sum) / sigma_1(W_sum)`` with ``W_sum =
                                sum_i W_i`` (0 if ``k > min(d, d_out)``); ``>= 0.05``.
``pattern_solvable``            ``d_out >= k``.
``identifiability``             ``d_out > m k``.
=============================== ===================================================

**Biases.** A layer with key biases ``u_i`` (see :class:`skattn.AttentionLayer`) is
learned on tokens with a constant coordinate appended, where head i's logit map is
``Theta_i`` with ``u_i^T`` appended as a last row (``fit_intercept=True``).  The
attention-side quantities (incoherence, independence, separation, stable rank, norm
ratio) are then measured on these ``(d + 1) x d`` matrices, so that two heads
differing only in their key biases count as distinct; the diagonal weight stays
that of ``Theta_i`` (the self-logit ``x^T Theta_i x``).  The intercept is one
constant shift of the output and enters no condition.

Why each matters (see also :class:`ConditionReport`):

* **Incoherence, independence, separation of the Theta_i.** Phases 2-5 recover the
  affine hull and then the span of the ``Theta_i``: an ``m``-dimensional span needs
  the heads linearly independent with margin (``independence``; for ``m = 2`` it
  is ``sqrt(1 - |cos|)``, so 0.2 allows cosines up to 0.96), and the epsilon-net of
  phase 6 can only tell apart heads farther apart than its resolution
  (``separation``). A cosine above 0.8 (an angle below 37 degrees) leaves two heads
  whose logits are correlated above 0.8 on every pair of tokens: their patterns
  agree on most rows and the data barely separates them.
* **Incoherence of the W_i.** Given the ``Theta_i`` the ``W_i`` are one
  least-squares solve away, which needs distinct head features, not distinct
  projections; parallel projections matter only together with similar attention.
  The threshold is therefore lenient: it flags near-parallel projections only.
* **Stable ranks.** ``||A||^2 / ||A||_2^2`` counts the directions carrying the
  mass of A (between 1 and the rank). A (nearly) rank-one ``Theta_i = u v^T``
  makes every logit the product ``(u . x_l)(v . x_a)``: a head that ranks tokens
  by one direction, whose Boolean logits are far from the Gaussian behaviour the
  analysis relies on (the sum over many coordinates); a (nearly) rank-one ``W_i``
  writes the head into a single output direction. The threshold 1.1 flags the
  (nearly) rank-one case only: random Gaussian 4 x 4 matrices have stable rank
  1.1-2.1 (1st-99th percentile), 8 x 8 ones 1.8-3.0.
* **Diagonal weight.** A token's logit with itself has mean ``Tr(Theta_i)``, while
  cross logits have mean 0 and standard deviation ``||Theta_i||``; so
  ``sqrt(diagonal weight)`` is the self-attention bias in cross-logit standard
  deviations (and, on Boolean tokens, the self-logit of a diagonal Theta is the
  constant ``Tr(Theta)``). Above 4 (a bias of 2 standard deviations) heads mostly
  attend to the token itself, ``F(X)`` is close to the linear map ``X W_sum`` and
  the certified rows of phase 2 carry little information on ``Theta``. Random
  heads have diagonal weight ``~1/d``; a multiple of the identity has ``d``.
* **Heaviest output column.** A head whose projection lives in one output
  coordinate is seen by phase 2's per-row fits through that coordinate only.
  Random Gaussian projections have shares ``~1/d_out`` (up to ~0.75 for 4 x 4).
* **Norm ratios.** A head ten times weaker than another (in ``W``) contributes ~1/10
  of the signal and is the first lost to noise; a ``Theta_i`` ten times smaller is
  nearly uniform attention, which looks like a shift of ``W_sum``.
* **Phase-2 solvability and identifiability.** Phase 2 solves
  ``y_l = p^T X W_sum`` for a pattern ``p`` in the simplex of ``R^k``: the
  ``k x d_out`` matrix ``X W_sum`` must have rank ``k``, which needs
  ``d_out >= k`` and ``W_sum`` of rank ``>= k`` with margin
  (``projection_sum_conditioning``). When ``d_out > m k``, an output row
  ``sum_i s_il^T X W_i`` (``m k`` unknown weights) generically determines every
  head's pattern, so a small residual of the one-pattern fit certifies that all
  heads agree; when ``d_out <= m k`` a mixture of different patterns can fit
  ``y_l`` as well and certification is ambiguous.
"""

from dataclasses import dataclass, field

import numpy as np

from ..layer import as_layer
from ..layer._math import min_separation
from ..utils._optional import require

__all__ = [
    "THRESHOLDS",
    "Condition",
    "ConditionReport",
    "check_conditions",
    "column_shares",
    "cosine_matrix",
    "diagonal_weights",
    "min_separation",
    "stable_ranks",
]

THRESHOLDS = {
    "attention_incoherence": ("<=", 0.8),
    "attention_independence": (">=", 0.2),
    "attention_separation": (">=", 0.2),
    "projection_incoherence": ("<=", 0.95),
    "attention_stable_rank": (">=", 1.1),
    "projection_stable_rank": (">=", 1.1),
    "diagonal_weight": ("<=", 4.0),
    "projection_column_share": ("<=", 0.8),
    "attention_norm_ratio": ("<=", 10.0),
    "projection_norm_ratio": ("<=", 10.0),
    "projection_sum_conditioning": (">=", 0.05),
}

_DESCRIPTIONS = {
    "attention_incoherence": "max |cos| between two Theta_i",
    "attention_independence": "sqrt(lambda_min) of the Theta_i cosine matrix",
    "attention_separation": "min relative distance between two Theta_i",
    "projection_incoherence": "max |cos| between two W_i",
    "attention_stable_rank": "min stable rank of a Theta_i",
    "projection_stable_rank": "min stable rank of a W_i",
    "diagonal_weight": "max Tr(Theta_i)^2 / ||Theta_i||_F^2",
    "projection_column_share": "max share of ||W_i||_F^2 in one output column",
    "attention_norm_ratio": "max / min ||Theta_i||_F",
    "projection_norm_ratio": "max / min ||W_i||_F",
    "projection_sum_conditioning": "sigma_k / sigma_1 of W_sum = sum_i W_i",
    "pattern_solvable": "phase 2 solves for a pattern: d_out >= k",
    "identifiability": "certification unambiguous: d_out > m k",
}

_RELATIONS = {
    "<=": np.less_equal,
    ">=": np.greater_equal,
    ">": np.greater,
}


@dataclass(frozen=True)
class Condition:
    """One line of a :class:`ConditionReport`.

    Created by :func:`check_conditions`; every parameter is stored as an
    attribute of the same name.

    Parameters
    ----------
    name : str
        Identifier of the quantity.
    value : float
        Its value for the layer (the worst head or pair for per-head quantities).
    relation : {"<=", ">=", ">"}
        How ``value`` must compare with ``threshold`` to pass.
    threshold : float
        The documented threshold.
    passed : bool
        Whether ``value relation threshold`` holds.
    description : str
        What is measured, in one line.
    per_head : ndarray or None
        The per-head values behind ``value`` (per-head quantities only).

    Examples
    --------
    >>> from skattn.diagnostics import Condition
    >>> c = Condition("attention_stable_rank", 1.04, ">=", 1.1, False, "stable rank")
    >>> print(c)
    attention_stable_rank: 1.04 (required >= 1.1) FAIL
    """

    name: str
    value: float
    relation: str
    threshold: float
    passed: bool
    description: str
    per_head: np.ndarray | None = field(default=None, compare=False)

    def __str__(self):
        status = "pass" if self.passed else "FAIL"
        return (
            f"{self.name}: {_fmt(self.value)} (required {self.relation} "
            f"{_fmt(self.threshold)}) {status}"
        )


def _fmt(x):
    x = float(x)
    if not np.isfinite(x):
        return str(x)
    if x == int(x) and abs(x) < 1e9:
        return str(int(x))
    return f"{x:.3g}"


@dataclass(frozen=True)
class ConditionReport:
    """The non-degeneracy diagnostics of a layer, as returned by
    :func:`check_conditions`.

    Printing it gives an aligned table; ``report["name"]`` (or
    ``report.name``) gives one :class:`Condition`; iterating yields them in order.
    Every parameter is stored as an attribute of the same name.

    Parameters
    ----------
    conditions : tuple of Condition
        The lines of the report.
    n_heads, n_features, n_outputs, n_tokens : int
        Shape of the layer and the sequence length the report is for.

    Examples
    --------
    >>> from skattn.diagnostics import check_conditions
    >>> from skattn.datasets import make_attention_layer
    >>> layer = make_attention_layer(2, 8, n_outputs=16, random_state=0)
    >>> report = check_conditions(layer, n_tokens=4)
    >>> report.passed, len(report) == len(report.names), report.failed
    (True, True, [])
    >>> report.identifiability.value
    16.0
    """

    conditions: tuple
    n_heads: int
    n_features: int
    n_outputs: int
    n_tokens: int

    @property
    def passed(self):
        """True when every condition passes."""
        return all(c.passed for c in self.conditions)

    @property
    def failed(self):
        """Names of the conditions that fail."""
        return [c.name for c in self.conditions if not c.passed]

    @property
    def names(self):
        """Names of all conditions, in order."""
        return [c.name for c in self.conditions]

    def __getitem__(self, name):
        for c in self.conditions:
            if c.name == name:
                return c
        raise KeyError(f"no condition named {name!r}; available: {self.names}.")

    def __getattr__(self, name):
        if name.startswith("_") or name in {"conditions"}:
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"ConditionReport has no attribute or condition {name!r}."
            ) from None

    def __iter__(self):
        return iter(self.conditions)

    def __len__(self):
        return len(self.conditions)

    def __str__(self):
        header = ("condition", "value", "required", "status", "what")
        rows = [
            (
                c.name,
                _fmt(c.value),
                f"{c.relation} {_fmt(c.threshold)}",
                "pass" if c.passed else "FAIL",
                c.description,
            )
            for c in self.conditions
        ]
        widths = [max(len(r[j]) for r in [header, *rows]) for j in range(4)]

        def line(r):
            return "  ".join(
                [r[0].ljust(widths[0]), r[1].rjust(widths[1])]
                + [r[j].ljust(widths[j]) for j in (2, 3)]
                + [r[4]]
            ).rstrip()

        n_pass = sum(c.passed for c in self.conditions)
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join(
            [
                f"Conditions for m={self.n_heads} heads, d={self.n_features}, "
                f"d_out={self.n_outputs}, k={self.n_tokens} tokens",
                line(header),
                *[line(r) for r in rows],
                f"overall: {verdict} ({n_pass}/{len(self.conditions)} passed; "
                f"a diagnostic of the learner's assumptions, not a proof)",
            ]
        )

    def to_frame(self):
        """The report as a pandas DataFrame indexed by condition name.

        Requires pandas (imported lazily).

        Returns
        -------
        frame : pandas.DataFrame
            One row per condition, indexed by its name, with the columns
            ``value``, ``relation``, ``threshold``, ``passed`` and
            ``description``.
        """
        pd = require("pandas", extra="sweep", feature="ConditionReport.to_frame")
        return pd.DataFrame(
            {
                "value": [c.value for c in self.conditions],
                "relation": [c.relation for c in self.conditions],
                "threshold": [c.threshold for c in self.conditions],
                "passed": [c.passed for c in self.conditions],
                "description": [c.description for c in self.conditions],
            },
            index=pd.Index(self.names, name="condition"),
        )


# -- the quantities, as pure functions -------------------------------------------------


def cosine_matrix(mats):
    """Cosines ``<A_i, A_j> / (||A_i|| ||A_j||)``: ``(m, ...) -> (m, m)``.

    A zero matrix has cosine 0 with every other and 1 with itself.

    Parameters
    ----------
    mats : array-like of shape (m, ...)
        The matrices (or vectors); each is flattened.

    Returns
    -------
    cos : ndarray of shape (m, m)
        The Frobenius cosines, with ones on the diagonal.

    Examples
    --------
    >>> import numpy as np
    >>> cosine_matrix(np.array([[1.0, 0.0], [1.0, 1.0]])).round(3)
    array([[1.   , 0.707],
           [0.707, 1.   ]])
    """
    flat = np.asarray(mats, float).reshape(len(mats), -1)
    norms = np.linalg.norm(flat, axis=1)
    safe = np.where(norms > 0, norms, 1.0)
    unit = flat / safe[:, None]
    cos = unit @ unit.T
    np.fill_diagonal(cos, 1.0)
    return cos


def stable_ranks(mats):
    """``||A_i||_F^2 / ||A_i||_2^2`` for each matrix (0 for a zero matrix).

    Parameters
    ----------
    mats : array-like of shape (m, p, q)
        The matrices.

    Returns
    -------
    ranks : ndarray of shape (m,)
        The stable rank of each matrix, in ``[1, min(p, q)]`` (0 when zero).

    Examples
    --------
    >>> import numpy as np
    >>> stable_ranks(np.stack([np.eye(3), np.ones((3, 3))]))
    array([3., 1.])
    """
    mats = np.asarray(mats, float)
    spectral = np.linalg.norm(mats, ord=2, axis=(1, 2))
    frob2 = np.sum(mats**2, axis=(1, 2))
    safe = np.where(spectral > 0, spectral, 1.0)
    return np.where(spectral > 0, frob2 / safe**2, 0.0)


def diagonal_weights(attention):
    """``Tr(Theta_i)^2 / ||Theta_i||_F^2`` (0 for a zero matrix), in ``[0, d]``.

    Parameters
    ----------
    attention : array-like of shape (m, d, d)
        The attention matrices ``Theta_i``.

    Returns
    -------
    weights : ndarray of shape (m,)
        The diagonal weight of each head.

    Examples
    --------
    >>> import numpy as np
    >>> diagonal_weights(np.stack([np.eye(4), np.ones((4, 4)) - np.eye(4)]))
    array([4., 0.])
    """
    attention = np.asarray(attention, float)
    frob2 = np.sum(attention**2, axis=(1, 2))
    trace = np.trace(attention, axis1=1, axis2=2)
    return np.where(frob2 > 0, trace**2 / np.where(frob2 > 0, frob2, 1.0), 0.0)


def column_shares(projection):
    """``max_j ||W_i[:, j]||^2 / ||W_i||_F^2`` per head (0 for a zero matrix).

    Parameters
    ----------
    projection : array-like of shape (m, d, d_out)
        The projection matrices ``W_i``.

    Returns
    -------
    shares : ndarray of shape (m,)
        The largest share of a head's squared norm in one output column, in
        ``[1 / d_out, 1]``.

    Examples
    --------
    >>> import numpy as np
    >>> column_shares(np.array([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]))
    array([1. , 0.5])
    """
    projection = np.asarray(projection, float)
    cols = np.sum(projection**2, axis=1)  # (m, d_out)
    total = cols.sum(axis=1)
    return np.where(total > 0, cols.max(axis=1) / np.where(total > 0, total, 1.0), 0)


def _norm_ratio(mats):
    norms = np.linalg.norm(np.asarray(mats, float).reshape(len(mats), -1), axis=1)
    if norms.max() == 0:
        return 1.0
    return float(norms.max() / norms.min()) if norms.min() > 0 else np.inf


def _max_offdiag(cos):
    if len(cos) < 2:
        return 0.0
    return float(np.max(np.abs(cos[~np.eye(len(cos), dtype=bool)])))


def _sum_conditioning(projection, n_tokens):
    s = np.linalg.svd(projection.sum(axis=0), compute_uv=False)
    if n_tokens > len(s) or s[0] == 0:
        return 0.0
    return float(s[n_tokens - 1] / s[0])


def check_conditions(layer, n_tokens=None):
    """Measure the non-degeneracy conditions the phased learner relies on.

    Parameters
    ----------
    layer : AttentionLayer or fitted estimator
        The layer, as :func:`skattn.layer.as_layer` reads it (an estimator's
        ``layer_``, else its ``attention_``, ``projection_`` and ``key_bias_``).
        Key biases are handled as the module docstring's "Biases" paragraph says.
    n_tokens : int, default=None
        Sequence length k; ``None`` takes it from the layer (``n_tokens_`` or
        ``n_tokens``).

    Returns
    -------
    report : ConditionReport
        One :class:`Condition` per quantity, in the order of the table in the
        module docstring of :mod:`skattn.diagnostics`, which also explains every
        threshold; ``report.passed`` is the overall verdict.

    Examples
    --------
    >>> from skattn.diagnostics import check_conditions
    >>> from skattn.datasets import make_attention_layer
    >>> layer = make_attention_layer(2, 8, n_outputs=16, random_state=0)
    >>> report = check_conditions(layer, n_tokens=4)
    >>> report.passed, report["identifiability"].passed
    (True, True)
    >>> check_conditions(layer, n_tokens=8).failed
    ['identifiability']
    """
    attention, projection, key_bias, _, k_layer = as_layer(layer, "layer")._arrays()
    if n_tokens is None:
        n_tokens = k_layer
    if n_tokens is None:
        raise ValueError(
            "n_tokens is None and the layer does not know its sequence length; pass "
            "n_tokens=k, the number of tokens per sequence."
        )
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int | np.integer):
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}.")
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}.")
    n_tokens = int(n_tokens)
    m, d, d_out = projection.shape
    # with key biases: the logit map on [x, 1] tokens, Theta_i with u_i^T appended
    logit_maps = (
        np.concatenate([attention, key_bias[:, None, :]], axis=1)
        if np.any(key_bias)
        else attention
    )

    th_cos = cosine_matrix(logit_maps)
    values = {
        "attention_incoherence": (_max_offdiag(th_cos), None),
        "attention_independence": (
            float(np.sqrt(max(np.linalg.eigvalsh(th_cos)[0], 0.0))),
            None,
        ),
        "attention_separation": (min_separation(logit_maps), None),
        "projection_incoherence": (_max_offdiag(cosine_matrix(projection)), None),
    }
    for name, per_head, worst in [
        ("attention_stable_rank", stable_ranks(logit_maps), np.min),
        ("projection_stable_rank", stable_ranks(projection), np.min),
        ("diagonal_weight", diagonal_weights(attention), np.max),
        ("projection_column_share", column_shares(projection), np.max),
    ]:
        values[name] = (float(worst(per_head)), per_head)
    values["attention_norm_ratio"] = (_norm_ratio(logit_maps), None)
    values["projection_norm_ratio"] = (_norm_ratio(projection), None)
    values["projection_sum_conditioning"] = (
        _sum_conditioning(projection, n_tokens),
        None,
    )

    thresholds = dict(THRESHOLDS)
    if d_out == 1:  # a single output column carries everything: vacuous
        thresholds["projection_column_share"] = ("<=", 1.0)
    thresholds["pattern_solvable"] = (">=", float(n_tokens))
    thresholds["identifiability"] = (">", float(m * n_tokens))
    values["pattern_solvable"] = (float(d_out), None)
    values["identifiability"] = (float(d_out), None)

    conditions = []
    for name, (value, per_head) in values.items():
        relation, threshold = thresholds[name]
        conditions.append(
            Condition(
                name=name,
                value=float(value),
                relation=relation,
                threshold=float(threshold),
                passed=bool(_RELATIONS[relation](value, threshold)),
                description=_DESCRIPTIONS[name],
                per_head=per_head,
            )
        )
    return ConditionReport(
        conditions=tuple(conditions),
        n_heads=m,
        n_features=d,
        n_outputs=d_out,
        n_tokens=n_tokens,
    )
