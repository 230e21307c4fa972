"""AttentionLayer: a fixed (planted or learned) multi-head attention layer."""

from numbers import Integral, Real

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin, _fit_context
from sklearn.utils import check_array
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_is_fitted, validate_data

from ..utils._validation import (
    all_or_nothing,
    check_finite,
    check_no_overflow,
    flatten_tokens,
    layer_sequences,
)
from ._convert import projections_to_parameters
from ._math import attention_patterns, balanced_factors, forward
from ._positions import LAYOUTS, Rotary


def check_layer_parameters(attention, projection):
    """Validate Theta (m, d, d) and W (m, d, d_out); return them as float64 arrays.

    Raises a ValueError naming the parameter, what was received and what is
    expected.

    Examples
    --------
    >>> import numpy as np
    >>> th, W = check_layer_parameters(np.zeros((2, 3, 3)), np.zeros((2, 3, 4)))
    >>> th.shape, W.shape
    ((2, 3, 3), (2, 3, 4))
    """
    attention = np.asarray(attention, dtype=float)
    projection = np.asarray(projection, dtype=float)
    if attention.ndim == 2:
        attention = attention[None]
    if projection.ndim == 2:
        projection = projection[None]
    if attention.ndim != 3:
        raise ValueError(
            f"attention must have shape (n_heads, n_features, n_features), got "
            f"{attention.shape}."
        )
    if projection.ndim != 3:
        raise ValueError(
            f"projection must have shape (n_heads, n_features, n_outputs), got "
            f"{projection.shape}."
        )
    if attention.shape[1] != attention.shape[2]:
        raise ValueError(_not_square(attention.shape, projection.shape))
    if attention.shape[0] != projection.shape[0]:
        raise ValueError(
            f"attention has {attention.shape[0]} heads but projection has "
            f"{projection.shape[0]}; both need shape (n_heads, ...) with the same "
            f"n_heads."
        )
    if attention.shape[1] != projection.shape[1]:
        raise ValueError(
            f"attention acts on {attention.shape[1]} features per token but "
            f"projection expects {projection.shape[1]}; projection must have shape "
            f"(n_heads, {attention.shape[1]}, n_outputs)."
        )
    check_finite(attention, "attention")
    check_finite(projection, "projection")
    return attention, projection


def _not_square(attention_shape, projection_shape):
    """The message for attention matrices that are not square: the shape got and
    the shape expected from the projection's ``(n_heads, n_features, ...)``."""
    rows, cols = attention_shape[1:]
    m, d = projection_shape[:2]
    return (
        f"attention must have shape (n_heads, n_features, n_features), got "
        f"{attention_shape}: its matrices are {rows} x {cols}, not square (each "
        f"Theta_i = Q_i K_i^T is n_features x n_features). projection of shape "
        f"{projection_shape} has n_features={d}, so attention of shape "
        f"{(m, d, d)} is expected; pass square matrices, e.g. Q_i @ K_i.T from "
        f"the query and key weights."
    )


def check_layer_biases(key_bias, intercept, n_heads, n_features, n_outputs):
    """Validate the key biases u_i (m, d) and the intercept c (d_out,).

    ``None`` stays ``None`` (no bias); anything else is returned as float64.

    Examples
    --------
    >>> import numpy as np
    >>> u, c = check_layer_biases(np.zeros((2, 3)), None, 2, 3, 4)
    >>> u.shape, c
    ((2, 3), None)
    """
    if key_bias is not None:
        key_bias = np.asarray(key_bias, dtype=float)
        if key_bias.ndim == 1 and n_heads == 1:
            key_bias = key_bias[None]
        if key_bias.shape != (n_heads, n_features):
            raise ValueError(
                f"key_bias must have shape (n_heads, n_features) = ({n_heads}, "
                f"{n_features}), one vector u_i per head, got {key_bias.shape}."
            )
        check_finite(key_bias, "key_bias")
    if intercept is not None:
        intercept = np.asarray(intercept, dtype=float)
        if intercept.shape != (n_outputs,):
            raise ValueError(
                f"intercept must have shape (n_outputs,) = ({n_outputs},), got "
                f"{intercept.shape}."
            )
        check_finite(intercept, "intercept")
    return key_bias, intercept


