"""A BERT-style encoder in numpy, real text, and the hidden states layer L sees.

* :class:`BertEncoder`: the forward pass of a BERT-style ``.safetensors``
  checkpoint (embeddings; per layer self-attention with biases, output dense,
  residual and LayerNorm, feed-forward with exact GELU, residual and LayerNorm),
  read with ``safetensors.numpy`` (no torch) and computed in float64 by the pure
  functions of this module;
* :func:`stdlib_docstring_tokens`: the docstrings of the Python standard library,
  read from its source files with :mod:`ast` (offline, deterministic), tokenized by
  the model's own ``tokenizer.json``;
* :class:`PretrainedHiddenStates`: windows of that text as the hidden states
  entering layer ``L``, a token distribution like the others;
* :func:`load_bert_hidden_states`: layer ``L``'s attention and that distribution.
"""

import ast
import functools
import numbers
import os
import sysconfig
import warnings
from pathlib import Path

import numpy as np
from scipy.special import ndtr

from ..utils._optional import require
from ._distributions import TokenDistribution, _check_positive_int
from ._pretrained import (
    _check_architecture,
    _check_head_shapes,
    _find_prefix,
    _finite_table,
    _layers_found,
    _load_tensors,
    _n_heads_from_config,
    _read_config,
    _tensor,
    layer_norm,
    load_bert_attention,
    minilm_checkpoint_path,
)

# -- the forward pass: pure functions, arrays in, arrays out -------------------------


def _dense(Z, linear):
    """``Z W^T + b`` for a ``(weight (out, in), bias (out,))`` pair; Z (..., in)."""
    weight, bias = linear
    # one 2-D product: a stacked (n, k, in) @ (in, out) is n small ones, 4x slower
    flat = Z.reshape(-1, Z.shape[-1]) @ weight.T + bias
    return flat.reshape(*Z.shape[:-1], -1)


def _gelu(Z):
    """Exact GELU, ``z Phi(z) = z (1 + erf(z / sqrt 2)) / 2`` (BERT's ``"gelu"``).

    ``Phi`` is :func:`scipy.special.ndtr`, 3x faster than the erf form.
    """
    return Z * ndtr(Z)


def _self_attention(H, query, key, value, n_heads):
    """Multi-head self-attention's context, before the output dense.

    ``concat_i softmax(Q_i K_i^T / sqrt(h)) V_i`` with ``Q = H Wq^T + bq`` (and
    ``K``, ``V`` alike) split into ``n_heads`` heads of ``h`` columns; no mask.

    Parameters
    ----------
    H : ndarray of shape (n_windows, n_tokens, n_features)
    query, key, value : tuple of (weight, bias)
        Weights of shape ``(n_features, n_features)``, biases ``(n_features,)``.
    n_heads : int

    Returns
    -------
    context : ndarray of shape (n_windows, n_tokens, n_features)
    """
    n, k, _ = H.shape

    def heads(Z):  # (n, k, d) -> (n, heads, k, h)
        return Z.reshape(n, k, n_heads, -1).transpose(0, 2, 1, 3)

    Q, K, V = heads(_dense(H, query)), heads(_dense(H, key)), heads(_dense(H, value))
    logits = Q @ K.transpose(0, 1, 3, 2) * Q.shape[-1] ** -0.5
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ V).transpose(0, 2, 1, 3).reshape(n, k, -1)


def _encoder_layer(H, weights, n_heads, eps):
    """One BERT encoder layer (post-LayerNorm), ``H`` of shape (n, k, d) -> same.

    ``A = LayerNorm(H + dense(attention(H)))``, then
    ``LayerNorm(A + dense2(gelu(dense1(A))))``; ``weights`` as in
    :attr:`BertEncoder.layers`.
    """
    context = _self_attention(
        H, weights["query"], weights["key"], weights["value"], n_heads
    )
    A = layer_norm(
        H + _dense(context, weights["attention_output"]),
        *weights["attention_norm"],
        eps=eps,
    )
    F = _dense(_gelu(_dense(A, weights["intermediate"])), weights["output"])
    return layer_norm(A + F, *weights["output_norm"], eps=eps)


