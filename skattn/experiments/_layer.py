"""Learn one attention layer of a pretrained model from your own text.

:func:`learn_layer` (``skattn layer`` on the command line) runs the pipeline
of :mod:`._pipeline` on one layer: the checkpoint (a BERT-style encoder,
:class:`._encoder_layer.EncoderSource`, or a GPT-2, Llama, Mistral or Qwen2
decoder, :class:`._decoder_layer.DecoderSource`) -> windows of the text ->
the teacher's examples -> the verdict of what they pin -> the fit -> its
measures -> the report and files.  :func:`_learn_one_layer` is that pipeline
for one layer of a checkpoint already opened, which
:func:`~skattn.experiments.learn_model` runs on every layer.  Every argument,
file and folder is checked before the model is loaded, so bad input fails at
once.
"""

import os
import time

from sklearn.base import clone
from sklearn.utils import Bunch

from ..layer import as_layer
from ..utils._optional import require
from ._decoder_layer import DecoderSource, _decoder_folder
from ._encoder_layer import EncoderSource
from ._pipeline import (
    UnidentifiableDataError,
    _certificate_summary,
    _check_arguments,
    _check_device,
    _check_out,
    _finish_report,
    _fit_learner,
    _fitting_anyway,
    _Pieces,
    _read_texts,
    _resume_record,
    _run_record,
    _sample_windows,
    _say,
    _unpinned_heads,
    _why,
    _windows_to_pin,
    window_plan,
)

__all__ = ["UnidentifiableDataError", "learn_layer"]

# What learn_layer writes into ``out``: role -> file name.
LAYER_FILES = {
    "layer": "layer.safetensors",
    "report": "report.json",
    "plot": "patterns.png",
}


def _open_source(checkpoint, n_tokens):
    """The checkpoint as the pipeline reads it: a decoder's
    (:class:`DecoderSource`) when ``config.json`` names one, else an encoder's
    (:class:`EncoderSource`, which checks the rest); nothing loaded yet."""
    decoder = _decoder_folder(checkpoint)
    if decoder is not None:
        return DecoderSource(decoder, n_tokens=n_tokens)
    return EncoderSource(checkpoint, n_tokens=n_tokens)


