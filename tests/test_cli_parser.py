"""The options of every command: their names and defaults, alike across commands
and equal to the estimator's.  The commands end to end: tests/test_cli_main.py."""


def test_fit_help_defaults_are_the_estimators():
    from skattn import MultiHeadAttentionRegressor
    from skattn.cli._parser import FIT_OPTIONS, _parser

    estimator = MultiHeadAttentionRegressor().get_params()
    fit = _parser()._subparsers._group_actions[0].choices["fit"]
    for action in fit._actions:
        parameter = FIT_OPTIONS.get(action.dest)
        if parameter and action.dest not in ("n_tokens", "random_state"):
            assert action.default == estimator[parameter], action.dest


def test_fit_and_layer_share_their_option_names_and_defaults():
    from skattn.cli._parser import _parser

    commands = _parser()._subparsers._group_actions[0].choices
    for name in ("demo", "fit", "layer"):
        for seed in ("--seed", "--random-state"):
            args = _command_args(commands, name, [seed, "7"])
            assert args.random_state == 7, (name, seed)
    for name in ("fit", "layer"):  # progress bars by default in both
        assert _command_args(commands, name, []).verbose == 1
        assert _command_args(commands, name, ["--quiet"]).verbose == 0
        assert _command_args(commands, name, ["--verbose"]).verbose == 2
        assert _command_args(commands, name, ["--cache", "c"]).cache == "c"


def _command_args(commands, name, extra):
    required = {
        "demo": [],
        "fit": ["X.npy", "--n-tokens", "2"],
        "layer": ["--layer", "0", "--text", "t.txt"],
    }
    return commands[name].parse_args(required[name] + extra)