def _embed(ids, embeddings, eps):
    """``LayerNorm(word[ids] + position[:k] + token_type[0])``: (n, k) -> (n, k, d)."""
    Z = (
        embeddings["word"][ids]
        + embeddings["position"][: ids.shape[1]]
        + embeddings["token_type"][0]
    )
    return layer_norm(Z, *embeddings["norm"], eps=eps)


# -- the encoder ------------------------------------------------------------------

# Per layer: (key in BertEncoder.layers, tensor name after "encoder.layer.L.").
_LAYER_TENSORS = (
    ("query", "attention.self.query"),
    ("key", "attention.self.key"),
    ("value", "attention.self.value"),
    ("attention_output", "attention.output.dense"),
    ("attention_norm", "attention.output.LayerNorm"),
    ("intermediate", "intermediate.dense"),
    ("output", "output.dense"),
    ("output_norm", "output.LayerNorm"),
)
_DTYPES = {"float64": np.float64, "float32": np.float32}


def _check_dtype(dtype):
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        raise ValueError(
            f"dtype must be 'float64' or 'float32' (the precision of the forward "
            f"pass), got {dtype!r}."
        )
    return name


class BertEncoder:
    """The forward pass of a BERT-style encoder, in numpy.

    Computes the hidden states of a BERT-style model (BERT, MiniLM, ...) for token
    id windows: the embedding output ``LayerNorm(word + position + token type
    0)``, then per layer self-attention with its biases, the output dense,
    residual and LayerNorm, the feed-forward (dense, exact erf GELU, dense),
    residual and LayerNorm.  Windows are single segments without padding, so no
    attention mask is applied: every token sees all ``n_tokens`` tokens, at
    positions ``0, ..., n_tokens - 1``.  Vectorised over windows (in batches, to
    bound memory); the weights are held in float64.

    Parameters
    ----------
    tensors : mapping of str to array-like
        The checkpoint's tensors by name, with any common prefix (``bert.``):
        ``embeddings.{word,position,token_type}_embeddings.weight``,
        ``embeddings.LayerNorm.{weight,bias}`` and, for every layer ``L``,
        ``encoder.layer.L.attention.self.{query,key,value}``,
        ``...attention.output.{dense,LayerNorm}``, ``...intermediate.dense``,
        ``...output.{dense,LayerNorm}`` (each ``.weight`` and ``.bias``).
    n_heads : int
        Attention heads per layer.
    eps : float, default=1e-12
        LayerNorm's epsilon (``layer_norm_eps`` of the config).
    tokenizer : str or path-like, default=None
        The model's ``tokenizer.json`` (used by :class:`PretrainedHiddenStates`
        to tokenize text); ``None``: none known.

    Attributes
    ----------
    n_layers : int
        Encoder layers.
    n_heads : int
        Attention heads per layer.
    eps : float
        LayerNorm's epsilon.
    tokenizer : pathlib.Path or None
        The model's ``tokenizer.json``.
    n_features : int
        Hidden size d.
    max_positions : int
        Rows of the position table: the longest window.
    vocab_size : int
        Rows of the word embeddings.
    embeddings : dict
        ``"word"``, ``"position"``, ``"token_type"`` tables and ``"norm"``, the
        LayerNorm ``(weight, bias)``, float64.
    layers : list of dict
        Per layer, ``(weight, bias)`` float64 pairs: ``"query"``, ``"key"``,
        ``"value"``, ``"attention_output"``, ``"attention_norm"``,
        ``"intermediate"``, ``"output"``, ``"output_norm"``.

    See Also
    --------
    load_bert_attention : one layer's attention sub-layer as an AttentionLayer.
    PretrainedHiddenStates : hidden states of real text as a distribution.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.datasets import BertEncoder
    >>> encoder = BertEncoder.from_safetensors()  # all-MiniLM-L6-v2
    >>> encoder.n_layers, encoder.n_heads, encoder.n_features
    (6, 12, 384)
    >>> ids = np.array([[101, 1996, 4937, 102]])  # [CLS] the cat [SEP]
    >>> encoder.hidden_states(ids, layer=6).shape
    (1, 4, 384)
    """

    def __init__(self, tensors, n_heads, *, eps=1e-12, tokenizer=None):
        where = "the checkpoint"
        _check_architecture(tensors, {}, where)
        prefix = _find_prefix(tensors, 0, where)
        found = _layers_found(tensors)
        if found != list(range(len(found))):
            raise ValueError(
                f"Encoder layers must be numbered 0, 1, ...; found {found}."
            )
        self.n_layers = len(found)
        self.n_heads = _check_positive_int(n_heads, "n_heads")
        if not isinstance(eps, numbers.Real) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}.")
        self.eps = float(eps)
        self.tokenizer = None if tokenizer is None else Path(tokenizer)

        def read(name, shape):
            """The float64 tensor prefix + name, checked against ``shape``."""
            key = prefix + name
            value = _finite_table(_tensor(tensors, "", key, where), key, len(shape))
            if any(
                s is not None and s != v
                for s, v in zip(shape, value.shape, strict=True)
            ):
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{key} has shape {value.shape}, expected {expected}.")
            return value

        word = read("embeddings.word_embeddings.weight", (None, None))
        self.vocab_size, d = word.shape
        self.n_features = d
        if d % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide the width {d}.")
        self.embeddings = {
            "word": word,
            "position": read("embeddings.position_embeddings.weight", (None, d)),
            "token_type": read("embeddings.token_type_embeddings.weight", (None, d)),
            "norm": (
                read("embeddings.LayerNorm.weight", (d,)),
                read("embeddings.LayerNorm.bias", (d,)),
            ),
        }
        self.max_positions = self.embeddings["position"].shape[0]
        self.layers = []
        for layer in range(self.n_layers):
            base = f"encoder.layer.{layer}."
            attention = {
                role: (
                    read(base + name + ".weight", (None, d)),
                    read(base + name + ".bias", (None,)),
                )
                for role, name in _LAYER_TENSORS[:3]
            }
            _check_head_shapes(
                attention["query"][0],
                attention["key"][0],
                attention["value"][0],
                f"Layer {layer} ({prefix}{base}attention.self.*)",
            )
            d_ff = read(base + "intermediate.dense.bias", (None,)).shape[0]
            shapes = {
                "query": ((d, d), (d,)),
                "key": ((d, d), (d,)),
                "value": ((d, d), (d,)),
                "attention_output": ((d, d), (d,)),
                "attention_norm": ((d,), (d,)),
                "intermediate": ((d_ff, d), (d_ff,)),
                "output": ((d, d_ff), (d,)),
                "output_norm": ((d,), (d,)),
            }
            self.layers.append(
                {
                    role: (
                        read(base + name + ".weight", shapes[role][0]),
                        read(base + name + ".bias", shapes[role][1]),
                    )
                    for role, name in _LAYER_TENSORS
                }
            )
        self._cast = {"float64": (self.embeddings, self.layers)}

    @classmethod
    def from_safetensors(cls, path=None, *, n_heads=None):
        """Read a BERT-style ``.safetensors`` checkpoint (no torch, no network).

        The ``config.json`` next to the file, if any, gives ``n_heads``
        (``num_attention_heads``), the LayerNorm epsilon (``layer_norm_eps``) and
        is checked for architectures this forward pass does not compute: other
        position embeddings than absolute ones, grouped-query heads, another
        activation than exact GELU.  A ``tokenizer.json`` next to the file is
        recorded as :attr:`tokenizer`.

        Parameters
        ----------
        path : str or path-like, default=None
            The ``.safetensors`` file; ``None`` uses
            :func:`minilm_checkpoint_path` (all-MiniLM-L6-v2).
        n_heads : int, default=None
            Attention heads; ``None`` reads ``num_attention_heads`` from the
            ``config.json``.

        Returns
        -------
        encoder : BertEncoder

        Raises
        ------
        ValueError
            On missing tensors, wrong shapes or non-finite weights (naming the
            tensor), and on unsupported architectures (naming what was found).
        """
        path = minilm_checkpoint_path() if path is None else Path(path)
        tensors = _load_tensors(path)
        config = _read_config(path)
        _check_architecture(tensors, config, path)
        act = config.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(
                f"{path}: config.json has hidden_act={act!r}; only BERT's exact "
                f"(erf) 'gelu' feed-forward activation is supported."
            )
        if n_heads is None:
            n_heads = _n_heads_from_config(path, config)
        tokenizer = path.with_name("tokenizer.json")
        try:
            encoder = cls(
                tensors,
                n_heads,
                eps=config.get("layer_norm_eps", 1e-12),
                tokenizer=tokenizer if tokenizer.is_file() else None,
            )
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        n_config = config.get("num_hidden_layers")
        if n_config is not None and n_config != encoder.n_layers:
            raise ValueError(
                f"{path}: config.json has num_hidden_layers={n_config} but the "
                f"checkpoint has {encoder.n_layers} encoder layers."
            )
        return encoder

    def _check_layer(self, layer, *, attention=False):
        """``layer`` as an int: a hidden state ``0 .. n_layers`` (the input of
        that layer; ``n_layers`` is the output), or with ``attention`` an
        attention layer ``0 .. n_layers - 1``; else a ``ValueError``."""
        top = self.n_layers - 1 if attention else self.n_layers
        if (
            isinstance(layer, bool)
            or not isinstance(layer, numbers.Integral)
            or not 0 <= layer <= top
        ):
            span = (
                f"[0, n_layers - 1 = {top}] (an attention layer)"
                if attention
                else f"[0, n_layers={top}]"
            )
            raise ValueError(f"layer must be an integer in {span}, got {layer!r}.")
        return int(layer)

    def _check_ids(self, ids):
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"ids must be a non-empty 2-D array (n_windows, n_tokens) of integer "
                f"token ids, got an array of shape {ids.shape} and dtype {ids.dtype}."
            )
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(
                f"ids has token ids outside [0, {self.vocab_size}) (the vocabulary): "
                f"min {int(ids.min())}, max {int(ids.max())}."
            )
        if ids.shape[1] > self.max_positions:
            raise ValueError(
                f"ids has windows of {ids.shape[1]} tokens, more than the model's "
                f"position table (max_position_embeddings={self.max_positions})."
            )
        return ids.astype(np.int64, copy=False)

    def _weights(self, dtype):
        if dtype not in self._cast:
            cast = _DTYPES[dtype]

            def convert(value):
                if isinstance(value, tuple):
                    return tuple(v.astype(cast) for v in value)
                return value.astype(cast)

            self._cast[dtype] = (
                {role: convert(v) for role, v in self.embeddings.items()},
                [{role: convert(v) for role, v in w.items()} for w in self.layers],
            )
        return self._cast[dtype]

    def hidden_states(self, ids, layer, *, dtype="float64", batch_size=256):
        """The hidden states entering encoder layer ``layer``.

        ``layer=0`` is the embedding output (LayerNorm included), ``layer=L`` the
        output of layer ``L - 1``, which is what layer ``L``'s attention sees;
        ``layer=n_layers`` is the final output (``last_hidden_state``).  Equal to
        ``hidden_states[layer]`` of ``transformers.BertModel(...,
        output_hidden_states=True)`` on the same ids with token type 0 and no
        padding.

        Parameters
        ----------
        ids : array-like of int of shape (n_windows, n_tokens)
            Token ids; ``n_tokens <= max_positions``.
        layer : int
            In ``0, ..., n_layers``.
        dtype : {"float64", "float32"}, default="float64"
            Precision of the computation (float32 is about 3x faster and agrees
            to about 1e-6 relative error); the result is float64 either way.
        batch_size : int, default=256
            Windows per vectorised batch (memory: about ``batch_size * n_tokens *
            4 * n_features`` floats).

        Returns
        -------
        H : ndarray of shape (n_windows, n_tokens, n_features)
        """
        ids = self._check_ids(ids)
        layer = self._check_layer(layer)
        embeddings, layers = self._weights(_check_dtype(dtype))
        batch_size = _check_positive_int(batch_size, "batch_size")
        out = np.empty((*ids.shape, self.n_features))
        for start in range(0, len(ids), batch_size):
            H = _embed(ids[start : start + batch_size], embeddings, self.eps)
            for weights in layers[:layer]:
                H = _encoder_layer(H, weights, self.n_heads, self.eps)
            out[start : start + batch_size] = H
        return out


