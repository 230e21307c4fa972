"""The documentation: the generated API page, the gallery scripts, the full build.

The full Sphinx build (``sphinx-build -W --keep-going -b html``: warnings are
errors, the gallery examples run) takes about a minute and needs the Sphinx tools,
which the ``test`` extra installs; outside CI it is skipped when one is missing (CI,
where ``CI`` is set, fails instead).  The other tests need no Sphinx.
"""

import ast
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
DOCS_REQUIREMENTS = ["sphinx", "numpydoc", "sphinx_gallery", "pydata_sphinx_theme"]


def _copy_sources(destination):
    """Copy docs/ and examples/ (without build products) into ``destination``."""
    ignore = shutil.ignore_patterns(
        "_build", "generated", "auto_examples", "api.rst", "sg_execution_times.rst"
    )
    shutil.copytree(DOCS, destination / "docs", ignore=ignore)
    shutil.copytree(EXAMPLES, destination / "examples", ignore=ignore)
    return destination / "docs"


def _load_conf(docs_dir):
    """Import docs/conf.py from a copy (importing it writes api.rst beside it)."""
    spec = importlib.util.spec_from_file_location(
        "skattn_docs_conf", docs_dir / "conf.py"
    )
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


def _api_entries(api_rst):
    """(module, name) pairs listed in the autosummary blocks of api.rst."""
    entries, module = [], None
    for line in api_rst.read_text().splitlines():
        if line.startswith(".. currentmodule::"):
            module = line.split("::")[1].strip()
        elif module and re.fullmatch(r"   [A-Za-z_]\w*", line):
            entries.append((module, line.strip()))
    return entries


def test_api_page_lists_every_public_name_once(tmp_path):
    conf = _load_conf(_copy_sources(tmp_path))
    entries = _api_entries(tmp_path / "docs" / "api.rst")
    assert ("skattn.layer", "AttentionLayer") in entries
    assert ("skattn.utils.discovery", "all_estimators") in entries
    documented = [getattr(importlib.import_module(mod), name) for mod, name in entries]
    # each object once (a re-export is documented in the most specific module)
    assert len({id(obj) for obj in documented}) == len(documented)
    # every name a module exports is documented somewhere
    for module_name, _, _ in conf.API_SECTIONS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        exported = conf.API_NAMES.get(module_name, getattr(module, "__all__", []))
        for name in set(exported) - conf.API_EXCLUDE:
            obj = getattr(module, name)
            assert any(obj is doc for doc in documented), f"{module_name}.{name}"


def test_api_page_is_rewritten_only_when_it_changes(tmp_path):
    conf = _load_conf(_copy_sources(tmp_path))
    api = tmp_path / "docs" / "api.rst"
    before = api.stat().st_mtime_ns
    os.utime(api, ns=(before - 10**9, before - 10**9))
    conf.write_api_page(api)
    assert api.stat().st_mtime_ns == before - 10**9


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("plot_*.py")), ids=str)
def test_gallery_script_has_a_title(script):
    # sphinx-gallery needs a module docstring opening with an rst title: a line
    # underlined (and optionally overlined) by a rule at least as long as it.
    docstring = ast.get_docstring(ast.parse(script.read_text()), clean=False)
    assert docstring, f"{script.name} has no docstring"
    lines = docstring.strip("\n").splitlines()
    if len(set(lines[0])) == 1 and lines[0][0] in "=-~#*^":
        lines = lines[1:]  # the overline
    title, rule = lines[0].strip(), lines[1]
    assert title and len(set(rule)) == 1 and rule[0] in "=-~#*^", script.name
    assert len(rule) >= len(title), script.name
    assert "# %%" in script.read_text(), f"{script.name} has no '# %%' cells"


def _code_blocks(page):
    """(language, body) of every code directive and literal block of an rst page."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        directive = re.match(r"\s*\.\. (?:code-block|code|sourcecode)::\s*(\S*)", line)
        literal = line.rstrip().endswith("::") and not line.lstrip().startswith("..")
        if not (directive or literal):
            continue
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and not following.startswith((" ", "\t")):
                break
            body.append(following)
        blocks.append((directive.group(1) if directive else "literal", "\n".join(body)))
    return blocks


def test_every_code_example_of_the_docs_is_a_doctest():
    # pytest runs the pages' >>> examples (--doctest-glob, docs/conftest.py); a
    # `code-block:: python` or a `::` block of code would never be executed
    pages = sorted(DOCS.rglob("*.rst")) + [EXAMPLES / "README.rst"]
    skipped = {"_build", "generated", "_templates"}
    pages = [page for page in pages if not skipped & set(page.parts)]
    doctests = 0
    for page in pages:
        for language, body in _code_blocks(page):
            assert language == "pycon", f"{page.name}: a {language} block is not run"
            assert ">>> " in body, f"{page.name}: a pycon block without >>>"
            doctests += 1
    assert doctests >= 9  # index.rst and the 8 snippets of the user guide


def test_gallery_has_a_header():
    assert (EXAMPLES / "README.rst").is_file()


def test_docs_build_without_warnings(tmp_path):
    missing = [
        name for name in DOCS_REQUIREMENTS if importlib.util.find_spec(name) is None
    ]
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"building the docs needs {', '.join(missing)}: pip install -e '.[docs]'"
        )
    docs = _copy_sources(tmp_path)
    out = tmp_path / "html"
    env = dict(
        os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-b",
            "html",
            str(docs),
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    problems = [
        line
        for line in result.stderr.splitlines()
        if "WARNING" in line or "ERROR" in line
    ]
    assert result.returncode == 0, "\n".join(problems) or result.stderr[-6000:]
    for page in [
        "index.html",
        "api.html",
        "user_guide/phased.html",
        "auto_examples/index.html",
    ]:
        assert (out / page).is_file(), page
    for script in EXAMPLES.glob("plot_*.py"):
        assert (out / "auto_examples" / f"{script.stem}.html").is_file(), script.name
        assert list((out / "_images").glob(f"sphx_glr_{script.stem}_*.png")), (
            script.name
        )
