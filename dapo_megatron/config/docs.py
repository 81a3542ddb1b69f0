"""Config key documentation: ``dapo-train --list-keys`` and the all-documented check."""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Any

from .loader import _field_types, _is_dataclass_type, _plain, _section_type, _type_name

__all__ = ["KeyDoc", "assert_all_documented", "documented_keys", "parse_attribute_docs"]


@dataclass(frozen=True)
class KeyDoc:
    """One documented config key.

    Attributes:
        key: dotted key, e.g. ``trainer.save_freq``.
        type: readable type, e.g. ``int``, ``str | None``, ``one of 'auto', 'disable'``.
        default: the default value (a section's key shows the class name).
        doc: the text of the ``Attributes:`` entry ("" when undocumented).
    """

    key: str
    type: str
    default: Any
    doc: str

    def __str__(self) -> str:  # one line per key for ``dapo-train --list-keys``
        return f"{self.key} ({self.type}, default {self.default!r}): {self.doc or '(undocumented)'}"


_SECTION_HEADER = re.compile(r"^\s*(Attributes|Args|Arguments|Fields)\s*:\s*$")
_OTHER_HEADER = re.compile(
    r"^\s*(Returns|Raises|Yields|Examples?|Notes?|Methods|See Also|References)\s*:\s*$"
)
_ENTRY = re.compile(
    r"^(\s*)([A-Za-z_]\w*(?:\s*[,/]\s*[A-Za-z_]\w*)*)\s*(\([^)]*\))?\s*:\s*(.*)$"
)


def parse_attribute_docs(cls: type) -> dict[str, str]:
    """Field name → text from the ``Attributes:`` section of ``cls``'s docstring (and bases').

    Google style: an entry is ``name: text`` (or ``name (type): text``) indented under
    the header; more-indented lines continue it. Entries of subclasses win. One entry
    may document several fields: ``clip_ratio_low, clip_ratio_high: text`` or
    ``a / b: text`` give every listed name the same text.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        text = klass.__dict__.get("__doc__")
        if not text:
            continue
        lines = inspect.cleandoc(text).splitlines()
        in_section, entry_indent, current = False, None, None
        for line in lines:
            if _SECTION_HEADER.match(line):
                in_section, entry_indent, current = True, None, None
                continue
            if not in_section:
                continue
            if _OTHER_HEADER.match(line):
                in_section = False
                continue
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            m = _ENTRY.match(line)
            if m and (entry_indent is None or indent == entry_indent):
                entry_indent = indent
                current = [n.strip() for n in re.split(r"[,/]", m.group(2))]
                for name in current:
                    docs[name] = m.group(4).strip()
            elif current is not None and entry_indent is not None and indent > entry_indent:
                for name in current:
                    docs[name] = f"{docs[name]} {line.strip()}".strip()
            elif entry_indent is not None and indent < entry_indent:
                in_section = False  # dedent below the entries ends the section
    return docs


def documented_keys(schema: type) -> list[KeyDoc]:
    """Every key of ``schema`` (sections and leaves, depth first) with type, default, doc.

    Defaults come from the dataclass defaults (``default_factory`` is called), docs from
    each class's ``Attributes:`` docstring section (:func:`parse_attribute_docs`).

    Raises:
        TypeError: ``schema`` is not a dataclass type.
    """
    if not _is_dataclass_type(schema):
        raise TypeError(f"schema must be a dataclass type, got {schema!r}")
    out: list[KeyDoc] = []

    def walk(cls: type, prefix: str) -> None:
        docs = parse_attribute_docs(cls)
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
    """Raise unless every key of ``schema`` has a non-empty ``Attributes:`` entry.

    Also rejects stale entries (documented names that are not fields).

    Raises:
        ValueError: listing every undocumented dotted key (and every stale entry as
            ``Class.name``), with the fix.
    """
    missing = [k.key for k in documented_keys(schema) if not k.doc]
    stale: list[str] = []
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        names = set(_field_types(cls))
        stale.extend(f"{cls.__qualname__}.{n}" for n in parse_attribute_docs(cls) if n not in names)
        for tp in _field_types(cls).values():
            sub = _section_type(tp)
            if sub is not None:
                walk(sub)

    walk(schema)
    problems = []
    if missing:
        problems.append("undocumented keys: " + ", ".join(missing))
    if stale:
        problems.append("documented names that are not fields: " + ", ".join(stale))
    if problems:
        raise ValueError(
            f"config schema {schema.__qualname__}: " + "; ".join(problems)
            + ". Add/fix 'name: description' lines under 'Attributes:' in the class docstrings."
        )
