"""What every params section shares: the params.yaml key a field is read from, and the
range checks whose one-line errors name it.

A section's name is where params.yaml holds it, derived from the ``Params`` fields
(``dpo``, ``dpo.lora``, ``model.rope_scaling``), never written into a message by hand:
a class used in several places (``TrainConfig`` fields under ``train``, ``sft`` and
``dpo``; ``LoraConfig`` under each of them) is named where it is being checked
(``check``), else where ``Params`` first holds its type.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import typing
from typing import Any, get_args

from lmforge.errors import ConfigError

# The section being validated and where params.yaml holds it: (id(section), "dpo.lora").
_CHECKING: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "lmforge_config_checking", default=None)


def yaml_name(cls: type, field_name: str) -> str:
    """The params.yaml key of a config field (a section may rename one, as sft's lr)."""
    return getattr(cls, "YAML_NAMES", {}).get(field_name, field_name)


def yaml_keys(cls: type) -> dict[str, str]:
    """``{params.yaml key: field name}`` for a config dataclass."""
    return {yaml_name(cls, f.name): f.name for f in dataclasses.fields(cls)}


def check(section: Any, where: str) -> None:
    """Validate ``section`` as the one params.yaml holds at ``where``: its errors (and
    its nested sections') name ``where``'s keys."""
    token = _CHECKING.set((id(section), where))
    try:
        section.validate()
    finally:
        _CHECKING.reset(token)


def check_child(parent: Any, field_name: str) -> None:
    """Validate the section in ``parent``'s field ``field_name`` (when set) as
    ``<parent's section>.<field>``."""
    child = getattr(parent, field_name)
    if child is not None:
        check(child, key(parent, field_name))


def section_name(obj: Any) -> str:
    """The params.yaml section a config object is read from (``train``, ``sft.lora``...):
    where it is being checked, else where ``Params`` first holds its type."""
    checking = _CHECKING.get()
    if checking is not None and checking[0] == id(obj):
        return checking[1]
    return section_paths().get(type(obj), type(obj).__name__)


def key(obj: Any, field_name: str) -> str:
    """``section.key`` of one of ``obj``'s fields, as the user wrote it in params.yaml."""
    return f"{section_name(obj)}.{yaml_name(type(obj), field_name)}"


@functools.cache
def section_paths() -> dict[type, str]:
    """``{config class: its params.yaml path}``, walking ``Params``' fields (nested
    sections included) breadth-first, so a class gets the shortest path holding it."""
    from lmforge.config.params import Params  # the sections import this module

    paths: dict[type, str] = {}
    queue: list[tuple[type, str]] = [(Params, "")]
    while queue:
        cls, prefix = queue.pop(0)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = f"{prefix}{yaml_name(cls, f.name)}"
            for tp in _section_types(hints[f.name]):
                if tp not in paths:
                    paths[tp] = path
                    queue.append((tp, f"{path}."))
    return paths


def _section_types(tp: Any) -> list[type]:
    """The config dataclasses a type hint holds (``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if dataclasses.is_dataclass(tp):
        return [tp]
    return [t for arg in get_args(tp) for t in _section_types(arg)]


def positive(obj: Any, *names: str) -> None:
    """Each named field of ``obj`` is > 0."""
    for n in names:
        if not getattr(obj, n) > 0:
            raise ConfigError(f"{key(obj, n)}: {getattr(obj, n)} must be > 0")


def non_negative(obj: Any, *names: str) -> None:
    """Each named field of ``obj`` is >= 0."""
    for n in names:
        if not getattr(obj, n) >= 0:
            raise ConfigError(f"{key(obj, n)}: {getattr(obj, n)} must be >= 0")


def fraction(obj: Any, *names: str) -> None:
    """Each named field of ``obj`` is in [0, 1]."""
    for n in names:
        if not 0 <= getattr(obj, n) <= 1:
            raise ConfigError(f"{key(obj, n)}: {getattr(obj, n)} must be in [0, 1]")


def below_one(obj: Any, *names: str) -> None:
    """Each named field of ``obj`` is in [0, 1) (a momentum, a dropout)."""
    for n in names:
        if not 0 <= getattr(obj, n) < 1:
            raise ConfigError(f"{key(obj, n)}: {getattr(obj, n)} must be in [0, 1)")
