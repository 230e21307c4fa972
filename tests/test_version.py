"""``skattn/_version.py``: the one place the version is written."""

import importlib.metadata

import skattn
from skattn._version import __version__


def test_the_package_metadata_reads_the_version():
    # pyproject.toml's dynamic version is this attribute: the installed
    # distribution, the package and the memory's stage entries agree
    assert skattn.__version__ == __version__
    assert importlib.metadata.version("skattn") == __version__
