"""Layer files in the ``.safetensors`` format, written and read by skattn itself.

:func:`write_safetensors` writes float64 tensors and string metadata with a
sorted header, so that identical layers give identical bytes (the
``safetensors`` library orders its metadata by a hash seeded anew at each run);
:func:`read_safetensors` reads such a file, or any ``.safetensors`` file of
float tensors, without the library, checking every byte it trusts.  ``skattn
layer`` writes its ``layer.safetensors`` with the first; :func:`save_layer`
and :func:`load_layer` (``skattn fit``'s layer files, ``.npz`` or
``.safetensors``) use both.
"""

import json
import math
import os
import struct
import tempfile
from numbers import Integral
from pathlib import Path

import numpy as np

__all__ = [
    "SAFETENSORS_FORMAT",
    "load_layer",
    "read_safetensors",
    "save_layer",
    "write_safetensors",
]

# What a .safetensors layer file's metadata says it is.
SAFETENSORS_FORMAT = "skattn attention layer: AttentionLayer(**tensors, n_tokens=...)"


def _atomic_write(path, write):
    """``write(file)`` into a temporary file of ``path``'s folder, renamed over
    ``path``: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_safetensors(path, tensors, metadata=None):
    """Write float64 tensors to a ``.safetensors`` file, the same bytes for the
    same content.

    The header is JSON with sorted keys and no spaces, the tensors laid out in
    name order, the metadata strings sorted; the library ``safetensors`` orders
    its metadata by a hash seeded anew at each run, so that checksums of two
    identical layers differ.  Any ``safetensors`` reader reads the file.  It is
    written atomically (a temporary file renamed over it).

    Parameters
    ----------
    path : str or path-like
        The file to write (its folder must exist).
    tensors : dict of str to array-like
        The tensors, stored as little-endian float64 (``"F64"``).
    metadata : dict of str to str, default=None
        The header's ``__metadata__``.

    Returns
    -------
    path : pathlib.Path
        The file written.

    Examples
    --------
    >>> import hashlib, os, tempfile
    >>> import numpy as np
    >>> from skattn.layer._files import write_safetensors
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     files = [write_safetensors(os.path.join(tmp, f"{i}.safetensors"),
    ...              {"b": np.ones(2), "a": np.zeros((1, 2))}, {"y": "1", "x": "2"})
    ...              for i in range(2)]
    ...     digests = {hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    >>> len(digests)
    1
    """
    path = Path(path)
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f8").tobytes()
        header[name] = {
            "data_offsets": [offset, offset + len(data)],
            "dtype": "F64",
            "shape": list(np.shape(tensors[name])),
        }
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as the format asks

    def write(file):
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for data in blobs:
            file.write(data)

    _atomic_write(path, write)
    return path


# safetensors dtypes that a layer file may hold (read as float64).
_SAFETENSORS_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": None,  # no numpy dtype: refused by name
}
# A header larger than this is not a layer's (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def read_safetensors(path):
    """The tensors (float64 numpy arrays) and metadata of a ``.safetensors`` file,
    read without the ``safetensors`` library; ``ValueError`` on any malformed
    byte."""
    raw = path.read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{len(raw)} bytes, shorter than the 8-byte header length")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > min(len(raw) - 8, _MAX_HEADER_BYTES):
        raise ValueError(f"a header length of {size} bytes in a file of {len(raw)}")
    header = json.loads(raw[8 : 8 + size].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError("__metadata__ is not a JSON object")
    body = memoryview(raw)[8 + size :]
    tensors = {}
    for name, entry in header.items():
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(
                f"tensor {name!r} has dtype {entry.get('dtype')!r}; a layer's are "
                f"F64, F32 or F16"
            )
        shape = [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
        count = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(body):
            raise ValueError(f"tensor {name!r} lies outside the file")
        if end - begin != count * np.dtype(dtype).itemsize:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for {shape}")
        tensors[name] = np.frombuffer(body[begin:end], dtype).astype(np.float64)
        tensors[name] = tensors[name].reshape(shape)
    return tensors, metadata


# Arrays of a layer file (see save_layer): the parameters of AttentionLayer.
LAYER_FILE_ARRAYS = (
    "attention",
    "projection",
    "key_bias",
    "intercept",
    "n_tokens",
    "head_rank",
)

# The layer files save_layer writes and load_layer reads.
LAYER_FILE_SUFFIXES = (".npz", ".safetensors")


def save_layer(layer, path):
    """Save a layer, or a fitted estimator's layer, to an ``.npz`` or a
    ``.safetensors`` file.

    An ``.npz`` file is a NumPy archive (no pickles) holding the arguments of
    :class:`~skattn.AttentionLayer`: ``attention`` (n_heads, d, d),
    ``projection`` (n_heads, d, d_out), ``key_bias`` (n_heads, d; zeros without
    biases), ``intercept`` (d_out,; zeros without), and ``n_tokens`` and
    ``head_rank`` (0-d integer arrays) when known.  A ``.safetensors`` file,
    the format ``skattn layer`` writes, holds the same four tensors (float64)
    and ``n_tokens`` and ``head_rank`` in its metadata, the same bytes for the
    same layer (:func:`write_safetensors`).  :func:`load_layer` reads both.  The
    file is written under exactly the given name, atomically (a temporary file
    renamed over it).  ``skattn fit`` writes its layer with this function.

    Parameters
    ----------
    layer : AttentionLayer or fitted estimator
        What to save (see :func:`skattn.layer.as_layer`).
    path : str or path-like
        The file to write; its name must end in ``.npz`` or ``.safetensors``.
        Overwritten if it exists.

    Returns
    -------
    path : pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If ``path`` ends otherwise, or its folder does not exist.

    See Also
    --------
    load_layer : read the file back.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> from skattn import AttentionLayer
    >>> from skattn.layer import load_layer, save_layer
    >>> layer = AttentionLayer(np.zeros((1, 2, 2)), np.ones((1, 2, 3)), n_tokens=4)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = save_layer(layer, os.path.join(tmp, "layer.npz"))
    ...     with np.load(path) as data:
    ...         print(sorted(data.files))
    ...     print(load_layer(path).n_tokens)
    ...     path = save_layer(layer, os.path.join(tmp, "layer.safetensors"))
    ...     print(load_layer(path).n_tokens)
    ['attention', 'intercept', 'key_bias', 'n_tokens', 'projection']
    4
    4
    """
    from ._coerce import as_layer

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in LAYER_FILE_SUFFIXES:
        raise ValueError(
            f"path={str(path)!r} must end in .npz (a NumPy archive) or .safetensors; "
            f"the layer is saved under exactly the given name."
        )
    if not path.parent.is_dir():
        raise ValueError(
            f"path={str(path)!r}: the folder {str(path.parent)!r} does not exist; "
            f"create it first."
        )
    from ..utils._array_api import to_numpy

    learned = as_layer(layer)
    attention, projection, key_bias, intercept, n_tokens = learned._arrays()
    arrays = {  # host copies of a layer fitted on a device
        "attention": to_numpy(attention),
        "projection": to_numpy(projection),
        "key_bias": to_numpy(key_bias),
        "intercept": to_numpy(intercept),
    }
    head_rank = learned.head_rank
    if head_rank is None:
        head_rank = getattr(layer, "head_rank", None)
    integers = {
        name: int(value)
        for name, value in (("n_tokens", n_tokens), ("head_rank", head_rank))
        if isinstance(value, Integral) and not isinstance(value, bool)
    }
    if suffix == ".safetensors":
        metadata = {"format": SAFETENSORS_FORMAT, **integers}
        return write_safetensors(path, arrays, metadata)
    arrays.update({name: np.asarray(value) for name, value in integers.items()})
    # a file object: np.savez appends no .npz to the name
    _atomic_write(path, lambda file: np.savez(file, **arrays))
    return path


def _file_int(value, name, path):
    """A layer file's ``n_tokens`` or ``head_rank`` (a 0-d integer array of an
    ``.npz``, a metadata string of a ``.safetensors``) as an int; None: absent."""
    if value is None:
        return None
    if isinstance(value, str):
        number = int(value) if value.strip().isdigit() else 0
    elif value.shape == () and value.dtype.kind in "iu":
        number = int(value)
    else:
        number = 0
    if number < 1:
        raise ValueError(
            f"{str(path)!r}: {name} must be a positive integer, got {value!r}."
        )
    return number


def _read_layer_file(path, expected):
    """``(arrays, n_tokens, head_rank)`` of a layer file, by its suffix; the
    errors name the file and ``expected``."""
    if path.suffix.lower() == ".safetensors":
        try:
            tensors, metadata = read_safetensors(path)
        except FileNotFoundError:
            raise
        except Exception as exc:  # untrusted bytes: any reader error is bad input
            raise ValueError(
                f"{str(path)!r} cannot be read as a .safetensors layer file "
                f"({type(exc).__name__}: {exc}); {expected}."
            ) from exc
        files = {"arrays": sorted(tensors), "metadata": metadata}
        get = metadata.get
    else:
        try:
            data = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise
        except Exception as exc:  # untrusted bytes: any reader error is bad input
            raise ValueError(
                f"{str(path)!r} cannot be read as a layer file ({type(exc).__name__}: "
                f"{exc}); {expected}."
            ) from exc
        if isinstance(data, np.ndarray):
            raise ValueError(f"{str(path)!r} holds a single array; {expected}.")
        with data:
            try:
                tensors = {n: data[n] for n in data.files if n in LAYER_FILE_ARRAYS}
            except Exception as exc:
                raise ValueError(
                    f"{str(path)!r} cannot be read as a layer file "
                    f"({type(exc).__name__}: {exc}); {expected}."
                ) from exc
            files = {"arrays": sorted(data.files)}
        get = tensors.get
    missing = [name for name in ("attention", "projection") if name not in tensors]
    if missing:
        raise ValueError(
            f"{str(path)!r} lacks the array(s) {missing} (it holds "
            f"{files['arrays']}); {expected}."
        )
    n_tokens = _file_int(get("n_tokens"), "n_tokens", path)
    head_rank = _file_int(get("head_rank"), "head_rank", path)
    return tensors, n_tokens, head_rank


def load_layer(path):
    """Read a layer saved by ``skattn fit``, ``skattn layer`` or :func:`save_layer`.

    Parameters
    ----------
    path : str or path-like
        An ``.npz`` file: arrays ``attention`` and ``projection``, and optionally
        ``key_bias``, ``intercept``, ``n_tokens`` and ``head_rank`` (loaded with
        ``allow_pickle=False``: nothing in the file can run code); or a
        ``.safetensors`` file (``skattn layer``'s ``layer.safetensors``): the
        same tensors, ``n_tokens`` and ``head_rank`` in its metadata (read by
        skattn itself: the ``safetensors`` extra is not needed).  See
        :func:`save_layer`.

    Returns
    -------
    layer : AttentionLayer
        The saved layer; its ``transform`` equals the fitted estimator's
        ``predict``.

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        If it is a folder, neither an ``.npz`` archive nor a ``.safetensors``
        file (random bytes, a pickle, a single ``.npy`` array), lacks
        ``attention`` or ``projection``, or holds arrays of shapes that do not
        make a layer; the message names the file.

    See Also
    --------
    save_layer : write such a file.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> from skattn import MultiHeadAttentionRegressor, make_attention_regression
    >>> from skattn.layer import load_layer, save_layer
    >>> X, y = make_attention_regression(500, 2, 3, 1, random_state=0)
    >>> est = MultiHeadAttentionRegressor(n_tokens=2).fit(X, y)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     layer = load_layer(save_layer(est, os.path.join(tmp, "layer.npz")))
    >>> bool(np.allclose(layer.transform(X), est.predict(X)))
    True
    """
    from ._attention_layer import AttentionLayer

    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{str(path)!r} is a folder, not a layer file (.npz or .safetensors)."
        )
    expected = (
        "expected the .npz archive that skattn fit or skattn.cli.save_layer writes "
        "(arrays attention, projection, key_bias, intercept, n_tokens), or the "
        ".safetensors file of skattn layer (tensors attention, projection, "
        "key_bias, intercept)"
    )
    arrays, n_tokens, head_rank = _read_layer_file(path, expected)
    layer = AttentionLayer(
        arrays["attention"],
        arrays["projection"],
        key_bias=arrays.get("key_bias"),
        intercept=arrays.get("intercept"),
        n_tokens=n_tokens,
        head_rank=head_rank,
    )
    try:
        layer._parameters()  # shapes and finiteness, now rather than at transform
    except ValueError as exc:
        raise ValueError(f"{str(path)!r} does not hold a valid layer: {exc}") from exc
    return layer
