"""Fill the demo's figures into README.md and docs/*.md from the committed metrics.

Two kinds of marker, invisible once rendered:

- inline: ``<!--= post.sft.token_accuracy | .3f -->0.078<!--/-->``: the expression is
  evaluated over the metrics files (``eval`` is metrics/eval.json, ``post`` is
  metrics/post.json, ``headline.base`` the base model's headline columns, ...; keys as
  attributes, ``["key"]`` where a key is no identifier; ``abs``, ``min``, ``max``,
  ``round``, ``sqrt``, ``log``, ``sum``, ``first`` (the first key present), ``z``
  (standard errors of a difference) are at hand; ``plots.train.loss`` is a column of
  plots/train.tsv) and formatted with the
  spec after ``|`` (``,.0f``, ``+.3f``, ``.1%``...);
- block: ``<!-- gen:NAME -->`` ... ``<!-- /gen:NAME -->``: the lines between are what
  ``BLOCKS[NAME]`` writes (the run summary, the headline table, the harness table...);

and a fenced block that starts with ``$ lmforge plan ...`` gets that command's output.

tests/test_demo_docs.py fails when a page differs from what this script writes, so a
figure cannot drift from the metrics; ``make demo`` runs it after ``dvc repro``.
Usage: ``python scripts/demo_docs.py [--check]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

from lmforge.headline import headline, headline_markdown

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/data.md", "docs/training.md", "docs/post-training.md",
         "docs/scale.md", "docs/tracking.md", "docs/mixture.md", "docs/results.md",
         "bench/RESULTS.md")
INLINE = re.compile(r"<!--=(.*?)-->(.*?)<!--/-->", re.S)
BLOCK = re.compile(r"(<!-- gen:([a-z_]+) -->\n).*?(<!-- /gen:\2 -->)", re.S)
PLAN = re.compile(r"```\n\$ (lmforge plan [^\n]*)\n.*?```", re.S)


class Figures(dict):
    """A metrics file's JSON with keys as attributes (``post.sft.token_accuracy``)."""

    def __getattr__(self, key: str):
        try:
            value = self[key]
        except KeyError:
            raise KeyError(f"no key {key!r} (has {sorted(self)[:12]})") from None
        return Figures(value) if isinstance(value, dict) else value

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        return Figures(value) if isinstance(value, dict) else value


def metrics(root: Path = REPO) -> dict[str, Figures]:
    """Every metrics/*.json by its stem, and ``headline``: every headline column by model
    (lmforge.headline, what metrics/headline.md tabulates)."""
    found = {p.stem: Figures(json.loads(p.read_text(encoding="utf-8")))
             for p in sorted((root / "metrics").glob("*.json"))}
    found["headline"] = Figures(headline(root / "metrics"))  # every column, by model
    found["plots"] = Figures({p.stem: tsv_columns(p)
                              for p in sorted((root / "plots").glob("*.tsv"))})
    return found


def tsv_columns(path: Path) -> dict[str, list[float]]:
    """A plots/*.tsv file as ``{column: [values]}`` (numbers where they parse)."""
    head, *rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    return {name: [_number(r[i]) for r in rows] for i, name in enumerate(head)}


def _number(cell: str) -> float | str:
    try:
        return float(cell)
    except ValueError:
        return cell  # a name column (mix_fit.tsv's proxies)


def first(figures: dict, *keys: str):
    """The value of the first of ``keys`` present (a metric under its new or old name)."""
    for key in keys:
        if key in figures:
            return figures[key]
    raise KeyError(f"none of {keys}")


def z(a: float, sa: float, b: float, sb: float) -> float:
    """Standard errors of the difference b - a between two independent estimates."""
    return (b - a) / math.sqrt(sa * sa + sb * sb)


HELPERS = {"abs": abs, "min": min, "max": max, "round": round, "sqrt": math.sqrt,
           "log": math.log, "len": len, "sum": sum, "sorted": sorted, "first": first, "z": z}


def figure(expr: str, spec: str, found: dict[str, Figures]) -> str:
    """One inline figure: ``expr`` over the metrics, formatted by ``spec``."""
    try:
        # Globals, so that comprehensions see the metrics too; our own pages only.
        value = eval(expr, {"__builtins__": {}, **HELPERS, **found})  # noqa: S307
    except Exception as e:  # one line naming the marker, whatever went wrong
        raise ValueError(f"figure {expr.strip()!r}: {type(e).__name__}: {e}") from None
    return format(value, spec)


def fmt(value: float, stderr: float | None = None, digits: int = 3) -> str:
    """``0.361 ± 0.040`` (or the value alone)."""
    return f"{value:.{digits}f}" + ("" if stderr is None else f" ± {stderr:.{digits}f}")


