"""The package's import graph has no cycles, neither between modules nor between eecore's subpackages:
every `import` in a module, at its top level or inside a function, is an edge (a function-level
import only hides a cycle until the function runs), and a cycle fails with its path.

The package graph has one node per subpackage (eecore.exits, eecore.engine, ...) and per top-level
module (eecore.llm, eecore.ops, ...); a module's import of another node's module is an edge between
their nodes. Without a cycle there the packages layer: a utility two packages share lives in a
package below both (eecore.text: the n-gram index, ROUGE-L), not in one of them."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "eecore"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    # A module's own parent packages are initialized before it anyway: "from eecore import ops" is an
    # edge to eecore.ops, not to eecore's __init__.
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in modules and m != name and m not in ancestors}


def module_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = module_graph()
    assert len(graph) > 50 and graph["eecore.llm"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def package_of(module: str) -> str:
    """A module's node in the package graph: eecore.exits.agreement -> eecore.exits, eecore.llm ->
    eecore.llm, eecore itself -> eecore."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    graph = module_graph() if graph is None else graph
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, imported in graph.items():
        packages[package_of(module)].update(package_of(m) for m in imported if package_of(m) != package_of(module))
    return packages


# Packages that import no other eecore package or module.
LEAF_PACKAGES = ["eecore.text"]


def test_package_of():
    assert package_of("eecore.exits.agreement") == "eecore.exits"
    assert package_of("eecore.speculative") == "eecore.speculative"
    assert package_of("eecore.llm") == "eecore.llm"
    graph = {"eecore.a.x": {"eecore.b.y"}, "eecore.b.y": {"eecore.b.z"}, "eecore.b.z": {"eecore.a"}, "eecore.a": set()}
    assert package_graph(graph) == {"eecore.a": {"eecore.b"}, "eecore.b": {"eecore.a"}}
    assert find_cycle(package_graph(graph)) == ["eecore.a", "eecore.b", "eecore.a"]


def test_no_package_cycles():
    graph = package_graph()
    assert {"eecore.exits", "eecore.speculative", "eecore.evaluation", "eecore.engine"} <= set(graph)
    assert "eecore.engine" in graph["eecore.exits"]
    cycle = find_cycle(graph)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_leaf_packages_import_no_other_package():
    graph = package_graph()
    for leaf in LEAF_PACKAGES:
        assert not graph[leaf], f"{leaf} imports {sorted(graph[leaf])}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def test_evaluation_and_sources_do_not_reach_training():
    """Evaluating a strategy, or reading the local text sources, never imports the trainers."""
    graph = module_graph()
    for start in [m for m in graph if m.startswith(("eecore.evaluation", "eecore.sources"))]:
        training = sorted(m for m in _reachable(graph, start) if m.startswith("eecore.train"))
        assert not training, f"{start} reaches {training}"
