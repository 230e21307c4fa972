"""Run the documentation's snippets as doctests (``pytest docs``).

Every ``.rst`` page is collected by ``--doctest-glob="*.rst"`` (pyproject.toml):
its ``>>>`` examples run in order, in one namespace per page, in a fresh temporary
folder (the sweep and out-of-core snippets write files).  A page whose snippets
need an optional extra that is missing is skipped with the reason and the extra
that installs it, by the hook of the root ``conftest.py`` (in CI, where the
``test`` extra installs them all, it runs and fails instead).
"""

import importlib.util

import pytest

# Sphinx's configuration and build products are not doctests.
collect_ignore = ["conf.py"]
collect_ignore_glob = ["_build/*", "generated/*", "auto_examples/*", "_templates/*"]


@pytest.fixture(autouse=True)
def _snippet_environment(tmp_path, monkeypatch):
    """A fresh working folder and a non-interactive matplotlib."""
    monkeypatch.chdir(tmp_path)
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib

        matplotlib.use("Agg")
    yield
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.pyplot as plt

        plt.close("all")
