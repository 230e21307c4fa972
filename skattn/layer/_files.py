"""Layer files in the ``.safetensors`` format, written and read by skattn itself.

:func:`write_safetensors` writes float64 tensors and string metadata with a
sorted header, so that identical layers give identical bytes (the
``safetensors`` library orders its metadata by a hash seeded anew at each run);
:func:`read_safetensors` reads such a file, or any ``.safetensors`` file of
float tensors, without the library, checking every byte it trusts.  ``skattn
layer`` writes its ``layer.safetensors`` with the first; ``skattn.cli.save_layer``
and ``skattn.cli.load_layer`` use both.
"""

import json
import math
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["SAFETENSORS_FORMAT", "write_safetensors", "read_safetensors"]

# What a .safetensors layer file's metadata says it is.
SAFETENSORS_FORMAT = "skattn attention layer: AttentionLayer(**tensors, n_tokens=...)"


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

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
