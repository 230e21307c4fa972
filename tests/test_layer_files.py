"""skattn.layer._files: .safetensors layer files written and read by skattn."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from skattn.layer._files import read_safetensors, write_safetensors

WRITE = """
import sys
import numpy as np
from skattn.layer._files import write_safetensors
write_safetensors(sys.argv[1], {"b": np.arange(3.0), "a": np.eye(2)},
                  {"n_tokens": "4", "format": "f", "head_rank": "2", "layer": "3"})
"""


def test_identical_content_gives_identical_bytes_across_processes(tmp_path):
    # the header's order is fixed, not a hash seeded anew at each run
    digests = set()
    for name in ("one.safetensors", "two.safetensors"):
        subprocess.run(
            [sys.executable, "-c", WRITE, str(tmp_path / name)], check=True, timeout=120
        )
        digests.add(hashlib.sha256((tmp_path / name).read_bytes()).hexdigest())
    assert len(digests) == 1
    raw = (tmp_path / "one.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    assert size % 8 == 0  # the data 8-byte aligned
    header = json.loads(raw[8 : 8 + size])
    assert list(header) == sorted(header)
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])


def test_read_back_and_by_the_safetensors_library(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"attention": rng.normal(size=(2, 3, 3)), "intercept": rng.normal(size=3)}
    path = write_safetensors(tmp_path / "l.safetensors", tensors, {"n_tokens": "5"})
    read, metadata = read_safetensors(path)
    assert metadata == {"n_tokens": "5"}
    for name, value in tensors.items():
        np.testing.assert_array_equal(read[name], value)
    safetensors = pytest.importorskip("safetensors.numpy")
    for name, value in safetensors.load_file(str(path)).items():
        np.testing.assert_array_equal(value, tensors[name])


def test_float32_tensors_are_read_as_float64(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "f32.safetensors"
    safetensors.save_file({"x": np.arange(4, dtype=np.float32)}, str(path))
    read, _ = read_safetensors(path)
    assert read["x"].dtype == np.float64
    np.testing.assert_array_equal(read["x"], np.arange(4.0))


def test_other_dtypes_are_refused_by_name(tmp_path):
    header = b'{"x":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}'
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    with pytest.raises(ValueError, match="tensor 'x' has dtype 'BF16'"):
        read_safetensors(path)
