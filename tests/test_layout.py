"""The package's layout: no import cycle among flashdraft's modules, counting every import statement
(inside functions and under TYPE_CHECKING too), and no file of flashdraft/ over 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashdraft"
MAX_LINES = 450


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The flashdraft modules `name` imports anywhere in its file, each with the line of its first import
    (`from pkg import x` imports module pkg.x when there is one, else pkg)."""
    found: dict[str, int] = {}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.setdefault(t, node.lineno)
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found = cycles(graph)
    detail = [f"{a} -> {b} (line {graph[a][b]})" for comp in found for a in comp for b in graph[a] if b in comp]
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_the_cycle_finder_sees_function_local_imports(tmp_path):
    """The finder itself: a cycle closed only by an import inside a function is found."""
    graph = {"a": {"b": 1}, "b": {"a": 9}, "c": {"a": 2}}
    assert cycles(graph) == [["a", "b"]]
    (tmp_path / "b.py").write_text("def f():\n    from flashdraft import config\n")
    assert imports("flashdraft.b", tmp_path / "b.py", {"flashdraft.config": Path(), "flashdraft.b": Path()}) == \
        {"flashdraft.config": 2}


def test_no_file_over_450_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
