"""Every public name of skattn has a numpydoc docstring with a runnable example.

The public names are the ``__all__`` of ``skattn`` and of its public subpackages,
``skattn.utils.estimator_checks`` and ``skattn.utils.discovery.all_estimators``
(``skattn.layer`` and ``skattn.diagnostics`` among the subpackages).  Each public
function and class needs a summary, a Parameters section naming exactly the
arguments of its signature (of
``__init__`` for a class), a Returns (or Yields) section when it returns something,
and an Examples section with at least one ``>>>`` line.  Each public method of a
public class (``fit``, ``predict``, ``transform``, ``sample``, the ``from_*``
constructors of the displays, ...) defined in skattn needs a summary, and the
Parameters and Returns sections when it takes or returns something; a property
needs a summary.

The docstrings are parsed with :mod:`numpydoc.validate` when numpydoc is
installed (the ``docs`` extra), else with a simpler check of the section headers.
The examples themselves run as doctests (``pytest --doctest-modules``, see
``pyproject.toml``).
"""

import ast
import importlib
import inspect
import re
import textwrap

import pytest

try:
    from numpydoc.validate import validate as numpydoc_validate
except ImportError:  # pragma: no cover - numpydoc is in the docs extra
    numpydoc_validate = None

# (module, names): names=None means the module's ``__all__``.
PUBLIC_MODULES = [
    ("skattn", None),
    ("skattn.datasets", None),
    ("skattn.metrics", None),
    ("skattn.estimators", None),
    ("skattn.phased", None),
    ("skattn.experiments", None),
    ("skattn.layer", None),
    ("skattn.diagnostics", None),
    ("skattn.utils.estimator_checks", None),
    ("skattn.utils.discovery", ["all_estimators"]),
]

# numpydoc error codes checked: missing docstring or summary, parameters missing
# from or unknown to the docstring, missing Returns / Yields, missing Examples.
CHECKED_CODES = {"GL08", "SS01", "PR01", "PR02", "RT01", "YD01", "EX01"}
# Methods need no Examples section (their class has one).
METHOD_CODES = CHECKED_CODES - {"EX01"}

# Known gaps in files owned elsewhere: {qualified name: the missing piece}.  A
# listed name is an expected failure until its docstring is completed (not strict:
# the names are checked only once ``skattn.phased`` exports them).
KNOWN_GAPS = {}


