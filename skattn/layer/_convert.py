"""Maps between skattn's parameters and the weights of real attention layers.

A real multi-head attention sub-layer with ``m`` heads of width ``d_h`` computes,
for queries, keys and values from the same tokens ``X`` (k, d),

    out = concat_i(softmax(s (X Wq_i^T + bq_i)(X Wk_i^T + bk_i)^T) (X Wv_i^T + bv_i))
          Wo^T + bo

with weights in the ``(out_features, in_features)`` convention of PyTorch and
BERT-style checkpoints (``Wq_i`` is rows ``i d_h:(i + 1) d_h`` of the query
weight) and the scale ``s = 1 / sqrt(d_h)``.  Expanding the logits,
``s (Wq_i x_l + bq_i)^T (Wk_i x_a + bk_i) = x_l^T Theta_i x_a + u_i^T x_a +``
(terms constant in ``a``, which cancel in the softmax), and since every attention
row sums to 1 the value and output biases add a constant.  So the layer is exactly

    F(X) = sum_i softmax(X Theta_i X^T + 1 (X u_i)^T) X W_i + 1 c^T

with ``Theta_i = s Wq_i^T Wk_i``, ``u_i = s Wk_i^T bq_i`` (the key bias ``bk``
drops out), ``W_i = Wv_i^T Wo_i^T`` (``Wo_i``: columns ``i d_h:(i + 1) d_h`` of the
output weight) and ``c = Wo bv + bo``.  The functions here are pure (arrays in,
arrays out); :class:`skattn.AttentionLayer` calls them.
"""

import numpy as np

_BIAS_NAMES = ("query", "key", "value", "output")


