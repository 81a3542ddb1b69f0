"""The config loader: dataclass schema + YAML file + dotted CLI overrides -> validated tree.

``load_config(DAPOConfig, "examples/configs/dapo_smollm2_cpu.yaml", ["actor.optim.lr=1e-6"])``
builds an OmegaConf structured config from the schema (struct mode: no key that the schema
lacks), merges the YAML file, then each override in order, converts the result back to
the schema's dataclasses and runs every section's ``validate()``, innermost first.
Supported field types: ``int``, ``float``, ``bool``, ``str``, ``Optional[...]``,
``Literal[...]``, ``Enum``, ``list[...]`` / ``dict[str, ...]`` of those, and nested
dataclasses (OmegaConf 2.3+ semantics: an int is accepted for a float field, a bool is
not accepted for an int field).

Strictness: every dataclass field is strict (an unknown key is an error). A ``dict[str, V]``
field is an open mapping: YAML and overrides may add any key under it, at any depth
(``model.extra_transformer_config.recompute_granularity=full``), with values checked
against ``V`` (``Any`` accepts everything); the dict field itself must exist.

Validation convention for schema authors (one for every section):

* ``validate(self) -> None`` checks the section's own fields and raises ``ValueError``
  whose message starts with ``field=value``, e.g. ``"save_freq=-2 must be -1 (never) or
  >= 1"``. It knows nothing of where the section sits in the tree: :func:`load_config`
  prefixes the dotted path once, giving ``"trainer.save_freq=-2 must be ..."``.
  Nested sections are validated by the walk, not by their parent's ``validate``.
* Checks across sections belong to the root's ``validate`` (``DAPOConfig``) and name
  every key in full.
* Checks that need a run-time fact (the world size, the optimizer step count) are
  methods ``check_<fact>(value) -> None`` of the section, with the same message form;
  a caller that knows the section's path wraps them in :func:`config_errors`.

Source: OmegaConf structured configs (``OmegaConf.structured``, ``OmegaConf.merge``,
``OmegaConf.from_dotlist``, ``OmegaConf.to_object``); key names follow verl's
``ppo_trainer.yaml`` (``trainer.*``).

Design: docs/design.md §1 (one training step: the config it reads) and §7 (a bad key stops the run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import inspect
import io
import math
import os
import types
import typing
from typing import Any, Iterator, Literal, Sequence, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .frozen import freeze

T = TypeVar("T")

__all__ = ["ConfigError", "config_errors", "load_config", "to_flat_dict", "to_yaml"]


class ConfigError(ValueError):
    """A config file or override names an unknown key, or gives a value of the wrong type."""


# --------------------------------------------------------------------------- schema walk


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (handles ``from __future__ import annotations``)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:  # an unresolvable forward reference in the schema
        raise TypeError(f"cannot resolve the field types of {cls.__qualname__}: {e}") from e
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(tp)):
            return args[0], True
    return tp, False


def _section_type(tp: Any) -> type | None:
    """The dataclass type of a field (``Optional`` unwrapped), or None for a leaf."""
    inner, _ = _unwrap_optional(tp)
    return inner if _is_dataclass_type(inner) else None


def _type_name(tp: Any) -> str:
    """Human-readable type, e.g. ``int``, ``float | None``, ``one of 'auto', 'disable'``."""
    inner, optional = _unwrap_optional(tp)
    origin = typing.get_origin(inner)
    if origin is Literal:
        name = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        name = f"{inner.__name__} (one of {', '.join(m.name for m in inner)})"
    elif origin in (list, tuple, dict, typing.Union, types.UnionType):
        args = ", ".join(_type_name(a) for a in typing.get_args(inner))
        name = f"{origin.__name__ if origin not in (typing.Union, types.UnionType) else 'Union'}[{args}]"
    elif isinstance(inner, type):
        name = inner.__name__
    else:
        name = str(inner).replace("typing.", "")
    return f"{name} | None" if optional else name


def _leaf_keys(schema: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key → annotated type for every field, sections included."""
    out: dict[str, Any] = {}
    for name, tp in _field_types(schema).items():
        key = f"{prefix}{name}"
        out[key] = tp
        sub = _section_type(tp)
        if sub is not None:
            out.update(_leaf_keys(sub, f"{key}."))
    return out