def _public_objects():
    """(qualified name, object) of every public function and class, once each.

    A name re-exported by a parent module (``skattn.check_conditions``) is checked
    once, under the most specific module that exports it, as in the API page.
    """
    home = {}
    for module_name, names in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        if names is None:
            names = getattr(module, "__all__", None)
        if names is None:
            names = [name for name in vars(module) if not name.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants such as __version__ or THRESHOLDS
            known = home.get(id(obj))
            if known is None or len(module_name) > len(known[0].rpartition(".")[0]):
                home[id(obj)] = (f"{module_name}.{name}", obj)
    return sorted(home.values(), key=lambda item: item[0])


def _public_methods(qualname, cls):
    """(qualified name, member, kind) of the public methods and properties of cls.

    Only members written in skattn are checked: those inherited from
    scikit-learn (``get_params``, ``score``, ...) are documented there.
    """
    found = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        for owner in cls.__mro__:
            if name in vars(owner):
                member = vars(owner)[name]
                break
        else:  # pragma: no cover - dir() lists only attributes of the MRO
            continue
        if not owner.__module__.startswith("skattn"):
            continue
        if isinstance(member, property):
            found.append((f"{qualname}.{name}", member, "property"))
        elif isinstance(member, staticmethod | classmethod):
            found.append((f"{qualname}.{name}", member.__func__, "method"))
        elif inspect.isfunction(member):
            found.append((f"{qualname}.{name}", member, "method"))
        elif inspect.isfunction(getattr(member, "fn", None)):
            # scikit-learn's available_if (e.g. partial_fit of the Adam optimizer)
            found.append((f"{qualname}.{name}", member.fn, "method"))
    return found


PUBLIC_OBJECTS = _public_objects()
PUBLIC_METHODS = [
    method
    for qualname, obj in PUBLIC_OBJECTS
    if inspect.isclass(obj)
    for method in _public_methods(qualname, obj)
]


def _mark_known_gaps(items):
    """pytest params, marked xfail where KNOWN_GAPS names a missing piece."""
    params = []
    for item in items:
        reason = KNOWN_GAPS.get(item[0])
        marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
        params.append(pytest.param(*item, id=item[0], marks=marks))
    return params


def _returns_something(func):
    """Whether func's source has a ``return <value>`` (outside nested functions)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):  # pragma: no cover - no source
        return False
    body = tree.body[0]
    stack = list(ast.iter_child_nodes(body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def _documented_parameters(doc):
    """Names in the Parameters section (``a, b : int`` documents both)."""
    match = re.search(
        r"^\s*Parameters\n\s*-{3,}\n(.*?)(?=^\s*\w[\w ]*\n\s*-{3,}\n|\Z)",
        doc,
        re.S | re.M,
    )
    if not match:
        return set()
    indent = min(
        len(line) - len(line.lstrip())
        for line in match.group(1).splitlines()
        if line.strip()
    )
    names = set()
    for line in match.group(1).splitlines():
        if line.strip() and len(line) - len(line.lstrip()) == indent:
            for name in line.split(":")[0].split(","):
                names.add(name.strip().lstrip("*"))
    return names


def _simple_errors(obj, func, codes):
    """A fallback for numpydoc.validate: the section headers and parameter names."""
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return [("GL08", "The object does not have a docstring")]
    errors = []
    params = (
        [
            name
            for name, p in inspect.signature(func).parameters.items()
            if name not in ("self", "cls")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if func is not None
        else []
    )
    documented = _documented_parameters(doc)
    missing, unknown = set(params) - documented, documented - set(params)
    if missing and "PR01" in codes:
        errors.append(("PR01", f"Parameters {sorted(missing)} not documented"))
    if unknown and "PR02" in codes:
        errors.append(("PR02", f"Unknown parameters {sorted(unknown)}"))
    has_returns = re.search(r"^(Returns|Yields)\n-{3,}$", doc, re.M)
    if func is not None and _returns_something(func) and not has_returns:
        errors.append(("RT01", "No Returns section found"))
    if "EX01" in codes and not re.search(r"^Examples\n-{3,}$", doc, re.M):
        errors.append(("EX01", "No examples section found"))
    return errors


def _errors(qualname, obj, codes):
    """The docstring errors of obj among ``codes``, as (code, message) pairs."""
    if inspect.isclass(obj):
        func = obj.__init__ if obj.__init__ is not object.__init__ else None
    else:
        func = obj
    if numpydoc_validate is None:
        return _simple_errors(obj, func, codes)
    result = numpydoc_validate(qualname)
    errors = [(code, msg) for code, msg in result["errors"] if code in codes]
    if inspect.isclass(obj) and "RT01" in codes:
        # a class's "return" is itself; numpydoc does not ask for Returns there
        errors = [(code, msg) for code, msg in errors if code != "RT01"]
    return errors


def _examples_section(obj):
    """The text of the Examples section of obj's docstring ('' when absent)."""
    doc = inspect.getdoc(obj) or ""
    match = re.search(
        r"^Examples\n-{3,}\n(.*?)(?=^\w[\w ]*\n-{3,}$|\Z)", doc, re.S | re.M
    )
    return match.group(1) if match else ""


def test_public_names_are_found():
    names = {qualname for qualname, _ in PUBLIC_OBJECTS}
    assert "skattn.layer.AttentionLayer" in names
    assert "skattn.estimators.MultiHeadAttentionRegressor" in names
    assert "skattn.utils.discovery.all_estimators" in names
    assert "skattn.diagnostics.check_conditions" in names
    methods = {qualname for qualname, _, _ in PUBLIC_METHODS}
    assert "skattn.estimators.MultiHeadAttentionRegressor.fit" in methods
    assert "skattn.metrics.AttentionPatternDisplay.from_estimator" in methods
    assert "skattn.estimators.GradientAttentionRegressor.partial_fit" in methods
    # methods inherited from scikit-learn are documented there
    assert "skattn.estimators.MultiHeadAttentionRegressor.get_params" not in methods


@pytest.mark.parametrize("qualname, obj", _mark_known_gaps(PUBLIC_OBJECTS))
def test_public_object_has_numpydoc_docstring(qualname, obj):
    errors = _errors(qualname, obj, CHECKED_CODES)
    assert not errors, f"{qualname}: " + "; ".join(f"{c} {m}" for c, m in errors)
    examples = _examples_section(obj)
    assert re.search(r"^\s*>>> ", examples, re.M), (
        f"{qualname}: the Examples section has no '>>>' line"
    )


@pytest.mark.parametrize("qualname, member, kind", _mark_known_gaps(PUBLIC_METHODS))
def test_public_method_has_numpydoc_docstring(qualname, member, kind):
    if kind == "property":
        doc = inspect.getdoc(member) or ""
        assert doc.strip(), f"{qualname}: the property has no docstring"
        return
    errors = _errors(qualname, member, METHOD_CODES)
    assert not errors, f"{qualname}: " + "; ".join(f"{c} {m}" for c, m in errors)


def test_simple_check_agrees_on_a_good_and_a_bad_docstring():
    # the fallback used without numpydoc finds the gaps numpydoc would find
    def good(a, b=1):
        """Add.

        Parameters
        ----------
        a, b : int
            Terms.

        Returns
        -------
        int

        Examples
        --------
        >>> good(1)
        2
        """
        return a + b

    def bad(a, c):
        """Add."""
        return a + c

    assert _simple_errors(good, good, CHECKED_CODES) == []
    codes = {code for code, _ in _simple_errors(bad, bad, CHECKED_CODES)}
    assert codes == {"PR01", "RT01", "EX01"}


def test_user_guide_names_real_parameters():
    # The phased learner's hyperparameters are written once, as substitutions at
    # the top of docs/user_guide/phased.rst; the grids of tolerances.rst use them
    # too.  A renamed parameter must be renamed in the user guide.
    from pathlib import Path

    from skattn.estimators import MultiHeadAttentionRegressor

    guide = Path(__file__).resolve().parents[1] / "docs" / "user_guide"
    if not guide.is_dir():  # pragma: no cover - an installed package without docs
        pytest.skip("docs/user_guide is not there")
    params = set(MultiHeadAttentionRegressor().get_params())
    phased = (guide / "phased.rst").read_text()
    named = set(re.findall(r"^\.\. \|p_\w+\| replace:: ``(\w+)``$", phased, re.M))
    assert len(named) >= 10
    tolerances = (guide / "tolerances.rst").read_text()
    named |= set(re.findall(r'param_grid=\{"(\w+)"', tolerances))
    named |= set(re.findall(r'"param_(\w+)"', tolerances))
    assert named, "no parameter names found in the user guide"
    assert not named - params, f"not parameters: {sorted(named - params)}"
