"""No import circles among the project's Python modules (the house rule), counting every import statement, also
those inside functions: a lazy import that closes a circle is still a circle (it only moves the failure)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"components": REPO, "pipelines": REPO, "trainer": REPO / "trainer_image"}


def module_name(path: Path) -> str:
    for root in ROOTS.values():
        if root in path.parents and path.relative_to(root).parts[0] in ROOTS:
            parts = list(path.relative_to(root).with_suffix("").parts)
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(path)


def graph() -> dict[str, set[str]]:
    files = [p for top, root in ROOTS.items() for p in (root / top).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_no_import_circles():
    edges = graph()
    assert "components.lib.promoted" in edges["components.lib.registry"]  # the graph sees what it should
    assert cycles(edges) == []


def test_the_check_finds_a_lazy_circle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]
