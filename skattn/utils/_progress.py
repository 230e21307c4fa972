"""Progress bars of the stages of a long fit, shown when the fit is verbose.

The estimator's ``fit`` runs the random-start path inside :func:`shown` (its
``verbose``); each stage then opens its bar with :func:`stage_bar`, one tqdm bar
per stage with what it counts (search steps and the residual, heads refined and
each head's residual, polish iterations and the residual) and tqdm's estimate of
the time left.  Outside :func:`shown`, or with ``verbose=0``, a stage's bar is a
do-nothing object and nothing is printed.  The setting travels in a context
variable, so the stages need no argument for it; a bar made in one thread may be
updated from others (tqdm locks its writes).
"""

import contextlib
import contextvars

__all__ = ["shown", "stage_bar", "current_bar", "iteration_bar"]

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
def stage_bar(desc, total, unit, *, iterations=False):
    """A tqdm bar of a stage (``total`` units; None when unknown), or a silent
    one; it is also :func:`current_bar` inside the block, and with
    ``iterations`` the :func:`iteration_bar`."""
    if not _SHOWN.get():
        bar = _Silent()
    else:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
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
