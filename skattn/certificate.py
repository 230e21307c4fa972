"""Public path kept for :mod:`skattn.diagnostics`' certificate (see there)."""

from .diagnostics._certificate import Certificate, certify

__all__ = ["Certificate", "certify"]
