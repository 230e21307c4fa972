"""Input distributions over sequences of tokens.

Every distribution draws rows of shape ``(n_tokens * n_features,)`` (token-major, as
everywhere in skattn) and supports two ways of drawing the same stream:

* ``sample(n_samples, random_state)`` returns all rows at once;
* ``iter_batches(n_samples, batch_size, random_state)`` yields them in batches.

How the stream is built, so that both agree for every batch size
------------------------------------------------------------------
``random_state`` is turned into one :class:`numpy.random.SeedSequence`. The stream is
cut into fixed chunks of ``chunk_rows`` rows (a number that depends only on the
distribution, at most 1024); chunk ``j`` is generated *in full* by its own generator
``default_rng(SeedSequence(entropy, spawn_key=(j,)))`` and the rows requested are
sliced out of the chunks. Hence, for the same integer ``random_state``:

* the concatenation of ``iter_batches(n, b)`` is identical to ``sample(n)`` for every
  batch size ``b``;
* ``sample(n)`` is a prefix of ``sample(n')`` for ``n <= n'``.

A ``RandomState``/``Generator`` instance (or ``None``, the global ``RandomState``) is
asked for the entropy once per call and is advanced by that draw; two calls with the
same instance therefore give different (independent) streams, as in scikit-learn.
"""

import numbers

import numpy as np
from sklearn.utils import check_random_state, check_scalar

# Largest number of float64 values generated per chunk (2 MiB): the chunk size in
# rows is a function of the distribution's width only, never of n or batch_size.
_CHUNK_VALUES = 2**18
_MAX_CHUNK_ROWS = 1024


def _seed_sequence(random_state):
    """One SeedSequence from None, an int, a RandomState or a Generator.

    ``int``, ``None`` and ``RandomState`` go through
    :func:`sklearn.utils.check_random_state`; the 128 bits of entropy are drawn from
    the resulting ``RandomState`` (or from the ``Generator``), so an int gives a
    reproducible sequence and an instance is advanced by the draw.

    Examples
    --------
    >>> _seed_sequence(0).entropy == _seed_sequence(0).entropy
    True
    """
    if isinstance(random_state, np.random.Generator):
        entropy = random_state.integers(0, 2**32, size=4, dtype=np.uint64)
    else:
        rs = check_random_state(random_state)
        entropy = rs.randint(0, 2**32, size=4, dtype=np.uint64)
    return np.random.SeedSequence([int(e) for e in entropy])


def _as_generator(random_state):
    """A fresh ``numpy.random.Generator`` derived from ``random_state``.

    Examples
    --------
    >>> float(_as_generator(0).random()) == float(_as_generator(0).random())
    True
    """
    return np.random.default_rng(_seed_sequence(random_state))


