"""bench/RESULTS.md's GPU tables (issue 44) from committed runs of bench/gpu_issue44.sh.

Each run folder (bench/results/gpu_h200/runN) holds what one device call returned:
``bench_gpu_mfu.json`` (plain and FSDP steps, upstream nanoGPT's train.py, nanoGPT's
model.py stepped in-process), the profiles (``profile*.txt``) and ``variants.log`` (more
plain steps, one option changed each). The device's busy time a step is the profiler's
own "Self CUDA time total" over the profiled steps; the rest of the timed step is time
the GPU waited for the host.

    python bench/gpu_table.py bench/results/gpu_h200/run1 bench/results/gpu_h200/run2
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SPEC_PEAK = 989e12  # the H200's dense bf16 peak, as telemetry.PEAK_FLOPS has it
GIB = 1 << 30
MIB = 1 << 20
SELF_CUDA = re.compile(r"Self CUDA time total: ([\d.]+)(ms|us|s)\b")
VARIANT = re.compile(r"^=== variant (\S+): (.*)$")
# "(median of 20 steps)" before steps were timed back to back, "(median of 20 steps back
# to back, as the loop runs them)" since.
VARIANT_TOK = re.compile(r"^\[plain\] tokens/s \(median of \d+ steps[^)]*\): ([\d,]+)")
VARIANT_MEM = re.compile(r"^\[plain\] peak memory ([\d,]+) MB")
UNIT_MS = {"ms": 1.0, "us": 1e-3, "s": 1e3}


def busy_ms(profile: Path, steps: int) -> float | None:
    """The device's busy ms a step in a profile file, None when it has no total."""
    if not profile.is_file():
        return None
    m = SELF_CUDA.search(profile.read_text(encoding="utf-8"))
    return float(m[1]) * UNIT_MS[m[2]] / steps if m else None


def variants(log: Path) -> list[dict]:
    """Each variant of variants.log: its name, options, tokens/s and peak memory (MiB);
    a variant that failed or was skipped has no tokens/s."""
    out: list[dict] = []
    if not log.is_file():
        return out
    for line in log.read_text(encoding="utf-8").splitlines():
        if m := VARIANT.match(line):
            out.append({"name": m[1], "options": m[2], "tok_s": None, "memory_mib": None})
        elif out and (m := VARIANT_TOK.match(line)):
            out[-1]["tok_s"] = float(m[1].replace(",", ""))
        elif out and (m := VARIANT_MEM.match(line)):
            out[-1]["memory_mib"] = float(m[1].replace(",", ""))
    return out


def compiled_plan_gib(doc: dict, key: str) -> float:
    """``lmforge plan``'s compiled total for the run's ``key`` step (plain or fsdp): the
    figure the run recorded, or, for runs from before it did, the plan recomputed for
    the run's shape, precision and the loss its step took."""
    f = doc[key]
    if "plan_compiled_mib" in f:
        return f["plan_compiled_mib"] / 1024
    from lmforge.config import ModelConfig
    from lmforge.plan import Setup, plan

    shape = doc["shape"]
    model = ModelConfig(n_layer=shape["n_layer"], n_head=shape["n_head"],
                        n_embd=shape["n_embd"], seq_len=shape["seq_len"])
    setup = Setup(model=model, vocab=shape["vocab"], precision=doc["precision"],
                  fused_loss="plain loss" not in f["how"])
    figures = plan(setup, 80.0, doc["micro"])["fsdp" if key == "fsdp" else "ddp"]
    return figures["total_compiled"] / GIB


def rows(run: Path) -> list[dict]:
    """The run's rows: lmforge plain and FSDP, nanoGPT's train.py and its in-process
    step, then the variants; each with tokens/s and what else the run measured."""
    doc = json.loads((run / "bench_gpu_mfu.json").read_text(encoding="utf-8"))
    nano_tok = doc["nanogpt"]["tok_s"] if doc.get("nanogpt") else None
    steps = (doc.get("profile") or {}).get("steps", 3)
    flops = (doc.get("plain") or doc.get("fsdp"))["flops_per_token"]
    out = []
    for key, what, prof in (("plain", "lmforge, plain module (what DDP wraps)", "profile.txt"),
                            ("fsdp", "lmforge, FSDP2 on a one-process mesh",
                             "profile_fsdp.txt")):
        f = doc.get(key)
        if not f:
            continue
        # Since run3 the headline is the steps back to back, beside each step alone
        # (the device drained around it, as every step of run1 and run2 was timed).
        alone = "tok_s_synced" in f
        out.append({"what": f"{what}; {f['how'].split('; ')[-1]}"
                            + ("; steps back to back" if alone else ""), "tok_s": f["tok_s"],
                    "step_ms": f["step_ms_median"], "busy_ms": busy_ms(run / prof, steps),
                    "memory_gib": f["peak_memory_mib"] / 1024,
                    "plan_gib": compiled_plan_gib(doc, key)})
        if alone:
            out.append({"what": f"{what}; each step alone", "tok_s": f["tok_s_synced"],
                        "step_ms": f["step_ms_synced"]})
    if nano_tok:
        n = doc["nanogpt"]
        out.append({"what": "upstream nanoGPT train.py, median of iterations 5-40",
                    "tok_s": nano_tok, "step_ms": n["ms_median"]})
    inproc = doc.get("profile_nanogpt")
    if inproc:
        out.append({"what": "nanoGPT model.py stepped in-process (this harness)",
                    "tok_s": inproc["tok_s"], "step_ms": inproc["step_ms_median"],
                    "busy_ms": busy_ms(run / "profile_nanogpt.txt", steps)})
    for v in variants(run / "variants.log"):
        if v["tok_s"]:
            out.append({"what": f"variant: plain module, `{v['options'].split(' --profile')[0]}`",
                        "tok_s": v["tok_s"], "step_ms": 16384 / v["tok_s"] * 1000,
                        "memory_gib": v["memory_mib"] / 1024 if v["memory_mib"] else None})
    for r in out:
        r["tflops"] = r["tok_s"] * flops / 1e12
        r["mfu"] = r["tok_s"] * flops / SPEC_PEAK
        r["vs_nanogpt"] = r["tok_s"] / nano_tok if nano_tok else None
    return out


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def markdown(run: Path) -> str:
    """One run's table."""
    lines = ["| what | tokens/s | model TFLOP/s | MFU of 989 | vs nanoGPT | step ms | "
             "GPU busy ms | GPU idle | peak GiB (plan, compiled) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows(run):
        busy = r.get("busy_ms")
        idle = 1 - busy / r["step_ms"] if busy else None
        mem = r.get("memory_gib")
        plan = f" ({r['plan_gib']:.2f})" if r.get("plan_gib") else ""
        lines.append(f"| {r['what']} | {r['tok_s']:,.0f} | {r['tflops']:.1f} | "
                     f"{r['mfu']:.1%} | {_cell(r['vs_nanogpt'], '.3f', '×')} | "
                     f"{r['step_ms']:.2f} | {_cell(busy, '.2f')} | {_cell(idle, '.1%')} | "
                     f"{_cell(mem, '.2f')}{plan if mem else ''} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Print each run folder's table."""
    for folder in argv:
        print(f"{folder}\n\n{markdown(Path(folder))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
