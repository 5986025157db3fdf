"""Markdown tables from ``bench_time_to_quality.py --out`` JSON (no torch needed).

Two layouts of the same figures:

* ``runs``: one row per variant and mode (bench/RESULTS.md);
* ``ablation``: one row per variant, equal tokens beside equal wall time, per-domain
  bits/byte of the equal-tokens run (docs/training.md, filled by scripts/demo_docs.py).

Every figure is the JSON's; nothing is typed here.
``python bench/ttq_table.py RESULTS.json [--layout runs|ablation]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any]:
    """The bench's ``--out`` JSON."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _run(results: dict[str, Any], name: str, mode: str) -> dict[str, Any] | None:
    """A variant's run in ``mode`` at the file's first seed (a table is one seed's)."""
    seed = results["seeds"][0]
    return results["runs"].get(f"{name}/{mode}/seed{seed}")


def _variants(results: dict[str, Any]) -> list[str]:
    """Variant names in the order they were run (baseline first)."""
    names: list[str] = []
    for key in results["runs"]:
        name = key.split("/")[0]
        if name not in names:
            names.append(name)
    return names


def _domains(run: dict[str, Any]) -> str:
    return " ".join(f"{v:.3f}" for v in run["domains"].values())


def runs_table(results: dict[str, Any]) -> str:
    """One row per variant and mode: steps, bits/byte ± stderr, the difference from the
    baseline, tokens/s and its ratio, per domain."""
    modes = [m for m in ("tokens", "wall") if _run(results, "baseline", m)]
    first = _run(results, "baseline", modes[0])
    lines = ["| variant | mode | steps | val bits/byte ± stderr | vs baseline | tok/s | "
             f"tok/s vs baseline | {' '.join(first['domains'])} |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        base = _run(results, "baseline", mode)
        for name in _variants(results):
            run = _run(results, name, mode)
            if run is None:
                continue
            lines.append(
                f"| {name} | {mode} | {run['steps']} | {run['bpb']:.4f} ± "
                f"{run['bpb_stderr']:.4f} | {run['bpb'] - base['bpb']:+.4f} | "
                f"{run['tokens_per_sec']:,.0f} | "
                f"{run['tokens_per_sec'] / base['tokens_per_sec']:.2f}x | {_domains(run)} |")
    return "\n".join(lines)


def ablation_table(results: dict[str, Any]) -> str:
    """One row per variant: equal tokens (bits/byte ± stderr, difference, tokens/s
    ratio), equal wall time (steps, bits/byte, difference), per domain at equal tokens."""
    base_t = _run(results, "baseline", "tokens")
    base_w = _run(results, "baseline", "wall")
    domains = " / ".join(base_t["domains"])
    lines = ["| change | equal tokens: val bits/byte | Δ | tok/s | "
             f"equal wall time: steps | val bits/byte | Δ | per domain, equal tokens ({domains}) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name in _variants(results):
        t, w = _run(results, name, "tokens"), _run(results, name, "wall")
        wall = (f"{w['steps']} | {w['bpb']:.3f} ± {w['bpb_stderr']:.3f} | "
                f"{w['bpb'] - base_w['bpb']:+.3f}" if w and base_w else "| |")
        lines.append(
            f"| {name} | {t['bpb']:.3f} ± {t['bpb_stderr']:.3f} | "
            f"{t['bpb'] - base_t['bpb']:+.3f} | "
            f"{t['tokens_per_sec'] / base_t['tokens_per_sec']:.2f}x | {wall} | "
            f"{_domains(t).replace(' ', ' / ')} |")
    return "\n".join(lines)


LAYOUTS = {"runs": runs_table, "ablation": ablation_table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="runs")
    args = ap.parse_args()
    print(LAYOUTS[args.layout](load(args.results)))


if __name__ == "__main__":
    main()
