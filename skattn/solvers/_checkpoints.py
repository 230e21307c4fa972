"""Finished stages of a fit kept on disk, so that an interrupted fit resumes.

A fit given ``memory`` (scikit-learn's convention, as ``Pipeline(memory=...)``: a
folder or a ``joblib.Memory``) keeps each finished stage of the random-start path
(the search's end, each head's refinement, the polish's iterates at intervals) in
a folder of its own, named by a digest of everything that decides the fit: the
data (``X``, ``Y``, the weights) and the settings.  Run again with the same
arguments, the fit reads the finished stages back instead of computing them, and
goes on from the last one: the layer is the one an uninterrupted fit gives,
because each stage's output, and the random generator's state after it, is stored
exactly (``joblib`` pickles, numpy arrays byte for byte).

Changed data or settings give another digest, so another folder: nothing is
reused.  Each entry is written to a temporary file and renamed, and its SHA-256
written beside it last; an entry whose bytes do not match its digest (a damaged
disk, a hand edit) raises an error naming the file, never a wrong layer.  An entry
without its digest (a kill between the two renames) counts as not written.

Each entry also records the skattn version that wrote it and the schema number of
its stage (:data:`SCHEMAS`, raised whenever what a stage keeps changes).  An entry
of another version or schema is recomputed, never reused half-compatible, and the
fit says so (``StageMemory.stale``, ``info["memory"]["stale"]``); the folder of a
fit does not depend on the version, so that an upgrade finds its old entries and
reports them instead of leaving them behind unnoticed.

The polish's iteration cap (``max_iter``, the estimators' ``polish_max_iter``)
decides only the stages that it cut short.  Where its own folder lacks a stage, a
fit reads the stage kept by the fit that differs from it in that cap alone (the
latest such folder, ``StageMemory.inherited``; the entry is then linked into its
own folder): the stages before the polish as they are, each polish stage that
ended before either cap could cut it (its ``settled`` test) too, and the others
are gone on from their kept iterates (``StageMemory.continued``).  A
kept stage holds only where every stage before it is the one it followed: each
entry records when it was written, and an entry written before a stage read or
computed before it in this fit (a reorientation that followed a polish which is
now continued) is computed again, as a stale one.
"""

import copy
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import joblib
import numpy as np
from sklearn.utils.validation import check_memory

from .._version import __version__
from ..utils._array_api import to_numpy

__all__ = ["StageMemory", "DamagedCacheError", "kept"]

# an entry's name in the folder of its fit: "<stage>.joblib" and "<stage>.sha256"
_DATA, _DIGEST = ".joblib", ".sha256"

# The schema number of each stage's kept value, by the label of its name (the
# text before "-<count>"): raise a stage's number when what it keeps changes, and
# the entries of the earlier schema are recomputed.  Stages are named by their
# place in the fit, not by their inputs: when a stage's result changes, raise the
# numbers of the stages after it too.
SCHEMAS = {
    "search": 1,
    # 2 (and every stage after the search): the refinement takes its converged
    # heads even when the layer then fits worse; 3: heads that crawl on more
    # sequences leave for the restart from their patterns
    "refine": 3,
    "heads": 3,
    "lm": 3,
    "search-afresh": 3,
    # 2: the record gained sequences_needed, judged_on, layer_residuals; 3, 4: as
    # every stage after the search
    "from-patterns": 4,
    "polish": 3,
    # skattn layer's teacher examples (hidden states and outputs)
    "examples": 1,
}


def stage_schema(name):
    """The schema number of stage ``name`` (``SCHEMAS`` of its label; 1 for a
    label not listed).

    Examples
    --------
    >>> from skattn.solvers._checkpoints import stage_schema
    >>> stage_schema("refine-1.from-patterns-2"), stage_schema("search-1")
    (4, 1)
    """
    last = name.rsplit(".", 1)[-1]
    match = re.match(r"(.+?)-\d+(?:-|$)", last)
    return SCHEMAS.get(match.group(1) if match else last, 1)


# Seconds between two kept iterates of a Levenberg-Marquardt run (an iterate of
# 12 MiniLM heads is about 8 MB; a run of minutes keeps a few)
ITERATE_INTERVAL = 30.0


# The polish's iteration cap as a fit's key writes it: the decoder's ``max_iter``
# entry, or ``max_iter=N`` inside the encoder's repr of its PolishOptions
_CAP_ENTRY = "max_iter"
_CAP_IN_TEXT = re.compile(r"(PolishOptions\([^)]*?\bmax_iter=)(\d+)")


