"""The package's rooms import only downwards, and no module imports in a cycle.

docs/architecture.md draws the rooms; this test holds the code to them. Every
import of the package is read, the ones inside functions too.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tf_adaptive_scale"

# Lowest first: a room may import itself and the rooms before it. The modules
# outside every room (the package's `__init__`, `demo`, `report`) are the top:
# they may import any room, and no room imports them.
ROOMS = ["backend", "numerics", "rules", "per_layer", "step", "training", "monitor"]


def module_name(path, package):
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path, modules):
    """The package's modules that `path` imports, by dotted name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from package import module` names a module; `from module import name` does not.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph(package=PACKAGE):
    paths = {module_name(path, package): path for path in package.rglob("*.py")}
    graph = {name: imported_modules(path, paths) - {name} for name, path in paths.items()}
    # A module's import of its own room's `__init__` (to reach a sibling) is no edge.
    return {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}


def room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else None


def upward_imports(graph):
    wrong = []
    for module, deps in graph.items():
        here = room(module)
        if here is None:
            continue
        for dep in deps:
            there = room(dep)
            if there is None or ROOMS.index(there) > ROOMS.index(here):
                wrong.append(f"{module} imports {dep}")
    return sorted(wrong)


def cycles(graph):
    seen, on_path, found = set(), [], []

    def visit(module):
        if module in on_path:
            found.append(" -> ".join(on_path[on_path.index(module):] + [module]))
            return
        if module in seen:
            return
        seen.add(module)
        on_path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        on_path.pop()

    for module in sorted(graph):
        visit(module)
    return found


def test_every_module_lives_in_a_room_or_is_a_command():
    top = {m for m in import_graph() if room(m) is None}
    assert top == {"tf_adaptive_scale", "tf_adaptive_scale.demo",
                   "tf_adaptive_scale.demo_console", "tf_adaptive_scale.report"}
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ROOMS)


def test_rooms_import_only_downwards():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("planted, expected", [
    ("from tf_adaptive_scale.step import optimizer", "tf_adaptive_scale.rules.clipping imports tf_adaptive_scale.step.optimizer"),
    ("from tf_adaptive_scale import report", "tf_adaptive_scale.rules.clipping imports tf_adaptive_scale.report"),
])
def test_a_planted_upward_import_is_caught(tmp_path, planted, expected):
    """The checks above fail on the mistakes they exist for (a copy of the package, one import planted)."""
    import shutil

    copy = tmp_path / "tf_adaptive_scale"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    clipping = copy / "rules" / "clipping.py"
    # Inside a function, where an upward import hides best.
    clipping.write_text(clipping.read_text() + f"\n\ndef _planted():\n    {planted}\n")
    graph = import_graph(copy)
    assert expected in upward_imports(graph)
    if "optimizer" in planted:
        assert any("tf_adaptive_scale.rules.clipping" in cycle for cycle in cycles(graph))
