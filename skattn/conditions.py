"""Public path kept for :mod:`skattn.diagnostics`' conditions (see there)."""

from .diagnostics._conditions import *  # noqa: F403
from .diagnostics._conditions import __all__  # noqa: F401
