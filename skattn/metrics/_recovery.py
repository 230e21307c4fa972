"""How close a learned attention layer is to the true one.

Heads are unordered, so every comparison of heads first matches them with the
Hungarian algorithm (:func:`scipy.optimize.linear_sum_assignment`). A learned layer may
have more heads than the truth (an over-parameterised learner): the best subset of
learned heads is matched and the others are reported as unmatched.
"""

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.utils import Bunch, check_array

from ..layer import AttentionLayer, as_layer
from ..utils._validation import flatten_tokens, layer_sequences


def reached_directions(X, n_features, tol=1e-10):
    """Mean token and projector onto the directions the tokens of X reach.

    The tokens of X lie in an affine subspace ``mu + range(R)``: ``mu`` is their
    mean and ``R`` the orthogonal projector onto the eigenvectors of their
    covariance with eigenvalue above ``tol`` times the largest.  For LayerNorm
    outputs, e.g., ``range(R)`` is a hyperplane (d - 1 directions).

    Parameters
    ----------
    X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
    n_features : int
    tol : float, default=1e-10

    Returns
    -------
    mean : ndarray of shape (n_features,)
    projector : ndarray of shape (n_features, n_features)

    Examples
    --------
    >>> import numpy as np
    >>> X = np.array([[1.0, 0.0, 0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, -1.0, 1.0, 0.0]])
    >>> mean, R = reached_directions(X, 3)
    >>> int(round(np.trace(R)))
    2
    """
    tokens = np.asarray(X, dtype=float).reshape(-1, n_features)
    mean = tokens.mean(axis=0)
    centred = tokens - mean
    evals, evecs = np.linalg.eigh(centred.T @ centred)
    keep = evecs[:, evals > tol * max(evals[-1], np.finfo(float).tiny)]
    return mean, keep @ keep.T


def _identifiable_parts(attention, projection, key_bias, intercept, mean, R):
    """The parts of a layer its outputs on reached tokens determine.

    With tokens ``x = mu + r`` (``r`` in range R) the logits, up to terms constant
    in the key token, are ``r_l^T (R Theta_i R) r_a + (R (Theta_i^T mu + u_i))^T
    r_a`` and the output is ``sum_i r^T (R W_i) + (sum_i W_i^T mu + c)``.
    """
    theta = R @ attention @ R
    key = (np.einsum("mde,d->me", attention, mean) + key_bias) @ R
    proj = R @ projection
    shift = np.einsum("mdo,d->o", projection, mean) + intercept
    return theta, key, proj, shift


def _check_compatible(true, learned, *, outputs=True):
    """Raise a ValueError unless ``learned``'s heads ``(Theta, W)`` have the shapes of
    ``true``'s (``W``'s only with ``outputs``) and are at least as many."""
    (th, W), (th_hat, W_hat) = true, learned
    if th.shape[1:] != th_hat.shape[1:] or (outputs and W.shape[1:] != W_hat.shape[1:]):
        w_hat, w, also = ("", "", "")
        if outputs:
            w_hat, w = f", W {W_hat.shape[1:]}", f", W {W.shape[1:]}"
            also = " and n_outputs"
        raise ValueError(
            f"learned has heads of shapes Theta {th_hat.shape[1:]}{w_hat} but "
            f"true_layer has Theta {th.shape[1:]}{w}; both layers need the same "
            f"n_features{also}."
        )
    if th_hat.shape[0] < th.shape[0]:
        raise ValueError(
            f"learned has {th_hat.shape[0]} head(s) but true_layer has "
            f"{th.shape[0]}; head-matched errors need at least as many learned heads "
            f"as true ones. Compare the functions with prediction_error instead."
        )


def _n_tokens(layer):
    """A layer's tokens per sequence: ``n_tokens_`` once fitted, else ``n_tokens``."""
    return getattr(layer, "n_tokens_", None) or layer.n_tokens


