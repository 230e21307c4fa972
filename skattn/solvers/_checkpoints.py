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
"""

import copy
import hashlib
import json
import os
import re
import tempfile
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
        "schema"}``: written by another skattn version (``written_by``, ``None``
        for a version that did not record it) or under another schema of the
        stage; each was computed again and its entry replaced.

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
        self.reused, self.computed, self.stale = [], [], []
        self.folder = None
        self.iterate_interval = ITERATE_INTERVAL
        self._calls, self._prefix = {}, ""
        location = _location(memory)
        if location is None:
            return
        key = {"data": data_digest(*data), **key}
        text = json.dumps(key, sort_keys=True, default=repr)
        name = hashlib.sha256(text.encode()).hexdigest()[:32]
        self.folder = Path(location) / "skattn" / name
        self.folder.mkdir(parents=True, exist_ok=True)
        settings = self.folder / "key.json"
        if not settings.exists():
            _atomic_write(settings, text.encode())

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
        """The kept value of stage ``name``, or ``(False, None)`` when not kept."""
        if self.folder is None:
            return False, None
        data, digest = self.folder / (name + _DATA), self.folder / (name + _DIGEST)
        if not digest.exists():
            return False, None
        expected = digest.read_text().strip()
        if not data.exists() or _sha256(data) != expected:
            raise DamagedCacheError(
                f"The kept stage {str(data)!r} of an earlier fit is damaged (its "
                f"bytes do not match {str(digest)!r}). Delete the folder "
                f"{str(self.folder)!r} (or pass another memory=) and fit again."
            )
        try:
            value = joblib.load(data)
        except Exception as exc:  # a digest that matches bytes joblib cannot read
            raise DamagedCacheError(
                f"The kept stage {str(data)!r} cannot be read ({exc}). Delete the "
                f"folder {str(self.folder)!r} and fit again."
            ) from exc
        schema = stage_schema(name)
        if (
            not isinstance(value, dict)
            or value.get("skattn") != __version__
            or value.get("schema") != schema
            or "value" not in value
        ):  # another version's entry: computed again (and replaced)
            written = value if isinstance(value, dict) else {}
            self.stale.append(
                {
                    "stage": name,
                    "written_by": written.get("skattn"),
                    "schema": written.get("schema"),
                }
            )
            return False, None
        return True, value["value"]

    def save(self, name, value):
        """Keep ``value`` as stage ``name`` (written, then its digest), with this
        skattn version and the stage's schema number."""
        if self.folder is None:
            return
        data, digest = self.folder / (name + _DATA), self.folder / (name + _DIGEST)
        digest.unlink(missing_ok=True)
        handle, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(handle)
        entry = {"skattn": __version__, "schema": stage_schema(name), "value": value}
        joblib.dump(entry, tmp)
        os.replace(tmp, data)
        _atomic_write(digest, _sha256(data).encode())

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
        }
        if self.stale:  # entries of another version: recomputed, and said
            versions = sorted({str(entry["written_by"]) for entry in self.stale})
            record["note"] = (
                f"{len(self.stale)} kept stage(s) in {str(self.folder)!r} were "
                f"written by another skattn version or stage schema (written by "
                f"{', '.join(versions)}; this is skattn {__version__}): computed "
                f"again and replaced, not reused"
            )
        return record

    def stage(self, name, compute):
        """Stage ``name``'s value: read back when kept, else computed and kept."""
        found, value = self.load(name)
        if found:
            self.reused.append(name)
            return value
        value = compute()
        self.save(name, value)
        self.computed.append(name)
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


def _atomic_write(path, payload):
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "wb") as out:
        out.write(payload)
    os.replace(tmp, path)


def kept(memory, label, compute, rng=None):
    """``compute(child)``, kept in ``memory`` as the stage ``label`` (numbered),
    with the state of the random generator ``rng`` after it: read back, the
    stage also puts ``rng`` where the computed stage left it, so that the stages
    after it draw what they drew.  ``child`` is the memory of the stages inside
    it (``None`` without memory).

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

    value, state = memory.stage(name, run)
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