def _is_dict_type(tp: Any) -> bool:
    """True for ``dict[...]`` / ``Dict[...]`` (``Optional`` unwrapped): an open mapping."""
    inner, _ = _unwrap_optional(tp)
    return inner is dict or typing.get_origin(inner) is dict


def _dict_field_of(key: str, valid: dict[str, Any]) -> str | None:
    """The dict-typed field that holds ``key`` below it (``"model.extra_transformer_config"``
    for ``"model.extra_transformer_config.recompute_granularity"``), or None."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in valid:
            return prefix if _is_dict_type(valid[prefix]) else None
    return None


def _open_dict_fields(cfg: Any, schema: type, update: Any = None) -> None:
    """Clear OmegaConf's struct flag on every dict-typed field of ``cfg`` (a structured
    config of ``schema``), so new keys can be merged into it; dataclass sections stay
    struct. A None-valued ``Optional[dict]`` field that ``update`` (the plain mapping about
    to be merged) sets to a mapping becomes ``{}`` first (a mapping merged into None would
    inherit the parent's struct flag)."""
    for name, tp in _field_types(schema).items():
        sub_update = update.get(name) if isinstance(update, dict) else None
        sub = _section_type(tp)
        node = cfg.get(name) if isinstance(cfg, DictConfig) else None
        if sub is not None:
            if isinstance(node, DictConfig):
                _open_dict_fields(node, sub, sub_update)
        elif _is_dict_type(tp):
            if node is None and isinstance(sub_update, dict):
                cfg[name] = {}
                node = cfg.get(name)
            if isinstance(node, DictConfig):
                OmegaConf.set_struct(node, False)


# --------------------------------------------------------------------------- loading


def _suggest(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close:  # compare the last component within the same section
        section, _, leaf = key.rpartition(".")
        siblings = [k for k in valid if k.rpartition(".")[0] == section]
        names = {k.rpartition(".")[2]: k for k in siblings}
        near = difflib.get_close_matches(leaf, list(names), n=1, cutoff=0.5)
        close = [names[near[0]]] if near else []
    if close:
        return f"; did you mean '{close[0]}'?"
    return ""


MOVED_KEYS = {
    "async_training.staleness_threshold": (
        "is verl's staleness as a fraction of a batch; here the bound is buffer.max_staleness, eta in integer "
        "weight versions (the oldest token of a trained sample is at most that many versions behind the actor)"),
    "async_training.partial_rollout": (
        "is rollout.partial_rollout, the one key of partial rollouts in every mode (under async_training a weight "
        "sync interrupts and continues the rows in flight; its default, null, is true there)"),
}
"""Keys of other stacks, or removed here, with a different meaning or home: the error points to ours."""


def _unknown_key_error(key: str, valid: dict[str, Any], source: str) -> ConfigError:
    if key in MOVED_KEYS:
        return ConfigError(f"config key '{key}' ({source}) {MOVED_KEYS[key]}: set that instead")
    section = key.rpartition(".")[0]
    while section and section not in valid:  # an unknown section: list its parent's keys
        section = section.rpartition(".")[0]
    siblings = sorted(k for k in valid if k.rpartition(".")[0] == section)
    hint = _suggest(key, list(valid))
    listing = ", ".join(siblings) if siblings else "(none)"
    return ConfigError(
        f"unknown config key '{key}' ({source}){hint} Valid keys"
        f"{' of ' + repr(section) if section else ''}: {listing}"
    )


def _check_keys(data: Any, schema: type, prefix: str, valid: dict[str, Any], source: str) -> None:
    """Reject keys of a YAML mapping that the schema lacks (recursing into sections)."""
    if not isinstance(data, dict):
        return
    fields = _field_types(schema)
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in fields:
            raise _unknown_key_error(key, valid, source)
        sub = _section_type(fields[k])
        if sub is not None:
            if v is not None and not isinstance(v, dict):
                raise _section_value_error(key, sub, v, source)
            _check_keys(v, sub, f"{key}.", valid, source)


def _section_value_error(key: str, section: type, value: Any, source: str) -> ConfigError:
    return ConfigError(
        f"config key '{key}' is a section ({section.__name__}), got the value {value!r} "
        f"({source}): set its fields instead, e.g. {key}.<field>=..."
    )


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return "<unknown>"
        data = data[part]
    return data


def _merge(base: Any, update: Any, valid: dict[str, Any], source: str, raw: dict) -> Any:
    try:
        return OmegaConf.merge(base, update)
    except ConfigKeyError as e:  # should be caught by _check_keys; keep a clear message
        raise _unknown_key_error(str(e.full_key), valid, source) from None
    except ValidationError as e:
        reason = str(e.msg).splitlines()[0] if e.msg else "invalid value"
        key = str(e.full_key) if e.full_key else ""
        owner = _dict_field_of(key, valid) if key not in valid else None
        if key not in valid and owner is None:
            raise ConfigError(f"invalid value ({source}): {reason}") from None
        value = _lookup(raw, key)
        expected = _type_name(valid[key]) if owner is None else \
            f"the value type of {owner} ({_type_name(valid[owner])})"
        raise ConfigError(
            f"config key '{key}' expects {expected}, got {value!r} "
            f"({type(value).__name__}) ({source}): {reason}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot apply {source}: {e}") from None


def _line_column(data: bytes, offset: int) -> tuple[int, int]:
    """1-based (line, column) of byte ``offset`` of ``data`` (the column counts bytes)."""
    start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - start + 1


def _yaml_error_text(err: Exception, text: str) -> tuple[int | None, int | None, str]:
    """``(line, column, what)`` of a PyYAML error (1-based; None when it has no mark), with a
    hint for a tab, which YAML never accepts as indentation."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    what = ": ".join(p for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p) \
        or str(err).splitlines()[0]
    if mark is None:
        return None, None, what
    lines = text.splitlines()
    if mark.line < len(lines) and "\t" in lines[mark.line][:mark.column + 1]:
        what += " (the line holds a tab: YAML indents with spaces only)"
    return mark.line + 1, mark.column + 1, what


def _read_yaml(path: str) -> Any:
    """``OmegaConf.load`` of ``path``, with one-line errors.

    Raises:
        ConfigError: ``"<path>, line L, column C: <what>"`` for bytes that are not UTF-8
            (the position of the first bad byte) and for YAML that does not parse (PyYAML's
            mark: a syntax error, a tab, a duplicate key), or ``"<path>: ..."`` for a
            document that OmegaConf cannot hold.
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, col = _line_column(data, e.start)
        raise ConfigError(f"{path}, line {line}, column {col}: byte 0x{data[e.start]:02x} is not UTF-8 "
                          f"({e.reason}); save the file as UTF-8") from None
    try:
        return OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        line, col, what = _yaml_error_text(e, text)
        where = f"{path}, line {line}, column {col}" if line is not None else path
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None


def _dotlist(item: str, key: str) -> Any:
    """``OmegaConf.from_dotlist([item])`` with a one-line error for a value that is not YAML.

    Raises:
        ConfigError: ``"override 'k=v', column C: ..."`` (C counts from the override's first
            character; a value cut short is reported at its end).
    """
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as e:
        value = item.split("=", 1)[1]
        line, col, what = _yaml_error_text(e, value)
        # PyYAML marks an unfinished value (``[1,``) on the line after its end
        col = len(value) + 1 if line is None or line > 1 else col
        raise ConfigError(
            f"override {item!r}, column {len(item) - len(value) + col}: the value is not valid YAML: {what} "
            "(close every bracket; quote a string that holds YAML syntax)"
        ) from None


def _parse_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} must look like key=value, e.g. trainer.total_training_steps=3"
        )
    key, value = item.split("=", 1)
    key = key.strip()
    if not key or key.startswith(("+", "~")):
        raise ConfigError(
            f"override {item!r}: only existing keys can be set (struct mode); write key=value"
        )
    return key, value


