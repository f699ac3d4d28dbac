"""The package's module graph has no cycles: every `import` in a module, at its top level or inside a
function, is an edge (a function-level import only hides a cycle until the function runs), and a
cycle among them fails with its path."""
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
