"""skattn.utils' private helpers: the optional-dependency guard."""

import pytest

from skattn.utils._optional import require


def test_require_returns_the_module():
    assert require("math", extra="test", feature="x").sqrt(4.0) == 2.0


def test_require_names_the_extra_and_the_package():
    with pytest.raises(ImportError, match=r'feature X requires nopkg.*"skattn\[ooc\]"'):
        require("nopkg.sub", extra="ooc", feature="feature X")
    with pytest.raises(ImportError, match=r"pip install other-name"):
        require("nopkg", extra="ooc", feature="feature X", package="other-name")