def check_decoder_parameters(
    rotary_query, rotary_key, n_kv_heads, n_heads, n_features, rope_theta=10000.0
):
    """Validate the rotary maps and the key/value heads of a decoder layer.

    ``rotary_query`` ``(n_heads, n_features [+ 1], r)`` and ``rotary_key``
    ``(n_kv_heads, n_features [+ 1], r)``, both or neither (``None``); ``r`` even;
    ``n_kv_heads`` (``None``: ``rotary_key``'s heads, else ``n_heads``) dividing
    ``n_heads``.  Returns ``(rotary_query, rotary_key, n_kv_heads)``, the arrays
    as float64 with ``n_features + 1`` rows (a zero bias row added).

    Examples
    --------
    >>> import numpy as np
    >>> P, K, g = check_decoder_parameters(np.ones((4, 3, 2)), np.ones((2, 3, 2)),
    ...                                    None, 4, 3)
    >>> P.shape, K.shape, g
    ((4, 4, 2), (2, 4, 2), 2)
    """
    if n_kv_heads is not None and (
        isinstance(n_kv_heads, bool)
        or not isinstance(n_kv_heads, Integral)
        or n_kv_heads < 1
    ):
        raise ValueError(f"n_kv_heads must be a positive integer, got {n_kv_heads!r}.")
    if (rotary_query is None) != (rotary_key is None):
        given = "rotary_query" if rotary_key is None else "rotary_key"
        raise ValueError(
            f"{given} is given without "
            f"{'rotary_key' if rotary_key is None else 'rotary_query'}: a rotary "
            f"layer needs both (the query and key maps of its rotated dimensions)."
        )
    if rotary_query is not None:
        rope_theta = float(rope_theta)
        if not (np.isfinite(rope_theta) and rope_theta > 0):
            raise ValueError(
                f"rope_theta must be a positive number, got {rope_theta!r}."
            )
        rotary_query = _rotary_map(rotary_query, "rotary_query", n_features)
        rotary_key = _rotary_map(rotary_key, "rotary_key", n_features)
        if rotary_query.shape[0] != n_heads:
            raise ValueError(
                f"rotary_query has {rotary_query.shape[0]} heads but the layer has "
                f"n_heads={n_heads}; rotary_query must have shape (n_heads, "
                f"n_features [+ 1], rotary_dim)."
            )
        r = rotary_query.shape[2]
        if rotary_key.shape[2] != r:
            raise ValueError(
                f"rotary_key has rotary dimension {rotary_key.shape[2]} but "
                f"rotary_query has {r}; both rotate the same dimensions."
            )
        if r % 2:
            raise ValueError(
                f"the rotary dimension (last axis of rotary_query) is {r}, odd: RoPE "
                f"rotates pairs of dimensions, so it must be even."
            )
        if n_kv_heads is None:
            n_kv_heads = rotary_key.shape[0]
        elif rotary_key.shape[0] != n_kv_heads:
            raise ValueError(
                f"rotary_key has {rotary_key.shape[0]} heads but n_kv_heads="
                f"{n_kv_heads}; rotary_key must have shape (n_kv_heads, ...)."
            )
    if n_kv_heads is not None and n_heads % n_kv_heads:
        raise ValueError(
            f"n_kv_heads={n_kv_heads} does not divide n_heads={n_heads}: each group "
            f"of n_heads / n_kv_heads query heads shares one key/value head."
        )
    return rotary_query, rotary_key, n_kv_heads


def _rotary_map(value, name, n_features):
    """A finite float64 ``(heads, n_features + 1, r)`` array (bias row added)."""
    arr = np.asarray(value, dtype=float)
    if arr.ndim != 3 or arr.shape[1] not in (n_features, n_features + 1):
        raise ValueError(
            f"{name} must have shape (heads, {n_features} or {n_features + 1}, "
            f"rotary_dim) (the map of the features, and optionally a bias row), "
            f"got {arr.shape}."
        )
    check_finite(arr, name)
    if arr.shape[1] == n_features:
        arr = np.concatenate([arr, np.zeros((arr.shape[0], 1, arr.shape[2]))], axis=1)
    return arr


