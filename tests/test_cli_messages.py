"""Library messages in a command's words: flags, not Python parameters.  Each
command's messages end to end: tests/test_cli_main.py."""


def test_layer_messages_name_the_flags_or_where_to_set_the_rest():
    from skattn.cli._messages import _command_words, _in_flags

    words = _command_words("layer")
    assert _in_flags(
        "held_out=0.1 of 2 windows leaves none to hold out; use more windows or "
        "another held_out.",
        *words,
    ) == (
        "--held-out 0.1 of 2 windows leaves none to hold out; use more windows or "
        "another --held-out."
    )
    # learner parameters that skattn layer has no flag for: said so, in the
    # command's terms (no Python parameter to pass)
    text = _in_flags("... Pass init='random' to silence this warning.", *words)
    assert text.startswith("... Pass init='random' to silence this warning. (init: ")
    assert text.endswith(
        "a learner parameter that this command does not have; skattn layer cannot "
        "set it: the command fits the default learner)"
    )
    # skattn fit has --init
    assert _in_flags("Pass init='random' now.", *_command_words("fit")) == (
        "Pass --init random now."
    )
    # skattn sweep's config keys are the parameters: its messages stay as they are
    assert _command_words("sweep") is None
