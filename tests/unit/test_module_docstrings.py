"""Every module of the package opens with a docstring that points to the docs/design.md
section it belongs to, and every section a docstring names exists (issue 20: module docstrings
are contracts with a pointer to docs/design.md)."""

from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(REPO, "dapo_megatron")


def _modules():
    for root, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(root, f)


def _sections() -> set[str]:
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as f:
        return {m.group(1) for m in re.finditer(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", f.read(), re.M)}


def test_every_module_docstring_points_to_its_design_section():
    missing = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        if "docs/design.md" not in doc:
            missing.append(os.path.relpath(path, REPO))
    assert not missing, f"module docstrings without a docs/design.md pointer: {missing}"


def test_every_named_section_exists():
    sections, bad = _sections(), []
    assert {"1", "2", "2.1", "3.8", "7"} <= sections, sorted(sections)
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for m in re.finditer(r"docs/design\.md((?: (?:§\d+(?:\.\d+)?)(?: step \d+(?:-\d+)?)?[^§\n]*?)+)", text):
            for sec in re.findall(r"§(\d+(?:\.\d+)?)", m.group(1)):
                if sec not in sections:
                    bad.append(f"{os.path.relpath(path, REPO)}: §{sec}")
    assert not bad, f"pointers to sections docs/design.md does not have: {bad}"
