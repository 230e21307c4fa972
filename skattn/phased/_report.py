"""PhaseReport: what one phase of the phased learner saw, decided, and its time."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PhaseReport:
    """One record per phase run, kept in ``MultiHeadAttentionRegressor.phase_report_``.

    Parameters
    ----------
    phase : str
        Short name, e.g. ``"1-crude-projection-sum"``.
    round : int
        Refinement round (phases 2-4 repeat), 0 for phases run once.
    seconds : float
        Wall time of the phase.
    info : dict
        What the phase reported: examples and rows used, rows certified, constraints,
        ranks or spectral gaps, residuals, and the estimate it handed on.

    Examples
    --------
    >>> r = PhaseReport("1-crude-projection-sum", 0, 0.25, {"n_samples": 1000})
    >>> r["n_samples"]
    1000
    >>> print(r)
    1-crude-projection-sum  round 0  0.250 s  n_samples=1000
    """

    phase: str
    round: int
    seconds: float
    info: dict = field(default_factory=dict)

    def __getitem__(self, key):
        return self.info[key]

    def summary(self, max_items=6):
        """One line: the phase, its round, its time and its scalar findings.

        Parameters
        ----------
        max_items : int, default=6
            Most scalar entries of ``info`` shown (arrays and dicts are left out).

        Returns
        -------
        line : str

        Examples
        --------
        >>> PhaseReport("5-span", 0, 0.5, {"rank": 2, "basis": [1, 2]}).summary()
        '5-span  round 0  0.500 s  rank=2'
        """
        items = [
            f"{key}={_short(value)}"
            for key, value in self.info.items()
            if np.ndim(value) == 0 and not isinstance(value, dict)
        ][:max_items]
        return (
            f"{self.phase}  round {self.round}  {self.seconds:.3f} s  "
            + "  ".join(items)
        ).rstrip()

    def __str__(self):
        return self.summary()


def _short(value):
    if isinstance(value, float | np.floating):
        return f"{value:.3g}"
    return str(value)


def format_reports(reports):
    """A multi-line table of phase reports (one line each).

    Parameters
    ----------
    reports : list of PhaseReport
        E.g. ``MultiHeadAttentionRegressor.phase_report_``.

    Returns
    -------
    table : str

    Examples
    --------
    >>> print(format_reports([PhaseReport("5-span", 0, 0.001, {"rank": 2})]))
    5-span  round 0  0.001 s  rank=2
    """
    return "\n".join(r.summary() for r in reports)
