"""Lazy package exports (PEP 562): a package's public names load their submodule on first use.

Why: a config check, a grader worker or ``python -m dapo_megatron.data.arithmetic`` imports one
torch-free submodule of a package; importing every submodule with the package would load torch
and megatron-core (~2 s a process) or pre-import the module ``-m`` runs (runpy's warning).
Torch-free itself.

Design: docs/design.md §5.2 (entry points: what a process loads) and §7 (a bad key stops the run
before torch loads).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Union


def lazy_exports(package: str, exports: dict[str, Union[str, tuple[str, str]]],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``(__getattr__, __dir__)``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> its submodule (relative, e.g. ``"config"``), or ``(submodule, its
            name there)`` where the names differ.
        namespace: the package's ``globals()``: a loaded name is stored there, so later lookups
            skip ``__getattr__``.

    ``__getattr__`` raises AttributeError for a name not in ``exports``, as a module does.
    """

    def __getattr__(name: str) -> Any:
        try:
            target = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module, attr = target if isinstance(target, tuple) else (target, name)
        value = getattr(importlib.import_module(f".{module}", package), attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