class AttentionLayer(TransformerMixin, BaseEstimator):
    """A multi-head attention layer ``F(X) = sum_i softmax(X Theta_i X^T) X W_i``.

    With biases, ``F(X) = sum_i softmax(X Theta_i X^T + 1 (X u_i)^T) X W_i +
    1 c^T``: the exact form of a real attention sub-layer with query, key, value
    and output biases (the query bias gives the key term ``u_i``, the key bias
    cancels in the softmax, value and output biases add the constant ``c``).

    A fixed function: use it as a planted teacher (``transform`` gives the labels),
    as the result of a learner (``estimator.layer_``), or as a step of a Pipeline.
    ``fit`` only validates the input widths; ``transform`` also works unfitted.

    Parameters
    ----------
    attention : array-like of shape (n_heads, n_features, n_features)
        The attention matrices Theta_i (query times key, any scaling folded in).
    projection : array-like of shape (n_heads, n_features, n_outputs)
        The projection matrices W_i (value times output map).
    n_tokens : int, default=None
        Tokens per sequence.  ``None`` infers it from a 3-D input, else from the
        width of a 2-D input divided by ``n_features``.
    key_bias : array-like of shape (n_heads, n_features), default=None
        The key-bias vectors u_i: head i's logit of key token a gains
        ``u_i^T x_a``.  ``None``: no such term.
    intercept : array-like of shape (n_outputs,), default=None
        Constant ``c`` added to every output token.  ``None``: zero.
    head_rank : int, default=None
        Declared rank r of every head (real transformers: the head dimension):
        ``Theta_i = Q_i K_i^T`` and ``W_i = V_i O_i`` with ``Q_i, K_i, V_i`` of
        shape ``(n_features, r)`` and ``O_i`` of shape ``(r, n_outputs)``.  The
        layer still holds and applies the products; ``fit`` and :meth:`factors`
        check that every ``Theta_i`` and ``W_i`` has rank at most r
        (numerically: singular values above ``1e-8`` times the largest of the
        stack) and raise a ValueError naming the ranks otherwise, and
        :meth:`factors` returns factors of that size.  ``None``: full rank.
    causal : bool, default=False
        Decoder (causal) attention: token l attends to the tokens ``a <= l``
        only.
    rotary_query : array-like of shape (n_heads, n_features [+ 1], rotary_dim), \
default=None
        Rotary position embeddings (RoPE): head i's logit between query token l
        and key token a gains ``q_i(l)^T R((a - l) omega) k_g(a)`` with ``q_i(l)
        = P_i^T [x_l; 1]`` (``P_i = rotary_query[i]``, the logit scale folded
        in; a last row, when present, is the query bias), ``k_g(a)`` likewise
        from ``rotary_key[g]``, and ``R`` the rotation of the pairs of rotated
        dimensions by the angles ``(a - l) rope_theta^(-2p / rotary_dim)``
        (:mod:`skattn.layer._positions`).  The position-free ``attention`` and
        ``key_bias`` still add to the logits (the dimensions a partial rotary
        layer does not rotate; zeros for Llama).  ``None``: no positions.
    rotary_key : array-like of shape (n_kv_heads, n_features [+ 1], rotary_dim), \
default=None
        The key maps ``K_g`` of the rotated dimensions; query head i uses key
        head ``g = i // (n_heads / n_kv_heads)``.  Given with ``rotary_query``.
    rope_theta : float, default=10000.0
        The RoPE base (transformers' ``rope_theta``).
    rope_layout : {"half", "interleaved"}, default="half"
        Which dimensions pair up: ``(p, p + rotary_dim / 2)`` (Llama, Qwen2,
        Mistral: ``rotate_half``) or ``(2p, 2p + 1)`` (GPT-J).
    n_kv_heads : int, default=None
        Key/value heads of grouped-query attention: consecutive groups of
        ``n_heads / n_kv_heads`` query heads share one key and one value head.
        ``None``: ``rotary_key``'s heads, else ``n_heads``.  The products
        ``attention`` and ``projection`` need not show the sharing; :meth:`to_torch`
        into a transformers module factors them with shared heads.

    Attributes
    ----------
    n_features_in_ : int
        Width of the flattened input seen in ``fit``.
    n_tokens_ : int
        Tokens per sequence seen in ``fit``.

    See Also
    --------
    skattn.datasets.make_attention_layer : plant a random layer.
    AttentionLayer.from_torch : a layer from ``torch.nn.MultiheadAttention``.
    AttentionLayer.from_projections : a layer from raw (checkpoint) weights.
    skattn.layer._positions : the math of rotary positions, masks and shared
        key heads.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> layer = AttentionLayer(np.zeros((1, 2, 2)), np.eye(2)[None])
    >>> X = np.array([[1.0, -1.0, 1.0, 1.0]])  # 2 tokens of 2 features
    >>> layer.transform(X)  # uniform attention: every row is the token mean
    array([[1., 0., 1., 0.]])
    """

    _parameter_constraints = {
        "attention": ["array-like"],
        "projection": ["array-like"],
        "n_tokens": [Interval(Integral, 1, None, closed="left"), None],
        "key_bias": ["array-like", None],
        "intercept": ["array-like", None],
        "head_rank": [Interval(Integral, 1, None, closed="left"), None],
        "causal": ["boolean"],
        "rotary_query": ["array-like", None],
        "rotary_key": ["array-like", None],
        "rope_theta": [Interval(Real, 0, None, closed="neither")],
        "rope_layout": [StrOptions(set(LAYOUTS))],
        "n_kv_heads": [Interval(Integral, 1, None, closed="left"), None],
    }

    def __init__(
        self,
        attention,
        projection,
        *,
        n_tokens=None,
        key_bias=None,
        intercept=None,
        head_rank=None,
        causal=False,
        rotary_query=None,
        rotary_key=None,
        rope_theta=10000.0,
        rope_layout="half",
        n_kv_heads=None,
    ):
        self.attention = attention
        self.projection = projection
        self.n_tokens = n_tokens
        self.key_bias = key_bias
        self.intercept = intercept
        self.head_rank = head_rank
        self.causal = causal
        self.rotary_query = rotary_query
        self.rotary_key = rotary_key
        self.rope_theta = rope_theta
        self.rope_layout = rope_layout
        self.n_kv_heads = n_kv_heads

    def _parameters(self):
        """Validated ``(attention, projection, key_bias, intercept)``."""
        attention, projection = check_layer_parameters(self.attention, self.projection)
        key_bias, intercept = check_layer_biases(
            self.key_bias, self.intercept, *projection.shape
        )
        return attention, projection, key_bias, intercept

    def _decoder(self, attention=None):
        """The validated decoder keywords of the math (``causal``, ``rotary``):
        ``{}`` for a position-free, unmasked layer."""
        if attention is None:
            attention = self._parameters()[0]
        m, d = attention.shape[:2]
        if self.causal not in (True, False):  # numpy booleans too
            raise ValueError(f"causal must be True or False, got {self.causal!r}.")
        if self.rope_layout not in LAYOUTS:
            raise ValueError(
                f"rope_layout must be one of {list(LAYOUTS)}, got {self.rope_layout!r}."
            )
        query, key, _ = check_decoder_parameters(
            self.rotary_query, self.rotary_key, self.n_kv_heads, m, d, self.rope_theta
        )
        decoder = {}
        if self.causal:
            decoder["causal"] = True
        if query is not None:
            decoder["rotary"] = Rotary(
                query, key, float(self.rope_theta), self.rope_layout
            )
        return decoder

    def _arrays(self):
        """What metrics and diagnostics compute with: the validated ``(attention,
        projection, key_bias, intercept, n_tokens)``, zero biases where absent and
        ``n_tokens_`` once fitted (else ``n_tokens``).

        A causal or rotary layer raises a ValueError: what computes with these
        arrays alone would miss its mask and positions."""
        attention, projection, key_bias, intercept = self._parameters()
        decoder = self._decoder(attention)
        if decoder:
            raise ValueError(
                f"this is a decoder layer ({' and '.join(sorted(decoder))}): its "
                f"function is not attention and projection alone, and this part of "
                f"skattn supports position-free, unmasked layers only; compare "
                f"decoder layers with skattn.metrics.prediction_error or "
                f"attention_pattern_error, or use transform / attention_patterns."
            )
        m, d, d_out = projection.shape
        return (
            attention,
            projection,
            np.zeros((m, d)) if key_bias is None else key_bias,
            np.zeros(d_out) if intercept is None else intercept,
            getattr(self, "n_tokens_", None) or self.n_tokens,
        )

    @classmethod
    def from_projections(
        cls,
        query,
        key,
        value,
        output,
        n_heads,
        *,
        biases=None,
        scale=None,
        n_tokens=None,
    ):
        """The layer of raw attention weights, exactly (biases included).

        The weights follow the ``(out_features, in_features)`` convention of
        PyTorch and BERT-style checkpoints, so tensors read from a
        ``.safetensors`` file with ``safetensors.numpy`` (no torch needed) map
        directly.  Head i uses rows ``i*h:(i+1)*h`` of ``query``, ``key`` and
        ``value`` (``h = width / n_heads``) and the same columns of ``output``:

        * ``Theta_i = scale * query_i^T key_i``;
        * ``u_i = scale * key_i^T b_query_i`` (the key bias cancels in the softmax);
        * ``W_i = value_i^T output_i^T``;
        * ``c = output @ b_value + b_output``.

        Parameters
        ----------
        query, key : array-like of shape (n_heads * head_dim, n_features)
            Query and key weights.
        value : array-like of shape (n_heads * value_dim, n_features)
            Value weights.
        output : array-like of shape (n_outputs, n_heads * value_dim)
            Output (dense) weights.
        n_heads : int
            Number of heads; must divide the widths.
        biases : dict, default=None
            Any of ``"query"``, ``"key"``, ``"value"``, ``"output"`` (vectors of
            the matching widths); missing or ``None`` means zero.  Without
            biases the layer has ``key_bias=None`` and ``intercept=None``.
        scale : float, default=None
            Logit scale; ``None`` is ``1 / sqrt(head_dim)``, as in PyTorch and BERT.
        n_tokens : int, default=None
            Passed to the layer.

        Returns
        -------
        layer : AttentionLayer

        Raises
        ------
        ValueError
            On shapes that do not fit together, ``n_heads`` not dividing the
            width, or non-finite weights, naming the argument.

        Examples
        --------
        >>> import numpy as np
        >>> from skattn import AttentionLayer
        >>> rng = np.random.default_rng(0)
        >>> q, k, v, o = rng.normal(size=(4, 6, 6))
        >>> layer = AttentionLayer.from_projections(
        ...     q, k, v, o, 2, biases={"query": np.ones(6)})
        >>> layer.attention.shape, layer.key_bias.shape, layer.intercept.shape
        ((2, 6, 6), (2, 6), (6,))
        """
        attention, projection, key_bias, intercept = projections_to_parameters(
            query, key, value, output, n_heads, biases=biases, scale=scale
        )
        if biases is None:
            key_bias = intercept = None
        return cls(
            attention,
            projection,
            n_tokens=n_tokens,
            key_bias=key_bias,
            intercept=intercept,
        )

    @classmethod
    def from_torch(cls, module, *, n_tokens=None):
        """The layer computed by a torch attention module, exactly.

        For a ``torch.nn.MultiheadAttention``, ``module(x, x, x,
        need_weights=False)[0]`` equals ``transform`` of this layer (in eval
        mode: dropout is a training-time perturbation and is not part of the
        function).  For transformers' decoder attention modules
        (``GPT2Attention``, ``LlamaAttention``, ``MistralAttention``,
        ``Qwen2Attention``), the module's output on the hidden states entering
        it, with its causal mask and its rotary positions, equals ``transform``
        (a causal layer; RoPE in ``rotary_query`` / ``rotary_key``, grouped-query
        heads in ``n_kv_heads``; see :mod:`skattn.layer._hf`).  What the layer
        does not represent (sliding windows, RoPE scalings, soft-capping,
        cross-attention, attention sinks, ...) is a one-line ValueError naming
        it.  ``batch_first`` only changes the tensor layout and is handled by
        the caller; the layer always takes
        ``(n_samples, n_tokens, n_features)``.  A module returned by
        :meth:`to_torch` is converted back as well.  Requires torch
        (``pip install "skattn[torch]"``).

        Parameters
        ----------
        module : torch.nn.MultiheadAttention or transformers attention module
            With or without bias.  ``add_bias_kv=True``, ``add_zero_attn=True`` and
            ``kdim``/``vdim`` different from ``embed_dim`` are not supported (a
            ValueError names the option); masks are arguments of the module's
            forward, not part of the layer: the layer attends over all tokens.
        n_tokens : int, default=None
            Passed to the layer.

        Returns
        -------
        layer : AttentionLayer
            With ``key_bias`` and ``intercept`` when the module has biases.

        Examples
        --------
        >>> import torch
        >>> from skattn import AttentionLayer
        >>> _ = torch.manual_seed(0)
        >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).double()
        >>> x = torch.randn(5, 3, 8, dtype=torch.float64)
        >>> layer = AttentionLayer.from_torch(mha)
        >>> expected = mha(x, x, x, need_weights=False)[0].detach().numpy()
        >>> diff = layer.transform(x.numpy()) - expected.reshape(5, -1)
        >>> bool(abs(diff).max() < 1e-12)
        True
        """
        from ._torch import hf_architecture, hf_module_parameters, torch_parameters

        if hf_architecture(module) is not None:
            return cls(**hf_module_parameters(module), n_tokens=n_tokens)
        if type(module).__module__.startswith("transformers"):
            raise ValueError(
                f"unsupported transformers module {type(module).__name__}; "
                f"supported: GPT2Attention, LlamaAttention, MistralAttention, "
                f"Qwen2Attention (and torch.nn.MultiheadAttention)."
            )
        decoder = {}
        if getattr(module, "causal", False):
            decoder["causal"] = True
        if getattr(module, "rotary_query", None) is not None:
            decoder.update(
                rotary_query=module.rotary_query.detach().cpu().double().numpy(),
                rotary_key=module.rotary_key.detach().cpu().double().numpy(),
                rope_theta=module.rope_theta,
                rope_layout=module.rope_layout,
            )
        attention, projection, key_bias, intercept = torch_parameters(module)
        bias_free = not (np.any(key_bias) or np.any(intercept))
        if bias_free and getattr(module, "in_proj_bias", 0) is None:
            key_bias = intercept = None
        return cls(
            attention,
            projection,
            n_tokens=n_tokens,
            key_bias=key_bias,
            intercept=intercept,
            **decoder,
        )

    def to_torch(self, *, batch_first=True, dtype=None, module="auto"):
        """A torch module whose forward equals this layer's ``transform``.

        When the heads fit its shapes (``n_heads`` divides ``n_features``,
        ``n_outputs == n_features``, and for every head ``rank [Theta_i^T, u_i]
        <= head_dim`` and ``rank W_i <= head_dim``, ``head_dim = n_features /
        n_heads``) the result is a standard ``torch.nn.MultiheadAttention`` (with
        bias, in eval mode): call it as ``mha(x, x, x, need_weights=False)[0]``.
        Otherwise (and for every causal or rotary layer) it is a small skattn
        ``torch.nn.Module`` holding ``attention``, ``projection``, ``key_bias``,
        ``intercept`` (and ``rotary_query``, ``rotary_key``) as parameters,
        called the same way (self-attention only; masks raise a ValueError: a
        causal layer masks itself).  Given a transformers ``GPT2Attention``,
        ``LlamaAttention``, ``MistralAttention`` or ``Qwen2Attention`` module,
        the layer is written into it, in place, in its own tensor names and
        layout (``strict`` ``load_state_dict``), so that the module computes the
        layer; a layer the module cannot hold (not causal, other positions or
        head counts, heads above its head dimension, biases it lacks) is a
        ValueError naming the reason.  Requires torch (``pip install
        "skattn[torch]"``).

        Parameters
        ----------
        batch_first : bool, default=True
            Layout of the module's input and output: ``(batch, tokens,
            features)`` when True, ``(tokens, batch, features)`` when False.
        dtype : torch.dtype, default=None
            ``None`` is ``torch.float64``.
        module : {"auto", "skattn"} or transformers attention module, \
default="auto"
            ``"skattn"`` always returns skattn's module; a transformers module
            is written into (``batch_first`` and ``dtype`` are then its own).

        Returns
        -------
        module : torch.nn.Module

        Examples
        --------
        >>> import numpy as np, torch
        >>> from skattn import AttentionLayer
        >>> from skattn.datasets import make_attention_layer
        >>> _ = torch.manual_seed(0)
        >>> layer = AttentionLayer.from_torch(torch.nn.MultiheadAttention(4, 2))
        >>> mha = layer.to_torch()  # rank-2 heads fit head_dim = 2
        >>> type(mha).__name__
        'MultiheadAttention'
        >>> x = torch.randn(3, 5, 4, dtype=torch.float64)
        >>> out = mha(x, x, x, need_weights=False)[0].detach().numpy()
        >>> bool(np.allclose(out, layer.transform(x.numpy()).reshape(3, 5, 4)))
        True
        >>> full = make_attention_layer(2, 4, random_state=0)  # full-rank heads
        >>> type(full.to_torch()).__name__
        'AttentionLayerModule'
        """
        from ._torch import hf_architecture, hf_write, import_torch, parameters_to_torch

        torch = import_torch()
        if not isinstance(module, str):
            if hf_architecture(module) is None:
                raise TypeError(
                    f"module must be 'auto', 'skattn' or a transformers GPT-2, "
                    f"Llama, Mistral or Qwen2 attention module, got "
                    f"{type(module).__name__}."
                )
            return hf_write(self, module)
        if module not in ("auto", "skattn"):
            raise ValueError(f'module must be "auto" or "skattn", got {module!r}.')
        attention, projection, key_bias, intercept = self._parameters()
        decoder = self._decoder(attention)
        m, d, d_out = projection.shape
        return parameters_to_torch(
            attention,
            projection,
            np.zeros((m, d)) if key_bias is None else key_bias,
            np.zeros(d_out) if intercept is None else intercept,
            batch_first=batch_first,
            dtype=torch.float64 if dtype is None else dtype,
            force_module=module == "skattn",
            **decoder,
        )

    def factors(self):
        """Low-rank factors ``(Q, K, V, O)`` of the heads.

        ``Theta_i = Q_i K_i^T`` and ``W_i = V_i O_i``, balanced (the singular
        values split evenly between the two factors of the SVD) and of the
        declared ``head_rank`` (``None``: full, ``min`` of the shapes).  Factors
        are defined only up to an invertible ``r x r`` gauge; the products are
        the layer.  Of a rotary layer, ``Q`` and ``K`` factor the position-free
        ``attention`` only: the rotated maps are ``rotary_query`` and
        ``rotary_key``.

        Returns
        -------
        query : ndarray of shape (n_heads, n_features, r)
        key : ndarray of shape (n_heads, n_features, r)
        value : ndarray of shape (n_heads, n_features, r)
        output : ndarray of shape (n_heads, r, n_outputs)

        Raises
        ------
        ValueError
            When a head has a higher rank than ``head_rank`` (its factors would
            truncate it, not reproduce it).

        Examples
        --------
        >>> from skattn.datasets import make_attention_layer
        >>> layer = make_attention_layer(2, 8, head_rank=3, random_state=0)
        >>> Q, K, V, O = layer.factors()
        >>> Q.shape, O.shape
        ((2, 8, 3), (2, 3, 8))
        >>> bool(np.allclose(Q @ K.transpose(0, 2, 1), layer.attention))
        True
        """
        attention, projection, _, _ = self._parameters()
        self._check_head_rank(attention, projection)
        d, d_out = attention.shape[1], projection.shape[2]
        rank_t = d if self.head_rank is None else min(self.head_rank, d)
        rank_w = min(d, d_out) if self.head_rank is None else min(self.head_rank, d)
        query, key = balanced_factors(attention, rank_t)
        value, output = balanced_factors(projection, min(rank_w, d_out))
        return query, key, value, np.swapaxes(output, 1, 2)

    @property
    def n_heads(self):
        """Number of heads m (a 2-D attention matrix is one head)."""
        return check_layer_parameters(self.attention, self.projection)[0].shape[0]

    @property
    def n_features(self):
        """Features per input token d (of the validated parameters)."""
        return check_layer_parameters(self.attention, self.projection)[0].shape[-1]

    @property
    def n_outputs(self):
        """Features per output token d_out (of the validated parameters)."""
        return check_layer_parameters(self.attention, self.projection)[1].shape[-1]

    def _sequences(self, X, reset):
        X, k3 = flatten_tokens(X)
        ndim = X.ndim if hasattr(X, "ndim") else np.ndim(X)
        if ndim != 2:
            raise ValueError(
                f"X must be 2-D (n_samples, n_tokens * n_features) or 3-D "
                f"(n_samples, n_tokens, n_features), got a {ndim}-D array of shape "
                f"{np.shape(X)}."
            )
        if reset or hasattr(self, "n_features_in_"):
            X = validate_data(self, X, reset=reset, dtype=np.float64)
        else:  # an unfitted (planted) layer: plain array checks, no fitted state
            X = check_array(X, dtype=np.float64, input_name="X")
        return layer_sequences(X, self.n_tokens, k3, np.shape(self.attention)[-1])

    def _check_head_rank(self, attention, projection):
        """Raise if a head's rank exceeds ``head_rank`` (numerically)."""
        if self.head_rank is None:
            return
        for name, mats in (("attention", attention), ("projection", projection)):
            ranks = _numerical_ranks(mats)
            if np.any(ranks > self.head_rank):
                raise ValueError(
                    f"head_rank={self.head_rank} but the {name} matrices have "
                    f"ranks {ranks.tolist()} (singular values above {_RANK_RTOL:g} "
                    f"times the largest); factors of rank {self.head_rank} would "
                    f"truncate them. Pass head_rank >= {int(ranks.max())} or "
                    f"head_rank=None."
                )

    @_fit_context(prefer_skip_nested_validation=True)
    @all_or_nothing
    def fit(self, X, y=None):
        """Validate X's widths against the layer; nothing is learned.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)
        y : ignored

        Returns
        -------
        self : AttentionLayer

        Raises
        ------
        ValueError
            On invalid parameters (shapes, NaN, a head of higher rank than
            ``head_rank``) or X; the fitted attributes of a previous fit are then
            left as they were.
        """
        attention, projection, _, _ = self._parameters()
        self._decoder(attention)
        self._check_head_rank(attention, projection)
        X3 = self._sequences(X, reset=True)
        self.n_tokens_ = X3.shape[1]
        return self

    def transform(self, X):
        """Apply the layer: ``F(X)`` flattened token-major.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        Y : ndarray of shape (n_samples, n_tokens * n_outputs)
        """
        attention, projection, key_bias, intercept = self._parameters()
        decoder = self._decoder(attention)
        X3 = self._sequences(X, reset=False)
        Y = forward(
            X3,
            attention,
            projection,
            key_bias=key_bias,
            intercept=intercept,
            **decoder,
        )
        check_no_overflow(
            Y, "transform", X=X3, attention=attention, projection=projection
        )
        return Y.reshape(X3.shape[0], -1)

    def predict(self, X):
        """Apply the layer: the same as :meth:`transform`.

        A layer read back from a file (``skattn.cli.load_layer``) stands in for
        the fitted estimator, whose ``predict`` this is.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        Y : ndarray of shape (n_samples, n_tokens * n_outputs)
        """
        return self.transform(X)

    def __call__(self, X):
        """Apply the layer, as a torch module is called: ``layer(X)`` is
        :meth:`transform`.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        Y : ndarray of shape (n_samples, n_tokens * n_outputs)

        Examples
        --------
        >>> import numpy as np
        >>> from skattn import AttentionLayer
        >>> layer = AttentionLayer(np.zeros((1, 2, 2)), np.eye(2)[None])
        >>> X = np.array([[1.0, -1.0, 1.0, 1.0]])
        >>> layer(X), layer.predict(X)
        (array([[1., 0., 1., 0.]]), array([[1., 0., 1., 0.]]))
        """
        return self.transform(X)

    def attention_patterns(self, X):
        """Per-head attention patterns on X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        patterns : ndarray of shape (n_samples, n_heads, n_tokens, n_tokens)
            Row l of head i is the distribution softmax_a(x_l^T Theta_i x_a +
            u_i^T x_a) (plus the rotary logits and the causal mask of a decoder
            layer).
        """
        attention, _, key_bias, _ = self._parameters()
        decoder = self._decoder(attention)
        X3 = self._sequences(X, reset=False)
        patterns = attention_patterns(X3, attention, key_bias, **decoder)
        return check_no_overflow(
            patterns, "attention_patterns", X=X3, attention=attention
        )

    def get_feature_names_out(self, input_features=None):
        """Output names ``token{t}_out{j}``, token-major.

        Parameters
        ----------
        input_features : array-like of str or None, default=None
            Ignored: the names depend only on the number of tokens seen by
            ``fit`` and on ``n_outputs``.

        Returns
        -------
        feature_names_out : ndarray of str objects of shape \
(n_tokens * n_outputs,)
            ``token{t}_out{j}`` for token ``t`` and output feature ``j``.
        """
        check_is_fitted(self, "n_tokens_")
        k = self.n_tokens_
        return np.asarray(
            [f"token{t}_out{j}" for t in range(k) for j in range(self.n_outputs)],
            dtype=object,
        )

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = False
        return tags


# Relative tolerance of a head's numerical rank (``head_rank`` checks).
_RANK_RTOL = 1e-8


def _numerical_ranks(matrices, rtol=_RANK_RTOL):
    """Rank of each matrix of a stack: singular values above ``rtol`` times the
    largest of the stack."""
    s = np.linalg.svd(matrices, compute_uv=False)
    return np.sum(s > rtol * max(float(s.max()), np.finfo(float).tiny), axis=1)
