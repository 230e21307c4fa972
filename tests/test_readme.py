"""Every code block of the README runs, or is the command another test runs.

The Python quickstart is executed here.  The shell blocks set up an environment
(``python3 -m venv``, ``pip install``: the one this suite runs in) and then run a
command: ``skattn demo`` runs here, ``pytest`` is what CI runs (``.ci/run``) and
the Sphinx command is what ``tests/test_docs.py`` builds.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The environment set-up steps of a shell block, not run by the tests.
SETUP = ("python3 -m venv ", ". .venv/bin/activate", "pip install ")


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _shell_commands():
    """(setup steps, command) of each shell block."""
    blocks = []
    for block in _blocks("bash"):
        steps = [step.strip() for step in block.strip().split("&&")]
        setup = [step for step in steps if step.startswith(SETUP)]
        blocks.append((setup, " && ".join(s for s in steps if s not in setup)))
    return blocks


def test_readme_quickstart_runs_and_recovers(capsys):
    blocks = _blocks("python")
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


def test_every_shell_block_of_the_readme_is_exercised():
    # a new command in the README needs a test that runs it, here or elsewhere
    commands = [command for _, command in _shell_commands()]
    assert commands == [
        "skattn demo",  # test_readme_demo_command_runs
        "pytest",  # this suite, as .ci/run runs it
        "python -m sphinx -W --keep-going -b html docs docs/_build/html",  # test_docs
    ]
    sphinx = (ROOT / "tests" / "test_docs.py").read_text()
    assert all(f'"{flag}"' in sphinx for flag in ("-W", "--keep-going", "html"))


def test_every_extra_the_readme_installs_exists():
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]
    )
    named = re.findall(r"(?:skattn|\.)\[([a-z,]+)\]", README.read_text())
    assert named, "the README names no extra"
    for group in named:
        assert set(group.split(",")) <= extras, group
    for setup, _ in _shell_commands():
        assert any(step.startswith("pip install ") for step in setup)


def test_readme_demo_command_runs():
    # `skattn demo` as the README types it: the console script when installed
    script = shutil.which("skattn", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "skattn"]
    result = subprocess.run(
        [*command, "demo"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Recovered: parameter errors below" in result.stdout


def test_readme_layout_table_lists_every_unit_of_the_package():
    table = README.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(skattn/[\w./]+)`", table))
    package = ROOT / "skattn"
    units = {f"skattn/{p.name}" for p in package.glob("*.py")}
    units |= {
        f"skattn/{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()
    }
    assert named == units, (units - named, named - units)
