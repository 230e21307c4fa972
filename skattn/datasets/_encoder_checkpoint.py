"""Learned encoder attention layers written back into BERT checkpoints.

:func:`bert_attention_tensors` turns an :class:`~skattn.AttentionLayer` (a
teacher read by :func:`~skattn.datasets.load_bert_attention`, or a learned layer,
e.g. ``as_layer(MultiHeadAttentionRegressor(fit_intercept=True,
head_rank=head_dim).fit(X, y))``) into the eight tensors of a BERT layer's
attention sub-layer, in their checkpoint names and in torch's ``Linear``
convention (weight ``(out, in)``); :func:`write_encoder_checkpoint` writes a
whole checkpoint folder with some layers' attention so replaced, which
transformers' ``BertModel`` and skattn's :class:`~skattn.datasets.BertEncoder`
load as they load the original.

The layer computes ``F(X) = sum_i softmax(X Theta_i X^T + 1 (X u_i)^T) X W_i +
1 c^T`` (:mod:`skattn.layer._convert`).  BERT's head ``i`` of width ``h``
computes ``softmax(s (X Wq_i^T + bq_i)(X Wk_i^T + bk_i)^T) (X Wv_i^T + bv_i)
Wo_i^T`` (plus ``bo``) with ``s = 1 / sqrt(h)``.  Its logit between query token
``l`` and key token ``a`` is ``s [x_l; 1]^T [Wq_i^T; bq_i^T] Wk_i x_a`` plus terms
of ``l`` alone (``bk_i``'s), which cancel in the softmax; so the ``(d + 1) x d``
matrix ``M_i = [Theta_i; u_i^T]`` (the rows of the inputs extended by a constant
1, the columns of the key token alone) must equal ``s [Wq_i^T; bq_i^T] Wk_i``:
the truncated SVD ``M_i = U S V^T`` of rank ``h`` gives ``[Wq_i^T; bq_i^T] = U
S^(1/2) / sqrt(s)`` and ``Wk_i^T = V S^(1/2) / sqrt(s)`` (balanced, so that
float32 storage rounds both alike), and ``bk_i = 0``.  Likewise ``W_i = U S V^T
= Wv_i^T Wo_i^T`` with ``Wv_i^T = U S^(1/2)``, ``Wo_i = V S^(1/2)`` and ``bv_i
= 0``; since every attention row sums to 1, ``c`` is the output dense bias.
A head needs ``rank M_i <= h`` and ``rank W_i <= h``, which a learner told
``head_rank=h`` gives (up to rounding); a head of higher rank cannot be held in
BERT's shapes and is a ``ValueError`` naming it.
"""

import numbers
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..layer import as_layer
from ..utils._optional import require
from ._pretrained import (
    _check_architecture,
    _find_prefix,
    _layers_found,
    _n_heads_from_config,
    _read_config,
)

__all__ = ["bert_attention_tensors", "write_encoder_checkpoint"]

WEIGHTS = "model.safetensors"
# The attention sub-layer's modules, after "encoder.layer.L.".
_MODULES = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "output": "attention.output.dense",
}
# Singular values of a head above this share of the largest of the layer count
# toward its rank (as AttentionLayer's head_rank check).
RANK_RTOL = 1e-8
# Extra directions of the randomized range finder of the heads' SVDs.
_OVERSAMPLE = 8
# Files of weights in other formats (or shards): not copied, since they would
# still hold the source's attention.
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".ot",
    ".gguf",
    ".index.json",
)
# Folders of exported models (sentence-transformers repositories): the same.
_WEIGHT_FOLDERS = ("onnx", "openvino")


