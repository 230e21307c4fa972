"""The steps every command that learns from a checkpoint shares.

checkpoint -> windows -> teacher examples -> verdict -> fit -> measure -> report:
the checkpoint-specific steps live with their kind of checkpoint
(:mod:`._encoder_layer` for BERT-style encoders, :mod:`._decoder_layer` for
GPT-2, Llama, Mistral and Qwen2); what is the same for every kind lives here,
each step a function: the arguments' and files' checks
(:func:`_check_arguments`, :func:`_check_device`, :func:`_read_texts`,
:func:`_check_out`), the windows' plan and draw (:func:`window_plan`,
:func:`_sample_windows`, :func:`_windows_to_pin`), the fit with its pieces
kept for a resumed run (:func:`_fit_learner`, :class:`_Pieces`,
:func:`_resume_record`), and the report (:func:`_run_record`,
:func:`_finish_report`).  :func:`~skattn.experiments.learn_layer` and
:func:`~skattn.experiments.learn_model` are two uses of them.
"""

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from numbers import Integral, Real
from pathlib import Path

import numpy as np

from ..utils._array_api import scipy_array_api_ignored
from ..utils._optional import require


def _check_int(value, name, low):
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {kind}, got {value!r}.")
    return int(value)


def _check_arguments(layer, n_tokens, n_windows, held_out, n_heads, plot, out):
    if isinstance(layer, bool) or not isinstance(layer, Integral) or layer < 0:
        raise ValueError(f"layer must be a non-negative integer, got {layer!r}.")
    _check_int(n_tokens, "n_tokens", 1)
    if n_tokens < 3:
        raise ValueError(
            f"n_tokens={n_tokens} leaves no room for text: a window is [CLS], at "
            f"least one token of text and [SEP]; use n_tokens >= 3."
        )
    if n_windows is not None:
        _check_int(n_windows, "n_windows", 2)
    if (
        isinstance(held_out, bool)
        or not isinstance(held_out, Real)
        or not 0 < held_out < 1
    ):
        raise ValueError(
            f"held_out must be a share of the windows in (0, 1), got {held_out!r}."
        )
    if n_heads is not None:
        _check_int(n_heads, "n_heads", 1)
    if plot and out is None:
        raise ValueError("plot=True needs out, the folder to write the figure in.")


def _check_device(device, estimator):
    """The ``torch.device`` to fit on (``None`` for numpy), checked before any
    work: torch installed, the device known and seen, the array API usable."""
    if device is None:
        return None
    if not isinstance(device, str):
        raise ValueError(
            f"device must be a torch device name such as 'cuda', 'cuda:1' or "
            f"'cpu', got {device!r}."
        )
    torch = require("torch", extra="torch", feature="Fitting on a device (device=)")
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"device={device!r} is not a torch device ({exc}); use e.g. 'cuda', "
            f"'cuda:1', 'mps' or 'cpu'."
        ) from None
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (where.index or 0) >= count:
            raise ValueError(
                f"device={device!r}: torch sees {count} CUDA device(s) here. Pass "
                f"another device, or leave device out to fit with numpy."
            )
    elif where.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}: torch sees no MPS device here.")
    elif where.type not in ("cpu", "cuda", "mps"):
        raise ValueError(
            f"device={device!r}: only 'cpu', 'cuda' and 'mps' devices are supported."
        )
    if scipy_array_api_ignored():
        raise ValueError(
            f"device={device!r} fits through scikit-learn's array API, which needs "
            f"SCIPY_ARRAY_API=1 set before scipy is imported; it is set, but scipy "
            f"was imported before (scipy reads it once, when imported). Set it "
            f"before Python starts: run 'SCIPY_ARRAY_API=1 python ...' (the skattn "
            f"command sets it itself)."
        )
    if os.environ.get("SCIPY_ARRAY_API") != "1":
        raise ValueError(
            f"device={device!r} fits through scikit-learn's array API, which needs "
            f"the environment variable SCIPY_ARRAY_API=1 set before scipy is "
            f"imported: run 'SCIPY_ARRAY_API=1 python ...' (the skattn command "
            f"sets it itself)."
        )
    if estimator is not None and not estimator.__sklearn_tags__().array_api_support:
        raise ValueError(
            f"device={device!r} needs a learner that supports the array API; "
            f"{type(estimator).__name__} computes in numpy. Use the default "
            f"learner (or a MultiHeadAttentionRegressor), or leave device out."
        )
    return where


