"""Small helpers over files the tests compare."""

from __future__ import annotations

from pathlib import Path


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, by path relative to it: two trees are equal byte for
    byte when their ``tree`` is."""
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file()}
