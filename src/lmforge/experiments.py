"""DVC experiments from Python: queue them, wait for the queue, read their results.

Sweeps (``lmforge mix sweep``, ``bench/forgetting_sweep.py``) are DVC queued experiments,
so every proxy is an ordinary experiment: ``dvc exp show`` lists it, ``dvc exp apply``
restores it, and its stages' outputs are in the DVC cache.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError


def dvc(*args: str) -> str:
    """Run ``dvc args``; its stdout, or one-line error with the end of its output."""
    try:
        proc = subprocess.run(["dvc", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise LmforgeError("dvc: not found on PATH (pip install lmforge installs it)") from None
    if proc.returncode != 0:
        # stderr last: its error line is the one to show, not the end of a table on stdout
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise LmforgeError(f"dvc {' '.join(args[:3])} failed: {' / '.join(tail)}")
    return proc.stdout


def queue_experiment(name: str, sets: list[str], targets: tuple[str, ...] = ()) -> None:
    """``dvc exp run --queue [targets] -n name -S set ...``."""
    args = ["exp", "run", "--queue", *targets, "-n", name]
    for s in sets:
        args += ["-S", s]
    dvc(*args)


def start_queue(jobs: int) -> None:
    """``dvc queue start -j jobs``, returning once the workers are up.

    The workers are daemons that inherit the starting process's stdout and stderr: with
    pipes there (``capture_output``) reading them would wait until the whole queue had
    run. A temporary file takes their output instead, and still gives an error's text.
    """
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.run(["dvc", "queue", "start", "-j", str(jobs)], stdout=out,
                              stderr=out, text=True)
        if proc.returncode != 0:
            out.seek(0)
            tail = out.read().strip().splitlines()[-3:]
            raise LmforgeError(f"dvc queue start failed: {' / '.join(tail)}")


def busy_experiments(tries: int = 3, pause: float = 2.0) -> list[str]:
    """Lines of ``dvc queue status`` for experiments queued or running.

    ``dvc queue status`` prints the task table, then asks the workers for their state;
    with two workers that second part can fail on a half-written message file (a known
    race in DVC's file-system broker, treeverse/dvc-task#73) after the table is out. A
    failed poll is tried again, ``tries`` times in all, before it is an error.
    """
    for attempt in range(tries):
        try:
            status = dvc("queue", "status")
            break
        except LmforgeError:
            if attempt == tries - 1:
                raise
            time.sleep(pause)
    return [line for line in status.splitlines() if re.search(r"\b(Running|Queued)\s*$", line)]


def wait_for_queue(poll: float = 10.0, report: Callable[[int], None] | None = None) -> None:
    """Until no experiment is queued or running (``dvc queue start`` returns at once);
    ``report(n)`` is told how many still are, whenever that changes.

    ``dvc queue status`` costs a second or two of CPU, so it is asked every ``poll``
    seconds, and at once when DVC's queue files change (``wait_for_queue_change``): the
    end of the last experiment is seen within a second, not up to ``poll`` later.
    """
    last = None
    while True:
        # Before asking: an experiment ending while `dvc queue status` runs (seconds)
        # is then a change still to see, not one already taken as the state waited on.
        seen = queue_fingerprint()
        if not (busy := busy_experiments()):
            return
        if report is not None and len(busy) != last:
            report(len(busy))
        last = len(busy)
        wait_for_queue_change(poll, since=seen)


# Where DVC's queue writes as experiments start and end: each executor's info file
# (run/<rev>/<rev>.run, rewritten at every change of state) and Celery's task results
# (celery/result/, one file per finished task). Not the experiments' logs beside the info
# files (run/<rev>/*.out): they grow with every line a stage prints, and each wake-up
# costs a `dvc queue status`. DVC internals: if they move, the fingerprint stays
# constant and waiting falls back to the timeout alone.
_QUEUE_FILES = (Path(".dvc/tmp/exps/run"), Path(".dvc/tmp/exps/celery/result"))
_QUEUE_LOGS = ".out"
# (path, mtime in ns, size) of each of those files, sorted.
Fingerprint = tuple[tuple[str, int, int], ...]


def queue_fingerprint(repo: Path = Path(".")) -> Fingerprint:
    """The state of DVC's queue files under ``repo``: (path, mtime, size) of each; a
    microsecond's read, where ``dvc queue status`` is a process."""
    entries = []
    for folder in _QUEUE_FILES:
        with contextlib.suppress(OSError):
            for path in (repo / folder).rglob("*"):
                if path.suffix == _QUEUE_LOGS:
                    continue
                with contextlib.suppress(OSError):  # removed while we looked
                    stat = path.stat()
                    entries.append((str(path), stat.st_mtime_ns, stat.st_size))
    return tuple(sorted(entries))


def wait_for_queue_change(timeout: float, repo: Path = Path("."), tick: float = 0.5,
                          since: Fingerprint | None = None) -> None:
    """Sleep until DVC's queue files under ``repo`` differ from ``since`` (by default,
    from what they are now), or ``timeout`` seconds pass."""
    seen = queue_fingerprint(repo) if since is None else since
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(min(tick, max(0.0, deadline - time.monotonic())))
        if queue_fingerprint(repo) != seen:
            return


def experiments() -> dict[str, dict[str, Any]]:
    """Every experiment ``dvc exp show --all-commits`` lists, by name: its ``state``
    (success, failed, queued, running), ``params`` and ``metrics`` ({file: data})."""
    out = dvc("exp", "show", "--json", "--all-commits")
    found: dict[str, dict[str, Any]] = {}

    # Commits hold "experiments": [{"revs": [{"rev", "name", "data"}], "executor":
    # {"state"} or null}]: null for one run outside the queue (in the workspace or with
    # --temp), which is finished once listed. A commit (a branch) is no experiment.
    def walk(node: Any, state: str | None) -> None:
        if isinstance(node, dict):
            if "revs" in node:
                executor = node.get("executor")
                state = (executor.get("state") if isinstance(executor, dict) else None
                         ) or "success"
            name, data = node.get("name"), node.get("data")
            if state and name and isinstance(data, dict):
                found.setdefault(name, {"state": state, "rev": node.get("rev"),
                                        "metrics": _files(data.get("metrics")),
                                        "params": _files(data.get("params"))})
            for key, value in node.items():
                walk(value, state if key == "revs" else None)
        elif isinstance(node, list):
            for value in node:
                walk(value, state)

    walk(json.loads(out or "[]"), None)
    # dvc exp show lists only the headline metrics; the stages' detail files (per-domain
    # figures, mix shares) are plain outputs committed in each experiment's git commit.
    for e in found.values():
        if e["state"] == "success" and e["rev"]:
            e["metrics"] = {**committed_json(e["rev"]), **e["metrics"]}
    return found


def _git(*args: str, cwd: str | None = None) -> str | None:
    """``git args``'s stdout, or None when git fails (a revision it does not know)."""
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd)
    except FileNotFoundError:
        return None
    return proc.stdout if proc.returncode == 0 else None


def committed_json(rev: str, folder: str = "metrics", cwd: str | None = None
                   ) -> dict[str, Any]:
    """``{path: data}`` of every JSON file under ``folder`` in git revision ``rev`` of the
    repository at ``cwd`` ({} when git does not know the revision). A file that is no
    JSON is left out: the reader that needs it names it as missing."""
    names = _git("ls-tree", "-r", "--name-only", rev, "--", folder, cwd=cwd)
    found: dict[str, Any] = {}
    for path in (names or "").splitlines():
        text = _git("show", f"{rev}:{path}", cwd=cwd) if path.endswith(".json") else None
        if text is not None:
            with contextlib.suppress(json.JSONDecodeError):
                found[path] = json.loads(text)
    return found


def _files(section: Any) -> dict[str, Any]:
    """``{path: data}`` of a ``dvc exp show --json`` metrics or params section."""
    if not isinstance(section, dict):
        return {}
    return {path: (m or {}).get("data", {}) for path, m in section.items()}
