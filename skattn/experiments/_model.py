"""Learn every attention layer of a model, write them back, compare the models.

:func:`learn_model` (``skattn model`` on the command line) runs the pipeline of
:func:`~skattn.experiments.learn_layer` on each attention layer of a checkpoint
in turn, each from the original model's own inputs to that layer (so that one
layer's error does not feed the next), each kept in the cache and resumable;
then writes a checkpoint folder with every learned attention in the
checkpoint's own tensor names, and compares the original and the learned model
on held-out windows, one layer replaced at a time and all together
(:meth:`EncoderSource.compare_models`, :meth:`DecoderSource.compare_models`).
"""

import json
import time

import numpy as np
from sklearn.utils import Bunch

from ._layer import _learn_one_layer, _open_source
from ._pipeline import (
    UnidentifiableDataError,
    _check_arguments,
    _check_device,
    _check_out,
    _jsonable,
    _read_texts,
    _say,
)

__all__ = ["learn_model", "table_text"]

# What learn_model writes into ``out`` besides a folder per layer.
MODEL_FILES = {"report": "report.json", "checkpoint": "checkpoint", "plot": "heads.png"}


def _check_layers(layers, n_layers):
    """The layers to learn, sorted: all (``None``), one (an int) or those given,
    each checked."""
    if layers is None:
        return list(range(n_layers))
    if isinstance(layers, int | np.integer) and not isinstance(layers, bool):
        layers = [layers]
    try:
        layers = list(layers)
    except TypeError:
        layers = [layers]
    good = all(
        isinstance(layer, int | np.integer)
        and not isinstance(layer, bool)
        and 0 <= layer < n_layers
        for layer in layers
    )
    if not layers or not good:
        raise ValueError(
            f"layers={layers!r}: give layer numbers from 0 to {n_layers - 1} "
            f"(the checkpoint has {n_layers} layers), or None for all."
        )
    return sorted({int(layer) for layer in layers})


def _layer_row(layer, result=None, error=None):
    """One row of the layer x head table: each head's verdict, and the
    windows that would pin the heads these windows do not."""
    if result is None:
        verdict = error.verdict
        heads = [
            {
                "head": h["head"],
                "verdict": "not fitted" if h["pinned"] else "not pinned by this data",
                "windows_needed": None if h["pinned"] else h.get("windows_needed"),
            }
            for h in verdict["heads"]
        ]
        return {
            "layer": layer,
            "learned": False,
            "held_out_relative_error": None,
            "heads": heads,
            "message": str(error),
        }
    report = result.report
    errors = {h["real_head"]: h.get("attention_error") for h in report["heads"]}
    heads = [
        {
            "head": h["head"],
            "verdict": h["verdict"],
            "attention_error": errors.get(h["head"]),
            "windows_needed": None if h.get("pinned", True) else h["windows_needed"],
        }
        for h in report["verdict"]["heads"]
    ]
    return {
        "layer": layer,
        "learned": True,
        "held_out_relative_error": report["held_out_relative_error"],
        "fit_seconds": report["fit_seconds"],
        "heads": heads,
    }


def _held_by_every_layer(results):
    """The windows (token ids) that every learned layer held out, in the first
    one's order: the models are compared on windows no layer was fitted on (a
    layer whose sharp heads asked for more windows fitted on others)."""
    if not results:
        return np.zeros((0, 0), dtype=np.int64)
    held = [result.held_out_ids for result in results.values()]
    common = set.intersection(*({tuple(row) for row in ids} for ids in held))
    return np.asarray([row for row in held[0] if tuple(row) in common])


# the mark of each head's verdict, in the table and on the picture's blank cells
_MARKS = {
    "exact": "=",
    "not converged": "~",
    "not pinned by this data": "?",
    "not fitted": "-",
}


def _legend(verdicts=_MARKS):
    """``(= exact, ~ not converged, ...)`` for ``verdicts``, in the marks' order."""
    shown = [
        f"{mark} {verdict}" for verdict, mark in _MARKS.items() if verdict in verdicts
    ]
    return f"({', '.join(shown)})"


