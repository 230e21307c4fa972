"""The README's quickstart runs and recovers the planted layer."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_quickstart_runs_and_recovers(capsys):
    blocks = _python_blocks()
    assert len(blocks) == 1
    namespace = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    errors = namespace["errors"]
    assert errors.attention_error <= 1e-6 and errors.projection_error <= 1e-6
    assert "Theta error" in capsys.readouterr().out


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    command = 'pip install -e ".[test]" && pytest'
    assert command in README.read_text() and command in ci