def _without_cap(key):
    """``(key without the polish's iteration cap, the cap or None)``.

    Examples
    --------
    >>> from skattn.solvers._checkpoints import _without_cap
    >>> _without_cap({"max_iter": 300, "tol": "1e-10"})
    ({'tol': '1e-10'}, 300)
    >>> _without_cap({"polish": "PolishOptions(max_iter=100, tol=1e-10)"})
    ({'polish': 'PolishOptions(max_iter=?, tol=1e-10)'}, 100)
    """
    key, cap = dict(key), key.get(_CAP_ENTRY)
    key.pop(_CAP_ENTRY, None)
    for name, value in key.items():
        found = _CAP_IN_TEXT.search(value) if isinstance(value, str) else None
        if found:
            cap = int(found.group(2))
            key[name] = _CAP_IN_TEXT.sub(r"\g<1>?", value)
    return key, cap


class DamagedCacheError(ValueError):
    """A kept stage whose bytes do not match their digest."""


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_digest(*arrays):
    """A digest of arrays' contents, dtypes and shapes (any namespace; ``None``
    allowed): the part of a fit's key that the data decide.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.solvers._checkpoints import data_digest
    >>> data_digest(np.zeros(3)) == data_digest(np.zeros(3))
    True
    >>> data_digest(np.zeros(3)) == data_digest(np.zeros(3, dtype=np.float32))
    False
    """
    digest = hashlib.sha256()
    for array in arrays:
        if array is None:
            digest.update(b"none")
            continue
        host = np.ascontiguousarray(to_numpy(array))
        digest.update(f"{host.dtype.str}{host.shape}".encode())
        digest.update(memoryview(host).cast("B"))
    return digest.hexdigest()