# -- real text: the standard library's docstrings ------------------------------------

# Top-level standard library entries that are not its text: the test suite and
# installation-specific generated files.
_STDLIB_SKIP = ("test", "site-packages", "__pycache__")
_STDLIB_SKIP_PARTS = ("test", "tests", "idle_test", "__pycache__")


def _stdlib_root():
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_modules(root):
    """Sorted top-level modules and packages of the standard library directory."""
    names = {p.stem for p in root.glob("*.py")} | {
        p.name for p in root.iterdir() if (p / "__init__.py").is_file()
    }
    return sorted(
        name
        for name in names
        if name not in _STDLIB_SKIP and not name.startswith("_sysconfigdata")
    )


@functools.lru_cache(maxsize=8)
def _stdlib_docstrings(modules):
    """The docstrings of the given top-level stdlib modules, in a fixed order.

    Files in sorted path order, within a file module, class and function
    docstrings in source order, each cleaned by :func:`ast.get_docstring`.
    """
    root = _stdlib_root()
    files = []
    for name in modules:
        package = root / name
        if package.is_dir():
            files += [
                p
                for p in package.rglob("*.py")
                if not set(p.relative_to(root).parts[:-1]) & set(_STDLIB_SKIP_PARTS)
            ]
        else:
            files.append(root / f"{name}.py")
    docs = []
    for file in sorted(files):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes in old sources
                tree = ast.parse(file.read_bytes())
        except (SyntaxError, ValueError):  # pragma: no cover - py2 sources
            continue
        nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        found = [
            (getattr(node, "lineno", 0), ast.get_docstring(node, clean=True))
            for node in ast.walk(tree)
            if isinstance(node, nodes)
        ]
        docs += [doc for _, doc in sorted(found, key=lambda t: t[0]) if doc]
    return tuple(docs)


