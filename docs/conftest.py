"""Run the documentation's snippets as doctests (``pytest docs``).

Every ``.rst`` page is collected by ``--doctest-glob="*.rst"`` (pyproject.toml):
its ``>>>`` examples run in order, in one namespace per page, in a fresh temporary
folder (the sweep and out-of-core snippets write files).  A page whose snippets
need an optional extra is skipped, with the reason and the extra that installs it,
when the extra is missing; in CI (where ``CI`` is set, and the ``test`` extra
installs them all) that is a failure instead, so no snippet goes unexecuted
silently.
"""

import importlib.util
import os

import pytest

# Sphinx's configuration and build products are not doctests.
collect_ignore = ["conf.py"]
collect_ignore_glob = ["_build/*", "generated/*", "auto_examples/*", "_templates/*"]

# page -> (modules its snippets import, the extra that installs them)
REQUIREMENTS = {
    "evaluation.rst": (["matplotlib"], "plot"),
    "experiments.rst": (
        ["pandas", "pyarrow", "dask", "distributed", "zarr"],
        "sweep,dask,ooc",
    ),
    "tolerances.rst": (["pandas"], "sweep"),
}


def _missing(modules):
    return [name for name in modules if importlib.util.find_spec(name) is None]


@pytest.fixture(autouse=True)
def _snippet_environment(request, tmp_path, monkeypatch):
    """A fresh working folder, a non-interactive matplotlib, the extras present."""
    page = os.path.basename(str(request.node.fspath))
    modules, extra = REQUIREMENTS.get(page, ([], None))
    missing = _missing(modules)
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"the snippets of {page} need {', '.join(missing)}: "
            f"pip install 'skattn[{extra}]'"
        )
    monkeypatch.chdir(tmp_path)
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib

        matplotlib.use("Agg")
    yield
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.pyplot as plt

        plt.close("all")
