"""Build typed dataclasses from plain dicts (YAML, JSON, ``a.b=c`` overrides) and back.

Every value is checked against the field's annotation; an unknown key fails with the nearest valid key
(``difflib``), a wrong type names the key, the expected type and the value received. Errors raised by a
dataclass's own ``__post_init__`` (``ValueError``/``TypeError``) are re-raised as :class:`UserError`
prefixed with the section they came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import yaml

from mcore.train.errors import UserError

T = TypeVar("T")


class RawText(str):
    """A command-line override value, kept as text until the field's type is known.

    ``data.path=0123`` must stay the string ``"0123"`` for a ``str`` field, yet ``train.steps=20`` must
    become an int: the text is parsed with YAML only when the target type is not ``str``.
    """


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    return "valid keys: " + ", ".join(sorted(valid))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_container(tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
    return origin in (list, tuple, dict)


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` converted to the annotation ``tp``, or raise :class:`UserError` naming ``path``."""
    if isinstance(value, RawText) and tp is not str:
        value = _parse_raw_text(value, tp, path)
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), path)
    if origin is typing.Literal:
        args = typing.get_args(tp)
        if value in args:
            return value
        raise UserError(
            f"config key '{path}' must be one of {', '.join(repr(a) for a in args)}, got {_describe(value)}"
        )
    if tp in (bool, int, float, str) or tp is torch.dtype:
        return _coerce_scalar(value, tp, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in tp)
            raise UserError(f"config key '{path}' must be one of {choices}, got {_describe(value)}") from None
    if origin in (list, tuple, dict) or tp in (list, tuple, dict):
        return _coerce_container(value, tp, path)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise UserError(f"config section '{path}' expects a mapping of keys, got {_describe(value)}")
        return from_dict(tp, value, path)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise UserError(f"config key '{path}' expects {_type_name(tp)}, got {_describe(value)}")


def _parse_raw_text(value: RawText, tp: Any, path: str) -> Any:
    """A command-line value for a non-``str`` field, parsed as YAML (kept as text where ``str`` is allowed)."""
    if tp is Any:
        return yaml.safe_load(value)
    args = typing.get_args(tp)
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if not (union and str in args):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise UserError(f"config key '{path}': cannot parse {str(value)!r}: {exc}") from None
    if value.lstrip()[:1] in ("[", "{") and any(_is_container(a) for a in args):
        # a key that takes a string or a list/mapping: `[...]`/`{...}` on the command line is the container
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, list | dict):
            return parsed
    return value


def _coerce_union(value: Any, args: tuple[Any, ...], path: str) -> Any:
    if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("null", "none"))):
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, path)
        except UserError:
            pass
    expected = " or ".join(_type_name(a) for a in args)
    raise UserError(f"config key '{path}' expects {expected}, got {_describe(value)}")


def _coerce_scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"config key '{path}' expects true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise UserError(f"config key '{path}' expects an integer, got {_describe(value)}")
        if isinstance(value, int):
            return value
        number = _as_number(value)
        if number is not None and float(number).is_integer():
            return int(number)
        raise UserError(f"config key '{path}' expects an integer, got {_describe(value)}")
    if tp is float:
        number = None if isinstance(value, bool) else _as_number(value)
        if number is not None:
            return float(number)
        raise UserError(f"config key '{path}' expects a number, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return str(value)
        raise UserError(f"config key '{path}' expects a string, got {_describe(value)}")
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, value.removeprefix("torch."))
    raise UserError(f"config key '{path}' expects a torch dtype name such as 'bfloat16', got {_describe(value)}")


def _coerce_container(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise UserError(f"config key '{path}' expects a mapping, got {_describe(value)}")
        if not args:
            return dict(value)
        return {coerce(k, args[0], path): coerce(v, args[1], _join(path, str(k))) for k, v in value.items()}
    if not isinstance(value, list | tuple):
        raise UserError(f"config key '{path}' expects a list, got {_describe(value)}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if origin is tuple and args:
        if len(args) != len(value):
            raise UserError(f"config key '{path}' expects {len(args)} items, got {len(value)}: {value!r}")
        return tuple(coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(args, value)))
    items = [coerce(v, args[0], f"{path}[{i}]") if args else v for i, v in enumerate(value)]
    return tuple(items) if (origin is tuple or tp is tuple) else items


def _as_number(value: Any) -> int | float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass's init fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and value (see the module docstring)."""
    types_ = field_types(cls)
    unknown = [k for k in data if k not in types_]
    if unknown:
        key = unknown[0]
        valid = [_join(path, k) for k in types_]
        raise UserError(f"unknown config key '{_join(path, str(key))}'; {_suggest(_join(path, str(key)), valid)}")
    kwargs = {k: coerce(v, types_[k], _join(path, k)) for k, v in data.items()}
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in kwargs
    ]
    if required:
        names = ", ".join(_join(path, r) for r in required)
        raise UserError(f"config section '{path or cls.__name__}' is missing required key(s): {names}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        where = f"config section '{path}'" if path else "config"
        raise UserError(f"{where}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """A JSON/YAML-safe copy of a (nested) dataclass: tuples become lists, dtypes and enums strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted = "a.b.c"``, creating the intermediate mappings."""
    parts = dotted.split(".")
    if any(not p for p in parts):
        raise UserError(f"override key {dotted!r} has an empty part; write it as section.key=value")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or not isinstance(child, dict):
            if child is not None and not isinstance(child, dict):
                # ``model: llama3-8b`` in YAML followed by ``model.num_hidden_layers=2`` on the command line.
                child = _scalar_to_section(child, ".".join(parts[: i + 1]))
            else:
                child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _scalar_to_section(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, str):
        return {"preset": value}
    raise UserError(f"config key '{path}' holds {_describe(value)}, so '{path}.<key>' cannot be set")
