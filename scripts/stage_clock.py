"""Pass ``dvc repro``'s output through and time each stage it runs.

``make demo`` pipes ``dvc repro`` through this script: every line is echoed as it comes,
a stage's clock starts at DVC's ``Running stage 'NAME':`` line and stops at the next
stage's line (or the end), and the table of stage seconds is written to ``--out`` (the
Makefile prints it last, so the demo's budget can be read off at a glance). A stage DVC
skips (``didn't change``) is listed as ``cached``.

    dvc repro 2>&1 | python scripts/stage_clock.py --out .dvc/tmp/stage_times.txt
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

RUNNING = re.compile(r"^Running stage '([^']+)'")
SKIPPED = re.compile(r"^Stage '([^']+)' didn't change, skipping")


def clock(lines, now=time.monotonic) -> list[tuple[str, float | None]]:
    """Echo ``lines``; return (stage, seconds) in run order, ``None`` for skipped ones."""
    times: list[tuple[str, float | None]] = []
    current, start = None, now()
    for line in lines:
        sys.stdout.write(line)
        sys.stdout.flush()
        ran, skipped = RUNNING.match(line), SKIPPED.match(line)
        if ran or skipped:
            t = now()
            if current is not None:
                times.append((current, t - start))
                current = None
            if ran:
                current, start = ran.group(1), t
            else:
                times.append((skipped.group(1), None))
    if current is not None:
        times.append((current, now() - start))
    return times


def table(times: list[tuple[str, float | None]], total: float) -> str:
    """The stage times as the demo prints them: one line per stage, then the total."""
    width = max([len(s) for s, _ in times] + [5])
    lines = [f"stage times (dvc repro, {total:.0f} s in all):"]
    for stage, seconds in times:
        lines.append(f"  {stage:{width}}  " + ("cached" if seconds is None
                                                 else f"{seconds:6.1f} s"))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the table")
    args = ap.parse_args()
    t0 = time.monotonic()
    times = clock(iter(sys.stdin.readline, ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table(times, time.monotonic() - t0), encoding="utf-8")


if __name__ == "__main__":
    main()
