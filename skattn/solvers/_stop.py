"""Why a solver stopped: one vocabulary for every optimizer and stage.

Every optimizer (:mod:`skattn.solvers.optimizers`) and stage
(:mod:`skattn.solvers.stages`) reports ``stop_reason`` as one of these words, and
so do the fitted ``stop_reason_`` of the gradient baseline and the phase reports.
"""

STOP_REASONS = {
    "step": "converged: the step tolerance was met (Levenberg-Marquardt)",
    "gradient": "converged: the gradient tolerance was met",
    "residual": "converged: the relative residual reached its target (the search)",
    "start": "nothing to do: the start already fits to the target residual",
    "no_decrease": (
        "stopped: the loss no longer decreases (at its rounding floor, or by less "
        "than the tolerance for the allowed number of steps)"
    ),
    "max_iter": "stopped: the iteration budget ran out",
    "singular": "stopped: the step's linear system stayed singular",
    "heads_unconverged": (
        "stopped: heads did not converge on their one-head problems, so the joint "
        "polish was skipped"
    ),
    "partial_fit": "stopped: one epoch of partial_fit, which has no stopping rule",
}


def check_stop_reason(reason):
    """``reason``, after checking that it is a word of :data:`STOP_REASONS`.

    Examples
    --------
    >>> check_stop_reason("step")
    'step'
    """
    if reason not in STOP_REASONS:
        raise AssertionError(
            f"stop reason {reason!r} is not one of {sorted(STOP_REASONS)}"
        )
    return reason
