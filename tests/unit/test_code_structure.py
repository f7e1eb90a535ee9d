"""The package stays readable: modules under 400 lines, functions under 60, no import circle.

Read from the source with ``ast`` (nothing is imported). A function's length is
its span from ``def`` to its last line, its docstring left out; nested
functions count in their parent's span and on their own.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "elastic_ft"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> path, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_module_over_400_lines():
    long = {
        _rel(p): n for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"


def test_no_function_over_60_lines():
    long = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _function_lines(node)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines, docstring aside: {long}"


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere (lazy imports in functions too)."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports the module mod; ``from mod import name`` the module mod.
            found.update(known(f"{source}.{a.name}") if f"{source}.{a.name}" in modules else known(source)
                         for a in node.names)
    return {m for m in found if m is not None and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert not _circles(graph), f"modules that import each other (directly or round a circle): {_circles(graph)}"


def test_circle_finder_sees_a_lazy_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _top_level_names(tree: ast.Module) -> tuple[set[str], list[str] | None]:
    """The names a module binds at its top level (``if``/``try`` blocks included), and its ``__all__``."""
    bound, exported = set(), None
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                bound.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if isinstance(target, ast.Name) and target.id == "__all__" and isinstance(node.value, ast.List):
                    exported = list(ast.literal_eval(node.value))  # a computed one (lazy exports) is left out
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo.extend(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                        + [s for h in getattr(node, "handlers", []) for s in h.body])
    return bound, exported


def test_every_exported_name_exists_in_its_module():
    # token_build's __all__ kept four names after they moved to token_exchange:
    # ``from elastic_ft.train.token_build import *`` raised AttributeError.
    missing = []
    for path in _modules().values():
        bound, exported = _top_level_names(ast.parse(path.read_text()))
        missing += [f"{_rel(path)}: {name}" for name in exported or () if name not in bound]
    assert not missing, f"names in __all__ that the module does not define or import: {missing}"


def test_export_check_sees_a_moved_name():
    bound, exported = _top_level_names(ast.parse("from x import a\nB = 1\ndef c(): pass\n__all__ = ['a', 'B', 'c', 'd']"))
    assert exported == ["a", "B", "c", "d"] and {"a", "B", "c"} <= bound and "d" not in bound