def _head_svd(matrices, head_dim, rtol):
    """The leading singular triplets ``(U, s, Vt)`` of each matrix of a stack:
    all of them, or (faster, for large matrices) the ``head_dim + 8`` of a
    randomized range finder (a fixed seed), whose discarded part is then
    checked to be below ``rtol`` of the largest singular value (else all)."""
    m, a, b = matrices.shape
    k = head_dim + _OVERSAMPLE
    if k < min(a, b):
        sketch = matrices @ np.random.default_rng(0).standard_normal((b, k))
        Q, _ = np.linalg.qr(sketch)  # (m, a, k): the range, of a rank <= k stack
        B = np.swapaxes(Q, 1, 2) @ matrices  # (m, k, b)
        U, s, Vt = np.linalg.svd(B, full_matrices=False)
        residual = np.linalg.norm(matrices - Q @ B, axis=(1, 2))  # Frobenius
        if np.all(residual <= rtol * s.max(initial=0.0)):
            return Q @ U, s, Vt
    return np.linalg.svd(matrices, full_matrices=False)


def _head_factors(matrices, head_dim, rtol, what):
    """Balanced rank-``head_dim`` factors ``(left, right)`` of each matrix of a
    stack, ``matrices[i] ~= left[i] @ right[i].T``; a ValueError names the heads
    of higher rank (singular values above ``rtol`` times the stack's
    largest)."""
    U, s, Vt = _head_svd(matrices, head_dim, rtol)
    top = max(float(s.max(initial=0.0)), np.finfo(float).tiny)
    ranks = np.sum(s > rtol * top, axis=1)
    over = np.flatnonzero(ranks > head_dim)
    if over.size:
        heads = ", ".join(f"head {i} has rank {int(ranks[i])}" for i in over)
        raise ValueError(
            f"the layer's {what} cannot be written in BERT's shapes: {heads} "
            f"(singular values above {rtol:g} times the layer's largest), above "
            f"head_dim={head_dim}; its next singular value is "
            f"{float(s[over[0], head_dim]) / top:.3g} of the largest, which would "
            f"be truncated. Learn the layer with head_rank={head_dim} (e.g. "
            f"MultiHeadAttentionRegressor(fit_intercept=True, head_rank="
            f"{head_dim}))."
        )
    r = min(head_dim, s.shape[1])
    root = np.sqrt(s[:, :r])
    left = np.zeros((*matrices.shape[:2], head_dim))
    right = np.zeros((matrices.shape[0], matrices.shape[2], head_dim))
    left[:, :, :r] = U[:, :, :r] * root[:, None, :]
    right[:, :, :r] = np.swapaxes(Vt[:, :r], 1, 2) * root[:, None, :]
    return left, right