def _load_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` without padding and truncation (a copy)."""
    Tokenizer = require(
        "tokenizers", extra="pretrained", feature="Tokenizing text"
    ).Tokenizer
    if tokenizer is None:
        tokenizer = minilm_checkpoint_path().with_name("tokenizer.json")
    if isinstance(tokenizer, Tokenizer):
        tok = Tokenizer.from_str(tokenizer.to_str())
    elif isinstance(tokenizer, str | os.PathLike):
        if not Path(tokenizer).is_file():
            raise ValueError(f"tokenizer file {str(tokenizer)!r} does not exist.")
        tok = Tokenizer.from_file(str(tokenizer))
    else:
        raise TypeError(
            f"tokenizer must be None, the path of a tokenizer.json or a "
            f"tokenizers.Tokenizer, got {type(tokenizer).__name__}."
        )
    tok.no_padding()
    tok.no_truncation()
    return tok


def stdlib_docstring_tokens(tokenizer=None, *, modules=None):
    """Token ids of the docstrings of the Python standard library.

    Real English text, offline and under the PSF license: the module, class and
    function docstrings (:func:`ast.get_docstring`) of the standard library's
    ``.py`` sources (``sysconfig.get_paths()["stdlib"]``, without its test suite),
    files in sorted path order and docstrings in source order, so the result is
    deterministic for a given Python installation (it changes with the Python
    version).  Each docstring is tokenized without special tokens.

    Parameters
    ----------
    tokenizer : str, path-like or tokenizers.Tokenizer, default=None
        A ``tokenizer.json`` (e.g. :attr:`BertEncoder.tokenizer`) or a
        tokenizer; ``None``: all-MiniLM-L6-v2's.  Needs the ``tokenizers``
        package (``pip install "skattn[pretrained]"``).
    modules : list of str, default=None
        Top-level standard library modules or packages to read (e.g.
        ``["json", "textwrap"]``); ``None``: all of them (about 800 files and
        9000 docstrings, 450000 MiniLM tokens on Python 3.11; a few seconds).

    Returns
    -------
    tokens : list of ndarray of int64
        The token ids of each non-empty docstring.

    Raises
    ------
    ValueError
        If a module is not a top-level module of the standard library.
    ImportError
        If ``tokenizers`` is not installed.

    Examples
    --------
    >>> from skattn.datasets import stdlib_docstring_tokens
    >>> tokens = stdlib_docstring_tokens(modules=["textwrap"])
    >>> len(tokens) > 5, tokens[0].dtype, bool(tokens[0].min() >= 0)
    (True, dtype('int64'), True)
    """
    root = _stdlib_root()
    available = _stdlib_modules(root)
    if modules is None:
        modules = available
    else:
        if isinstance(modules, str):
            modules = [modules]
        unknown = sorted(set(modules) - set(available))
        if unknown:
            raise ValueError(
                f"modules has names that are not top-level modules of the standard "
                f"library in {root}: {unknown}."
            )
    docs = _stdlib_docstrings(tuple(sorted(set(modules))))
    tok = _load_tokenizer(tokenizer)
    encodings = tok.encode_batch(list(docs), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encodings if len(e.ids) > 0]


def _text_windows(tokens, n_tokens, special=None):
    """Consecutive non-overlapping windows of each token array (no padding).

    With ``special=(cls_id, sep_id)`` each window is ``[cls, t_1, ...,
    t_{n_tokens-2}, sep]``.  An array's last incomplete window is dropped, so
    windows never cross docstrings.  Returns int64 (n_windows, n_tokens).
    """
    inner = n_tokens - (2 if special else 0)
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    counts = lengths // inner
    if counts.sum() == 0:
        raise ValueError(
            f"No text has {inner} tokens for a window of n_tokens={n_tokens} "
            f"(longest: {int(lengths.max(initial=0))} tokens)."
        )
    flat = np.concatenate(tokens)
    text_start = np.repeat(np.cumsum(lengths) - lengths, counts)
    rank = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    windows = flat[(text_start + inner * rank)[:, None] + np.arange(inner)]
    if special:
        cls_id, sep_id = special
        column = np.ones((len(windows), 1), dtype=np.int64)
        windows = np.hstack([cls_id * column, windows, sep_id * column])
    return windows


class PretrainedHiddenStates(TokenDistribution):
    """Windows of real text as the hidden states entering layer L of an encoder.

    The sequences are windows of ``n_tokens`` tokens of real text (by default
    the standard library's docstrings, :func:`stdlib_docstring_tokens`,
    tokenized once by the encoder's tokenizer): each window is ``[CLS]``, the
    next ``n_tokens - 2`` tokens of one docstring, ``[SEP]``, i.e. what the
    tokenizer makes of a short text; windows are consecutive, do not overlap and
    never cross docstrings (the last incomplete one of each is dropped).  Each
    window is run through the encoder alone, as an ``n_tokens``-token input
    (positions ``0, ..., n_tokens - 1``, token type 0, no padding, no mask), and
    a sample is the hidden states entering layer ``layer``: what that layer's
    attention sees.  Windows are drawn uniformly with replacement;
    ``sample``/``iter_batches`` behave like the other distributions
    (deterministic under an int ``random_state``, batch-size invariant).  The
    hidden states of the windows drawn are computed in batches, vectorised, and
    kept (``cache=True``: ``8 * n_tokens * n_features`` bytes per distinct
    window, 49 kB at 16 x 384).

    Parameters
    ----------
    encoder : BertEncoder, str, path-like or None, default=None
        The encoder, or the ``.safetensors`` file of one
        (:meth:`BertEncoder.from_safetensors`); ``None``: all-MiniLM-L6-v2.
    n_tokens : int, default=16
        Tokens per window k (at most the encoder's ``max_positions``; at least 3
        with ``special_tokens``).
    layer : int, default=0
        The layer whose input is sampled, in ``0, ..., n_layers`` (0: the
        embedding output; ``n_layers``: the final output).
    sequences : array-like of int of shape (n_windows, n_tokens), default=None
        Given id windows instead of the standard library's text.
    modules : list of str, default=None
        Standard library modules of the text (see
        :func:`stdlib_docstring_tokens`); ``None``: all.
    special_tokens : bool, default=True
        Frame each text window with ``[CLS]`` and ``[SEP]``; ``False``: windows of
        ``n_tokens`` text tokens.
    dtype : {"float64", "float32"}, default="float64"
        Precision of the forward pass; samples are float64 either way.
    cache : bool, default=True
        Keep the hidden states of the windows drawn.

    Attributes
    ----------
    name : str
        ``"pretrained"``.
    sequences : ndarray of int64 of shape (n_windows, n_tokens)
        The id windows drawn from.

    See Also
    --------
    EmbeddedTokens : i.i.d. vocabulary tokens embedded (layer 0 only).
    load_bert_hidden_states : this distribution with layer L's attention.

    Examples
    --------
    >>> from skattn.datasets import PretrainedHiddenStates
    >>> dist = PretrainedHiddenStates(n_tokens=8, layer=2, modules=["textwrap"])
    >>> X = dist.sample(3, random_state=0)
    >>> X.shape, bool((X == dist.sample(3, random_state=0)).all())
    ((3, 3072), True)
    """

    name = "pretrained"
    # Windows run through the encoder together (when they are not cached).
    _GROUP_WINDOWS = 512

    def __init__(
        self,
        encoder=None,
        n_tokens=16,
        *,
        layer=0,
        sequences=None,
        modules=None,
        special_tokens=True,
        dtype="float64",
        cache=True,
    ):
        if not isinstance(encoder, BertEncoder):
            encoder = BertEncoder.from_safetensors(encoder)
        super().__init__(n_tokens, encoder.n_features)
        self.encoder = encoder
        k = self.n_tokens
        if k > encoder.max_positions:
            raise ValueError(
                f"n_tokens={k} exceeds the model's position table "
                f"(max_position_embeddings={encoder.max_positions}); windows must "
                f"have at most {encoder.max_positions} tokens."
            )
        self.layer = encoder._check_layer(layer)
        self.dtype = _check_dtype(dtype)
        self.cache = bool(cache)
        if sequences is None:
            if encoder.tokenizer is None:
                raise ValueError(
                    "The encoder has no tokenizer (no tokenizer.json next to its "
                    "checkpoint); pass sequences of token ids."
                )
            special = None
            if special_tokens:
                if k < 3:
                    raise ValueError(
                        f"n_tokens={k} leaves no room for text between [CLS] and "
                        f"[SEP]; use n_tokens >= 3 or special_tokens=False."
                    )
                tok = _load_tokenizer(encoder.tokenizer)
                special = (tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"))
                if None in special:
                    raise ValueError(
                        f"The tokenizer {encoder.tokenizer} has no [CLS] or [SEP] "
                        f"token; use special_tokens=False."
                    )
            tokens = stdlib_docstring_tokens(encoder.tokenizer, modules=modules)
            sequences = _text_windows(tokens, k, special)
        sequences = np.asarray(sequences)
        if sequences.ndim != 2 or sequences.shape[1] != k:
            raise ValueError(
                f"sequences must have shape (n_windows, n_tokens={k}), got "
                f"{sequences.shape}."
            )
        self.sequences = encoder._check_ids(sequences).copy()
        self._states = {}

    def hidden_states(self, index):
        """The flattened hidden states of windows ``sequences[index]``.

        Parameters
        ----------
        index : array-like of int of shape (n,)
            Rows of :attr:`sequences`.

        Returns
        -------
        X : ndarray of shape (n, n_tokens * n_features)
        """
        index = np.asarray(index, dtype=np.int64)
        unique, inverse = np.unique(index, return_inverse=True)
        known = self._states if self.cache else {}
        todo = [i for i in unique.tolist() if i not in known]
        if todo:
            H = self.encoder.hidden_states(
                self.sequences[todo], self.layer, dtype=self.dtype
            )
            known.update(zip(todo, H.reshape(len(todo), -1), strict=True))
        rows = np.stack([known[i] for i in unique.tolist()])
        return rows[inverse.reshape(-1)]

    def _draw(self, rng, n_rows):
        return rng.integers(0, len(self.sequences), size=n_rows)

    def _generate(self, rng, n_rows):
        return self.hidden_states(self._draw(rng, n_rows)), None

    def _chunks(self, n_samples, random_state):
        # The base stream (one generator per chunk), but the windows of several
        # chunks go through the encoder together: larger matrix products.
        group = max(1, self._GROUP_WINDOWS // self.chunk_rows)
        pending = []

        def flush():
            picks = np.concatenate([pick for pick in pending])
            X = self.hidden_states(picks)
            start = 0
            for pick in pending:
                yield X[start : start + len(pick)], None
                start += len(pick)

        for rng, stop in self._chunk_generators(n_samples, random_state):
            pending.append(self._draw(rng, self.chunk_rows)[:stop])
            if len(pending) == group:
                yield from flush()
                pending = []
        if pending:
            yield from flush()

    def _params(self):
        return {
            **super()._params(),
            "layer": self.layer,
            "n_windows": len(self.sequences),
            "dtype": self.dtype,
        }

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


def load_bert_hidden_states(
    path=None,
    *,
    layer=0,
    n_tokens=16,
    n_heads=None,
    modules=None,
    dtype="float64",
):
    """A BERT-style layer's attention and its input on real text.

    The pair a learner needs to recover layer ``layer`` of a pretrained model
    from what it really sees: the attention sub-layer of
    :func:`load_bert_attention` and the :class:`PretrainedHiddenStates` of
    windows of standard library docstrings entering that layer.

    Parameters
    ----------
    path : str or path-like, default=None
        The ``.safetensors`` file; ``None``: all-MiniLM-L6-v2.
    layer : int, default=0
        Encoder layer, in ``0, ..., n_layers - 1``.
    n_tokens : int, default=16
        Tokens per window.
    n_heads : int, default=None
        Attention heads; ``None`` reads the ``config.json``.
    modules : list of str, default=None
        Standard library modules of the text; ``None``: all.
    dtype : {"float64", "float32"}, default="float64"
        Precision of the forward pass computing the hidden states.

    Returns
    -------
    attention_layer : AttentionLayer
        Layer ``layer``'s attention sub-layer (with ``key_bias`` and
        ``intercept``).
    distribution : PretrainedHiddenStates
        The hidden states entering layer ``layer``.

    Examples
    --------
    >>> from skattn.datasets import load_bert_hidden_states
    >>> layer, dist = load_bert_hidden_states(layer=3, n_tokens=8,
    ...                                       modules=["textwrap"])
    >>> X = dist.sample(2, random_state=0)
    >>> layer.transform(X).shape
    (2, 3072)
    """
    path = minilm_checkpoint_path() if path is None else Path(path)
    encoder = BertEncoder.from_safetensors(path, n_heads=n_heads)
    layer = encoder._check_layer(layer, attention=True)
    attention_layer, _ = load_bert_attention(
        path, layer=layer, n_heads=encoder.n_heads, n_tokens=n_tokens
    )
    distribution = PretrainedHiddenStates(
        encoder, n_tokens, layer=layer, modules=modules, dtype=dtype
    )
    return attention_layer, distribution
