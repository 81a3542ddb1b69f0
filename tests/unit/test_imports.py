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


def _imports(name: str, path: str, modules: dict[str, str], type_checking: bool = False) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (annotations-only imports under
    ``if TYPE_CHECKING:`` too when ``type_checking``). ``from pkg import sub`` depends on
    ``pkg.sub``, not on the package's ``__init__``, when ``sub`` is a module."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
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
    assert "dapo_megatron.config.trainer" in graph["dapo_megatron.config.run"]
    assert _cycles(graph) == []


def test_no_import_circle_with_annotations_only_imports():
    """Annotations-only imports (``if TYPE_CHECKING:``) count too: a circle there is a layering
    that only happens not to fail at run time."""
    modules = _module_files()
    graph = {name: _imports(name, path, modules, type_checking=True) for name, path in modules.items()}
    assert _cycles(graph) == []


MAX_LOCAL_IMPORTS_PER_1K_LINES = 3


def _local_imports(path: str) -> list[int]:
    """Line numbers of the imports inside a function body of ``path``."""
    out: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                out.append(child.lineno)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(open(path, encoding="utf-8").read(), path), False)
    return out


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A ``#`` comment on the import, on another import of its block, or on the line that opens
    the block (the line above, or the ``try:`` above it)."""
    i = lineno - 1
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
        i -= 1  # the first import of a consecutive block
    j = i
    while j < len(lines) and lines[j].strip().startswith(("import ", "from ")):
        if "#" in lines[j]:
            return True
        j += 1
    above = [lines[k] for k in (i - 1, i - 2) if k >= 0]
    if above and above[0].strip().startswith("try:"):
        return "#" in above[0] or (len(above) > 1 and above[1].strip().startswith("#"))
    return bool(above) and above[0].strip().startswith("#")


def test_reason_finder_needs_a_comment():
    assert _has_reason(["def f():", "    # sglang needs CUDA", "    import sglang"], 3)
    assert _has_reason(["def f():", "    try:  # CUDA only", "        import sglang"], 3)
    assert not _has_reason(["def f():", "    x = 1", "    import os"], 3)


def test_function_level_imports_are_few_and_each_says_why():
    """Imports belong at the top; one inside a function (an optional dependency that needs a GPU,
    or megatron-core before its warnings are silenced) says why, and there are at most
    MAX_LOCAL_IMPORTS_PER_1K_LINES per 1000 lines of the package."""
    total_lines, found, unexplained = 0, [], []
    for path in _module_files().values():
        lines = open(path, encoding="utf-8").read().split("\n")
        total_lines += len(lines)
        for lineno in _local_imports(path):
            where = f"{os.path.relpath(path, REPO)}:{lineno}"
            found.append(where)
            if not _has_reason(lines, lineno):
                unexplained.append(where)
    assert not unexplained, f"function-level imports without a reason comment: {unexplained}"
    assert len(found) <= MAX_LOCAL_IMPORTS_PER_1K_LINES * total_lines / 1000, (
        f"{len(found)} function-level imports in {total_lines} lines: {found}")
