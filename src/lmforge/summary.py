"""A short console summary of a pipeline run, from the metrics files (`make demo` ends with it)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def summary(metrics_dir: str | Path = "metrics") -> str:
    """Data counts, training figures and per-domain evaluation as a few readable lines."""
    m = Path(metrics_dir)
    lines = []
    for stage in ("ingest", "filter", "dedup", "mix"):
        total = _load(m / f"{stage}.json").get("total", {})
        if total:
            rejected = sum(total.get("rejected", {}).values())
            lines.append(f"{stage:<9} {total['in']:>6,} in  {total['kept']:>6,} kept  "
                         f"{rejected:>5,} rejected")
    tok, train, ev = _load(m / "tokenizer.json"), _load(m / "train.json"), _load(m / "eval.json")
    if tok:
        lines.append(f"tokenizer vocab {tok['vocab_size']:,}, "
                     f"{tok['chars_per_token']['all']} chars/token, lossless={tok['lossless']}")
    if train:
        lines.append(f"train     {train['params']:,} params, {train['steps']} steps, "
                     f"{train['tokens']:,} tokens, {train['tokens_per_sec']:,.0f} tok/s, "
                     f"{train['wall_seconds']:.0f} s")
    if ev:
        vocab = tok.get("vocab_size")
        ref = f" (ln vocab = {math.log(vocab):.2f})" if vocab else ""
        val = ev["val"]
        lines.append(f"evaluate  val loss {val['loss']:.3f}{ref}, perplexity "
                     f"{val['perplexity']:.1f}, bits/byte {val['bits_per_byte']:.3f}")
        for name, d in sorted(val["domains"].items()):
            lines.append(f"          {name:<14} loss {d['loss']:.3f}  "
                         f"bits/byte {d['bits_per_byte']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary())
