"""Experiments at scale: grids of planted recoveries and their displays.

* :func:`recovery_sweep`: fit learners over a grid (learner x planted layer x
  n_samples x noise x seed) through joblib (local processes or a Dask cluster),
  one row per fit in a ``pandas.DataFrame``, written to a file as fits finish
  and resumed from it;
* :func:`load_sweep_config`: the TOML config of ``skattn sweep CONFIG.toml``;
* :class:`SweepCurveDisplay`, :class:`PhaseDiagramDisplay`: success rate or error
  against n, one curve per learner, and a value over two axes of the grid;
* :func:`learn_layer`: learn layer L of a pretrained BERT-style, GPT-2, Llama,
  Mistral or Qwen2 model back from its hidden states on your own text files
  (``skattn layer``), and write the learned layer, a report and a plot;
* :func:`learn_model`: every attention layer of such a model in turn
  (``skattn model``), the learned model written back in the checkpoint's own
  tensor names, and the original and learned models compared on held-out text.

pandas is needed for the results (``pip install skattn[sweep]``), dask and
distributed for a cluster (``pip install skattn[dask]``); both are imported only
when used.
"""

from ._config import load_sweep_config
from ._layer import learn_layer
from ._model import learn_model
from ._plot import PhaseDiagramDisplay, SweepCurveDisplay
from ._sweep import cell_id, recovery_sweep

__all__ = [
    "PhaseDiagramDisplay",
    "SweepCurveDisplay",
    "cell_id",
    "learn_layer",
    "learn_model",
    "load_sweep_config",
    "recovery_sweep",
]