class StageMemory:
    """The finished stages of one fit, kept in a folder of ``memory``.

    Parameters
    ----------
    memory : str, path, joblib.Memory or None
        Where to keep them (``None``: nowhere; every stage computes).
    key : dict
        What decides the fit besides the data (settings, seeds): JSON-able
        values, or ``repr``-able ones.
    data : tuple of arrays
        The arrays that decide the fit (``X``, ``Y``, the weights).

    Attributes
    ----------
    folder : Path or None
        The fit's folder (``<memory>/skattn/<digest>``).
    reused, computed : list of str
        The stages read back and the stages computed, in order.
    stale : list of dict
        The kept stages found but not reused, each ``{"stage", "written_by",
        "schema", "reason"}``: written by another skattn version (``written_by``,
        ``None`` for a version that did not record it) or under another schema
        of the stage (``reason`` ``"version"``), or before a stage that this fit
        read or computed before it (``"order"``); each was computed again and
        its entry replaced.
    cap : int or None
        The polish's iteration cap written in ``key`` (see the module's notes).
    inherited : Path or None
        The folder of the fit that differs from this one in the cap alone, whose
        stages this fit reads where its own folder has none; its cap is
        ``inherited_cap``.
    continued : list of str
        Kept stages found that the cap would have cut otherwise: gone on from
        their kept iterates instead of read back.

    Examples
    --------
    >>> import numpy as np, tempfile
    >>> from skattn.solvers._checkpoints import StageMemory
    >>> where = tempfile.mkdtemp()
    >>> first = StageMemory(where, {"n_heads": 1}, (np.ones(3),))
    >>> first.stage("search", lambda: np.arange(3.0)).tolist()
    [0.0, 1.0, 2.0]
    >>> again = StageMemory(where, {"n_heads": 1}, (np.ones(3),))
    >>> again.stage("search", lambda: 1 / 0).tolist(), again.reused
    ([0.0, 1.0, 2.0], ['search'])
    """

    def __init__(self, memory, key, data):
        self.reused, self.computed, self.stale, self.continued = [], [], [], []
        self.folder = self.inherited = self.inherited_cap = None
        self.iterate_interval = ITERATE_INTERVAL
        self._calls, self._prefix = {}, ""
        # when the last stage in effect was written (ns): a kept entry written
        # before it followed another run of that stage
        self._latest = 0
        self._replaced = {}  # continued stages: (digest of the value, written)
        # shared with the children: once a stage's value is this fit's own, the
        # inherited fit's later stages followed another and are not read
        self._shared = {"diverged": False}
        location = _location(memory)
        key = {"data": data_digest(*data), **key} if location is not None else key
        self.cap = _without_cap(key)[1]
        if location is None:
            return
        text = json.dumps(key, sort_keys=True, default=repr)
        name = hashlib.sha256(text.encode()).hexdigest()[:32]
        self.folder = Path(location) / "skattn" / name
        self.folder.mkdir(parents=True, exist_ok=True)
        settings = self.folder / "key.json"
        if not settings.exists():
            _atomic_write(settings, text.encode())
        self.inherited, self.inherited_cap = _sibling(self.folder, text)

    @property
    def enabled(self):
        return self.folder is not None

    def next_name(self, label):
        """``"<label>-<i>"``, ``i`` counting this fit's calls of ``label``: a fit
        run again with the same arguments calls its stages in the same order, so
        the names of its stages are those of the interrupted run."""
        count = self._calls[label] = self._calls.get(label, 0) + 1
        return f"{self._prefix}{label}-{count}"

    def child(self, name):
        """The same memory, its stage names under ``name`` with counts of their
        own: for work done in threads, each given its child in call order."""
        child = copy.copy(self)
        child._prefix, child._calls = f"{self._prefix}{name}.", {}
        return child

    def load(self, name):
        """The kept value of stage ``name``, or ``(False, None)`` when not kept
        (or kept before a stage that this fit read or computed before it)."""
        found, entry = self._read(name)
        return (True, entry["value"]) if found else (False, None)

    def _read(self, name):
        """``(True, entry)`` for stage ``name``'s entry that holds, with its
        ``written`` time and the ``cap`` it ran under, or ``(False, None)``."""
        if self.folder is None:
            return False, None
        own = self.folder / (name + _DIGEST)
        if own.exists() or self.inherited is None or self._shared["diverged"]:
            entry = self._entry(self.folder, name, self.cap)
        else:  # the fit under another cap's, held in this fit's folder from now
            entry = self._entry(self.inherited, name, self.inherited_cap)
            if entry is not None:
                _link(self.inherited, self.folder, name)
        return (False, None) if entry is None else (True, entry)

    def _entry(self, folder, name, cap):
        """The entry of stage ``name`` in ``folder`` that holds, or None."""
        data, digest = folder / (name + _DATA), folder / (name + _DIGEST)
        if not digest.exists():
            return None
        expected = digest.read_text().strip()
        if not data.exists() or _sha256(data) != expected:
            raise DamagedCacheError(
                f"The kept stage {str(data)!r} of an earlier fit is damaged (its "
                f"bytes do not match {str(digest)!r}). Delete the folder "
                f"{str(folder)!r} (or pass another memory=) and fit again."
            )
        try:
            value = joblib.load(data)
        except Exception as exc:  # a digest that matches bytes joblib cannot read
            raise DamagedCacheError(
                f"The kept stage {str(data)!r} cannot be read ({exc}). Delete the "
                f"folder {str(folder)!r} and fit again."
            ) from exc
        schema = stage_schema(name)
        if (
            not isinstance(value, dict)
            or value.get("skattn") != __version__
            or value.get("schema") != schema
            or "value" not in value
        ):  # another version's entry: computed again (and replaced)
            written = value if isinstance(value, dict) else {}
            self._stale(name, written, "version")
            return None
        # entries written before stamps were kept: the file's time
        written = value.get("written") or data.stat().st_mtime_ns
        if written < self._latest:  # it followed another run of a stage before it
            self._stale(name, value, "order")
            return None
        return {**value, "written": written, "cap": cap}

    def _stale(self, name, entry, reason):
        self.stale.append(
            {
                "stage": name,
                "written_by": entry.get("skattn"),
                "schema": entry.get("schema"),
                "reason": reason,
            }
        )

    def save(self, name, value):
        """Keep ``value`` as stage ``name`` (written, then its digest), with this
        skattn version, the stage's schema number and the time; returns that
        time (ns)."""
        if self.folder is None:
            return None
        data, digest = self.folder / (name + _DATA), self.folder / (name + _DIGEST)
        digest.unlink(missing_ok=True)
        handle, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(handle)
        written = max(time.time_ns(), self._latest + 1)
        entry = {
            "skattn": __version__,
            "schema": stage_schema(name),
            "written": written,
            "value": value,
        }
        joblib.dump(entry, tmp)
        os.replace(tmp, data)
        _atomic_write(digest, _sha256(data).encode())
        return written

    def take(self, name, settled=None):
        """``(True, value)`` of stage ``name`` where its kept entry holds for
        this fit, else ``(False, None)``: the stage is to be computed (and
        then :meth:`keep`).

        ``settled(value)``, for a stage that the polish's iteration cap can cut
        short: whether the kept value, of a run under another cap, ended before
        either cap could cut it (then it is read back; else it is gone on from
        its kept iterates, and listed in ``continued``).  A stage read back is
        the last in effect: entries written before it are not read after it.
        """
        found, entry = self._read(name)
        if not found:
            return False, None
        value = entry["value"]
        if settled is not None and entry["cap"] != self.cap and not settled(value):
            self.continued.append(name)
            self._replaced[name] = (joblib.hash(value), entry["written"])
            return False, None
        self.reused.append(name)
        self._latest = max(self._latest, entry["written"])
        return True, value

    def keep(self, name, value):
        """Keep the computed ``value`` of stage ``name``, the last in effect (a
        continued stage that ends where it had ended keeps its place in time:
        the stages after it hold still)."""
        written = self.save(name, value)
        self.computed.append(name)
        replaced = self._replaced.pop(name, None)
        if replaced is not None and replaced[0] == joblib.hash(value):
            written = replaced[1]
        else:
            self._shared["diverged"] = True
        if written is not None:
            self._latest = max(self._latest, written)

    def record(self):
        """What this fit kept, for its info: None without a folder, else the
        ``folder``, the stages ``reused``, ``computed`` and ``stale`` in order,
        and, when some were stale, a ``note`` that says so."""
        if self.folder is None:
            return None
        record = {
            "folder": str(self.folder),
            "reused": list(self.reused),
            "computed": list(self.computed),
            "stale": list(self.stale),
            "continued": list(self.continued),
            "inherited": None if self.inherited is None else str(self.inherited),
        }
        other = [entry for entry in self.stale if entry.get("reason") == "version"]
        if other:  # entries of another version: recomputed, and said
            versions = sorted({str(entry["written_by"]) for entry in other})
            record["note"] = (
                f"{len(other)} kept stage(s) in {str(self.folder)!r} were "
                f"written by another skattn version or stage schema (written by "
                f"{', '.join(versions)}; this is skattn {__version__}): computed "
                f"again and replaced, not reused"
            )
        return record

    def stage(self, name, compute, settled=None):
        """Stage ``name``'s value: read back when kept (see :meth:`take` for
        ``settled``), else computed and kept."""
        found, value = self.take(name, settled)
        if found:
            return value
        value = compute()
        self.keep(name, value)
        return value


