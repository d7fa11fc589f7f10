"""TOML tables -> frozen dataclasses: the one way PrfaaS reads a configuration file.

`build(cls, table, source=...)` reads a parsed TOML table into the dataclass `cls`, driven
by its type hints:

- every key must be a field (a typo is an error), every field without a default is required;
- a value must fit its hint: `str`, `bool`, `int` (a bool is not an int), `float` (an int
  is accepted and widened), `Literal[...]`, `X | None` (TOML has no null: `None` only ever
  means "absent"), `tuple[X, ...]` (a TOML array), `Mapping[str, X]` (a table of named
  tables), and nested dataclasses (tables, arrays of tables) recursively;
- then the class is called, so its `__post_init__` validates values and their relations.
  It reports a bad field with `check(ok, key, value, why)` (a `FieldError`), which also
  reads well when code builds the dataclass directly.

Every problem leaves as one `ConfigError` naming the file, the key path
(`instances[1].role`, `hardware.h20.prefill_seconds`) and the value as the file wrote it:
`deploy.toml: gateway.threshold: must be >= 0 (got -5)`.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names file, key path and value."""


class FieldError(ValueError):
    """The field `key` holds the bad `value` (raised by `__post_init__` checks).

    `key` is relative to the dataclass that raises it (`"block_size"`, or `"pd.instances"`
    for a check across nested tables); `build` prefixes the table's path. A `value` of
    None means the key is absent, so the message shows no value.
    """

    def __init__(self, key: str, value: object, why: str) -> None:
        shown = "" if value is None else f" (got {value!r})"
        super().__init__(f"{key}: {why}{shown}")
        self.key, self.value, self.why = key, value, why


def check(ok: bool, key: str, value: object, why: str) -> None:
    """Raise `FieldError(key, value, why)` unless `ok`."""
    if not ok:
        raise FieldError(key, value, why)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read and parse one TOML file.

    Raises:
        ConfigError: the file cannot be read or is not valid TOML (the message names it).
    """
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def build(cls: type[T], table: object, *, source: str) -> T:
    """Read the parsed TOML document or table `table` into the dataclass `cls`.

    Raises:
        ConfigError: an unknown or missing key, a value of the wrong type, or one its class
            rejects; the message starts with `source` and names the key path and value.
    """
    try:
        result: T = _value(cls, table, "")
    except FieldError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return result


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _value(hint: Any, value: object, path: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if isinstance(hint, type) and is_dataclass(hint):
        return _table(hint, value, path)
    if origin is UnionType or origin is Union:
        (inner,) = [a for a in args if a is not NoneType]  # only `X | None` is supported
        return _value(inner, value, path)
    if origin is Literal:
        ok = any(type(value) is type(a) and value == a for a in args)  # True is not 1
        check(ok, path, value, f"must be one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise FieldError(path, value, "must be an array")
        return tuple(_value(args[0], v, f"{path}[{n}]") for n, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise FieldError(path, value, "must be a table")
        return {k: _value(args[1], v, _join(path, k)) for k, v in value.items()}
    return _scalar(hint, value, path)


def _scalar(hint: Any, value: object, path: str) -> Any:
    if hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise FieldError(path, value, "must be a number")
        return float(value)
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        check(ok, path, value, "must be an integer")
        return value
    if hint is str or hint is bool:
        check(isinstance(value, hint), path, value, f"must be a {_NAMES[hint]}")
        return value
    raise TypeError(f"{path}: type {hint!r} is not supported in a config dataclass")


def _table(cls: type[Any], table: object, path: str) -> Any:
    if not isinstance(table, dict):
        raise FieldError(path, table, "must be a table")
    hints, known = get_type_hints(cls), {f.name: f for f in fields(cls)}
    unknown = sorted(table.keys() - known.keys())
    if unknown:
        why = f"unknown key (known: {', '.join(known)})"  # the key is wrong, not its value
        raise FieldError(_join(path, unknown[0]), None, why)
    for name, f in known.items():
        if name not in table and f.default is MISSING and f.default_factory is MISSING:
            raise FieldError(_join(path, name), None, "is required")
    values = {k: _value(hints[k], v, _join(path, k)) for k, v in table.items()}
    try:
        return cls(**values)
    except FieldError as exc:
        # A __post_init__ check on a field's own value: show it as the file wrote it (a TOML
        # array, not the tuple it became; `-5`, not `-5.0`).
        own = exc.key in values and exc.value is values[exc.key]
        shown = table[exc.key] if own else exc.value
        raise FieldError(_join(path, exc.key), shown, exc.why) from None


_NAMES = {str: "string", bool: "boolean"}
