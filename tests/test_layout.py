"""The package's import graph: no cycle, and data flows one way.

Every ``import`` and ``from ... import`` of every module of ``skattn`` -- at module
level and inside functions (lazy imports count too) -- is read with :mod:`ast`
and resolved to the skattn module it names.  Two properties are asserted:

* no import cycle between the modules, nor between the units of the layout
  (``layer``, ``solvers``, ``phased``, ... below);
* every import goes from a unit to a unit of a lower layer (or within a unit),
  in the order of the layout (lowest first):

  0. ``utils`` (validation, batching, optional-dependency guards)
  1. ``layer`` (the object of study)
  2. ``solvers`` (the loss, parametrizations, the polish)
  3. ``diagnostics`` (conditions, certificate, Jacobian, held-out error)
  4. ``datasets`` (distributions and planted layers: they check planted heads'
     separation with ``diagnostics``) and ``phased`` (the learner)
  5. ``estimators`` (parameters, validation, one call into ``phased`` or
     ``solvers``, fitted attributes)
  6. ``metrics`` (recovery metrics, scorers, displays of fitted estimators)
  7. ``utils.estimator_checks`` (skattn's checks of any estimator)
  8. the public face: ``skattn/__init__.py`` and the old public module paths
     ``skattn.certificate`` and ``skattn.conditions`` (re-exports)
  9. ``utils.discovery`` (walks the whole package for its estimators)
  10. ``experiments`` (sweeps of any discovered estimator)
  11. ``cli``, then 12. ``__main__``.

Units of the same layer do not import each other.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "skattn"

LAYERS = [
    {"utils"},
    {"layer"},
    {"solvers"},
    {"diagnostics"},
    {"datasets", "phased"},
    {"estimators"},
    {"metrics"},
    {"utils.estimator_checks"},
    {"skattn", "certificate", "conditions"},
    {"utils.discovery"},
    {"experiments"},
    {"cli"},
    {"__main__"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}

# Imports against the order, each with its reason (none at present).
# (importer module, unit): reason
EXCEPTIONS = {}


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _resolve(importer, is_package, node, modules):
    """The skattn modules an import node names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [name for name in names if name.split(".")[0] == "skattn"]
    if node.level:
        base = importer.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "skattn":
        return []
    # ``from package import module`` names the module itself
    found = [
        f"{target}.{alias.name}"
        for alias in node.names
        if f"{target}.{alias.name}" in modules
    ]
    return found or [target]


def _graph():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets.update(_resolve(name, is_package, node, modules))
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _unit(module):
    parts = module.split(".")
    if len(parts) == 1:
        return "skattn"
    if parts[1] == "utils" and len(parts) > 2 and not parts[2].startswith("_"):
        return f"utils.{parts[2]}"
    return parts[1]


def _cycle(graph):
    """A cycle of the directed graph as a list of nodes, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path)
                if found:
                    return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


GRAPH = _graph()


def test_every_unit_has_a_layer():
    units = {_unit(module) for module in GRAPH}
    assert units <= set(RANK), units - set(RANK)


def test_no_import_cycle_between_modules():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH))


def test_no_import_cycle_between_units():
    units = {}
    for module, targets in GRAPH.items():
        for target in targets:
            if (module, _unit(target)) in EXCEPTIONS:
                continue
            if _unit(target) != _unit(module):
                units.setdefault(_unit(module), set()).add(_unit(target))
    assert _cycle(units) is None, " -> ".join(_cycle(units))


def test_imports_go_down_the_layers():
    upward = []
    for module, targets in sorted(GRAPH.items()):
        source = _unit(module)
        for target in sorted(targets):
            unit = _unit(target)
            if unit == source or (module, unit) in EXCEPTIONS:
                continue
            if RANK[unit] >= RANK[source]:
                upward.append(f"{module} ({source}) imports {target} ({unit})")
    assert not upward, "\n".join(upward)


def test_exceptions_are_still_needed():
    for module, unit in EXCEPTIONS:
        assert any(_unit(t) == unit for t in GRAPH[module]), (module, unit)


def test_package_root_holds_only_the_public_face():
    # public names, the CLI and the old public module paths: no private modules
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert root == [
        "__init__.py",
        "__main__.py",
        "certificate.py",
        "cli.py",
        "conditions.py",
    ]
    subpackages = sorted(
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    )
    assert subpackages == [
        "datasets",
        "diagnostics",
        "estimators",
        "experiments",
        "layer",
        "metrics",
        "phased",
        "solvers",
        "utils",
    ]