class TokenDistribution:
    """Base class of the input distributions over ``(n_tokens, n_features)`` sequences.

    Subclasses implement ``_generate(rng, n_rows)`` returning ``(X, labels)`` with
    ``X`` of shape ``(n_rows, n_tokens * n_features)`` and ``labels`` an integer
    array of shape ``(n_rows,)`` or ``None``.

    Parameters
    ----------
    n_tokens : int
        Tokens per sequence k.
    n_features : int
        Features per token d.

    See Also
    --------
    BooleanTokens, GaussianTokens, TokenizedMixture : the distributions.

    Examples
    --------
    >>> import numpy as np
    >>> from skattn.datasets import TokenDistribution
    >>> class Ones(TokenDistribution):
    ...     name = "ones"
    ...     def _generate(self, rng, n_rows):
    ...         return np.ones((n_rows, self.width)), None
    >>> Ones(n_tokens=2, n_features=3).sample(4).shape
    (4, 6)
    """

    name = "base"

    def __init__(self, n_tokens, n_features):
        self.n_tokens = _check_positive_int(n_tokens, "n_tokens")
        self.n_features = _check_positive_int(n_features, "n_features")

    # -- the stream ---------------------------------------------------------------
    @property
    def width(self):
        """Columns of a flattened sample, ``n_tokens * n_features``."""
        return self.n_tokens * self.n_features

    @property
    def chunk_rows(self):
        """Rows generated per internal chunk (depends on the width only)."""
        return int(max(1, min(_MAX_CHUNK_ROWS, _CHUNK_VALUES // self.width)))

    def _generate(self, rng, n_rows):  # pragma: no cover - abstract
        raise NotImplementedError

    def _chunk_generators(self, n_samples, random_state):
        """Yield ``(rng, stop)`` per chunk: its generator and the rows kept of it."""
        seq = _seed_sequence(random_state)
        rows = self.chunk_rows
        n_chunks = -(-n_samples // rows)
        for j in range(n_chunks):
            child = np.random.SeedSequence(seq.entropy, spawn_key=(j,))
            yield np.random.default_rng(child), min(rows, n_samples - j * rows)

    def _chunks(self, n_samples, random_state):
        """Yield ``(X, labels)`` chunks covering the first ``n_samples`` rows."""
        for rng, stop in self._chunk_generators(n_samples, random_state):
            X, labels = self._generate(rng, self.chunk_rows)
            yield X[:stop], None if labels is None else labels[:stop]

    def _batches(self, n_samples, batch_size, random_state):
        """Yield ``(X, labels)`` batches of ``batch_size`` rows (the last may be
        shorter) re-sliced from the fixed chunks."""

        def join(parts):
            return None if parts[0] is None else np.concatenate(parts)

        carry_X, carry_y, n_carry = [], [], 0
        for X, y in self._chunks(n_samples, random_state):
            start = 0
            if n_carry:  # complete the batch begun in earlier chunks
                start = min(batch_size - n_carry, X.shape[0])
                carry_X.append(X[:start])
                carry_y.append(None if y is None else y[:start])
                n_carry += start
                if n_carry < batch_size:
                    continue
                yield join(carry_X), join(carry_y)
                carry_X, carry_y, n_carry = [], [], 0
            while X.shape[0] - start >= batch_size:
                stop = start + batch_size
                yield X[start:stop], None if y is None else y[start:stop]
                start = stop
            if start < X.shape[0]:
                carry_X, carry_y = [X[start:]], [None if y is None else y[start:]]
                n_carry = X.shape[0] - start
        if n_carry:
            yield join(carry_X), join(carry_y)

    def _sample(self, n_samples, random_state):
        n_samples = _check_positive_int(n_samples, "n_samples")
        X = np.empty((n_samples, self.width))
        labels = None
        start = 0
        for chunk, chunk_labels in self._chunks(n_samples, random_state):
            stop = start + chunk.shape[0]
            X[start:stop] = chunk
            if chunk_labels is not None:
                if labels is None:
                    labels = np.empty(n_samples, dtype=chunk_labels.dtype)
                labels[start:stop] = chunk_labels
            start = stop
        return X, labels

    def sample(self, n_samples, random_state=None):
        """Draw ``n_samples`` sequences, flattened token-major.

        Parameters
        ----------
        n_samples : int
            Number of sequences.
        random_state : int, RandomState instance, Generator or None, default=None
            Seed of the stream; see the module docstring for the guarantees.

        Returns
        -------
        X : ndarray of shape (n_samples, n_tokens * n_features)
            float64; token ``t`` of row ``s`` is ``X[s, t*d:(t+1)*d]``.
        """
        return self._sample(n_samples, random_state)[0]

    def iter_batches(self, n_samples, batch_size, random_state=None):
        """Yield the rows of ``sample(n_samples, random_state)`` in batches.

        The concatenation of the batches is identical to ``sample(n_samples,
        random_state)`` (same int seed) for every ``batch_size``.

        Parameters
        ----------
        n_samples : int
            Total number of sequences.
        batch_size : int
            Rows per batch; the last batch holds the remainder.
        random_state : int, RandomState instance, Generator or None, default=None

        Yields
        ------
        X_batch : ndarray of shape (batch_size, n_tokens * n_features)
        """
        n_samples, batch_size = self._check_batches(n_samples, batch_size)
        for X, _ in self._batches(n_samples, batch_size, random_state):
            yield X

    @staticmethod
    def _check_batches(n_samples, batch_size):
        return (
            _check_positive_int(n_samples, "n_samples"),
            _check_positive_int(batch_size, "batch_size"),
        )

    # -- support and shape checks ---------------------------------------------------
    def check(self, X):
        """Validate that X has this distribution's layout and finite values.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or
            (n_samples, n_tokens, n_features)

        Returns
        -------
        X : ndarray of shape (n_samples, n_tokens * n_features)
            The input as a float64 2-D array (a copy only if a conversion was
            needed).

        Raises
        ------
        ValueError
            If X has the wrong rank or width, or non-finite values.
        """
        X = np.asarray(X, dtype=np.float64)
        if X.ndim == 3:
            if X.shape[1:] != (self.n_tokens, self.n_features):
                raise ValueError(
                    f"X has shape {X.shape}, expected (n_samples, {self.n_tokens}, "
                    f"{self.n_features}) for {self!r}."
                )
            X = X.reshape(X.shape[0], -1)
        if X.ndim != 2:
            raise ValueError(
                f"X must be 2-D (n_samples, n_tokens * n_features) or 3-D "
                f"(n_samples, n_tokens, n_features); got an array of shape {X.shape}."
            )
        if X.shape[1] != self.width:
            raise ValueError(
                f"X has {X.shape[1]} columns, expected n_tokens * n_features = "
                f"{self.n_tokens} * {self.n_features} = {self.width} for {self!r}."
            )
        if not np.all(np.isfinite(X)):
            raise ValueError(
                f"X contains NaN or infinite values; {self.name} inputs are finite."
            )
        return X

    # -- display ---------------------------------------------------------------------
    def _params(self):
        return {"n_tokens": self.n_tokens, "n_features": self.n_features}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self._params() == other._params()

    def __hash__(self):
        return hash((type(self).__name__, tuple(self._params().items())))


class BooleanTokens(TokenDistribution):
    """Uniform Boolean tokens: every entry of X is -1 or +1 with probability 1/2.

    The input distribution of Chen & Li (2024). Entries are independent, mean 0,
    variance 1, so for independent tokens ``x, y`` and any matrix Theta the logit
    ``x^T Theta y`` has mean 0 and variance ``||Theta||_F^2``.

    Parameters
    ----------
    n_tokens : int
        Tokens per sequence k.
    n_features : int
        Features per token d.

    Attributes
    ----------
    name : str
        ``"boolean"``.

    See Also
    --------
    GaussianTokens : standard normal tokens.

    Examples
    --------
    >>> from skattn.datasets import BooleanTokens
    >>> dist = BooleanTokens(n_tokens=3, n_features=2)
    >>> X = dist.sample(4, random_state=0)
    >>> X.shape, sorted(set(X.ravel().tolist()))
    ((4, 6), [-1.0, 1.0])
    """

    name = "boolean"

    def _generate(self, rng, n_rows):
        bits = rng.integers(0, 2, size=(n_rows, self.width), dtype=np.int8)
        return 2.0 * bits - 1.0, None

    def check(self, X):
        """Validate layout, and that every entry is exactly -1 or +1.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_tokens * n_features) or \
(n_samples, n_tokens, n_features)
            The sequences to check.

        Returns
        -------
        X : ndarray of shape (n_samples, n_tokens * n_features)
            The input as a float64 2-D array.

        Raises
        ------
        ValueError
            On a wrong shape, or on any value other than ±1, naming the first
            offending value and where it was found.

        Examples
        --------
        >>> import numpy as np
        >>> from skattn.datasets import BooleanTokens
        >>> BooleanTokens(1, 2).check(np.array([[1.0, 0.5]]))
        Traceback (most recent call last):
        ...
        ValueError: X must have entries in {-1, +1} ...
        """
        X = super().check(X)
        bad = np.abs(X) != 1.0
        if np.any(bad):
            row, col = np.argwhere(bad)[0]
            raise ValueError(
                f"X must have entries in {{-1, +1}} for the Boolean input "
                f"distribution, but found {float(X[row, col])!r} at row {row}, "
                f"column {col} "
                f"({int(bad.sum())} such value(s) in total). For real-valued tokens "
                f'use input_distribution="gaussian".'
            )
        return X


class GaussianTokens(TokenDistribution):
    """Standard normal tokens: every entry of X is i.i.d. N(0, 1).

    Parameters
    ----------
    n_tokens : int
        Tokens per sequence k.
    n_features : int
        Features per token d.

    Attributes
    ----------
    name : str
        ``"gaussian"``.

    See Also
    --------
    BooleanTokens : uniform ±1 tokens.

    Examples
    --------
    >>> from skattn.datasets import GaussianTokens
    >>> X = GaussianTokens(n_tokens=2, n_features=3).sample(5, random_state=0)
    >>> X.shape, X.dtype
    ((5, 6), dtype('float64'))
    """

    name = "gaussian"

    def _generate(self, rng, n_rows):
        return rng.standard_normal((n_rows, self.width)), None


class VocabularyTokens(TokenDistribution):
    """Embedded words with positions: the distribution ``"vocabulary"``.

    Token ``l`` is ``[u_w, p_l]``: the vector ``u_w ~ N(0, I)`` of a word ``w``
    drawn uniformly from ``n_words`` in the first ``d - d // 2`` features, the
    vector ``p_l`` of its position (``position_scale`` times ``N(0, I)``) in the
    last ``d // 2``: the input a transformer's first layer sees, where heads can
    attend by content, by position (a previous-token head) or both.  The words
    and positions are fixed by ``vocabulary_seed``, not by the sampling seed.
    (:class:`~skattn.datasets.EmbeddedTokens` draws from a given table, e.g. a
    checkpoint's.)

    Parameters
    ----------
    n_tokens : int
        Tokens per sequence k.
    n_features : int
        Features per token d, at least 2.
    n_words : int, default=3000
        Size of the vocabulary.
    position_scale : float, default=0.8
        Scale of the position vectors.
    vocabulary_seed : int, default=0
        Seed of the word and position vectors.

    Attributes
    ----------
    name : str
        ``"vocabulary"``.
    words : ndarray of shape (n_words, n_features - n_features // 2)
    positions : ndarray of shape (n_tokens, n_features // 2)

    Examples
    --------
    >>> from skattn.datasets import sample_inputs
    >>> X = sample_inputs("vocabulary", 2, 3, 4, random_state=0).reshape(2, 3, 4)
    >>> bool((X[0, :, 2:] == X[1, :, 2:]).all()), bool((X[0, :, 2:] == 0).any())
    (True, False)
    """

    name = "vocabulary"

    def __init__(
        self,
        n_tokens,
        n_features,
        *,
        n_words=3000,
        position_scale=0.8,
        vocabulary_seed=0,
    ):
        super().__init__(n_tokens, n_features)
        if self.n_features < 2:
            raise ValueError(
                "VocabularyTokens needs n_features >= 2 (word and position "
                f"features), got {self.n_features}."
            )
        self.n_words = _check_positive_int(n_words, "n_words")
        self.position_scale = float(position_scale)
        self.vocabulary_seed = int(vocabulary_seed)
        rng = np.random.default_rng(self.vocabulary_seed)
        half = self.n_features // 2
        self.words = rng.standard_normal((self.n_words, self.n_features - half))
        self.positions = self.position_scale * rng.standard_normal(
            (self.n_tokens, half)
        )

    def _params(self):
        return {
            **super()._params(),
            "n_words": self.n_words,
            "position_scale": self.position_scale,
            "vocabulary_seed": self.vocabulary_seed,
        }

    def _generate(self, rng, n_rows):
        ids = rng.integers(self.n_words, size=(n_rows, self.n_tokens))
        shape = (n_rows, self.n_tokens, self.positions.shape[1])
        X = np.concatenate(
            [self.words[ids], np.broadcast_to(self.positions, shape)], axis=-1
        )
        return X.reshape(n_rows, self.width), None


class TokenizedMixture(TokenDistribution):
    """Tokenized mixture: a few class-relevant tokens hidden among noise tokens.

    The data model of Deora et al. (2023), generalised to ``n_classes`` classes.
    Each sequence ``s`` is generated as follows:

    1. a class ``c_s`` is drawn uniformly from ``{0, ..., n_classes - 1}``;
    2. a set ``R_s`` of ``n_relevant`` distinct positions is drawn uniformly among
       the ``n_tokens`` positions;
    3. every relevant token is ``x_t = mu_{c_s} + noise * z_t`` (``t`` in ``R_s``);
    4. every other token is ``x_t = nu + noise * z_t``;

    with ``z_t ~ N(0, I_d)`` i.i.d. The means are fixed, orthogonal and
    deterministic: ``mu_c = signal * e_c`` (the c-th standard basis vector) and
    ``nu = noise_mean * e_{n_classes}`` (so ``nu = 0`` by default: pure Gaussian
    noise tokens).

    Parameters
    ----------
    n_tokens : int
        Tokens per sequence k.
    n_features : int
        Features per token d; at least ``n_classes`` (plus one when
        ``noise_mean != 0``) so that the means are orthogonal.
    n_classes : int, default=2
        Number of classes.
    n_relevant : int, default=1
        Relevant (class-bearing) tokens per sequence, ``1 <= n_relevant <=
        n_tokens``.
    signal : float, default=3.0
        Norm of every class mean ``mu_c``.
    noise : float, default=1.0
        Standard deviation of the Gaussian noise added to every entry.
    noise_mean : float, default=0.0
        Norm of the shared mean ``nu`` of the noise tokens.

    Attributes
    ----------
    name : str
        ``"tokenized_mixture"``.
    class_means : ndarray of shape (n_classes, n_features)
        The ``mu_c``.
    noise_mean_vector : ndarray of shape (n_features,)
        The ``nu``.

    References
    ----------
    .. [1] P. Deora, R. Ghaderi, H. Taheri, C. Thrampoulidis, "On the optimization
       and generalization of multi-head attention", arXiv:2310.12680, 2023.

    Examples
    --------
    >>> from skattn.datasets import TokenizedMixture
    >>> dist = TokenizedMixture(n_tokens=4, n_features=3, noise=0.0)
    >>> X, labels = dist.sample(2, random_state=0, return_labels=True)
    >>> X.shape, labels.shape
    ((2, 12), (2,))
    >>> int((X.reshape(2, 4, 3)[0] != 0).any(axis=1).sum())  # one relevant token
    1
    """

    name = "tokenized_mixture"

    def __init__(
        self,
        n_tokens,
        n_features,
        *,
        n_classes=2,
        n_relevant=1,
        signal=3.0,
        noise=1.0,
        noise_mean=0.0,
    ):
        super().__init__(n_tokens, n_features)
        self.n_classes = _check_positive_int(n_classes, "n_classes")
        self.n_relevant = _check_positive_int(n_relevant, "n_relevant")
        if self.n_relevant > self.n_tokens:
            raise ValueError(
                f"n_relevant={self.n_relevant} exceeds n_tokens={self.n_tokens}; "
                f"expected 1 <= n_relevant <= n_tokens."
            )
        self.signal = float(check_scalar(signal, "signal", numbers.Real, min_val=0))
        self.noise = float(check_scalar(noise, "noise", numbers.Real, min_val=0))
        self.noise_mean = float(
            check_scalar(noise_mean, "noise_mean", numbers.Real, min_val=0)
        )
        needed = self.n_classes + (self.noise_mean != 0)
        if self.n_features < needed:
            raise ValueError(
                f"n_features={self.n_features} is too small for n_classes="
                f"{self.n_classes}"
                + (" and a noise mean" if self.noise_mean else "")
                + f"; the orthogonal means need n_features >= {needed}."
            )
        eye = np.eye(self.n_features)
        self.class_means = self.signal * eye[: self.n_classes]
        self.noise_mean_vector = (
            self.noise_mean * eye[self.n_classes]
            if self.noise_mean
            else np.zeros(self.n_features)
        )

    def _params(self):
        return {
            **super()._params(),
            "n_classes": self.n_classes,
            "n_relevant": self.n_relevant,
            "signal": self.signal,
            "noise": self.noise,
            "noise_mean": self.noise_mean,
        }

    def _generate(self, rng, n_rows):
        k, d = self.n_tokens, self.n_features
        labels = rng.integers(0, self.n_classes, size=n_rows)
        # A uniformly random subset of n_relevant positions: the first n_relevant
        # entries of a uniformly random permutation of the k positions.
        order = np.argsort(rng.random((n_rows, k)), axis=1)
        relevant = np.zeros((n_rows, k), dtype=bool)
        np.put_along_axis(relevant, order[:, : self.n_relevant], True, axis=1)
        means = np.where(
            relevant[:, :, None],
            self.class_means[labels][:, None, :],
            self.noise_mean_vector,
        )
        X = means + self.noise * rng.standard_normal((n_rows, k, d))
        return X.reshape(n_rows, k * d), labels

    def sample(self, n_samples, random_state=None, *, return_labels=False):
        """Draw ``n_samples`` sequences (and their classes on request).

        Parameters
        ----------
        n_samples : int
        random_state : int, RandomState instance, Generator or None, default=None
        return_labels : bool, default=False
            Also return the class of every sequence.

        Returns
        -------
        X : ndarray of shape (n_samples, n_tokens * n_features)
        labels : ndarray of shape (n_samples,)
            Only when ``return_labels=True``: the classes ``c_s`` (ints).
        """
        X, labels = self._sample(n_samples, random_state)
        return (X, labels) if return_labels else X

    def iter_batches(
        self, n_samples, batch_size, random_state=None, *, return_labels=False
    ):
        """Yield the rows (and labels) of ``sample(...)`` in batches.

        Yields ``X_batch`` or, with ``return_labels=True``, ``(X_batch,
        labels_batch)``; their concatenation is identical to ``sample(n_samples,
        random_state, return_labels=...)`` for every ``batch_size``.

        Parameters
        ----------
        n_samples : int
            Total number of sequences.
        batch_size : int
            Rows per batch; the last batch holds the remainder.
        random_state : int, RandomState instance, Generator or None, default=None
            Seed of the stream.
        return_labels : bool, default=False
            Also yield the class of every sequence.

        Yields
        ------
        X_batch : ndarray of shape (batch_size, n_tokens * n_features)
            The next rows.
        labels_batch : ndarray of shape (batch_size,)
            Only when ``return_labels=True``: their classes.
        """
        n_samples, batch_size = self._check_batches(n_samples, batch_size)
        for X, labels in self._batches(n_samples, batch_size, random_state):
            yield (X, labels) if return_labels else X


def _check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


_DISTRIBUTIONS = {
    "boolean": BooleanTokens,
    "gaussian": GaussianTokens,
    "vocabulary": VocabularyTokens,
}


def resolve_distribution(distribution, n_tokens, n_features):
    """A distribution instance from a name or an instance, with shape checks.

    Parameters
    ----------
    distribution : {"boolean", "gaussian", "vocabulary"} or TokenDistribution
        ``"vocabulary"``: :class:`VocabularyTokens`.
    n_tokens, n_features : int
        Shape the distribution must have.

    Returns
    -------
    TokenDistribution

    Examples
    --------
    >>> resolve_distribution("boolean", 3, 2)
    BooleanTokens(n_tokens=3, n_features=2)
    """
    if isinstance(distribution, TokenDistribution):
        if (distribution.n_tokens, distribution.n_features) != (n_tokens, n_features):
            raise ValueError(
                f"distribution={distribution!r} draws {distribution.n_tokens} tokens "
                f"of {distribution.n_features} features, expected n_tokens="
                f"{n_tokens} and n_features={n_features}."
            )
        return distribution
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(
            f"distribution must be one of {sorted(_DISTRIBUTIONS)} or a "
            f"TokenDistribution instance, got {distribution!r}."
        )
    return _DISTRIBUTIONS[distribution](n_tokens, n_features)


def sample_inputs(distribution, n_samples, n_tokens, n_features, *, random_state=None):
    """Draw ``n_samples`` sequences from a named (or given) input distribution.

    Shorthand for ``resolve_distribution(distribution, n_tokens,
    n_features).sample(n_samples, random_state)``.

    Parameters
    ----------
    distribution : {"boolean", "gaussian", "vocabulary"} or TokenDistribution
    n_samples, n_tokens, n_features : int
    random_state : int, RandomState instance, Generator or None, default=None

    Returns
    -------
    X : ndarray of shape (n_samples, n_tokens * n_features)

    Examples
    --------
    >>> sample_inputs("boolean", 2, 3, 2, random_state=0).shape
    (2, 6)
    """
    dist = resolve_distribution(distribution, n_tokens, n_features)
    return dist.sample(n_samples, random_state=random_state)