def _fit_on(learner, X, y, device):
    """``learner.fit(X, y)``; on ``device`` (a torch device) as tensors there,
    under the array API dispatch."""
    if device is None:
        learner.fit(X, y)
        return
    import torch
    from sklearn import config_context

    with config_context(array_api_dispatch=True):
        learner.fit(torch.asarray(X, device=device), torch.asarray(y, device=device))


# The files a folder given as text contributes (its tree, sorted).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


def _expand_texts(texts):
    """The text files of ``texts``: files as given, a folder's files with a
    suffix of ``TEXT_SUFFIXES`` (its whole tree, sorted), and the matches of a
    glob pattern (``*``, ``?``, ``[...]``; ``**`` for any depth), sorted."""
    import glob

    files = []
    for entry in texts:
        path = Path(entry)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
            )
            if not found:
                raise ValueError(
                    f"text folder {str(path)!r} holds no text file (files ending "
                    f"in {', '.join(TEXT_SUFFIXES)})."
                )
            files.extend(found)
        elif not path.exists() and glob.has_magic(str(entry)):
            found = sorted(
                Path(p)
                for p in glob.glob(str(entry), recursive=True)
                if Path(p).is_file()
            )
            if not found:
                raise FileNotFoundError(f"no text file matches {str(entry)!r}.")
            files.extend(found)
        else:
            files.append(path)
    return files


def _read_texts(texts):
    """The contents of the text files (folders and glob patterns expanded, see
    :func:`_expand_texts`), each checked before anything else."""
    if isinstance(texts, str | os.PathLike):
        texts = [texts]
    if not texts:
        raise ValueError("texts is empty: give at least one text file.")
    texts = _expand_texts(texts)
    contents = []
    for path in texts:
        if not path.exists():
            raise FileNotFoundError(f"text file {str(path)!r} does not exist.")
        try:
            contents.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"text file {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}); give plain text files."
            ) from exc
        except OSError as exc:
            raise OSError(
                f"cannot read text file {str(path)!r}: {exc.strerror or exc}."
            ) from exc
    return texts, contents


def _nearest_existing(path):
    """``path`` itself if it exists, else its nearest existing parent."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(folder):
    """An OSError unless a file can be created in ``folder`` (none is left)."""
    if not folder.is_dir():
        raise NotADirectoryError(20, f"{str(folder)!r} is a file")
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".skattn-probe-"):
        pass


def _check_out(out):
    """Refuse an output folder that cannot be made or written in, creating nothing.

    An existing folder gets a probe file; a missing one is checked in its nearest
    existing parent folder, and created only when the results are written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"out {str(out)!r} is a file; give a folder (created if missing)."
        )
    try:
        _probe(_nearest_existing(out))
    except OSError as exc:
        raise ValueError(
            f"out {str(out)!r} is not a folder skattn can write in "
            f"({exc.strerror or exc}); choose another folder."
        ) from exc
    return out


def _held_out_count(held_out, wanted):
    """Windows held out of ``wanted``: ``round(held_out * wanted)``, at least one
    and fewer than ``wanted`` (a one-line error otherwise)."""
    n_held = round(held_out * wanted)
    if not 1 <= n_held < wanted:
        raise ValueError(
            f"held_out={held_out} of {wanted} windows leaves "
            f"{'none to hold out' if n_held < 1 else 'none to fit'}; use more "
            f"windows or another held_out."
        )
    return n_held


# Held-out windows at most, when the text has more than the fit's count asks for:
# they are measured, not fitted (their hidden states cost memory: 2000 windows
# of 64 tokens of MiniLM are 0.4 GB in float64).
MAX_HELD_OUT = 2000