def _check_index(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
    return int(value)


def bert_attention_tensors(
    layer, *, layer_index, head_dim=None, prefix="encoder.layer.", rtol=RANK_RTOL
):
    """A layer's BERT attention tensors: query, key, value and output dense.

    The inverse of :func:`~skattn.datasets.load_bert_attention` for one layer:
    ``AttentionLayer.from_projections`` of the returned weights and biases (with
    ``n_heads = layer.n_heads``) computes the same function as ``layer``, up to
    rounding, though the tensors may differ from the checkpoint's (the factors of
    each head are fixed only up to an invertible ``head_dim x head_dim`` map, and
    the key and value biases are written as zeros: the key bias cancels in the
    softmax, and the value bias is folded into the output dense bias).  Each
    head's ``[Theta_i; u_i^T]`` and ``W_i`` are factored by a truncated SVD (see
    the module docstring), the logit scale ``1 / sqrt(head_dim)`` folded in.

    Parameters
    ----------
    layer : AttentionLayer or fitted estimator
        A position-free, unmasked layer (anything
        :func:`skattn.layer.as_layer` takes) of ``n_heads`` heads on ``d``
        features with ``d`` outputs, ``d = n_heads * head_dim``; its biases
        (``key_bias``, ``intercept``) may be ``None`` (zero).
    layer_index : int
        The encoder layer ``L`` of the tensor names.
    head_dim : int, default=None
        BERT's head width ``h``; ``None`` is ``d / n_heads``, the only value
        BERT's shapes allow (given to check it).
    prefix : str, default="encoder.layer."
        What comes before ``L`` in the names (``"bert.encoder.layer."`` for a
        checkpoint of ``BertFor...`` models).
    rtol : float, default=1e-8
        A head's rank counts its singular values above ``rtol`` times the
        largest of the layer's heads; a rank above ``head_dim`` is an error.
        The discarded singular values (at most ``rtol`` of the largest) are the
        only error of the conversion besides rounding.

    Returns
    -------
    tensors : dict of str to ndarray
        ``{prefix}{L}.attention.self.{query,key,value}.{weight,bias}`` and
        ``{prefix}{L}.attention.output.dense.{weight,bias}``, float64; weights
        of shape ``(d, d)`` (``(out, in)``: head ``i`` is rows ``i h:(i + 1) h``
        of the query, key and value weights and the same columns of the output
        dense weight), biases ``(d,)``.

    Raises
    ------
    ValueError
        If the layer is causal or rotary, its output width differs from its
        input width, ``head_dim * n_heads`` differs from the width, or a head
        has ``rank [Theta_i; u_i^T] > head_dim`` or ``rank W_i > head_dim``
        (naming the heads and their ranks).

    Examples
    --------
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, o = rng.normal(size=(4, 6, 6))
    >>> layer = AttentionLayer.from_projections(
    ...     q, k, v, o, 2, biases={"query": np.ones(6), "output": np.ones(6)})
    >>> tensors = bert_attention_tensors(layer, layer_index=3)
    >>> tensors["encoder.layer.3.attention.self.query.weight"].shape
    (6, 6)
    >>> again = AttentionLayer.from_projections(
    ...     *(tensors[f"encoder.layer.3.attention.{n}.weight"]
    ...       for n in ("self.query", "self.key", "self.value", "output.dense")),
    ...     2, biases={r: tensors[f"encoder.layer.3.attention.{n}.bias"]
    ...                for r, n in (("query", "self.query"), ("key", "self.key"),
    ...                             ("value", "self.value"),
    ...                             ("output", "output.dense"))})
    >>> X = rng.normal(size=(3, 4, 6))
    >>> bool(np.allclose(again.transform(X), layer.transform(X), rtol=1e-12))
    True
    """
    layer = as_layer(layer)
    layer_index = _check_index(layer_index, "layer_index")
    attention, projection, key_bias, intercept = layer._parameters()
    if layer._decoder(attention):
        raise ValueError(
            "the layer is causal or rotary (a decoder's); a BERT encoder layer "
            "attends to every token with no positions in its attention."
        )
    m, d, d_out = projection.shape
    if d_out != d:
        raise ValueError(
            f"the layer has {d_out} outputs per token but {d} inputs; BERT's "
            f"attention output dense maps back to the hidden size ({d} x {d})."
        )
    if head_dim is None:
        if d % m:
            raise ValueError(
                f"n_heads={m} does not divide the width {d}: BERT's heads have "
                f"width hidden_size / num_attention_heads."
            )
        head_dim = d // m
    elif (
        isinstance(head_dim, bool)
        or not isinstance(head_dim, numbers.Integral)
        or head_dim * m != d
    ):
        raise ValueError(
            f"head_dim must be the width {d} over the {m} heads of the layer "
            f"(BERT's all_head_size is the hidden size), got {head_dim!r}."
        )
    if not (isinstance(rtol, numbers.Real) and 0 <= rtol <= 1):
        raise ValueError(f"rtol must be a number in [0, 1], got {rtol!r}.")
    head_dim = int(head_dim)
    key_bias = np.zeros((m, d)) if key_bias is None else key_bias
    intercept = np.zeros(d) if intercept is None else intercept
    scale = 1.0 / np.sqrt(head_dim)
    logits = np.concatenate([attention, key_bias[:, None, :]], axis=1)  # (m, d+1, d)
    query, key = _head_factors(logits, head_dim, rtol, "attention (with key_bias)")
    value, output = _head_factors(projection, head_dim, rtol, "projection")
    query, key = query / np.sqrt(scale), key / np.sqrt(scale)
    base = f"{prefix}{layer_index}."
    weights = {
        "query": np.swapaxes(query[:, :d], 1, 2).reshape(d, d),
        "key": np.swapaxes(key, 1, 2).reshape(d, d),
        "value": np.swapaxes(value, 1, 2).reshape(d, d),
        "output": np.swapaxes(output, 0, 1).reshape(d, d),
    }
    biases = {
        "query": query[:, d].reshape(d),
        "key": np.zeros(d),
        "value": np.zeros(d),
        "output": np.array(intercept, dtype=np.float64),
    }
    tensors = {}
    for role, module in _MODULES.items():
        tensors[f"{base}{module}.weight"] = weights[role]
        tensors[f"{base}{module}.bias"] = biases[role]
    return tensors


def _source_weights(source):
    """The source's ``model.safetensors`` (a folder or the file itself)."""
    source = Path(source)
    path = source if source.suffix == ".safetensors" else source / WEIGHTS
    if not path.is_file():
        sharded = (path.parent / (WEIGHTS + ".index.json")).is_file()
        raise (ValueError if sharded else FileNotFoundError)(
            f"{str(path.parent)!r} "
            + (
                "holds a sharded checkpoint (model.safetensors.index.json); only "
                "one model.safetensors is supported."
                if sharded
                else "has no model.safetensors (a BERT-style checkpoint folder)."
            )
        )
    return path


def _copy_small_files(source, folder):
    """Copy the source folder's files but its weights: config, tokenizer,
    sentence-transformers modules and pooling; hidden files are left out."""
    copied = []
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if (
            not path.is_file()
            or any(part.startswith(".") for part in relative.parts)
            or relative.parts[0] in _WEIGHT_FOLDERS
            or path.name.endswith(_WEIGHT_SUFFIXES)
        ):
            continue
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(relative.as_posix())
    return copied


def write_encoder_checkpoint(folder, source_folder, layers, *, rtol=RANK_RTOL):
    """Write a BERT checkpoint folder with some layers' attention replaced.

    ``folder`` gets the source's ``model.safetensors`` with, for each layer
    ``L`` of ``layers``, the query, key, value and attention output dense
    tensors of layer ``L`` replaced by :func:`bert_attention_tensors` of the
    given layer (in the source's names, ``bert.`` prefix or none, and dtypes;
    every other tensor, its metadata and the file's ``format`` as they were),
    and a copy of the source's other files (``config.json``,
    ``tokenizer.json``, ``tokenizer_config.json``, ``vocab.txt``,
    ``modules.json``, the sentence-transformers files and folders such as
    ``1_Pooling``); weights in other formats (``pytorch_model.bin``,
    ``onnx/``, ...) are not copied, since they would still hold the source's
    attention.  transformers' ``BertModel.from_pretrained(folder)`` and
    ``BertEncoder.from_safetensors(folder / "model.safetensors")`` then compute
    the given layers' functions in place of the attention sub-layers (self-
    attention and output dense, before the residual and LayerNorm), exactly up
    to the rounding of the source's dtype.

    Parameters
    ----------
    folder : str or path-like
        The folder to write (created if missing; files of the same names are
        replaced).  Not the source folder.
    source_folder : str or path-like
        A BERT-style checkpoint folder holding one ``model.safetensors`` and its
        ``config.json`` (with ``num_attention_heads``), or that file itself.
    layers : dict of int to AttentionLayer or fitted estimator
        Layer index ``L`` to the layer replacing that layer's attention; each
        of ``num_attention_heads`` heads on the hidden size.
    rtol : float, default=1e-8
        :func:`bert_attention_tensors`' ``rtol``: a head of higher rank than
        ``head_dim`` beyond it is refused; ``1.0`` cuts every head to its
        ``head_dim`` largest directions without a word.

    Returns
    -------
    path : pathlib.Path
        The ``model.safetensors`` written.

    Raises
    ------
    ValueError
        If the source is not a BERT-style checkpoint (or is sharded), a layer
        index is not one of its layers, a layer's heads or width differ from the
        checkpoint's, or a layer's heads have ranks above the head width
        (:func:`bert_attention_tensors`).
    FileNotFoundError
        If the source has no ``model.safetensors``.

    Examples
    --------
    >>> import tempfile
    >>> import numpy as np
    >>> from skattn.datasets import load_bert_attention, minilm_checkpoint_path
    >>> teacher, tokens = load_bert_attention(layer=2)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = write_encoder_checkpoint(
    ...         tmp, minilm_checkpoint_path().parent, {2: teacher})
    ...     again, _ = load_bert_attention(path, layer=2)
    ...     names = sorted(p.name for p in path.parent.iterdir())
    >>> "tokenizer.json" in names and "1_Pooling" in names
    True
    >>> X = tokens.sample(2, random_state=0)
    >>> error = np.abs(again.transform(X) - teacher.transform(X)).max()
    >>> bool(error < 1e-5 * np.abs(teacher.transform(X)).max())
    True
    """
    safetensors = require(
        "safetensors", extra="pretrained", feature="Writing .safetensors checkpoints"
    )
    st_numpy = require(
        "safetensors.numpy",
        extra="pretrained",
        feature="Writing .safetensors checkpoints",
        package="safetensors",
    )
    source = _source_weights(source_folder)
    folder = Path(folder)
    if folder.resolve().is_relative_to(source.parent.resolve()):
        raise ValueError(
            f"folder {str(folder)!r} is (inside) the source checkpoint's folder "
            f"{str(source.parent)!r}; write the new checkpoint to another folder."
        )
    if not isinstance(layers, dict) or not layers:
        raise ValueError(
            f"layers must be a non-empty dict of layer index to AttentionLayer, "
            f"got {layers!r:.80}."
        )
    layers = {
        _check_index(index, "a layer index"): obj for index, obj in layers.items()
    }
    config = _read_config(source)
    n_heads = _n_heads_from_config(source, config)
    with safetensors.safe_open(str(source), framework="np") as file:
        metadata = dict(file.metadata() or {})
    tensors = st_numpy.load_file(str(source))
    _check_architecture(tensors, config, source)
    found = _layers_found(tensors)
    replaced = []
    for index, learned in sorted(layers.items()):
        if index not in found:
            raise ValueError(
                f"{source} has no encoder layer {index}; its layers are {found}."
            )
        learned = as_layer(learned, name=f"layers[{index}]")
        prefix = _find_prefix(tensors, index, source)
        d = tensors[f"{prefix}encoder.layer.{index}.attention.self.query.weight"]
        d = d.shape[1]
        if (learned.n_heads, learned.n_features) != (n_heads, d):
            raise ValueError(
                f"layers[{index}] has {learned.n_heads} heads on {learned.n_features} "
                f"features; {source} has {n_heads} heads on {d} features."
            )
        try:
            new = bert_attention_tensors(
                learned,
                layer_index=index,
                head_dim=d // n_heads,
                prefix=prefix + "encoder.layer.",
                rtol=rtol,
            )
        except ValueError as exc:
            raise ValueError(f"layers[{index}]: {exc}") from exc
        for name, value in new.items():
            old = tensors.get(name)
            if old is None or old.shape != value.shape:
                got = "is missing" if old is None else f"has shape {old.shape}"
                raise ValueError(
                    f"{source}: {name} {got}, expected shape {value.shape}."
                )
            tensors[name] = np.ascontiguousarray(value, dtype=old.dtype)  # C order
        replaced.append(index)
    folder.mkdir(parents=True, exist_ok=True)
    _copy_small_files(source.parent, folder)
    metadata.setdefault("format", "pt")
    metadata["skattn"] = (
        f"attention of encoder layers {replaced} replaced by learned layers"
    )
    path = folder / WEIGHTS
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{WEIGHTS}.", suffix=".tmp")
    os.close(fd)
    try:
        st_numpy.save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
