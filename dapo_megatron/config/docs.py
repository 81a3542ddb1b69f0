"""Config key documentation: ``dapo-train --list-keys`` and the all-documented check.

A field is documented by the string literal right below it in the class body, an
attribute docstring (PEP 257; read by Sphinx autodoc, shown by editors on hover, used by
torchtitan's job config)::

    @dataclass
    class TrainerConfig:
        save_freq: int = -1
        \"\"\"save a checkpoint every this many steps (and after the last step); -1 never saves.\"\"\"

The text is taken from the syntax tree of the class's source file (:mod:`ast`: the
literal is the statement after the field's annotated assignment), not parsed out of
prose, and whitespace is collapsed to one line. Fields inherited from a base class are
documented by the base's body.

Design: docs/design.md §1 (one training step: the config it reads).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import linecache
from dataclasses import dataclass
from typing import Any

from .loader import _field_types, _is_dataclass_type, _plain, _section_type, _type_name

__all__ = ["KeyDoc", "assert_all_documented", "documented_keys", "field_docs"]


@dataclass(frozen=True)
class KeyDoc:
    """One documented config key.

    Attributes:
        key: dotted key, e.g. ``trainer.save_freq``.
        type: readable type, e.g. ``int``, ``str | None``, ``one of 'auto', 'disable'``.
        default: the default value (a section's key shows the class name).
        doc: the field's docstring on one line ("" when undocumented).
    """

    key: str
    type: str
    default: Any
    doc: str

    def __str__(self) -> str:  # one line per key for ``dapo-train --list-keys``
        return f"{self.key} ({self.type}, default {self.default!r}): {self.doc or '(undocumented)'}"


@functools.lru_cache(maxsize=None)
def _class_bodies(path: str) -> dict[str, list[ast.stmt]]:
    """Qualified class name (``Outer.Inner``, ``f.<locals>.C``) → class body, for one file."""
    source = "".join(linecache.getlines(path))
    bodies: dict[str, list[ast.stmt]] = {}

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                bodies.setdefault(".".join((*scope, child.name)), child.body)
                visit(child, (*scope, child.name))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, (*scope, child.name, "<locals>"))
            else:
                visit(child, scope)

    visit(ast.parse(source, path), ())
    return bodies


def _own_field_docs(cls: type) -> dict[str, str]:
    """Field name → docstring for the annotated assignments in ``cls``'s own body."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return {}
    body = _class_bodies(path).get(cls.__qualname__, []) if path else []
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Field name → its docstring (one line) for ``cls`` and its bases; a subclass wins.

    A class without a readable source file (defined in an interactive session) has none.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs.update(_own_field_docs(klass))
    return docs


def documented_keys(schema: type) -> list[KeyDoc]:
    """Every key of ``schema`` (sections and leaves, depth first) with type, default, doc.

    Defaults come from the dataclass defaults (``default_factory`` is called), docs from
    the field docstrings (:func:`field_docs`).

    Raises:
        TypeError: ``schema`` is not a dataclass type.
    """
    if not _is_dataclass_type(schema):
        raise TypeError(f"schema must be a dataclass type, got {schema!r}")
    out: list[KeyDoc] = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        types_ = _field_types(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            tp = types_[f.name]
            sub = _section_type(tp)
            if sub is not None and dataclasses.is_dataclass(default):
                default = type(default).__name__
            out.append(KeyDoc(f"{prefix}{f.name}", _type_name(tp), _plain(default), docs.get(f.name, "")))
            if sub is not None:
                walk(sub, f"{prefix}{f.name}.")

    walk(schema, "")
    return out


def assert_all_documented(schema: type) -> None:
    """Raise unless every key of ``schema`` has a non-empty field docstring.

    Raises:
        ValueError: listing every undocumented dotted key, with the fix.
    """
    missing = [k.key for k in documented_keys(schema) if not k.doc]
    if missing:
        raise ValueError(
            f"config schema {schema.__qualname__}: undocumented keys: " + ", ".join(missing)
            + '. Put a docstring on the line below each field: name: int = 0 then """what it does."""'
        )