def window_plan(available, n_windows, held_out, wanted):
    """``(n_total, n_held, why)``: how many windows to use and to hold out.

    With ``n_windows``, those (``round(held_out * n_windows)`` held out).
    Without, the fit takes ``wanted`` (the count's windows with the search's
    margin, ``search_samples_needed``) and the rest of the text is held out
    (at least the ``held_out`` share of the whole, at most ``MAX_HELD_OUT``
    beyond it), so that more text makes the fit no slower; where the text has
    too few, every window, ``round(held_out * available)`` held out.  ``why``
    says which, for the first line of the run.

    Examples
    --------
    >>> window_plan(1250, None, 0.2, 92)
    (1250, 1158, 'the count asks for 92 with its margin; the rest held out')
    >>> window_plan(100, None, 0.2, 92)[:2], window_plan(1250, 200, 0.2, 92)[:2]
    ((100, 20), (200, 40))
    """
    if n_windows is not None:
        return n_windows, _held_out_count(held_out, n_windows), "n_windows"
    least = max(1, round(held_out * wanted / (1 - held_out)))
    if available < wanted + least:
        return (
            available,
            _held_out_count(held_out, available),
            f"all of them: fewer than the {wanted + least} that the count asks "
            f"for with its margin and held-out share",
        )
    held = min(available - wanted, max(least, MAX_HELD_OUT))
    rest = "the rest held out" if held == available - wanted else "held out"
    return (
        wanted + held,
        held,
        f"the count asks for {wanted} with its margin; {rest}",
    )


def _why(why):
    """The first line's reason for the windows of :func:`window_plan`."""
    return "as asked" if why == "n_windows" else why


def _unpinned_heads(verdict):
    """The heads a pinning verdict finds unpinned, as a comma-separated list."""
    return ", ".join(str(h["head"]) for h in verdict["heads"] if not h["pinned"])


def _windows_to_pin(verdict, n_fit, n_windows):
    """The fit windows that the heads the verdict finds unpinned ask for (the
    counting bound's, from the rows these windows split), when the window count
    was left to the count (``n_windows`` None) and they ask for more; else
    None."""
    if verdict["determined"] or n_windows is not None:
        return None
    needed = [h["windows_needed"] for h in verdict["heads"] if not h["pinned"]]
    if not needed or None in needed or max(needed) <= n_fit:
        return None
    return int(max(needed))


def _sample_windows(ids, n_windows, n_held, random_state):
    """``(ids, fit, held)``: ``n_windows`` of the windows ``ids`` (all when None)
    drawn at random, kept in text order, and ``n_held`` of them held out."""
    rng = np.random.default_rng(random_state)
    n_available = len(ids)
    n_total = n_available if n_windows is None else n_windows
    ids = ids[np.sort(rng.choice(n_available, size=n_total, replace=False))]
    order = rng.permutation(n_total)
    return ids, np.sort(order[n_held:]), np.sort(order[:n_held])


class UnidentifiableDataError(ValueError):
    """The windows cannot pin some head of the layer (raised before the fit).

    ``verdict``: the verdict that says so (per head, the windows that would
    pin it), when the pipeline raised it."""

    def __init__(self, message, verdict=None):
        super().__init__(message)
        self.verdict = verdict


# The end of a verdict that stops the fit (without fit_anyway)
_FIT_ANYWAY = "(or fit_anyway: fit all the same)"


def _fitting_anyway(message):
    """The verdict's line when ``fit_anyway`` goes on: no hint to set it."""
    return message.replace(_FIT_ANYWAY, "(fitting all the same)")


