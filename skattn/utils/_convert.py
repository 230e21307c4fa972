"""A fitted estimator's arrays moved to numpy: :func:`estimator_to_numpy`.

An estimator fitted under ``sklearn.config_context(array_api_dispatch=True)``
keeps its fitted arrays in the namespace and on the device of its training data
(torch tensors on a GPU, CuPy arrays, ...), scikit-learn's rule; its ``predict``
then wants inputs of that namespace and device.  :func:`estimator_to_numpy`
returns a copy whose arrays are numpy arrays on the host: to pickle it for a
machine without a GPU, to predict on numpy inputs, or to hand it to code that
computes in numpy.  (scikit-learn 1.9 has a private counterpart,
``sklearn.utils._array_api.move_estimator_to``; skattn supports older
scikit-learn, so this one is its own.)
"""

import copy

import numpy as np
from sklearn.base import clone

from ._array_api import to_numpy
from ._validation import is_foreign_array

__all__ = ["estimator_to_numpy"]


def estimator_to_numpy(estimator):
    """A copy of ``estimator`` whose arrays are numpy arrays on the host.

    Every array among the estimator's attributes -- fitted ones such as
    ``attention_`` and ``projection_``, and parameters -- becomes a numpy array,
    whatever its namespace and device (torch, CuPy, array-api-strict, numpy); the
    search goes into dicts, lists and tuples and into estimators held as
    attributes (``layer_``).  Other attributes are deep copies.  The copy
    shares no memory with ``estimator``, which is left as it is.

    Parameters
    ----------
    estimator : estimator object
        A scikit-learn estimator, fitted or not.

    Returns
    -------
    estimator_numpy : estimator object
        A new estimator of the same class and parameters, its array attributes
        numpy arrays (float64 stays float64).

    See Also
    --------
    skattn.MultiHeadAttentionRegressor : fits in its input's namespace under
        ``array_api_dispatch``.

    Examples
    --------
    >>> import torch
    >>> from sklearn import config_context
    >>> from skattn import MultiHeadAttentionRegressor, make_attention_regression
    >>> from skattn.utils import estimator_to_numpy
    >>> X, y = make_attention_regression(300, 2, 3, 1, n_outputs=4, random_state=0)
    >>> est = MultiHeadAttentionRegressor(n_tokens=2, init="random", random_state=0)
    >>> with config_context(array_api_dispatch=True):  # needs SCIPY_ARRAY_API=1
    ...     est = est.fit(torch.asarray(X), torch.asarray(y))
    >>> type(est.attention_).__name__
    'Tensor'
    >>> est_np = estimator_to_numpy(est)
    >>> type(est_np.attention_).__name__, est_np.attention_.dtype
    ('ndarray', dtype('float64'))
    >>> bool((est_np.attention_ == est.attention_.numpy()).all())
    True
    """
    return _converted(estimator, {})


def _converted(value, memo):
    """``value`` with its arrays as numpy copies (see :func:`estimator_to_numpy`);
    ``memo`` maps ids already converted to their copies (shared objects stay
    shared, cycles end)."""
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, np.ndarray) or is_foreign_array(value):
        out = np.array(to_numpy(value), copy=True)
    elif type(value) is dict:
        out = {name: _converted(item, memo) for name, item in value.items()}
    elif type(value) in (list, tuple):
        out = type(value)(_converted(item, memo) for item in value)
    elif hasattr(value, "get_params") and not isinstance(value, type):
        out = clone(value)
        for name, attribute in vars(value).items():
            setattr(out, name, _converted(attribute, memo))
    else:
        out = copy.deepcopy(value)
    memo[key] = out
    return out
