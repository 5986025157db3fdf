"""What a data stage tells the user on the console: counts, and the records it rejected."""

from __future__ import annotations

import os

import pyarrow.parquet as pq

# Enough to show what went wrong without flooding the console; the table has them all.
SHOW_REJECTS = 10


def summary_line(stage: str, metrics: dict) -> str:
    """``filter: 2,992 in, 2,902 kept, 90 rejected (gopher_stop_words 41, ...)``."""
    total_in = total_kept = 0
    reasons: dict[str, int] = {}
    for counts in metrics["domains"].values():
        total_in += counts["in"]
        total_kept += counts["kept"]
        for reason, n in counts["rejected"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    rejected = sum(reasons.values())
    line = f"{stage}: {total_in:,} in, {total_kept:,} kept, {rejected:,} rejected"
    if reasons:
        top = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        line += " (" + ", ".join(f"{r} {n:,}" for r, n in top) + ")"
    return line


def reject_lines(path: str | os.PathLike, limit: int = SHOW_REJECTS) -> list[str]:
    """One line per rejected input record (``file:line: reason: detail``), at most ``limit``."""
    if not os.path.exists(path):
        return []
    table = pq.read_table(path, columns=["file", "line", "reason", "detail"])
    rows = table.slice(0, limit).to_pylist()
    lines = [f"  rejected {r['file']}:{r['line']}: {r['reason']}: {r['detail']}" for r in rows]
    if table.num_rows > limit:
        lines.append(f"  ... and {table.num_rows - limit:,} more in {path}")
    return lines


def print_report(stage: str, metrics: dict, rejects: str | os.PathLike | None = None) -> None:
    """Print the summary line, then the first rejected records if a rejects table is given."""
    print(summary_line(stage, metrics))
    for line in reject_lines(rejects) if rejects else []:
        print(line)