def learn_layer(
    checkpoint=None,
    *,
    layer,
    texts,
    n_tokens=16,
    n_windows=None,
    held_out=0.2,
    n_heads=None,
    out=None,
    plot=False,
    estimator=None,
    random_state=0,
    memory=None,
    device=None,
    fit_anyway=False,
    verbose=0,
):
    """Learn layer L of a BERT-style model back from its behaviour on your text.

    The text files are tokenized by the model's tokenizer and cut into
    consecutive, non-overlapping windows ``[CLS]``, ``n_tokens - 2`` tokens of
    one file, ``[SEP]`` (the last incomplete window of a file is dropped).  Each
    window runs alone through the model's encoder in numpy (positions ``0, ...,
    n_tokens - 1``, no padding, no mask, float64); the hidden states entering
    layer ``layer`` are the inputs X, and the layer's attention sub-layer
    (self-attention and output dense with all their biases, before the residual
    and LayerNorm), restricted to its first ``n_heads`` heads, gives the targets
    y.  A random share ``held_out`` of the windows is held out; the others fit
    ``MultiHeadAttentionRegressor(n_heads=n_heads, n_tokens=n_tokens,
    fit_intercept=True, head_rank=<the model's head dimension>)`` (the settings
    of ``benchmarks/bench_minilm_teacher.py`` for real layers).

    Everything is checked before the model is loaded: the arguments, the text
    files, the output folder, the plotting extra, the checkpoint's files, its
    architecture, the layer and heads it has, and that the text makes enough
    windows.

    **Decoders.** A checkpoint whose ``config.json`` has ``model_type``
    ``"gpt2"``, ``"llama"``, ``"mistral"`` or ``"qwen2"`` is checked from its
    config and the safetensors headers alone
    (:func:`skattn.datasets._decoder_checkpoint.check_decoder_checkpoint`:
    sliding windows, RoPE scalings, partial rotary factors, soft-capping,
    cross-attention, query/key norms, attention sinks, missing or misshapen
    tensors are one-line errors), then run by transformers' own model
    (``AutoModelForCausalLM``, float64, needs ``pip install
    "skattn[transformers]"``): windows of ``n_tokens`` consecutive tokens (no
    special tokens, positions from 0), X the inputs of layer ``layer``'s
    attention module (after ``input_layernorm`` / ``ln_1``), y its outputs
    (``o_proj`` / ``c_proj`` and biases included, before the residual), the
    RoPE tables handed to it in float64 (transformers builds them in float32:
    ``report["rope_tables"]`` says by how much that changes the outputs).  The
    learner is ``MultiHeadAttentionRegressor(causal=True, rope=..., n_kv_heads=...,
    head_rank=<head_dim>, fit_intercept=<the module has biases>)``
    (:func:`~skattn.experiments._decoder_layer.decoder_learner`); the pre-fit
    verdict is the count of output values against the layer's unknowns
    (:func:`~skattn.experiments._decoder_layer.decoder_verdict`).  ``out``
    receives ``layer.safetensors`` in the checkpoint's own tensor names
    (``model.layers.L.self_attn.q_proj.weight``, ..., GPT-2's
    ``transformer.h.L.attn.c_attn.weight``, ...; ``model.load_state_dict(
    tensors, strict=False)`` loads it), which is loaded back into the model:
    ``report["loaded_back_held_out_relative_error"]``.  ``n_heads`` and
    ``plot`` do not apply (the layer is learned whole); ``memory`` keeps the
    decoder learner's stages as it keeps an encoder's.

    Parameters
    ----------
    checkpoint : str or path-like, default=None
        A folder holding ``model.safetensors``, ``config.json`` (``model_type``
        ``"bert"``) and ``tokenizer.json``, or the ``.safetensors`` file of such
        a folder; ``None``: the packaged all-MiniLM-L6-v2
        (:func:`skattn.datasets.minilm_checkpoint_path`).  Or a decoder's
        folder (above).
    layer : int
        The encoder layer to learn, from 0.
    texts : str, path-like or sequence of them
        UTF-8 text files; a folder gives its files ending in ``.txt``, ``.md``,
        ``.rst`` or ``.py`` (its whole tree, sorted), a glob pattern (``*``,
        ``?``, ``[...]``, ``**`` for any depth) its matching files.
    n_tokens : int, default=16
        Tokens per window, ``[CLS]`` and ``[SEP]`` included (at least 3).
    n_windows : int, default=None
        Windows to use, fit and held out together: a random subset of all the
        windows of the text (an error when the text has fewer).  ``None``: the
        fit takes as many as the count asks for with the search's margin
        (``search_samples_needed`` of :func:`skattn.metrics.data_verdict`; for an
        encoder, more where its sharp heads' split rows ask for more) and the
        rest of the text is held out (at most
        :data:`~skattn.experiments._pipeline.MAX_HELD_OUT` beyond the
        ``held_out`` share), so that more text does not make the fit slower;
        every window when the text has fewer (:func:`~skattn.experiments.
        _pipeline.window_plan`).  The first line says which.
    held_out : float, default=0.2
        Share of the windows held out for the error, in ``(0, 1)`` (with
        ``n_windows=None`` and more text than the fit needs, at least that
        share).
    n_heads : int, default=None
        Learn the layer restricted to its first ``n_heads`` heads (the teacher
        is then their outputs plus the layer's output bias); ``None``: all.
    out : str or path-like, default=None
        Folder to write into (created if missing): the learned layer
        (``layer.safetensors``: tensors ``attention``, ``projection``,
        ``key_bias``, ``intercept``, the arguments of
        :class:`~skattn.AttentionLayer`), the report (``report.json``) and with
        ``plot`` the figure (``patterns.png``); ``None``: nothing is written.
    plot : bool, default=False
        Draw real (top) against learned (bottom) attention patterns of the first
        heads on a held-out window (:class:`~skattn.metrics.AttentionPatternDisplay`;
        needs matplotlib, ``pip install "skattn[plot]"``, and ``out``).
    estimator : estimator, default=None
        Fit a clone of this instead (any skattn regressor; it is fitted on X of
        shape ``(n_windows, n_tokens, n_features)``); ``None``: the default above.
        Its ``certificate_``, when it has one (``certificate=True``), is
        summarised in the report.
    random_state : int, default=0
        Which windows are used and held out, and the learner's seed.
    memory : str, joblib.Memory or None, default=None
        The default learner's ``memory``: where it keeps each finished stage, so
        that a fit interrupted (killed, Ctrl-C) and run again with the same
        arguments resumes after the last one (``skattn layer`` keeps them in
        ``<out>/cache`` unless ``--no-cache``).  The teacher's examples (hidden
        states and outputs) are kept there too, keyed by the windows' token ids
        and the checkpoint's bytes, so that a run with another number of threads
        (whose floats round otherwise) still resumes.
    device : str or None, default=None
        A torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``, ``"mps"``) to fit
        on: the windows become torch tensors there and the learner fits them
        under ``sklearn.config_context(array_api_dispatch=True)`` (the user
        guide's *On a GPU*: the random-start path on the device, the phases on
        host copies).  Needs torch (``pip install "skattn[torch]"``), a learner
        that supports the array API (the default does), and the environment
        variable ``SCIPY_ARRAY_API=1`` set before scipy was imported (``skattn
        layer --device`` sets it for you).  ``None``: numpy on the host.
    fit_anyway : bool, default=False
        Before the fit, the windows are counted against what the layer's heads
        need (:func:`skattn.metrics.data_verdict`, and per head the rows that
        split the teacher's attention against the counting bound of
        :func:`skattn.metrics.sharp_head_pinning`).  When some head cannot be
        pinned by them, ``learn_layer`` raises at once, naming the heads and
        about how many windows would pin them; ``fit_anyway=True`` fits anyway,
        and the report says which heads this data does not pin.  Windows that
        pass the count with less room than the search from random starts needs
        (``search_samples_needed`` of :func:`skattn.metrics.data_verdict`) are
        fitted, and said first (the report's ``verdict["margin"]``).
    verbose : int, default=0
        Print each step to stderr when positive, and pass it to the learner
        (a progress bar per stage; from 2, one line per polish iteration).

    Returns
    -------
    result : sklearn.utils.Bunch
        report : dict
            What ``report.json`` holds: ``held_out_relative_error``,
            ``train_relative_error``, ``attention_pattern_error``,
            ``parameter_errors`` (head-matched, on the directions the held-out
            hidden states reach), ``heads`` (per real head: the matched learned
            head, its errors and both heads' sharpness,
            :func:`skattn.metrics.sharpness_profile`), ``certificate`` (the
            summary of the learner's ``certificate_``, else ``None``),
            ``device`` (the torch device fitted on, else ``None``),
            ``verdict`` (what the windows pin, counted before the fit: per
            head its split rows, those the counting bound asks for, the
            windows that would pin it, and after the fit ``exact``, ``not
            converged`` or ``not pinned by this data``; ``summary``, e.g.
            ``"10 exact, 2 not pinned by this data"``),
            ``fit_seconds`` (this run's fit), ``resume`` (with ``memory``:
            ``stages_reused`` and ``stages_computed`` by this run, the ``cache``
            folder, ``earlier_pieces_seconds`` of the runs interrupted by
            Ctrl-C before it and ``fit_seconds_all_pieces``, their sum with
            this run's, or for a finished fit run again the earlier run's
            total with this run's, and a ``note`` saying which; else
            ``None``), ``total_seconds``, ``peak_memory_mb``,
            ``n_windows_fit``, ``n_windows_held_out``, ``text``, ``checkpoint``,
            ``estimator``, ``warnings``, ``files`` and ``arguments``.
            Non-finite numbers are ``None``.
        estimator : estimator
            The fitted learner.
        teacher : AttentionLayer
            The real layer (its first ``n_heads`` heads).
        learned : AttentionLayer
            The learned layer.
        X_held_out, y_held_out : ndarray
            The held-out windows' hidden states ``(n, n_tokens * n_features)``
            and the teacher's outputs on them.
        files : dict
            Paths written: ``"layer"``, ``"report"`` and ``"plot"`` (those
            written).

    Raises
    ------
    FileNotFoundError
        If a text file or the checkpoint folder does not exist.
    ValueError
        On a bad argument; an output folder that cannot be written; a checkpoint
        folder lacking a file, of another architecture than BERT's, or without
        that layer or that many heads; text too short for the windows asked; a
        device that torch does not know or does not see, or asked without
        ``SCIPY_ARRAY_API=1``.
    ImportError
        If ``tokenizers`` or ``safetensors`` (``pip install "skattn[pretrained]"``),
        with ``plot`` matplotlib (``skattn[plot]``), or with ``device`` torch
        (``skattn[torch]``) is missing; for a decoder checkpoint, torch,
        transformers or tokenizers (``pip install "skattn[transformers]"``).

    See Also
    --------
    skattn.datasets.load_bert_hidden_states : the same teacher on the standard
        library's docstrings.

    Examples
    --------
    A tiny, fast run (a few windows, one head, a learner capped at a few
    iterations: the error says nothing about what a real run reaches; so few
    windows cannot pin a head, hence ``fit_anyway``):

    >>> import tempfile
    >>> from pathlib import Path
    >>> import safetensors, tokenizers  # the pretrained extra
    >>> from skattn import MultiHeadAttentionRegressor
    >>> from skattn.experiments import learn_layer
    >>> learner = MultiHeadAttentionRegressor(
    ...     n_heads=1, fit_intercept=True, head_rank=32, init="random",
    ...     polish_max_iter=2, start_search="none", random_state=0)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     text = Path(tmp, "text.txt")
    ...     _ = text.write_text("The cat sat on the mat. " * 40)
    ...     result = learn_layer(layer=2, texts=[text], n_tokens=8, n_heads=1,
    ...                          estimator=learner, out=Path(tmp, "out"),
    ...                          fit_anyway=True)
    ...     written = sorted(p.name for p in Path(tmp, "out").iterdir())
    >>> result.report["n_windows_fit"], result.report["n_windows_held_out"]
    (37, 9)
    >>> result.report["verdict"]["summary"]
    '1 not pinned by this data'
    >>> written
    ['layer.safetensors', 'report.json']
    """
    start = time.perf_counter()
    arguments = {
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "layer": layer,
        "texts": (
            [str(texts)]
            if isinstance(texts, str | os.PathLike)
            else [str(t) for t in texts]
        ),
        "n_tokens": n_tokens,
        "n_windows": n_windows,
        "held_out": held_out,
        "n_heads": n_heads,
        "out": None if out is None else str(out),
        "plot": bool(plot),
        "estimator": None if estimator is None else repr(estimator),
        "random_state": random_state,
        "device": None if device is None else str(device),
        "fit_anyway": bool(fit_anyway),
    }
    # -- every check, before the model is loaded --------------------------------
    _check_arguments(layer, n_tokens, n_windows, held_out, n_heads, plot, out)
    device = _check_device(device, estimator)
    paths, contents = _read_texts(texts)
    if out is not None:
        out = _check_out(out)
    if plot:
        require("matplotlib", extra="plot", feature="The pattern plot (plot=True)")
    source = _open_source(checkpoint, n_tokens)
    source.check(layer, n_heads, plot)
    all_ids = source.windows(paths, contents, n_windows, held_out)
    return _learn_one_layer(
        source,
        layer,
        all_ids,
        paths=paths,
        n_windows=n_windows,
        held_out=held_out,
        n_heads=n_heads,
        out=out,
        plot=plot,
        estimator=estimator,
        random_state=random_state,
        memory=memory,
        device=device,
        fit_anyway=fit_anyway,
        verbose=verbose,
        arguments=arguments,
        start=start,
    )


