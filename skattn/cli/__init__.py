"""The command line: ``skattn demo``, ``fit``, ``sweep``, ``layer`` and ``model``.

``skattn demo`` plants a multi-head attention layer, samples examples, learns it back
with the phased learner of Chen & Li and with the gradient baseline, and prints what
each phase did and how well each learner recovered the layer.  It exits with status 1
when the phased learner fails to recover the layer.

``skattn fit X.npy y.npy --n-tokens K --n-heads M --out layer.npz`` learns a layer
from arrays on disk and saves it to a layer file
(:func:`skattn.layer.save_layer`), which :func:`skattn.layer.load_layer` reads
back as an :class:`~skattn.AttentionLayer`.

``skattn sweep CONFIG.toml`` runs :func:`skattn.experiments.recovery_sweep` over the
grid of a TOML config (see :func:`skattn.experiments.load_sweep_config` and the user
guide's *Experiments at scale*), on local processes or the config's Dask scheduler,
writing one row per fit to the config's output file; rerun it to resume.  It exits
with status 1 when a cell failed, printing each failed cell's reason.

``skattn layer [CHECKPOINT] --layer L --text FILE [FILE ...]`` learns layer L of a
BERT-style checkpoint folder (by default the packaged all-MiniLM-L6-v2), or of a
GPT-2, Llama, Mistral or Qwen2 one (its examples from transformers' own model, the
layer written in the checkpoint's own tensor names), back from the hidden states of
the given text files entering it, and writes the learned layer
(``layer.safetensors``), a JSON report (``report.json``: held-out error, per-head
errors and sharpness, time, memory) and with ``--plot`` the real and learned
attention patterns (``patterns.png``) into ``--out``: see
:func:`skattn.experiments.learn_layer`.  Every input is checked before the model is
loaded.

``skattn model [CHECKPOINT] --text FILE [FILE ...]`` learns every attention
layer of the checkpoint (or ``--layers``) that way, writes the learned model back
in the checkpoint's own tensor names, and compares the original and learned
models on held-out windows: see :func:`skattn.experiments.learn_model`.

Bad input never ends in a Python traceback: argparse refuses malformed options
(status 2, with the usage), and any other error -- a missing or unreadable file, an
output folder that does not exist, an invalid config -- is one line ``skattn:
error: ...`` on stderr with status 1, found before any fit starts where it can be.

Where things live: :mod:`._main` (``main`` and each command), :mod:`._parser`
(the options), :mod:`._messages` (library messages in a command's words: its
flags, not Python parameters); the layer files are :mod:`skattn.layer`'s
(``save_layer``, ``load_layer``, re-exported here).
"""

from ..layer._files import load_layer, save_layer
from ._main import main

__all__ = ["load_layer", "main", "save_layer"]
