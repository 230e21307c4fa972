"""Progress bars of the stages of a long fit, shown when the fit is verbose.

The estimator's ``fit`` runs the random-start path inside :func:`shown` (its
``verbose``); each stage then opens its bar with :func:`stage_bar`, one tqdm bar
per stage with what it counts (search steps and the residual, heads refined and
each head's residual, polish iterations and the residual) and tqdm's estimate of
the time left.  Outside :func:`shown`, or with ``verbose=0``, a stage's bar is a
do-nothing object and nothing is printed.  The setting travels in a context
variable, so the stages need no argument for it; a bar made in one thread may be
updated from others (tqdm locks its writes).

A bar's total is what the stage will count, or nothing: a stage that may stop
early shows an open-ended count with its bound in the description (``polish (at
most 200)``), so that no estimate of the time left rests on a total that changes
mid-run.  When stderr is no terminal (a log file, a pipe), the bars are plain
text (:class:`PlainBar`): a line when a stage starts, one at most every
:data:`PLAIN_INTERVAL` seconds while it counts, and one when it ends, without
the control codes that redraw a terminal's line.
"""

import contextlib
import contextvars
import sys
import threading
import time

__all__ = ["shown", "stage_bar", "current_bar", "iteration_bar", "make_bar", "PlainBar"]

# Seconds between two lines of a plain-text bar while it counts.
PLAIN_INTERVAL = 30.0

_SHOWN = contextvars.ContextVar("skattn_progress_shown", default=False)
_CURRENT = contextvars.ContextVar("skattn_progress_current", default=None)
# the bar that counts Levenberg-Marquardt iterations (the joint polish's only: the
# heads' own problems are counted by head)
_ITERATIONS = contextvars.ContextVar("skattn_progress_iterations", default=None)


class _Silent:
    """A bar that shows nothing."""

    n = 0
    total = None

    def update(self, n=1):
        pass

    def refresh(self):
        pass

    def set_postfix_str(self, text, refresh=True):
        pass

    def set_description_str(self, text, refresh=True):
        pass


class PlainBar:
    """A progress bar for a log file: plain lines, no control codes.

    One line when it starts, one at most every ``interval`` seconds while it
    counts (at an update), and one when it closes, each ``desc: count unit
    [elapsed], postfix``; the count is ``n/total``, or ``n`` when the total is
    not known.  The methods the stages call on a tqdm bar (``update``,
    ``set_postfix_str``, ``set_description_str``, ``refresh``, ``close``).

    Examples
    --------
    >>> import io
    >>> from skattn.utils._progress import PlainBar
    >>> out = io.StringIO()
    >>> bar = PlainBar("polish (at most 200)", None, "iter", file=out, clock=lambda: 0)
    >>> bar.update(3); bar.set_postfix_str("loss 0.1"); bar.close()
    >>> print(out.getvalue(), end="")
    polish (at most 200): 0 iter [0:00]
    polish (at most 200): 3 iter [0:00], loss 0.1 (done)
    """

    def __init__(
        self,
        desc,
        total,
        unit,
        *,
        file=None,
        interval=None,
        clock=time.monotonic,
    ):
        self.desc, self.total, self.unit, self.n = desc, total, unit, 0
        self.postfix = ""
        self._file = sys.stderr if file is None else file
        self._interval = PLAIN_INTERVAL if interval is None else interval
        self._clock = clock
        self._start = self._last = clock()
        self._lock = threading.Lock()
        self._closed = False
        self._print()

    def _print(self, end=""):
        count = self.n if self.total is None else f"{self.n}/{self.total}"
        seconds = int(self._clock() - self._start)
        line = f"{self.desc}: {count} {self.unit} [{seconds // 60}:{seconds % 60:02d}]"
        if self.postfix:
            line += f", {self.postfix}"
        print(line + end, file=self._file, flush=True)

    def update(self, n=1):
        with self._lock:
            self.n += n
            now = self._clock()
            if now - self._last >= self._interval:
                self._last = now
                self._print()

    def set_postfix_str(self, text, refresh=True):
        self.postfix = str(text)

    def set_description_str(self, text, refresh=True):
        self.desc = str(text)

    def refresh(self):
        pass

    def close(self):
        with self._lock:
            if not self._closed:
                self._closed = True
                self._print(" (done)")


def _is_terminal(stream):
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


def make_bar(total, desc, unit, *, at_most=None):
    """A shown bar: tqdm on a terminal, a :class:`PlainBar` elsewhere.

    ``at_most``: the stage counts at most this many units but may stop before;
    the count is then open-ended and the bound is in the description.
    """
    if at_most is not None:
        total, desc = None, f"{desc} (at most {at_most})"
    if not _is_terminal(sys.stderr):
        return PlainBar(desc, total, unit)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)


@contextlib.contextmanager
def shown(verbose):
    """Within it, :func:`stage_bar` shows its bars when ``verbose`` is positive.

    Examples
    --------
    >>> from skattn.utils._progress import shown, stage_bar
    >>> with shown(0), stage_bar("search", 10, "step") as bar:
    ...     bar.update(3)
    """
    token = _SHOWN.set(bool(verbose) and verbose > 0)
    try:
        yield
    finally:
        _SHOWN.reset(token)


@contextlib.contextmanager
def stage_bar(desc, total, unit, *, iterations=False, at_most=None):
    """The bar of a stage (:func:`make_bar`: ``total`` units, None when unknown;
    ``at_most``, a bound the stage may stop before), or a silent one; it is also
    :func:`current_bar` inside the block, and with ``iterations`` the
    :func:`iteration_bar`."""
    if not _SHOWN.get():
        bar = _Silent()
    else:
        bar = make_bar(total, desc, unit, at_most=at_most)
    token = _CURRENT.set(bar)
    counting = _ITERATIONS.set(bar) if iterations else None
    try:
        yield bar
    finally:
        _CURRENT.reset(token)
        if counting is not None:
            _ITERATIONS.reset(counting)
        if not isinstance(bar, _Silent):
            bar.close()


def current_bar():
    """The bar of the innermost :func:`stage_bar` (a silent one outside any)."""
    bar = _CURRENT.get()
    return _Silent() if bar is None else bar


def iteration_bar():
    """The bar that counts the joint polish's iterations (silent elsewhere)."""
    bar = _ITERATIONS.get()
    return _Silent() if bar is None else bar