def _first_line(source, layer, n_heads, fit, held, n_available, n_files, why):
    what, after = source.describe(layer, n_heads, len(fit))
    return (
        f"{what} to fit on {len(fit)} windows of {source.n_tokens} tokens "
        f"({len(held)} held out) of the {n_available} of {n_files} text file(s): "
        f"{_why(why)}" + ("" if after is None else f"; {after}") + "."
    )


def _learn_one_layer(
    source,
    layer,
    all_ids,
    *,
    paths,
    n_windows,
    held_out,
    n_heads,
    out,
    plot,
    estimator,
    random_state,
    memory,
    device,
    fit_anyway,
    verbose,
    arguments,
    start,
):
    """The pipeline on layer ``layer`` of an opened, checked ``source``, from
    the text's windows ``all_ids``: the result of :func:`learn_layer`."""
    n_available = len(all_ids)
    wanted = source.windows_wanted(layer, n_heads)
    n_total, n_held, why = window_plan(n_available, n_windows, held_out, wanted)
    ids, fit, held = _sample_windows(all_ids, n_total, n_held, random_state)
    _say(
        verbose,
        _first_line(source, layer, n_heads, fit, held, n_available, len(paths), why),
    )

    # -- the teacher and its examples -------------------------------------------
    teacher = source.teacher(layer, n_heads)
    X3, y, reused = source.examples(layer, teacher, ids, memory)
    _say(
        verbose,
        f"layer {layer}'s inputs and outputs "
        + ("read back from the cache." if reused else "computed."),
    )

    # -- what these windows can pin, before the long fit ---------------------------
    verdict = source.verdict(layer, teacher, X3[fit])
    more = _windows_to_pin(verdict, len(fit), n_windows)
    if more is not None:  # a sharp head asks for more windows than the count
        n_total, n_held, why = window_plan(n_available, None, held_out, more)
        # grown only where the text has them: else the verdict stops the fit
        # now, rather than after a fit on all the text that still cannot pin it
        if n_total - n_held >= more:
            ids, fit, held = _sample_windows(all_ids, n_total, n_held, random_state)
            _say(
                verbose,
                f"layer {layer}: the windows split too few rows of head(s) "
                f"{_unpinned_heads(verdict)}: fitting on {len(fit)} windows "
                f"({len(held)} held out) of the text's {n_available}.",
            )
            X3, y, reused = source.examples(layer, teacher, ids, memory)
            verdict = source.verdict(layer, teacher, X3[fit])
    if not verdict["determined"] and not fit_anyway:
        raise UnidentifiableDataError(verdict["message"], verdict)
    if not verdict["determined"]:  # fit_anyway
        _say(verbose, _fitting_anyway(verdict["message"]))
    elif verdict.get("margin"):  # a thin margin: said, not stopped (a measured rule)
        _say(verbose, verdict["margin"])
    if verdict["determined"] and verdict.get("note"):  # weakly pinned directions
        _say(verbose, f"layer {layer}: {verdict['note']}.")

    # -- the fit ------------------------------------------------------------------
    if estimator is None:
        learner = source.learner(
            layer, teacher, random_state=random_state, memory=memory, verbose=verbose
        )
    else:
        learner = clone(estimator)
    X_fit = source.fit_inputs(X3[fit], estimator is None)
    pieces = None if memory is None else _Pieces(memory, arguments)
    fit_seconds, caught = _fit_learner(
        learner, X_fit, y[fit].reshape(len(fit), -1), device, pieces
    )
    _say(verbose, f"fitted in {fit_seconds:.1f} s; measuring.")

    # -- what it learned, and the files -------------------------------------------
    learned = as_layer(learner, "estimator")
    data = Bunch(layer=layer, ids=ids, X3=X3, y=y, fit=fit, held=held)
    report = source.measure(teacher, learned, data, verdict)
    cert = getattr(learner, "certificate_", None)
    report["certificate"] = None if cert is None else _certificate_summary(cert)
    files = {}
    if out is not None:
        files = {role: out / LAYER_FILES[role] for role in ("layer", "report")}
        if plot:
            files["plot"] = out / LAYER_FILES["plot"]
        out.mkdir(parents=True, exist_ok=True)
        source.write(files, learned, layer, teacher, data, report)
    report.update(
        _run_record(
            fit_seconds=fit_seconds,
            resume=_resume_record(learner, pieces, fit_seconds),
            fit=fit,
            held=held,
            paths=paths,
            n_available=n_available,
            ids=ids,
            checkpoint=source.facts(layer, teacher),
            learner=learner,
            device=device,
            caught=caught,
            files=files,
            arguments=arguments,
        )
    )
    report = _finish_report(report, files, start, verbose)
    return Bunch(
        report=report,
        estimator=learner,
        teacher=teacher,
        learned=learned,
        X_held_out=X3[held].reshape(len(held), -1),
        y_held_out=y[held].reshape(len(held), -1),
        held_out_ids=ids[held],
        files=files,
    )
