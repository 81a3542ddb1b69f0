"""A loaded config is frozen: assigning a field of any section raises :class:`FrozenConfigError`.

:func:`~dapo_megatron.config.loader.load_config` validates the tree once and then calls
:func:`freeze`, so what was validated is what every component reads: a component that needs a
different value builds a changed copy (``dataclasses.replace(cfg.data, train_files=[...])``,
unfrozen, then :func:`freeze` again where it becomes the run's config), and a user sets it with
a dotted override (``data.train_files=[a.parquet]``). Configs built in code
(``DAPOConfig()``, ``ActorConfig(lr=...)``) stay mutable until :func:`freeze`.

How: the sections are plain (mutable) dataclasses, each defined beside its owner. :func:`freeze`
marks every section instance of the tree with its dotted path (an entry in the instance's
``__dict__``, not a field: ``==``, ``repr``, ``dataclasses.fields`` / ``replace`` / ``asdict``
do not see it) and gives each section class, once, a ``__setattr__`` / ``__delattr__`` that
refuses while the instance carries the mark; unmarked instances of the class behave as before.
``copy.deepcopy`` and pickling keep the mark (they restore ``__dict__`` without ``__setattr__``);
``dataclasses.replace`` builds an unmarked copy. The lists and dicts held by fields are not
copied or wrapped: freezing covers assigning (and deleting) fields.

Design: docs/design.md §1 (one training step: the config it reads).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["FrozenConfigError", "freeze", "is_frozen"]

_MARK = "__dapo_frozen_path__"  # instance __dict__ entry: the section's dotted path ("" for the root)
_HOOKED = "__dapo_freeze_hook__"  # class attribute: the class has the refusing __setattr__


class FrozenConfigError(AttributeError):
    """A field of a loaded (frozen) config was assigned or deleted; the message names the key.

    An ``AttributeError``, as ``dataclasses.FrozenInstanceError`` is."""


def _refuse(obj: Any, name: str, verb: str) -> None:
    path = obj.__dict__[_MARK]
    key = f"{path}.{name}" if path else name
    raise FrozenConfigError(
        f"{key}: the config is frozen after load_config, {verb} it is refused; give the value as a "
        f"dotted override ({key}=...) or build a changed copy with dataclasses.replace(...)")


def _hook(cls: type) -> None:
    if cls.__dict__.get(_HOOKED):
        return
    base_set, base_del = cls.__setattr__, cls.__delattr__

    def __setattr__(self, name, value):
        if _MARK in self.__dict__:
            _refuse(self, name, "setting")
        base_set(self, name, value)

    def __delattr__(self, name):
        if _MARK in self.__dict__:
            _refuse(self, name, "deleting")
        base_del(self, name)

    cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__
    setattr(cls, _HOOKED, True)


def freeze(cfg: T, path: str = "") -> T:
    """Freeze ``cfg`` and every section below it in place; returns ``cfg``.

    Args:
        cfg: a dataclass instance (the root config, or one section of it).
        path: ``cfg``'s dotted key in the run's config, for the error messages (``"data"``).

    Raises:
        TypeError: ``cfg`` is not a dataclass instance.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"freeze expects a dataclass instance, got {type(cfg).__name__}")
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            freeze(value, key)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    freeze(item, f"{key}[{i}]")
    _hook(type(cfg))
    cfg.__dict__[_MARK] = path
    return cfg


def is_frozen(cfg: Any) -> bool:
    """``cfg`` is a dataclass instance that :func:`freeze` marked."""
    return _MARK in getattr(cfg, "__dict__", {})
