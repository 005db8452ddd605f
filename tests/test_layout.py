"""The package's shape stays easy to enter: no import cycle between modules (function-level imports
included), kernels never import the runtime or the rest of the package, and no module grows past
the size one reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 620


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "occult").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py")):
        if "kernels" in path.relative_to(ROOT).parts[:2] and path.is_relative_to(ROOT / "occult"):
            continue                     # occult/kernels is a link to kernels/: counted once, below
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":
            parts = ["occult", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                wanted = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in wanted:
                found = owner(target) if target.startswith("occult") else None
                if found == "occult" and target != "occult":
                    continue             # a namespace package (occult.kernels) has no module of its own
                if found and found != name:
                    targets.add(found)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_in_a_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kernels_import_only_kernels_and_the_core():
    allowed = ("occult.kernels", "occult.provenance", "occult.logs")
    for name, targets in import_graph().items():
        if name.startswith("occult.kernels"):
            assert all(t.startswith(allowed) for t in targets), (name, sorted(targets))


def test_model_code_does_not_import_the_runtime():
    for name, targets in import_graph().items():
        if name.startswith("occult.models"):
            assert not [t for t in targets if t.startswith(("occult.ep", "occult.harness", "occult.sim"))], name


def test_no_module_is_longer_than_a_reader_can_hold():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
