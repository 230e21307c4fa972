"""The package's import graph: no cycle, and data flows one way.

Every ``import`` and ``from ... import`` of every module of ``skattn`` -- at module
level and inside functions (lazy imports count too) -- is read with :mod:`ast`
and resolved to the skattn module it names.  Two properties are asserted:

* no import cycle between the modules, nor between the units of the layout
  (``layer``, ``solvers``, ``phased``, ... below);
* every import goes from a unit to a unit of a lower layer (or within a unit),
  in the order of the layout (lowest first):

  0. ``utils`` (validation of sequences and weights, batching, optional-dependency
     guards)
  1. ``layer`` (the object of study: the math of F, the geometry of the heads)
  2. ``solvers`` (the loss, parametrizations, the polish)
  3. ``metrics`` (recovery metrics, scorers, held-out error, head redundancy,
     displays; a fitted estimator is read by duck typing, never imported)
  4. ``diagnostics`` (conditions, certificate, Jacobian), ``datasets``
     (distributions and planted layers) and ``phased`` (the learner): on one
     layer, so none imports another -- the phases and the datasets import no
     diagnostics
  5. ``estimators`` (parameters, validation, one call into ``phased`` or
     ``solvers``, fitted attributes)
  6. ``utils.estimator_checks`` (skattn's checks of any estimator)
  7. the public face: ``skattn/__init__.py`` and the old public module paths
     ``skattn.certificate`` and ``skattn.conditions`` (re-exports)
  8. ``utils.discovery`` (walks the whole package for its estimators)
  9. ``experiments`` (sweeps of any discovered estimator)
  10. ``cli``, then 11. ``__main__``.

Units of the same layer do not import each other.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "skattn"

LAYERS = [
    {"_version"},
    {"utils"},
    {"layer"},
    {"solvers"},
    {"metrics"},
    {"diagnostics", "datasets", "phased"},
    {"estimators"},
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
    # public names and the old public module paths; of private modules
    # only the version, a constant every unit may read
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert root == [
        "__init__.py",
        "__main__.py",
        "_version.py",
        "certificate.py",
        "conditions.py",
    ]
    subpackages = sorted(
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    )
    assert subpackages == [
        "cli",
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


# Inside skattn.solvers, read top-down: the driver runs the stages, the stages
# run the optimizers, everything reads the kernels; the options and the stop
# vocabulary are leaves.  (lowest first; the package's __init__ re-exports)
SOLVERS_ORDER = [
    {"skattn.solvers._stop", "skattn.solvers._options", "skattn.solvers._checkpoints"},
    {"skattn.solvers.kernels"},
    {"skattn.solvers.optimizers"},
    {"skattn.solvers.stages"},
    {"skattn.solvers._driver"},
    {"skattn.solvers"},
]


def _solvers_part(module):
    for part in sorted((p for layer in SOLVERS_ORDER for p in layer), key=len)[::-1]:
        if module == part or module.startswith(part + "."):
            return part
    return None


def test_solvers_read_top_down():
    rank = {part: r for r, layer in enumerate(SOLVERS_ORDER) for part in layer}
    upward = []
    for module, targets in sorted(GRAPH.items()):
        source = _solvers_part(module)
        if source is None:
            continue
        for target in sorted(targets):
            part = _solvers_part(target)
            if part is None or part == source:
                continue
            if rank[part] >= rank[source]:
                upward.append(f"{module} ({source}) imports {target} ({part})")
    assert not upward, "\n".join(upward)
    parts = {_solvers_part(m) for m in GRAPH if m.startswith("skattn.solvers")}
    assert parts == set(rank), parts ^ set(rank)


# Modules that need no test module of their own: re-exports and the entry point.
NO_OWN_TESTS = {
    "skattn.__main__": "runs skattn.cli.main (tests/test_cli_main.py)",
    "skattn.certificate": "re-exports skattn.diagnostics",
    "skattn.conditions": "re-exports skattn.diagnostics",
}


def test_tests_mirror_the_package():
    # module skattn/<package>/<sub>/_<name>.py -> tests/test_<package>_<sub>_<name>.py
    tests = PACKAGE.parent / "tests"
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if path.name == "__init__.py" or module in NO_OWN_TESTS:
            continue
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = "test_" + "_".join(part.lstrip("_") for part in parts) + ".py"
        if not (tests / name).is_file():
            missing.append(f"{module}: tests/{name}")
    assert not missing, "\n".join(missing)