def _peak_memory_mb():
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _jsonable(value):
    """Plain JSON values: numpy scalars and arrays to lists, non-finite to None."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | np.ndarray):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.bool_ | bool):
        return bool(value)
    if isinstance(value, np.integer | Integral):
        return int(value)
    if isinstance(value, np.floating | Real):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return str(value)
    return value


def _certificate_summary(cert):
    return {
        "verdict": cert.verdict,
        "train_residual": cert.train_residual,
        "exact": cert.exact,
        "jacobian_rank": cert.jacobian_rank,
        "n_parameters": cert.n_parameters,
        "null_dimension": cert.null_dimension,
        "held_out_error": cert.held_out_error,
        "held_out_interval": cert.held_out_interval,
        "redundant_heads": list(cert.redundant_heads),
        "conditions_failed": list(cert.conditions.failed),
        "sharp_head_verdicts": list(cert.sharp_head_verdicts),
        "text": str(cert),
    }


def _run_record(
    *,
    fit_seconds,
    resume,
    fit,
    held,
    paths,
    n_available,
    ids,
    checkpoint,
    learner,
    device,
    caught,
    files,
    arguments,
):
    """The report's record of a run, the same for every checkpoint: time, memory,
    windows, text, the checkpoint's facts, the learner, its warnings, files and
    the arguments."""
    return {
        "fit_seconds": fit_seconds,
        "resume": resume,
        "peak_memory_mb": _peak_memory_mb(),
        "n_windows_fit": len(fit),
        "n_windows_held_out": len(held),
        "text": {
            "files": [str(p) for p in paths],
            "n_windows_available": n_available,
            "n_distinct_windows_fit": len(np.unique(ids[fit], axis=0)),
        },
        "checkpoint": checkpoint,
        "estimator": repr(learner),
        "device": None if device is None else str(device),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "files": {role: str(path) for role, path in files.items()},
        "arguments": arguments,
    }


def _finish_report(report, files, start, verbose):
    """The report with its total time, as JSON values, written to
    ``files["report"]`` when there is one, and its held-out error said."""
    report["total_seconds"] = time.perf_counter() - start
    report = _jsonable(report)
    if "report" in files:
        files["report"].write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    _say(verbose, f"held-out relative error {report['held_out_relative_error']}.")
    return report


# Whose lines the pipeline's progress reads as, and in whose words: from Python
# "skattn layer" and parameter names; a command sets its own (:func:`voice`).
_VOICE = {"name": "skattn layer", "words": None}


@contextlib.contextmanager
def voice(name, words=None):
    """The pipeline's progress lines, while in the block, as ``name: line``
    with ``words(line)`` for the line (a command's flags for parameters).

    Examples
    --------
    >>> import io, contextlib as cl
    >>> err = io.StringIO()
    >>> with voice("skattn model", str.upper), cl.redirect_stderr(err):
    ...     _say(True, "layer 0 of 6")
    >>> err.getvalue()
    'skattn model: LAYER 0 OF 6\\n'
    """
    before = dict(_VOICE)
    _VOICE.update(name=name, words=words)
    try:
        yield
    finally:
        _VOICE.update(before)


def _say(verbose, message):
    if verbose:
        words = _VOICE["words"]
        message = words(message) if words is not None else message
        print(f"{_VOICE['name']}: {message}", file=sys.stderr, flush=True)


class _Pieces:
    """The fit seconds of the runs of one ``learn_layer`` call, kept in the
    memory folder (``skattn-layer-pieces.json``): those interrupted by Ctrl-C,
    so that the run that resumes them reports the time of all the pieces, and
    the total of the last run that finished, for a later run that reuses its
    stages.  A killed run records nothing."""

    FILE = "skattn-layer-pieces.json"

    def __init__(self, memory, arguments):
        self.path = Path(str(memory)) / self.FILE
        same = {k: v for k, v in arguments.items() if k not in ("out", "plot")}
        text = json.dumps(same, sort_keys=True, default=str)
        self.key = hashlib.sha256(text.encode()).hexdigest()[:16]

    def _read(self):
        try:
            ledger = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: start afresh
            return {}
        return ledger if isinstance(ledger, dict) else {}

    def _entry(self, ledger):
        entry = ledger.get(self.key)
        if not isinstance(entry, dict):
            entry = {}
        interrupted = entry.get("interrupted")
        finished = entry.get("finished")
        return {
            "interrupted": [
                float(x) for x in interrupted or [] if isinstance(x, int | float)
            ],
            "finished": float(finished) if isinstance(finished, int | float) else None,
        }

    def _update(self, change):
        """Apply ``change`` to this call's entry and write the ledger back (an
        interruption or a finished fit must not fail on its bookkeeping)."""
        try:
            ledger = self._read()
            entry = self._entry(ledger)
            change(entry)
            ledger[self.key] = entry
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass

    def record(self, seconds):
        """Add an interrupted piece of ``seconds``."""
        self._update(lambda entry: entry["interrupted"].append(round(seconds, 3)))

    def earlier(self):
        """``(interrupted pieces before this run, last finished total or None)``."""
        entry = self._entry(self._read())
        return entry["interrupted"], entry["finished"]

    def finish(self, total):
        """This run finished: forget the pieces, keep ``total``."""

        def change(entry):
            entry["interrupted"], entry["finished"] = [], round(total, 3)

        self._update(change)


def _memory_record(learner):
    """The learner's ``info["memory"]`` (stages reused and computed), or None."""
    for phase in reversed(getattr(learner, "phase_report_", None) or []):
        kept = getattr(phase, "info", {}).get("memory")
        if kept:
            return kept
    return None


