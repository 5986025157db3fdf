"""Checkpoint directories per run: ``models/checkpoints/<run id>/``.

A long run's checkpoints are the most expensive files a user has, so each run (one
fingerprint: the params, data and tokenizer that define its trajectory) keeps them in a
directory of its own, with a ``run.json`` that says what the run is and how far it got.
A run resumes only from its own directory and never deletes another's: an experiment
tried while a long run is paused costs that run nothing. Removing runs is an explicit
command (``lmforge checkpoints prune``).

While a process trains a run it holds a lock on the run's directory, so two processes
(say, two queued experiments with the same params) never write the same checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import LmforgeError
from lmforge.io import write_json
from lmforge.train import checkpoint as ckpt

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
ID_LEN = 16  # hex digits of the fingerprint that name the directory
_ID = re.compile(rf"^[0-9a-f]{{{ID_LEN}}}$")


def run_id(fp: str) -> str:
    """The directory name of run ``fp``."""
    return fp[:ID_LEN]


def run_dir(root: str | os.PathLike, fp: str) -> Path:
    """``root/<run id>``."""
    return Path(root) / run_id(fp)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_run(directory: str | os.PathLike) -> dict[str, Any]:
    """A run directory's ``run.json`` ({} when missing or unreadable)."""
    try:
        return json.loads((Path(directory) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def start_run_dir(root: str | os.PathLike, fp: str, identity: dict[str, Any] | None,
                  max_steps: int, extra: dict[str, Any] | None = None) -> Path:
    """Create (or reopen) run ``fp``'s directory and record it in ``run.json``."""
    directory = run_dir(root, fp)
    directory.mkdir(parents=True, exist_ok=True)
    record = read_run(directory)
    record.update({
        "fingerprint": fp,
        "started": record.get("started") or _now(),
        "updated": _now(),
        "max_steps": max_steps,
        "status": "running",
        "last_step": record.get("last_step", 0),
    })
    if identity is not None:
        record["identity"] = identity
    record.update(extra or {})
    write_json(directory / RUN_FILE, record, durable=True)
    return directory


def update_run(directory: str | os.PathLike, **fields: Any) -> None:
    """Merge ``fields`` into the run's ``run.json`` (atomically, fsynced)."""
    directory = Path(directory)
    record = read_run(directory)
    record.update(fields, updated=_now())
    write_json(directory / RUN_FILE, record, durable=True)


@contextlib.contextmanager
def locked(directory: str | os.PathLike) -> Iterator[None]:
    """Hold the run's lock while training it; one line if another process holds it."""
    path = Path(directory) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise LmforgeError(
                f"train: run {Path(directory).name} is being trained by another process "
                f"(pid {holder}); wait for it, or stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def is_locked(directory: str | os.PathLike) -> bool:
    """True while some process trains this run."""
    path = Path(directory) / LOCK_FILE
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def adopt_legacy(root: str | os.PathLike, log: Callable[[str], None] = print) -> int:
    """Move checkpoints of the old flat layout (``root/step-*.pt``) into their runs' dirs.

    Each file names its run in its ``fingerprint``; nothing is deleted. An unreadable
    file stays where it is. Returns how many files moved.
    """
    root = Path(root)
    moved = 0
    for path in ckpt.list_checkpoints(root):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            fp, step = str(state["fingerprint"]), int(state["step"])
        except Exception:  # unreadable, or moved away by another process: leave it
            continue
        directory = run_dir(root, fp)
        if not (directory / RUN_FILE).is_file():
            directory.mkdir(parents=True, exist_ok=True)
            write_json(directory / RUN_FILE, {
                "fingerprint": fp, "started": None, "updated": _now(),
                "max_steps": None, "status": "adopted", "last_step": step,
                "last_checkpoint": path.name}, durable=True)
        try:
            path.replace(directory / path.name)
        except FileNotFoundError:  # another run starting beside us moved it first
            continue
        moved += 1
    light = root / "light"
    if light.is_dir():
        for sub in light.iterdir():  # light/<fp[:12]>/: into the run it belongs to
            owners = [d for d in root.iterdir() if d.name.startswith(sub.name) and d != light]
            if len(owners) == 1:
                (owners[0] / "light").mkdir(exist_ok=True)
                for f in sub.iterdir():
                    f.replace(owners[0] / "light" / f.name)
                sub.rmdir()
        with contextlib.suppress(OSError):
            light.rmdir()
    if moved:
        log(f"train: moved {moved} checkpoint(s) of the flat layout into their run "
            f"directories under {root}")
    return moved


@dataclass
class RunInfo:
    """One run directory as ``lmforge checkpoints`` shows it."""

    id: str
    path: Path
    record: dict[str, Any]
    size_bytes: int
    newest: Path | None
    training_now: bool

    @property
    def last_step(self) -> int:
        return int(self.record.get("last_step") or 0)

    @property
    def status(self) -> str:
        """training now / finished / interrupted (killed or failed before the end)."""
        if self.training_now:
            return "training now"
        status = self.record.get("status")
        return "finished" if status == "finished" else "interrupted"

    @property
    def age_seconds(self) -> float:
        return time.time() - self.path.stat().st_mtime if self.newest is None else (
            time.time() - self.newest.stat().st_mtime)


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def list_runs(root: str | os.PathLike) -> list[RunInfo]:
    """Every run directory under ``root``, the most recently written first."""
    root = Path(root)
    runs = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not (d.is_dir() and _ID.match(d.name)):
            continue
        found = ckpt.list_checkpoints(d)
        runs.append(RunInfo(d.name, d, read_run(d), _size(d), found[-1] if found else None,
                            is_locked(d)))
    return sorted(runs, key=lambda r: r.age_seconds)


def prune_runs(root: str | os.PathLike, keep: set[str], dry_run: bool = False,
               log: Callable[[str], None] = print) -> list[RunInfo]:
    """Delete every run directory whose id is not in ``keep``; never one being trained."""
    removed = []
    for run in list_runs(root):
        if run.id in keep:
            continue
        if run.training_now:
            log(f"checkpoints: {run.id} is being trained now; kept")
            continue
        if not dry_run:
            shutil.rmtree(run.path)
        removed.append(run)
    return removed
