"""What phases 2-4 raise and warn when too few rows certify at a tolerance."""


class CertificationError(ValueError):
    """Too few certified rows or constraints at the current tolerance.

    A ``ValueError``: relaxing the certification tolerance or passing more examples
    fixes it, and the message says which.

    Examples
    --------
    >>> issubclass(CertificationError, ValueError)
    True
    """


class CertificationWarning(UserWarning):
    """Phases 2-4 stopped early: a later round certified too few rows.

    Examples
    --------
    >>> issubclass(CertificationWarning, UserWarning)
    True
    """
