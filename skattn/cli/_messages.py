"""Library messages in the words of the running command: its flags, not the
Python parameters (:func:`_in_flags`), one line each (:func:`_error`,
:func:`_show_warning`)."""

import inspect
import re
import sys

from ._parser import _LAYER_FLAGS, FIT_OPTIONS

# What a command's user can do about a learner parameter it has no flag for
# (said in the command's terms: no Python parameters, issue 64).
_UNSET_HINTS = {
    "fit": "skattn fit cannot set it; its flags are in skattn fit --help",
    "layer": "skattn layer cannot set it: the command fits the default learner",
    "model": "skattn model cannot set it: the command fits the default learner",
}

# (flags, hint) of the command running (main sets it); None: messages as they are.
_WORDS = None

_VALUE = r"""'[^']*'|"[^"]*"|[\w.+-]*\w"""


def _command_words(command):
    """The (flags, hint) of ``command`` for :func:`_in_flags`; None for the
    commands whose messages name parameters on purpose (sweep: config keys)."""
    if command == "fit":
        flags = {p: "--" + o.replace("_", "-") for o, p in FIT_OPTIONS.items()}
        return {**flags, "device": "--device"}, _UNSET_HINTS["fit"]
    if command in ("layer", "model"):
        return _LAYER_FLAGS, _UNSET_HINTS[command]
    return None


def _learner_parameters():
    from ..estimators import MultiHeadAttentionRegressor

    return set(inspect.signature(MultiHeadAttentionRegressor).parameters)


def _in_flags(message, flags, hint=None):
    """A library message in the words of a command.

    ``name=value`` becomes ``--flag value`` and a bare ``name_with_underscores``
    becomes ``--flag`` for the parameters the command has a flag for (``flags``:
    parameter -> flag); the learner parameters it has none for are named as
    such, with ``hint``: where to set them.

    Examples
    --------
    >>> _in_flags('use input_distribution="gaussian".',
    ...           {"input_distribution": "--distribution"})
    'use --distribution gaussian.'
    >>> _in_flags("held_out=0.2 of 9 windows", {"held_out": "--held-out"})
    '--held-out 0.2 of 9 windows'
    >>> _in_flags("raise polish_max_iter.", {}, "set it in Python")
    'raise polish_max_iter. (polish_max_iter: a learner parameter that this command does not have; set it in Python)'
    """  # noqa: E501
    message = str(message)

    def assigned(match):
        value = match.group(2)
        if len(value) > 1 and value[0] in "'\"" and value[-1] == value[0]:
            value = value[1:-1]
        return f"{flags[match.group(1)]} {value}"

    if flags:
        names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
        message = re.sub(rf"(?<![\w-])({names})=({_VALUE})", assigned, message)
        bare = sorted((n for n in flags if "_" in n), key=len, reverse=True)
        if bare:
            pattern = "|".join(map(re.escape, bare))
            message = re.sub(
                rf"(?<![\w-])({pattern})\b", lambda m: flags[m.group(1)], message
            )
    if hint is None:
        return message
    unset = sorted(
        name
        for name in _learner_parameters() - set(flags)
        if re.search(
            rf"(?<![\w-]){re.escape(name)}" + ("\\b" if "_" in name else "="), message
        )
    )
    if unset:
        what = (
            "a learner parameter that this command does not have"
            if len(unset) == 1
            else "learner parameters that this command does not have"
        )
        message += f" ({', '.join(unset)}: {what}; {hint})"
    return message


def _error(message):
    """The ``SystemExit`` of bad input: one line ``skattn: error: ...``, status 1,
    in the words of the running command (its flags, :func:`_in_flags`)."""
    if _WORDS is not None:
        message = _in_flags(message, *_WORDS)
    return SystemExit("skattn: error: " + " ".join(str(message).split()))


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Warnings as one line each, without the source line that looks like a
    traceback, in the words of the running command (:func:`_in_flags`)."""
    stream = sys.stderr if file is None else file
    if _WORDS is not None:
        message = _in_flags(message, *_WORDS)
    text = " ".join(str(message).split())
    print(f"skattn: warning: {category.__name__}: {text}", file=stream)