def table_text(rows):
    """The layer x head table as text: one line per layer, a letter per head
    (``=`` exact, ``~`` not converged, ``?`` not pinned by this data, ``-``
    not fitted: pinned, in a layer with a head that is not).

    Examples
    --------
    >>> rows = [{"layer": 0, "held_out_relative_error": 2e-13, "heads": [
    ...     {"verdict": "exact"}, {"verdict": "not pinned by this data"}]}]
    >>> print(table_text(rows))
    layer  heads  held-out
        0  =?     2e-13
    (= exact, ~ not converged, ? not pinned by this data, - not fitted)
    """
    width = max(len(row["heads"]) for row in rows)
    lines = [f"layer  {'heads'.ljust(width)}  held-out"]
    for row in rows:
        letters = "".join(_MARKS[h["verdict"]] for h in row["heads"]).ljust(width)
        error = row["held_out_relative_error"]
        shown = "not learned" if error is None else f"{error:.3g}"
        lines.append(f"{row['layer']:5d}  {letters}  {shown}")
    lines.append(_legend())
    return "\n".join(lines)


def _heads_figure(rows):
    """A layer x head heatmap of the held-out attention errors (log10), its
    colorbar's label inside the figure however few the layers; a head without
    an error (not fitted, not pinned by the data) carries the table's mark,
    explained under the axes."""
    import matplotlib.pyplot as plt

    width = max(len(row["heads"]) for row in rows)
    grid = np.full((len(rows), width), np.nan)
    blank = {}  # (layer row, head) -> verdict of the heads without an error
    for i, row in enumerate(rows):
        for j, head in enumerate(row["heads"]):
            error = head.get("attention_error")
            if error is not None:
                grid[i, j] = np.log10(max(error, 1e-16))
            elif head.get("verdict") in _MARKS:
                blank[i, j] = head["verdict"]
    # 3 inches at least: the colorbar's label runs along its height
    size = (1 + 0.5 * width, max(3.0, 1 + 0.5 * len(rows)))
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    image = ax.imshow(grid, cmap="viridis", vmin=-16, vmax=0, aspect="auto")
    for (i, j), verdict in blank.items():
        ax.text(j, i, _MARKS[verdict], ha="center", va="center")
    ax.set_xlabel("head" if not blank else f"head\n{_legend(set(blank.values()))}")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(rows)), [str(row["layer"]) for row in rows])
    fig.colorbar(image, ax=ax, label="log10 held-out attention error")
    return fig