def _ratio(num, den):
    """``num / den`` with ``0 / 0 = 0`` and ``x / 0 = inf`` (elementwise)."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf)
    out = np.where((num == 0) & (den == 0), 0.0, out)
    return out[()] if out.ndim == 0 else out


def _pairwise_sq_distances(true, learned):
    """All ``||learned_j - true_i||_F^2``: ``(m, ...), (m', ...) -> (m, m')``."""
    a = true.reshape(true.shape[0], -1)
    b = learned.reshape(learned.shape[0], -1)
    sq = (a**2).sum(1)[:, None] + (b**2).sum(1)[None, :] - 2.0 * a @ b.T
    return np.maximum(sq, 0.0)


def parameter_error(true_layer, learned, X=None):
    """Head-matched relative errors of the attention and projection matrices.

    The true heads ``(Theta_i, W_i)`` are matched to learned heads
    ``(hat Theta_j, hat W_j)`` by the assignment ``sigma`` minimising

    ``sum_i ||hat Theta_sigma(i) - Theta_i||_F^2 / ||Theta||_F^2
    + ||hat W_sigma(i) - W_i||_F^2 / ||W||_F^2``,

    where ``||Theta||_F`` and ``||W||_F`` are the norms of the true heads stacked,
    i.e. the assignment minimises ``attention_error^2 + projection_error^2``
    (Hungarian algorithm). If ``learned`` has more heads than the truth, the best
    subset is matched and the other learned heads are ignored by the errors (they
    are listed in ``unmatched``); use :func:`prediction_error` to judge the function
    they compute.  Key biases ``u_i`` (when either layer has them) add
    ``||hat u_sigma(i) - u_i||^2 / ||u||^2`` to the matching cost.

    With ``X``, everything is measured on what inputs like X can tell apart.  Its
    tokens lie in ``mu + range(R)`` (:func:`reached_directions`: ``mu`` the mean
    token, ``R`` the projector onto the directions the tokens span after
    centring, e.g. the hyperplane of LayerNorm outputs); up to terms constant in
    the key token (which cancel in the softmax) the logits are ``r_l^T (R Theta_i
    R) r_a + (R (Theta_i^T mu + u_i))^T r_a`` and the output is ``sum_i r^T (R
    W_i) + (sum_i W_i^T mu + c)``, so the errors compare ``R Theta_i R``, the
    effective key bias ``R (Theta_i^T mu + u_i)``, ``R W_i`` and the effective
    intercept ``sum_i W_i^T mu + c``: the parts that the layer's outputs on such
    inputs determine.

    Parameters
    ----------
    true_layer : AttentionLayer or fitted estimator
        The truth, as :func:`skattn.layer.as_layer` reads it (an estimator's
        ``layer_``, else its ``attention_``, ``projection_`` and biases).
    learned : AttentionLayer or fitted estimator
        The layer to compare, with at least as many heads as ``true_layer`` and the
        same ``n_features`` and ``n_outputs``.
    X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features), default=None
        Inputs whose reached subspace the errors are measured on (see above);
        ``None`` compares the raw parameters.

    Returns
    -------
    result : sklearn.utils.Bunch
        attention_error : float
            ``||stack_i(hat Theta_sigma(i)) - stack_i(Theta_i)||_F /
            ||stack_i(Theta_i)||_F``.
        projection_error : float
            The same for the ``W_i``.
        attention_errors : ndarray of shape (n_heads,)
            Per true head: ``||hat Theta_sigma(i) - Theta_i||_F / ||Theta_i||_F``.
        projection_errors : ndarray of shape (n_heads,)
            Per true head, the same for ``W_i``.
        key_bias_error : float
            The relative error of the stacked key biases ``u_i`` (0 when neither
            layer has them).
        intercept_error : float
            ``||hat c - c|| / ||c||`` (0 when both are zero).
        assignment : ndarray of shape (n_heads,)
            ``sigma(i)``: the learned head matched to true head ``i``.
        unmatched : ndarray
            Indices of the learned heads matched to no true head.

        Relative errors use ``0 / 0 = 0`` and ``x / 0 = inf`` (a true head with
        ``Theta_i = 0``, i.e. uniform attention, is only matched exactly by 0).

    Raises
    ------
    sklearn.exceptions.NotFittedError
        If a side is an estimator that is not fitted.
    TypeError
        If a side is none of what :func:`skattn.layer.as_layer` accepts.
    ValueError
        If the parameters are invalid or the shapes are incompatible.

    See Also
    --------
    prediction_error : relative error of the layer's outputs.
    attention_pattern_error : head-matched distance between attention patterns.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> from skattn.datasets import make_attention_layer
    >>> from skattn.metrics import parameter_error
    >>> true = make_attention_layer(3, 4, random_state=0)
    >>> swapped = AttentionLayer(true.attention[[2, 0, 1]], true.projection[[2, 0, 1]])
    >>> err = parameter_error(true, swapped)
    >>> float(err.attention_error), float(err.projection_error), err.assignment
    (0.0, 0.0, array([1, 2, 0]))
    """
    th, W, u, c, k_true = as_layer(true_layer, "true_layer")._arrays()
    th_hat, W_hat, u_hat, c_hat, k_est = as_layer(learned, "learned")._arrays()
    _check_compatible((th, W), (th_hat, W_hat))
    if X is not None:
        X3 = _sequences(X, _common_n_tokens(k_true, k_est), th.shape[1])
        mean, R = reached_directions(X3, th.shape[1])
        th, u, W, c = _identifiable_parts(th, W, u, c, mean, R)
        th_hat, u_hat, W_hat, c_hat = _identifiable_parts(
            th_hat, W_hat, u_hat, c_hat, mean, R
        )
    th_norm, W_norm, u_norm = (np.linalg.norm(a) for a in (th, W, u))
    cost = _pairwise_sq_distances(th, th_hat) / (th_norm**2 if th_norm > 0 else 1.0)
    cost += _pairwise_sq_distances(W, W_hat) / (W_norm**2 if W_norm > 0 else 1.0)
    cost += _pairwise_sq_distances(u, u_hat) / (u_norm**2 if u_norm > 0 else 1.0)
    rows, cols = linear_sum_assignment(cost)
    assignment = cols[np.argsort(rows)]
    th_diff = th_hat[assignment] - th
    W_diff = W_hat[assignment] - W
    return Bunch(
        key_bias_error=float(_ratio(np.linalg.norm(u_hat[assignment] - u), u_norm)),
        intercept_error=float(_ratio(np.linalg.norm(c_hat - c), np.linalg.norm(c))),
        attention_error=float(_ratio(np.linalg.norm(th_diff), th_norm)),
        projection_error=float(_ratio(np.linalg.norm(W_diff), W_norm)),
        attention_errors=_ratio(
            np.linalg.norm(th_diff.reshape(len(th), -1), axis=1),
            np.linalg.norm(th.reshape(len(th), -1), axis=1),
        ),
        projection_errors=_ratio(
            np.linalg.norm(W_diff.reshape(len(W), -1), axis=1),
            np.linalg.norm(W.reshape(len(W), -1), axis=1),
        ),
        assignment=assignment,
        unmatched=np.setdiff1d(np.arange(th_hat.shape[0]), assignment),
    )


def _sequences(X, n_tokens, n_features):
    """Validate X and return it as ``(n, k, d)``; ``n_tokens`` may be None."""
    X, k3 = flatten_tokens(X)
    X = check_array(X, dtype=np.float64, input_name="X")
    return layer_sequences(X, n_tokens, k3, n_features)


def _common_n_tokens(*values):
    known = {v for v in values if v is not None}
    if len(known) > 1:
        raise ValueError(
            f"true_layer and learned disagree on n_tokens ({sorted(known)}); compare "
            f"layers fitted on sequences of the same length."
        )
    return known.pop() if known else None


def prediction_error(true_layer, learned, X):
    """Relative error of the outputs, ``||F_hat(X) - F(X)||_F / ||F(X)||_F``.

    The Frobenius norms run over all samples, tokens and output features.

    Parameters
    ----------
    true_layer : AttentionLayer or fitted estimator
        The truth, as :func:`skattn.layer.as_layer` reads it.
    learned : AttentionLayer or fitted estimator
        Any number of heads. An estimator without ``layer_`` or
        ``attention_``/``projection_`` but with a per-token ``predict`` is
        evaluated through ``predict(X)``.
    X : array-like of shape (n_samples, n_tokens * n_features) or \
            (n_samples, n_tokens, n_features)
        Inputs on which to compare; ``n_tokens`` is taken from a 3-D X, else from
        the layers, else ``width // n_features``.

    Returns
    -------
    error : float
        ``0.0`` when both outputs are zero, ``inf`` when only ``F(X)`` is.

    Examples
    --------
    >>> from skattn.datasets import make_attention_regression, make_attention_layer
    >>> from skattn.metrics import prediction_error
    >>> X, y, true = make_attention_regression(
    ...     50, 3, 4, 2, random_state=0, return_layer=True)
    >>> prediction_error(true, true, X)
    0.0
    >>> other = make_attention_layer(2, 4, random_state=1)
    >>> prediction_error(true, other, X) > 0.5
    True
    """
    true = as_layer(true_layer, "true_layer")
    th, W = true._parameters()[:2]
    k_true = _n_tokens(true)
    predict_only = not (
        isinstance(learned, AttentionLayer)
        or isinstance(getattr(learned, "layer_", None), AttentionLayer)
        or (hasattr(learned, "attention_") and hasattr(learned, "projection_"))
    )
    if predict_only and hasattr(learned, "predict"):
        k_est = getattr(learned, "n_tokens_", None)
        X3 = _sequences(X, _common_n_tokens(k_true, k_est), th.shape[1])
        Y_hat = np.asarray(learned.predict(X3.reshape(X3.shape[0], -1)), float)
        expected = X3.shape[0] * X3.shape[1] * W.shape[2]
        if Y_hat.size != expected:
            raise ValueError(
                f"learned predicts {Y_hat.size // X3.shape[0]} values per sequence "
                f"but true_layer outputs {X3.shape[1]} tokens x {W.shape[2]} = "
                f"{expected // X3.shape[0]}; prediction_error compares per-token "
                f"outputs (a learner with one output per sequence, such as "
                f"RandomFeatureAttentionRegressor, needs another metric)."
            )
        Y_hat = Y_hat.reshape(X3.shape[0], X3.shape[1], -1)
        if Y_hat.shape[2] != W.shape[2]:
            raise ValueError(
                f"learned predicts {Y_hat.shape[2]} outputs per token but true_layer "
                f"has n_outputs={W.shape[2]}."
            )
    else:
        layer = as_layer(learned, "learned")
        th_hat, W_hat = layer._parameters()[:2]
        if th_hat.shape[1:] != th.shape[1:] or W_hat.shape[1:] != W.shape[1:]:
            raise ValueError(
                f"learned has heads of shapes Theta {th_hat.shape[1:]}, W "
                f"{W_hat.shape[1:]} but true_layer has Theta {th.shape[1:]}, W "
                f"{W.shape[1:]}; both layers need the same n_features and n_outputs."
            )
        X3 = _sequences(X, _common_n_tokens(k_true, _n_tokens(layer)), th.shape[1])
        Y_hat = layer.transform(X3).reshape(X3.shape[0], X3.shape[1], -1)
    # each layer's own forward: a decoder's mask and rotary positions included
    Y = true.transform(X3).reshape(Y_hat.shape)
    return float(_ratio(np.linalg.norm(Y_hat - Y), np.linalg.norm(Y)))


def attention_pattern_error(true_layer, learned, X):
    """Head-matched mean total-variation distance between attention patterns.

    For true head ``i`` and learned head ``j`` let ``D_ij`` be the total-variation
    distance ``(1/2) sum_a |s_ila - hat s_jla|`` between their attention rows,
    averaged over the samples of X and the rows ``l``. Heads are matched by the
    assignment ``sigma`` minimising ``sum_i D_i,sigma(i)`` (Hungarian algorithm;
    a learned layer with more heads is matched on its best subset), and the error
    is the mean of ``D_i,sigma(i)`` over the true heads. It lies in ``[0, 1]``: 0
    when the matched heads attend identically, 1 when their rows have disjoint
    supports.

    Parameters
    ----------
    true_layer : AttentionLayer or fitted estimator
    learned : AttentionLayer or fitted estimator
        At least as many heads as ``true_layer``, same ``n_features``.
    X : array-like of shape (n_samples, n_tokens * n_features) or \
            (n_samples, n_tokens, n_features)

    Returns
    -------
    error : float

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> from skattn.metrics import attention_pattern_error
    >>> true = AttentionLayer(np.zeros((1, 2, 2)), np.eye(2)[None])
    >>> X = np.array([[1.0, -1.0, 1.0, 1.0]])
    >>> attention_pattern_error(true, true, X)
    0.0
    """
    true, layer = as_layer(true_layer, "true_layer"), as_layer(learned, "learned")
    th, W = true._parameters()[:2]
    _check_compatible((th, W), layer._parameters()[:2], outputs=False)
    X3 = _sequences(X, _common_n_tokens(_n_tokens(true), _n_tokens(layer)), th.shape[1])
    # each layer's own patterns: a decoder's mask and rotary positions included
    P = true.attention_patterns(X3)  # (n, m, k, k)
    P_hat = layer.attention_patterns(X3)  # (n, m', k, k)
    cost = _pattern_distances(P, P_hat)
    rows, cols = linear_sum_assignment(cost)
    return float(cost[rows, cols].mean())


def _pattern_distances(patterns_true, patterns_learned):
    """Mean total-variation distance between every pair of heads' patterns.

    Each row of a pattern is a distribution over tokens; the distance between two
    heads is the total variation ``0.5 * sum_a |p_a - q_a|`` averaged over samples
    and rows, so it lies in ``[0, 1]`` (0: the heads attend identically).

    Parameters
    ----------
    patterns_true : ndarray of shape (n_samples, n_heads_true, n_tokens, n_tokens)
    patterns_learned : ndarray of shape (n_samples, n_heads_learned, n_tokens, \
n_tokens)

    Returns
    -------
    distances : ndarray of shape (n_heads_true, n_heads_learned)

    Examples
    --------
    >>> import numpy as np
    >>> P = np.array([[[[1.0, 0.0], [0.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]]])
    >>> _pattern_distances(P, P[:, ::-1])
    array([[0.5, 0. ],
           [0. , 0.5]])
    """
    # One true head at a time keeps the intermediate at (n, m_learned, k, k).
    return np.stack(
        [
            0.5
            * np.abs(head[:, None] - patterns_learned).sum(axis=-1).mean(axis=(0, 2))
            for head in np.moveaxis(patterns_true, 1, 0)
        ]
    )
