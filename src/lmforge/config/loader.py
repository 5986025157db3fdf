"""params.yaml into a ``Params``: YAML read, keys and types checked, then validated."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from lmforge.config.checks import yaml_keys, yaml_name
from lmforge.config.params import Params
from lmforge.errors import ConfigError


def load_params(path: str | os.PathLike = "params.yaml") -> Params:
    """Read, type-check and validate ``path``; raise ConfigError with a one-line message."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such params file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}:{where}: invalid YAML: {problem}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        params = from_dict(Params, raw if raw is not None else {}, "")
        params.validate()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return params


def from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys and value types."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {_kind(data)}")
    names = yaml_keys(cls)  # params.yaml key -> field name
    fields = {key: f for f in dataclasses.fields(cls)
              for key in [yaml_name(cls, f.name)]}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{prefix}{key}: unknown key{hint}")
    for name, f in fields.items():
        required = (f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING)
        if required and name not in data:
            raise ConfigError(f"{prefix}{name}: required key missing")
    values = {names[k]: _coerce(hints[names[k]], v, f"{prefix}{k}") for k, v in data.items()}
    return cls(**values)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against type hint ``tp`` (recursing into containers/dataclasses)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        choices = get_args(tp)
        # Typed: 0 and 1 equal False and True, but are not the booleans a key allows.
        if not any(value == c and type(value) is type(c) for c in choices):
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{key}: {value!r} is not one of {', '.join(map(str, choices))}{hint}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_kind(value)}")
        (item,) = get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {_kind(value)}")
        _, item = get_args(tp)
        return {str(k): _coerce(item, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, f"{key}.")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML reads "5e-4" (no dot) as a string; accept it as the number it means.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config type {tp!r} for {key} is not supported")  # a bug in this file


def section_dict(section: Any) -> dict[str, Any]:
    """A params section as a plain dict of params.yaml keys (for MLflow and metrics)."""
    return {yaml_name(type(section), k): v for k, v in dataclasses.asdict(section).items()}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are kept as values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
