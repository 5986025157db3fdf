"""Atomic file output: a killed stage never leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success.

    ``durable``: fsync the file before the rename and the directory after it, so a power
    loss leaves either the old file or the complete new one, never an empty one under
    the new name (the rename can reach the disk before the data otherwise).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp makes files 0600; give the result the mode a plain open() would.
        os.chmod(tmp_path, 0o666 & ~_umask())
        if durable:
            fsync_path(tmp_path)
        os.replace(tmp_path, path)
        if durable:
            fsync_path(path.parent)
    finally:
        tmp_path.unlink(missing_ok=True)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any, durable: bool = False,
               sort_keys: bool = True) -> None:
    """Write ``obj`` as stable, human-readable JSON (sorted keys unless ``sort_keys`` is
    false: then in ``obj``'s order), atomically."""
    with atomic_path(path, durable) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys, ensure_ascii=False)
                       + "\n", encoding="utf-8")


def read_json_object(path: str | os.PathLike, missing: str = "not found") -> dict[str, Any]:
    """A JSON object from ``path``; a missing, malformed or non-object file is one
    ``InputError`` line naming it (``missing`` says what its absence means)."""
    from lmforge.errors import InputError

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: {missing}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name; swap it into place only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes directories 0700
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


PARTIAL_SUFFIX = ".partial"
_STAMP = ".fingerprint"


@contextlib.contextmanager
def resumable_dir(path: str | os.PathLike, fingerprint: str) -> Iterator[Path]:
    """Like :func:`atomic_dir`, but the work directory, ``.<name>.partial`` beside
    ``path``, outlives a kill or an error, so a rerun with the same ``fingerprint``
    (the stage's inputs and settings) continues from what it holds. Another fingerprint
    starts afresh. On success, the work directory becomes ``path``, without its
    bookkeeping (names starting with ``.``)."""
    path = Path(path)
    work = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")
    stamp = work / _STAMP
    if work.exists() and not (stamp.is_file() and stamp.read_text() == fingerprint):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint)
    yield work
    for hidden in work.glob(".*"):
        if hidden.is_dir():
            shutil.rmtree(hidden)
        else:
            hidden.unlink()
    with atomic_dir(path) as tmp:
        os.rmdir(tmp)
        os.replace(work, tmp)


def files_fingerprint(paths: list[Path], *settings: object) -> str:
    """A digest of ``settings`` and of each file's name, size and modification time: what
    a stage's resumable work depends on (a changed input gets a new mtime)."""
    h = hashlib.blake2b(digest_size=16)
    for s in settings:
        h.update(repr(s).encode())
    for p in paths:
        st = os.stat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
