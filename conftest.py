"""Test-session set-up shared by the test suite and the doctests.

SCIPY_ARRAY_API must be set before scipy is imported, so that scikit-learn's
array-API estimator check runs instead of being skipped.
"""

import os

os.environ.setdefault("SCIPY_ARRAY_API", "1")