@contextlib.contextmanager
def config_errors(path: str) -> Iterator[None]:
    """Re-raise a ``ValueError`` of the block as a :class:`ConfigError` whose message
    begins with ``path`` (a section's dotted key, e.g. ``"parallel"``) exactly once.

    For checks that need run-time facts, e.g.
    ``with config_errors("parallel"): cfg.parallel.check_world_size(world)``
    turns ``"tensor_model_parallel_size=2 ..."`` into ``"parallel.tensor_model_parallel_size=2 ..."``.
    """
    prefix = f"{path}." if path and not path.endswith(".") else path
    try:
        yield
    except ConfigError as e:
        if not prefix or str(e).startswith(prefix):
            raise
        raise ConfigError(f"{prefix}{e}") from None
    except ValueError as e:
        msg = str(e)
        raise ConfigError(msg if not prefix or msg.startswith(prefix) else f"{prefix}{msg}") from None


def _is_float_type(tp: Any) -> bool:
    """True for ``float``, ``float | None`` and a list / tuple of floats."""
    inner, _ = _unwrap_optional(tp)
    if inner is float:
        return True
    origin = typing.get_origin(inner)
    return origin in (list, tuple) and all(a is float or a is Ellipsis for a in typing.get_args(inner))


def _check_finite(obj: Any, path: str) -> None:
    """Raise :class:`ConfigError` for a NaN or infinite value of a float field of the section
    ``obj`` (YAML's ``.nan`` / ``.inf`` parse as floats; no key of the schema means either)."""
    for name, tp in _field_types(type(obj)).items():
        if not _is_float_type(tp):
            continue
        value = getattr(obj, name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            shown = tuple(value) if isinstance(value, (list, tuple)) else value
            raise ConfigError(f"{path}{name}={shown} must be a finite number")


def _validate_tree(obj: Any, path: str = "") -> None:
    """Call every section's ``validate()``, innermost first, under :func:`config_errors`,
    after :func:`_check_finite` of its float fields (every section, with or without ``validate``).

    Raises:
        TypeError: a ``validate`` that takes arguments or returns a value (the convention
            is ``validate(self) -> None``; checks against run-time facts are separate methods).
        ConfigError: a ``validate`` raised ``ValueError``; the message gets the dotted path.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _validate_tree(value, f"{path}{f.name}.")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _validate_tree(item, f"{path}{f.name}[{i}].")
    _check_finite(obj, path)
    method = getattr(obj, "validate", None)
    if method is None:
        return
    name = type(obj).__qualname__
    if any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
           for p in inspect.signature(method).parameters.values()):
        raise TypeError(f"{name}.validate must take no arguments (validate(self) -> None); "
                        "name a check that needs run-time facts check_<fact>(...) instead")
    with config_errors(path):
        result = method()
    if result is not None:
        raise TypeError(f"{name}.validate must return None (raise ValueError on a bad value), "
                        f"got {type(result).__name__}")


def load_config(schema: type[T], yaml_path: str | None = None, overrides: Sequence[str] = ()) -> T:
    """Build a validated ``schema`` instance from its defaults, a YAML file and overrides.

    Order: dataclass defaults < YAML file < overrides (left to right). Interpolations
    (``${trainer.project_name}``) are resolved; the result is a plain dataclass tree.

    Args:
        schema: the root dataclass type (e.g. the trainer's ``DAPOConfig``).
        yaml_path: a YAML file holding any subset of the schema's keys, or None.
        overrides: dotted ``key=value`` strings, values parsed as YAML
            (``trainer.total_training_steps=3``, ``actor.optim.lr=1e-6``,
            ``trainer.resume_mode=disable``, ``data.files=[a.parquet,b.parquet]``,
            ``x.y=null``); below a ``dict[str, ...]`` field any key is accepted
            (``model.extra_transformer_config.recompute_granularity=full``).

    Returns:
        An instance of ``schema`` whose nested sections are instances of their dataclasses,
        validated once here and frozen (:func:`~dapo_megatron.config.frozen.freeze`: assigning a
        field raises ``FrozenConfigError`` naming the key; ``dataclasses.replace`` makes a changed,
        unfrozen copy).

    Raises:
        TypeError: ``schema`` is not a dataclass type.
        FileNotFoundError: ``yaml_path`` does not exist.
        ConfigError (a ValueError): an unknown key of a dataclass section (message: the
            full dotted key, the closest valid key, the valid keys of that section), a value
            of the wrong type (for a key below a dict field: the dict's value type)
            or outside a ``Literal`` (message: the key, the expected type, the value), a
            malformed override (a value that is not YAML: the column), a YAML file that is
            not UTF-8 or does not parse (file, line and column), a YAML file whose top level
            is not a mapping, or a value
            that a ``validate()`` rejected (the message starts with the dotted field,
            once, e.g. ``trainer.save_freq=-2 must be ...``).
        TypeError: a section's ``validate`` does not follow ``validate(self) -> None``.
    """
    if not _is_dataclass_type(schema):
        raise TypeError(f"schema must be a dataclass type, got {schema!r}")
    valid = _leaf_keys(schema)
    cfg = OmegaConf.structured(schema)
    OmegaConf.set_struct(cfg, True)
    _open_dict_fields(cfg, schema)  # dict fields take new keys; dataclass fields stay strict

    if yaml_path is not None:
        if not os.path.isfile(yaml_path):
            raise FileNotFoundError(f"config file {yaml_path!r} does not exist")
        loaded = _read_yaml(yaml_path)
        raw = OmegaConf.to_container(loaded, resolve=False)
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {yaml_path!r} must hold a mapping at the top level")
        source = f"from {yaml_path}"
        _check_keys(raw, schema, "", valid, source)
        _open_dict_fields(cfg, schema, raw)
        cfg = _merge(cfg, loaded, valid, source, raw)

    for item in overrides:
        key, _ = _parse_override(item)
        if key not in valid and _dict_field_of(key, valid) is None:
            raise _unknown_key_error(key, valid, f"from override {item!r}")
        update = _dotlist(item, key)
        raw = OmegaConf.to_container(update, resolve=False)
        section = _section_type(valid[key]) if key in valid else None
        value = _lookup(raw, key)
        if section is not None and value is not None and not isinstance(value, dict):
            raise _section_value_error(key, section, value, f"from override {item!r}")
        _check_keys(raw, schema, "", valid, f"from override {item!r}")
        _open_dict_fields(cfg, schema, raw)
        cfg = _merge(cfg, update, valid, f"from override {item!r}", raw)

    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as e:  # e.g. an interpolation naming a missing key, a MISSING value
        raise ConfigError(f"cannot resolve the config: {e}") from None
    _validate_tree(obj)
    return freeze(obj)


# --------------------------------------------------------------------------- output


def to_yaml(cfg: Any) -> str:
    """The config as YAML (enums by name), loadable again by :func:`load_config`.

    Raises:
        TypeError: ``cfg`` is not a dataclass instance.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_yaml expects a dataclass instance, got {type(cfg).__name__}")
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def to_flat_dict(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """``{"trainer.total_training_steps": 100, ...}``: every leaf under its dotted key.

    For ``mlflow.log_params`` (which stringifies values). Enums become their names,
    tuples become lists, dict-valued fields are flattened further, None stays None.

    Raises:
        TypeError: ``cfg`` is not a dataclass instance.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_flat_dict expects a dataclass instance, got {type(cfg).__name__}")
    out: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        else:
            out[key] = _plain(value)

    walk(cfg, prefix.rstrip("."))
    return out
