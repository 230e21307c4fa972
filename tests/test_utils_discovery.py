"""Discovery of skattn's public estimators (``utils/discovery.py``)."""

import pytest
from sklearn.base import RegressorMixin, TransformerMixin

import skattn
from skattn.utils.discovery import all_estimators


def test_all_estimators_are_the_public_ones_sorted_by_name():
    found = all_estimators()
    names = [name for name, _ in found]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert {"AttentionLayer", "MultiHeadAttentionRegressor"} <= set(names)
    for name, cls in found:
        assert getattr(skattn, name) is cls  # exported at the package's root
        assert not name.startswith(("_", "Base"))


def test_type_filter_keeps_the_kinds_asked_for():
    regressors = all_estimators("regressor")
    transformers = all_estimators(["transformer"])
    assert all(issubclass(cls, RegressorMixin) for _, cls in regressors)
    assert all(issubclass(cls, TransformerMixin) for _, cls in transformers)
    both = all_estimators(["regressor", "transformer"])
    assert sorted(both) == sorted(set(regressors) | set(transformers))
    with pytest.raises(ValueError, match="type_filter must be among"):
        all_estimators("classifier")