def block_summary(found: dict[str, Figures], root: Path) -> str:
    """`python -m lmforge.summary` on the committed metrics, as a code block."""
    from lmforge.summary import summary

    return "```\n" + summary(root / "metrics") + "\n```\n"


def block_headline(found: dict[str, Figures], root: Path) -> str:
    """Every headline column as a markdown table: models as rows (metrics/headline.md)."""
    return headline_markdown(found["headline"])


def block_harness(found: dict[str, Figures], root: Path) -> str:
    """lm-eval acc ± stderr per task (rows) and model (columns), with chance."""
    h = found["harness"]
    models = [m for m in ("base", "sft", "dpo") if m in h]
    lines = ["| task | " + " | ".join(models) + " | chance |",
             "|---|" + "---:|" * (len(models) + 1)]
    for task in sorted(h["chance"]):
        cells = [fmt(h[m][task]["acc"], h[m][task]["acc_stderr"]) for m in models]
        lines.append(f"| `{task}` | " + " | ".join(cells) + f" | {h['chance'][task]:.2f} |")
    return "\n".join(lines) + "\n"


def block_post(found: dict[str, Figures], root: Path) -> str:
    """evaluate_post's held-out task scores for the three models."""
    p = found["post"]
    models = [m for m in ("base", "sft", "dpo") if m in p]
    rows = [("token accuracy (reply tokens that are the greedy choice)", "token_accuracy"),
            ("response loss (nats per reply token)", "response_loss"),
            ("exact match of the greedy reply", "exact_match"),
            ("multiple choice by log-likelihood (chance 0.25)", "mc_acc"),
            ("preference accuracy (chosen more likely; chance 0.5)", "pref_accuracy"),
            ("reward accuracy against the SFT reference", "reward_accuracy")]
    lines = ["| held-out test | " + " | ".join(models) + " |", "|---|" + "---:|" * len(models)]
    for label, key in rows:
        cells = [fmt(p[m][key], p[m].get(f"{key}_stderr")) if key in p[m] else ""
                 for m in models]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    forgot = p.get("forgetting_bits_per_byte", {})
    cells = [f"{forgot[m]['mix_weighted']:+.3f}" if m in forgot else "" for m in models]
    lines.append("| forgetting: val bits/byte change, mixture-weighted | "
                 + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def block_domains(found: dict[str, Figures], root: Path) -> str:
    """The base model's val loss and bits/byte per domain (metrics/eval.json)."""
    doms = found["eval"]["val"]["domains"]
    lines = ["| domain | docs | loss | bits/byte |", "|---|---:|---:|---:|"]
    for name, d in sorted(doms.items()):
        lines.append(f"| {name} | {d['docs']} | {fmt(d['loss'], d['loss_stderr'])} | "
                     f"{fmt(d['bits_per_byte'], d['bits_per_byte_stderr'])} |")
    return "\n".join(lines) + "\n"


def _script(path: Path):
    """A script that is no package module (scripts/, bench/), loaded from its file.

    Registered in ``sys.modules`` before it runs, as importlib's recipe does: a
    dataclass there looks its module up by name."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _ttq_table(root: Path, results: str) -> str:
    """bench/ttq_table.py's ablation layout of a committed time-to-quality JSON."""
    ttq = _script(root / "bench/ttq_table.py")
    return ttq.ablation_table(ttq.load(root / "bench/results" / results)) + "\n"


def block_ablation_demo(found: dict[str, Figures], root: Path) -> str:
    """Each speedrun change alone and the chosen set at the demo shape (issue 24's bench,
    bench/results/time_to_quality_demo_200steps.json)."""
    return _ttq_table(root, "time_to_quality_demo_200steps.json")


def block_ablation_nobf(found: dict[str, Figures], root: Path) -> str:
    """The demo-shape ablation on a CPU capped to AVX2 (no bf16 units), issue 43."""
    return _ttq_table(root, "time_to_quality_demo_200steps_avx2.json")


def block_ablation_large(found: dict[str, Figures], root: Path) -> str:
    """The same at 8 layers x 512 (bench/results/time_to_quality_8x512_100steps.json)."""
    return _ttq_table(root, "time_to_quality_8x512_100steps.json")


def block_dpo_recipes(found: dict[str, Figures], root: Path) -> str:
    """Issue 45's DPO recipe sweep (bench/dpo_recipe_sweep.py's table of the committed
    bench/results/dpo_recipes.json), or a note that it has not been measured yet."""
    path = root / "bench/results/dpo_recipes.json"
    if not path.is_file():
        return ("*Not yet measured: `python bench/dpo_recipe_sweep.py --out "
                "bench/results/dpo_recipes.json` runs the sweep.*\n")
    sweep = _script(root / "bench/dpo_recipe_sweep.py")
    return sweep.markdown(json.loads(path.read_text(encoding="utf-8"))) + "\n"


def block_gpu_mfu(found: dict[str, Figures], root: Path) -> str:
    """Issue 44's GPU sitting: bench/gpu_table.py's table of each committed run."""
    table = _script(root / "bench/gpu_table.py")
    runs = sorted((root / "bench/results/gpu_h200").glob("run*"))
    return "\n\n".join(f"**{run.name}**\n\n{table.markdown(run)}" for run in runs) + "\n"


def block_serve_load(found: dict[str, Figures], root: Path) -> str:
    """Issue 48's load runs: bench/bench_serve.py's table of its committed JSONs."""
    serve = _script(root / "bench/bench_serve.py")
    names = ("serve_load.json", "serve_load_1000.json", "serve_load_queue32.json")
    return serve.markdown([root / "bench/results" / n for n in names]) + "\n"


def block_mix_driver(found: dict[str, Figures], root: Path) -> str:
    """Issue 47's mix driver at x1/x10/x30: bench/bench_mix_driver.py's table."""
    bench = _script(root / "bench/bench_mix_driver.py")
    path = root / "bench/results/mix_driver.json"
    return bench.markdown(json.loads(path.read_text(encoding="utf-8"))) + "\n"


def block_dedup_driver(found: dict[str, Figures], root: Path) -> str:
    """Issue 47's dedup driver at x1/x10/x30: bench/bench_dedup_driver.py's table."""
    bench = _script(root / "bench/bench_dedup_driver.py")
    path = root / "bench/results/dedup_driver.json"
    return bench.markdown(json.loads(path.read_text(encoding="utf-8"))) + "\n"


def block_tb_projection(found: dict[str, Figures], root: Path) -> str:
    """Issue 47's terabyte projection: bench/project_tb.py's tables from the committed
    x1/x10/x30 run of bench_data_scale.py and the dedup driver's."""
    bench = _script(root / "bench/project_tb.py")
    scale = json.loads((root / "bench/results/data_scale_x30.json").read_text(encoding="utf-8"))
    dedup = json.loads((root / "bench/results/dedup_driver.json").read_text(encoding="utf-8"))
    return bench.markdown(scale, dedup) + "\n"


def block_ray_cluster(found: dict[str, Figures], root: Path) -> str:
    """Issue 47's three-node Ray run at x10: bench/bench_ray_cluster.py's table."""
    bench = _script(root / "bench/bench_ray_cluster.py")
    path = root / "bench/results/ray_cluster_x10.json"
    return bench.markdown(json.loads(path.read_text(encoding="utf-8"))) + "\n"


BLOCKS: dict[str, Callable[[dict[str, Figures], Path], str]] = {
    "summary": block_summary, "headline": block_headline, "harness": block_harness,
    "post": block_post, "domains": block_domains, "ablation_demo": block_ablation_demo,
    "ablation_large": block_ablation_large, "ablation_nobf": block_ablation_nobf,
    "dpo_recipes": block_dpo_recipes, "gpu_mfu": block_gpu_mfu,
    "serve_load": block_serve_load, "mix_driver": block_mix_driver,
    "dedup_driver": block_dedup_driver, "tb_projection": block_tb_projection,
    "ray_cluster": block_ray_cluster}


def plan_output(m: re.Match) -> str:
    """A fenced ``$ lmforge plan ...`` block with the command's output today (the
    function scripts/plan_docs.py fills docs/fine-tuning-memory.md with)."""
    plan_docs = _script(REPO / "scripts/plan_docs.py")
    return f"```\n$ {m.group(1)}\n{plan_docs.run(m.group(1))}```"


def render(page: str, found: dict[str, Figures], root: Path = REPO) -> str:
    """The page with every marker's figure, block and ``lmforge plan`` output recomputed."""
    def inline(m: re.Match) -> str:
        expr, _, spec = m.group(1).rpartition("|")
        return f"<!--={m.group(1)}-->{figure(expr, spec.strip(), found)}<!--/-->"

    def block(m: re.Match) -> str:
        if m.group(2) not in BLOCKS:
            raise ValueError(f"unknown block gen:{m.group(2)} (known: {sorted(BLOCKS)})")
        return m.group(1) + BLOCKS[m.group(2)](found, root) + m.group(3)

    return PLAN.sub(plan_output, BLOCK.sub(block, INLINE.sub(inline, page)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each page that is out of date")
    args = parser.parse_args(argv)
    found, stale = metrics(), []
    for name in PAGES:
        path = REPO / name
        text = path.read_text(encoding="utf-8")
        try:
            new = render(text, found)
        except ValueError as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(name)
            if not args.check:
                tmp = path.with_suffix(".md.tmp")
                tmp.write_text(new, encoding="utf-8")
                tmp.replace(path)  # atomic: a reader sees the old page or the new one
    verb = "out of date" if args.check else "rewrote"
    print(f"demo_docs: {verb}: {', '.join(stale)}" if stale else "demo_docs: up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