def _plot_heads(rows, path):
    """:func:`_heads_figure`, saved to ``path``."""
    import matplotlib.pyplot as plt

    fig = _heads_figure(rows)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def learn_model(
    checkpoint=None,
    *,
    texts,
    layers=None,
    n_tokens=16,
    n_windows=None,
    held_out=0.2,
    out=None,
    plot=False,
    random_state=0,
    memory=None,
    device=None,
    fit_anyway=False,
    verbose=0,
):
    """Learn every attention layer of a model back, and compare the models.

    Each layer (all, or ``layers``) is learned by the pipeline of
    :func:`~skattn.experiments.learn_layer` with its default learner, from the
    original model's inputs to that layer on the same windows of the text; a
    layer whose heads these windows cannot pin is not fitted (its row says
    which heads and about how many windows would pin them) and keeps its
    original attention in the learned model.  Then the original and the
    learned model are compared on the held-out windows, with each learned
    layer alone in place of the original's and with all of them: for a
    BERT-style encoder its final hidden states and the mean-pooled sentence
    embeddings (as sentence-transformers pools them: cosine similarity and
    relative difference), for a decoder its final hidden states, its
    next-token log-probabilities and the perplexity of the held-out windows.

    Parameters
    ----------
    checkpoint : str or path-like, default=None
        As :func:`~skattn.experiments.learn_layer`'s (default: the packaged
        all-MiniLM-L6-v2).
    texts : str, path-like or sequence of them
        As :func:`~skattn.experiments.learn_layer`'s.
    layers : sequence of int, default=None
        The layers to learn; ``None``: every one.
    n_tokens, n_windows, held_out, random_state, device :
        As :func:`~skattn.experiments.learn_layer`'s, for every layer.
    out : str or path-like, default=None
        Folder to write into: ``layer-L/`` per layer (as ``learn_layer``'s
        ``out``), ``checkpoint/`` (the learned model, loadable as the
        original is), ``report.json``, with ``plot`` ``heads.png``.
    plot : bool, default=False
        Draw the layer x head heatmap of held-out attention errors (encoders;
        needs matplotlib and ``out``).
    memory : str or None, default=None
        Where every layer keeps its finished stages (one folder for all: a
        run interrupted and started again resumes at the layer and stage it
        reached).
    fit_anyway : bool, default=False
        Fit the layers whose heads the windows cannot pin too (their heads are
        reported ``not pinned by this data``); by default they are not fitted.
    verbose : int, default=0
        As :func:`~skattn.experiments.learn_layer`'s.

    Returns
    -------
    result : sklearn.utils.Bunch
        report : dict
            ``layers`` (the table's rows: per layer its held-out error, fit
            time and per head ``verdict``, ``attention_error`` and
            ``windows_needed``), ``model`` (the comparison: per layer replaced
            and ``"all"``), ``n_windows_fit`` (the most a layer fitted),
            ``n_windows_held_out`` (those every layer held out: the models are
            compared on them),
            ``total_seconds``, ``files``.
        layers : dict
            Layer -> the result of its ``learn_layer`` pipeline.
        table : str
            The layer x head table (:func:`table_text`).

    Examples
    --------
    A tiny random GPT-2 (2 layers, hidden 16), made offline, learned back from
    60 windows of 8 tokens:

    >>> import tempfile
    >>> from pathlib import Path
    >>> import numpy as np
    >>> import torch, transformers  # the transformers extra
    >>> from skattn.datasets._decoder_checkpoint import save_random_decoder
    >>> from skattn.experiments import learn_model
    >>> words = "open the file and read every line then close it".split()
    >>> text = " ".join(np.random.default_rng(0).choice(words, size=1200))
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     folder, _ = save_random_decoder(Path(tmp, "gpt2"), "gpt2", [text])
    ...     _ = Path(tmp, "text.txt").write_text(text)
    ...     result = learn_model(folder, texts=Path(tmp, "text.txt"), n_tokens=8,
    ...                          n_windows=60)
    >>> [[h["verdict"] for h in row["heads"]] for row in result.report["layers"]]
    [['exact', 'exact'], ['exact', 'exact']]
    >>> entry = result.report["model"]["all"]
    >>> bool(entry["log_probs_relative_difference"] < 1e-8)
    True
    """
    start = time.perf_counter()
    _check_arguments(0, n_tokens, n_windows, held_out, None, plot, out)
    device = _check_device(device, None)
    paths, contents = _read_texts(texts)
    if out is not None:
        out = _check_out(out)
    source = _open_source(checkpoint, n_tokens)
    if plot and source.kind != "encoder":
        raise ValueError(
            "plot=True: the heatmap shows heads matched one to one, which decoder "
            "layers (learned whole) do not report yet; leave plot out."
        )
    layers = _check_layers(layers, source.n_layers)
    for layer in layers:
        source.check(layer, None, False)
    all_ids = source.windows(paths, contents, n_windows, held_out)
    results, rows, learned = {}, [], {}
    for layer in layers:
        arguments = {
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "layer": layer,
            "texts": [str(p) for p in paths],
            "n_tokens": n_tokens,
            "n_windows": n_windows,
            "held_out": held_out,
            "random_state": random_state,
            "device": None if device is None else str(device),
            "fit_anyway": bool(fit_anyway),
            "command": "model",
        }
        _say(verbose, f"layer {layer} of {source.n_layers}:")
        try:
            result = _learn_one_layer(
                source,
                layer,
                all_ids,
                paths=paths,
                n_windows=n_windows,
                held_out=held_out,
                n_heads=None,
                out=None if out is None else out / f"layer-{layer}",
                plot=False,
                estimator=None,
                random_state=random_state,
                memory=memory,
                device=device,
                fit_anyway=fit_anyway,
                verbose=verbose,
                arguments=arguments,
                start=time.perf_counter(),
            )
        except UnidentifiableDataError as exc:
            _say(verbose, f"layer {layer} not fitted: {exc}")
            rows.append(_layer_row(layer, error=exc))
            continue
        results[layer] = result
        rows.append(_layer_row(layer, result))
        learned[layer] = result.learned
    held = _held_by_every_layer(results)
    n_fit = max((r.report["n_windows_fit"] for r in results.values()), default=0)
    comparison = {}
    if learned:
        _say(verbose, f"comparing the models on {len(held)} held-out windows.")
        comparison = source.compare_models(learned, held)
    else:
        _say(verbose, "no layer learned: the models are the same model.")
    files = {}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)  # no layer's folder made it
        files["report"] = out / MODEL_FILES["report"]
        if learned:
            files["checkpoint"] = out / MODEL_FILES["checkpoint"]
            source.write_model(files["checkpoint"], learned)
        if plot:
            files["plot"] = out / MODEL_FILES["plot"]
            _plot_heads(rows, files["plot"])
    report = _jsonable(
        {
            "layers": rows,
            "model": comparison,
            "n_windows_fit": n_fit,
            "n_windows_held_out": len(held),
            "checkpoint": str(source.folder),
            "total_seconds": time.perf_counter() - start,
            "files": {role: str(path) for role, path in files.items()},
        }
    )
    if "report" in files:
        files["report"].write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return Bunch(report=report, layers=results, table=table_text(rows), files=files)