def _location(memory):
    """The folder of ``memory`` (``None`` for no caching), as ``check_memory``
    reads it."""
    if memory is None:
        return None
    if isinstance(memory, os.PathLike):
        memory = os.fspath(memory)
    memory = check_memory(memory)
    return getattr(memory, "location", None)


def _sibling(folder, text):
    """``(folder, cap)`` of the latest fit beside ``folder`` whose key (the
    JSON ``text``) differs from this fit's in the polish's iteration cap alone,
    or ``(None, None)``."""
    mine = _without_cap(json.loads(text))[0]
    found = []
    for settings in folder.parent.glob("*/key.json"):
        if settings.parent == folder:
            continue
        try:
            other, cap = _without_cap(json.loads(settings.read_text()))
        except (OSError, ValueError):  # not a fit's key: not a sibling
            continue
        if other == mine and cap is not None:
            found.append((settings.parent.stat().st_mtime_ns, settings.parent, cap))
    if not found:
        return None, None
    _, sibling, cap = max(found, key=lambda entry: entry[0])
    return sibling, cap


def _link(source, target, name):
    """Stage ``name``'s entry of folder ``source`` into ``target`` (a hard link,
    or a copy that keeps its times): its digest last, as :meth:`StageMemory.
    save` writes."""
    for suffix in (_DATA, _DIGEST):
        there, here = source / (name + suffix), target / (name + suffix)
        here.unlink(missing_ok=True)
        try:
            os.link(there, here)
        except OSError:  # another file system, or none allowed
            shutil.copy2(there, here)


def _atomic_write(path, payload):
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "wb") as out:
        out.write(payload)
    os.replace(tmp, path)


def kept(memory, label, compute, rng=None, settled=None):
    """``compute(child)``, kept in ``memory`` as the stage ``label`` (numbered),
    with the state of the random generator ``rng`` after it: read back, the
    stage also puts ``rng`` where the computed stage left it, so that the stages
    after it draw what they drew.  ``child`` is the memory of the stages inside
    it (``None`` without memory).  ``settled(value)``: for a stage that the
    polish's iteration cap can cut short (:meth:`StageMemory.take`).

    Examples
    --------
    >>> import numpy as np, tempfile
    >>> from skattn.solvers._checkpoints import StageMemory, kept
    >>> where = tempfile.mkdtemp()
    >>> rng = np.random.default_rng(0)
    >>> first = kept(StageMemory(where, {}, ()), "draw", lambda _: rng.normal(), rng)
    >>> after = rng.normal()
    >>> rng = np.random.default_rng(0)
    >>> again = kept(StageMemory(where, {}, ()), "draw", lambda _: 1 / 0, rng)
    >>> again == first, rng.normal() == after
    (True, True)
    """
    if memory is None or not memory.enabled:
        return compute(None)
    name = memory.next_name(label)

    def run():
        value = compute(memory.child(name))
        return value, None if rng is None else _rng_state(rng)

    test = None if settled is None else (lambda entry: settled(entry[0]))
    value, state = memory.stage(name, run, test)
    if rng is not None:
        _set_rng_state(rng, state)
    return value


def _rng_state(rng):
    if isinstance(rng, np.random.RandomState):
        return rng.get_state()
    return rng.bit_generator.state


def _set_rng_state(rng, state):
    if isinstance(rng, np.random.RandomState):
        rng.set_state(state)
    else:
        rng.bit_generator.state = state