def _as_matrix(value, name):
    """A finite float64 2-D array, or a ValueError naming ``name``."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{name} must be a numeric array, got {type(value).__name__}."
        ) from exc
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must be a 2-D weight matrix (out_features, in_features), got "
            f"an array of shape {arr.shape}."
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(
            f"{name} contains {int(np.sum(~np.isfinite(arr)))} NaN or infinite "
            f"value(s); weights must be finite."
        )
    return arr


def _as_vector(value, name, size):
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(
            f"{name} contains {int(np.sum(~np.isfinite(arr)))} NaN or infinite "
            f"value(s); biases must be finite."
        )
    return arr


def check_projection_weights(query, key, value, output, n_heads, biases=None):
    """Validate raw projection weights; return them (and the biases) as float64.

    Parameters
    ----------
    query, key : array-like of shape (n_heads * head_dim, n_features)
    value : array-like of shape (n_heads * value_dim, n_features)
    output : array-like of shape (n_outputs, n_heads * value_dim)
    n_heads : int
    biases : dict or None
        Optional keys ``"query"``, ``"key"``, ``"value"``, ``"output"``; a missing
        key or ``None`` is a zero bias.

    Returns
    -------
    query, key, value, output : ndarray
    biases : dict
        All four biases as float64 vectors (zeros where none was given).

    Examples
    --------
    >>> import numpy as np
    >>> q, k, v, o, b = check_projection_weights(
    ...     np.ones((4, 3)), np.ones((4, 3)), np.ones((4, 3)), np.ones((3, 4)), 2)
    >>> q.shape, sorted(b)
    ((4, 3), ['key', 'output', 'query', 'value'])
    """
    if (
        isinstance(n_heads, bool)
        or not isinstance(n_heads, int | np.integer)
        or n_heads < 1
    ):
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}.")
    query = _as_matrix(query, "query")
    key = _as_matrix(key, "key")
    value = _as_matrix(value, "value")
    output = _as_matrix(output, "output")
    d = query.shape[1]
    for name, arr in (("key", key), ("value", value)):
        if arr.shape[1] != d:
            raise ValueError(
                f"{name} has {arr.shape[1]} input features but query has {d}; all "
                f"of query, key and value must have shape (width, n_features) with "
                f"the same n_features (kdim/vdim different from the input width are "
                f"not supported)."
            )
    if key.shape[0] != query.shape[0]:
        raise ValueError(
            f"key has {key.shape[0]} output features but query has "
            f"{query.shape[0]}; the query and key weights must have the same shape."
        )
    for name, arr in (("query", query), ("value", value)):
        if arr.shape[0] % n_heads:
            raise ValueError(
                f"n_heads={n_heads} does not divide the width of {name} "
                f"({arr.shape[0]} output features); pass the number of heads the "
                f"layer was built with."
            )
    if output.shape[1] != value.shape[0]:
        raise ValueError(
            f"output has {output.shape[1]} input features but value has "
            f"{value.shape[0]} output features; output must have shape (n_outputs, "
            f"{value.shape[0]})."
        )
    biases = {} if biases is None else dict(biases)
    unknown = sorted(set(biases) - set(_BIAS_NAMES))
    if unknown:
        raise ValueError(
            f"biases has unknown key(s) {unknown}; expected a subset of "
            f"{list(_BIAS_NAMES)}."
        )
    sizes = {
        "query": query.shape[0],
        "key": key.shape[0],
        "value": value.shape[0],
        "output": output.shape[0],
    }
    checked = {}
    for name in _BIAS_NAMES:
        bias = biases.get(name)
        checked[name] = (
            np.zeros(sizes[name])
            if bias is None
            else _as_vector(bias, f"biases[{name!r}]", sizes[name])
        )
    return query, key, value, output, checked


def projections_to_parameters(
    query, key, value, output, n_heads, biases=None, scale=None
):
    """skattn parameters of a real attention sub-layer (see the module docstring).

    Parameters
    ----------
    query, key : ndarray of shape (n_heads * head_dim, n_features)
    value : ndarray of shape (n_heads * value_dim, n_features)
    output : ndarray of shape (n_outputs, n_heads * value_dim)
    n_heads : int
    biases : dict or None
        ``"query"``, ``"key"``, ``"value"``, ``"output"`` vectors (missing: zero).
    scale : float or None
        Logit scale; ``None`` is ``1 / sqrt(head_dim)``.

    Returns
    -------
    attention : ndarray of shape (n_heads, n_features, n_features)
        ``Theta_i = scale Wq_i^T Wk_i``.
    projection : ndarray of shape (n_heads, n_features, n_outputs)
        ``W_i = Wv_i^T Wo_i^T``.
    key_bias : ndarray of shape (n_heads, n_features)
        ``u_i = scale Wk_i^T bq_i``.
    intercept : ndarray of shape (n_outputs,)
        ``c = Wo bv + bo``.

    Examples
    --------
    >>> import numpy as np
    >>> eye = np.eye(2)
    >>> th, W, u, c = projections_to_parameters(eye, eye, eye, eye, 1, scale=1.0)
    >>> th[0], W[0]
    (array([[1., 0.],
           [0., 1.]]), array([[1., 0.],
           [0., 1.]]))
    """
    query, key, value, output, b = check_projection_weights(
        query, key, value, output, n_heads, biases
    )
    m = int(n_heads)
    d = query.shape[1]
    head_dim = query.shape[0] // m
    value_dim = value.shape[0] // m
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}.")
    Wq = query.reshape(m, head_dim, d)
    Wk = key.reshape(m, head_dim, d)
    Wv = value.reshape(m, value_dim, d)
    Wo = output.reshape(output.shape[0], m, value_dim).transpose(1, 0, 2)
    attention = scale * np.einsum("mhd,mhe->mde", Wq, Wk)
    key_bias = scale * np.einsum("mhd,mh->md", Wk, b["query"].reshape(m, head_dim))
    projection = np.einsum("mhd,moh->mdo", Wv, Wo)
    intercept = output @ b["value"] + b["output"]
    return attention, projection, key_bias, intercept


def _range_basis(columns, max_rank):
    """Orthonormal basis (d, r) of the column space of ``columns``; None if r > max.

    The numerical rank uses numpy's ``matrix_rank`` tolerance.
    """
    if columns.size == 0:
        return np.zeros((columns.shape[0], 0))
    U, s, _ = np.linalg.svd(columns, full_matrices=False)
    tol = (s[0] if s.size else 0.0) * max(columns.shape) * np.finfo(float).eps
    rank = int(np.sum(s > tol))
    if rank > max_rank:
        return None
    return U[:, :rank]


def parameters_to_projections(
    attention, projection, key_bias, intercept, n_heads, scale=None
):
    """Weights of a standard multi-head attention with head_dim = d / n_heads.

    The inverse of :func:`projections_to_parameters` (with ``scale``, ``None``:
    ``1 / sqrt(head_dim)``), up to the gauge of each head's factorisation: head ``i``
    needs ``rank [Theta_i^T, u_i] <= head_dim`` and ``rank W_i <= head_dim``, and
    the output width must equal the input width ``d``.

    Returns
    -------
    weights : dict or None
        ``query``, ``key``, ``value``, ``output`` (out_features, in_features)
        matrices and ``query_bias``, ``key_bias``, ``value_bias``,
        ``output_bias`` vectors, or ``None`` when the heads do not fit (then
        the reason is in ``reason``).
    reason : str
        Empty when ``weights`` is not None.

    Examples
    --------
    >>> import numpy as np
    >>> th, W = np.eye(2)[None], np.eye(2)[None]
    >>> weights, _ = parameters_to_projections(th, W, np.zeros((1, 2)), np.zeros(2), 1)
    >>> sorted(weights)[:2], weights["query"].shape
    (['key', 'key_bias'], (2, 2))
    """
    m, d, d_out = projection.shape
    if d_out != d:
        return None, f"n_outputs={d_out} differs from n_features={d}"
    if d % m:
        return None, f"n_heads={m} does not divide n_features={d}"
    head_dim = d // m
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    query = np.zeros((m, head_dim, d))
    key = np.zeros((m, head_dim, d))
    query_bias = np.zeros((m, head_dim))
    value = np.zeros((m, head_dim, d))
    out_heads = np.zeros((m, d_out, head_dim))
    for i in range(m):  # per head: a factorisation, no loop over samples
        B = _range_basis(np.column_stack([attention[i].T, key_bias[i]]), head_dim)
        if B is None:
            return None, (f"head {i} has rank [Theta_i^T, u_i] > head_dim={head_dim}")
        r = B.shape[1]
        key[i, :r] = B.T
        query[i, :r] = (attention[i] @ B).T / scale
        query_bias[i, :r] = B.T @ key_bias[i] / scale
        C = _range_basis(projection[i], head_dim)
        if C is None:
            return None, f"head {i} has rank W_i > head_dim={head_dim}"
        r = C.shape[1]
        value[i, :r] = C.T
        out_heads[i, :, :r] = (C.T @ projection[i]).T
    weights = {
        "query": query.reshape(d, d),
        "key": key.reshape(d, d),
        "value": value.reshape(d, d),
        "output": out_heads.transpose(1, 0, 2).reshape(d_out, d),
        "query_bias": query_bias.reshape(d),
        "key_bias": np.zeros(d),
        "value_bias": np.zeros(d),
        "output_bias": np.asarray(intercept, float).copy(),
    }
    return weights, ""
