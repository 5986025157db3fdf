"""Regenerate the command output in docs/fine-tuning-memory.md from ``lmforge plan``.

Every fenced block whose first line is ``$ lmforge plan ...`` is replaced by that command's
output, and the table between ``<!-- matrix -->`` and ``<!-- /matrix -->`` by the largest
micro-batches the command's ``--json`` reports. tests/test_finetune_plan.py fails when
the page differs from what this script writes. Usage: ``python scripts/plan_docs.py``.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = "docs/fine-tuning-memory.md"
BLOCK = re.compile(r"```\n\$ (lmforge plan [^\n]*)\n.*?```", re.S)
MATRIX = re.compile(r"(<!-- matrix -->\n).*?(<!-- /matrix -->)", re.S)
SHAPES = ("1b", "3b", "7b", "mistral-7b", "8b", "qwen2.5-7b")
MODES = ("full", "lora", "qlora")
DEVICES = (("24 GiB GPU", "cuda", 24), ("48 GiB GPU", "cuda", 48), ("80 GiB GPU", "cuda", 80),
           ("64 GiB CPU RAM", "cpu", 64))


def run(command: str) -> str:
    """The stdout of ``lmforge plan ...`` run on the repository's params.yaml."""
    from lmforge.cli import main

    argv = shlex.split(command)[1:] + ["--params", str(REPO / "params.yaml")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    return out.getvalue()


def cell(shape: str, mode: str, device: str, gib: float) -> dict:
    """What ``lmforge plan --mode M --shape S [--device D] --device-gb G --json`` reports,
    from the function the command calls (the test checks a cell against the command)."""
    from lmforge.plan import finetune_plan, preset_tune

    return finetune_plan(preset_tune(shape, mode, device), gib, 1)


def matrix() -> str:
    """Markdown: per shape and mode, the largest micro-batch without / with checkpointing."""
    head = "| shape | mode | " + " | ".join(name for name, _, _ in DEVICES) + " |"
    lines = [head, "|" + "---|" * (2 + len(DEVICES))]
    for shape in SHAPES:
        for mode in MODES:
            cells = []
            for _, device, gib in DEVICES:
                doc = cell(shape, mode, device, gib)
                no, ac = doc["no_ac"]["max_micro_batch"], doc["ac"]["max_micro_batch"]
                cells.append("does not fit" if no == ac == 0 else f"{no} / {ac}")
            lines.append(f"| {shape} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(page: str) -> str:
    """The page with every generated region recomputed."""
    page = BLOCK.sub(lambda m: f"```\n$ {m.group(1)}\n{run(m.group(1))}```", page)
    return MATRIX.sub(lambda m: m.group(1) + matrix() + m.group(2), page)


def main() -> int:
    path = REPO / PAGE
    text = render(path.read_text())
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: a reader sees the old page or the new one
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
