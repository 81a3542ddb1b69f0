"""The package's modules import each other without a circle (function-local imports included)."""

import ast
import os

from conftest import REPO

PKG = os.path.join(REPO, "dapo_megatron")


def _module_files() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path[:-3], os.path.dirname(PKG)).replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (annotations-only imports under
    ``if TYPE_CHECKING:`` excepted). ``from pkg import sub`` depends on ``pkg.sub``, not on
    the package's ``__init__``, when ``sub`` is a module."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                subs = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in modules]
                found.update(subs if len(subs) == len(child.names) else [base, *subs])
            visit(child)

    visit(ast.parse(open(path, encoding="utf-8").read(), path))
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_cycle_finder_finds_a_function_local_circle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    modules = _module_files()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "dapo_megatron.data.schema" in graph["dapo_megatron.data.arithmetic"]
    assert "dapo_megatron.trainer" in graph["dapo_megatron.config.run"]
    assert _cycles(graph) == []