def _resume_record(learner, pieces, fit_seconds):
    """``report["resume"]``: what this run reused and the time of all pieces."""
    kept = _memory_record(learner)
    if pieces is None and kept is None:
        return None
    earlier, finished = ([], None) if pieces is None else pieces.earlier()
    reused = 0 if kept is None else len(kept.get("reused", []))
    computed = 0 if kept is None else len(kept.get("computed", []))
    record = {
        "cache": None if kept is None else kept.get("folder"),
        "stages_reused": reused,
        "stages_computed": computed,
        "earlier_pieces_seconds": earlier,
        "fit_seconds_all_pieces": sum(earlier) + fit_seconds,
    }
    if reused and not earlier:
        if finished is not None:  # a finished fit run again: its stages read back
            record["fit_seconds_all_pieces"] = finished + fit_seconds
            record["note"] = (
                f"the stages reused were computed by an earlier run of the same "
                f"arguments that took {finished:.1f} s in all, counted here"
            )
        else:
            record["note"] = (
                "stages were reused from a run whose time is not recorded (killed "
                "before it finished): fit_seconds_all_pieces counts this run only"
            )
    if pieces is not None:
        total = record["fit_seconds_all_pieces"]
        pieces.finish(total if computed or finished is None else finished)
    return record


def _fit_learner(learner, X, y, device, pieces):
    """``(fit_seconds, caught)``: ``learner`` fitted on ``X``, ``y`` (on
    ``device`` when given, :func:`_fit_on`), its warnings caught (and shown
    again after the fit: the report keeps them).  A Ctrl-C records this
    piece's time in ``pieces`` (when kept), for the run that resumes it."""
    fit_start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit_on(learner, X, y, device)
    except KeyboardInterrupt:
        if pieces is not None:
            pieces.record(time.perf_counter() - fit_start)
        raise
    fit_seconds = time.perf_counter() - fit_start
    for w in caught:  # shown after all, and recorded in the report
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return fit_seconds, caught


def _relative(a, b):
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / norm) if norm else 0.0


def compare_outputs(hidden, hidden_learned, *, log_probs=None, ids=None):
    """The comparison entries of two models' outputs on the same windows:
    ``hidden_states_relative_difference`` (final hidden states ``(n, k, d)``),
    ``embedding_cosine_min`` and ``embedding_relative_difference`` (mean over
    tokens, as sentence-transformers pools), and with ``log_probs`` (the two
    models' next-token log-probabilities ``(n, k, V)``) and ``ids`` their
    ``log_probs_relative_difference`` and each model's ``perplexity`` of the
    windows' next tokens.

    Examples
    --------
    >>> H = np.ones((2, 3, 4))
    >>> compare_outputs(H, H)["embedding_cosine_min"]
    1.0
    """
    e0, e1 = hidden.mean(axis=1), hidden_learned.mean(axis=1)
    cosine = np.sum(e0 * e1, axis=1) / (
        np.linalg.norm(e0, axis=1) * np.linalg.norm(e1, axis=1)
    )
    entry = {
        "hidden_states_relative_difference": _relative(hidden_learned, hidden),
        "embedding_cosine_min": float(np.min(cosine)),
        "embedding_relative_difference": _relative(e1, e0),
    }
    if log_probs is not None:
        lp0, lp1 = log_probs
        nxt = np.asarray(ids)[:, 1:, None]

        def perplexity(lp):
            taken = np.take_along_axis(lp[:, :-1], nxt, axis=2)
            return float(np.exp(-taken.mean()))

        entry.update(
            log_probs_relative_difference=_relative(lp1, lp0),
            perplexity_original=perplexity(lp0),
            perplexity_learned=perplexity(lp1),
        )
    return entry
