"""Data for study_llama_search.py: a tiny random Llama layer 1 on real text windows.

Saves X, Y (real tokens), the teacher's factors, and settings to an npz.
Usage: python study_llama_search_data.py OUT.npz N
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np

from skattn import AttentionLayer
from skattn.datasets._decoder_checkpoint import (
    attention_module,
    check_decoder_checkpoint,
    decoder_examples,
    save_random_decoder,
)
from skattn.datasets._encoder import _stdlib_docstrings
from skattn.experiments._decoder_layer import decoder_windows
from skattn.layer._hf import decoder_settings

MODULES = ("argparse", "collections", "email", "json", "logging", "pathlib", "typing")
out, n = sys.argv[1], int(sys.argv[2])
docs = _stdlib_docstrings(MODULES)
tmp = tempfile.mkdtemp()
folder, _ = save_random_decoder(
    Path(tmp, "llama"),
    "llama",
    docs,
    n_features=64,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    std=0.2,
    random_state=0,
)
ck = check_decoder_checkpoint(folder, layer=1, n_tokens=32)
config = json.loads((folder / "config.json").read_text())
settings = decoder_settings(config, 1)
ids, _ = decoder_windows(
    folder / "tokenizer.json", ["x"], ["\n\n".join(docs)], 32, None, 0.2
)
print("available windows", len(ids))
rng = np.random.default_rng(0)
ids = ids[rng.choice(len(ids), min(n, len(ids)), replace=False)]
X, Y, model = decoder_examples(ck, ids)
_, module = attention_module(model, ck)
teacher = AttentionLayer.from_torch(module).set_params(n_tokens=32)
print(
    {
        k: settings[k]
        for k in ("n_heads", "n_kv_heads", "head_dim", "rope_theta", "biases")
    }
)
print(
    {k: (None if v is None else np.shape(v)) for k, v in teacher.get_params().items()}
)
np.savez(
    out,
    X=X,
    Y=Y,
    ids=ids,
    attention=teacher.attention,
    projection=teacher.projection,
    rotary_query=teacher.rotary_query,
    rotary_key=teacher.rotary_key,
    rope_theta=teacher.rope_theta,
    n_kv_heads=teacher.n_kv_heads or 0,
    rope_layout=teacher.rope_layout,
)
