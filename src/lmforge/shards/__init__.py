"""Binary token shards: the format, the writer, and the training/evaluation loader."""

from __future__ import annotations

from typing import Any

__all__ = ["IGNORE_INDEX", "ShardSet", "WindowLoader", "eval_batches"]


def __getattr__(name: str) -> Any:
    # Lazy: the loader needs torch, the shards stage (format + writer) does not.
    if name in __all__:
        from lmforge.shards import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'lmforge.shards' has no attribute {name!r}")
