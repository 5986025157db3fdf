"""Issue 45's DPO recipe sweep: loss x beta x lr x replay x LoRA x NLL weight.

Queues one DVC experiment per recipe (``dvc exp run --queue -n NAME -S dpo.KEY=VALUE
...``, dpo keys only, so each reruns ``dpo``, ``evaluate_post``, ``harness`` and the
cheap ``headline``: data, base and SFT models come from the cache), runs the queue one
at a time, then tabulates ``dvc exp show --json`` per recipe: the DPO model's held-out
preference accuracy and reward accuracy (metrics/post.json), its forgetting against the
SFT model (DPO minus SFT val bits/byte, mixture-weighted with its standard error and
per domain, from metrics/post_detail.json), the lm-eval mean (metrics/harness.json),
val KL per token and the dpo stage's wall time (metrics/dpo.json), and whether the
recipe is on the Pareto front of preference accuracy against forgetting.

Every recipe sets all the keys it sweeps, so it means the same run whatever the
defaults in params.yaml are. One seed each (``dpo.seed`` as params.yaml has it). It
queues only from a baseline that is committed and up to date (``dvc status`` clean), so
no recipe reruns the stages before ``dpo``; a recipe already run on this commit is kept.

    python bench/dpo_recipe_sweep.py --out bench/results/dpo_recipes.json  # queue, run
    python bench/dpo_recipe_sweep.py --report-only      # the table of experiments run
    python bench/dpo_recipe_sweep.py --dry-run          # the dvc commands it would queue
    python bench/dpo_recipe_sweep.py --recipes dpo-sig-b05-lr5e4-r0,dpo-ipo-b50-lr5e4-r0

``--out`` keeps the rows already in that file for recipes this run did not collect (a
batch run earlier from the same baseline) and recomputes the Pareto column over all.
``markdown(json)`` renders the table for docs/post-training.md (scripts/demo_docs.py,
block ``dpo_recipes``, from the committed bench/results/dpo_recipes.json).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmforge.experiments import (
    dvc,
    experiments,
    queue_experiment,
    start_queue,
    wait_for_queue,
)
from lmforge.headline import harness_figures

# Hydra's override grammar, which `dvc exp run -S` parses (as bench/forgetting_sweep.py).
LORA = "{rank:8,alpha:16,dropout:0.0,targets:[attn,mlp]}"
LOSS_SHORT = {"sigmoid": "sig", "ipo": "ipo", "dpop": "dpop", "simpo": "simpo"}
# The keys a recipe sets (params.yaml's dpo section spells them so).
SWEPT = ("loss", "beta", "lr", "replay", "replay_weight", "nll_weight", "lora",
         "dpop_lambda", "simpo_gamma", "micro_batch_size", "max_steps")
# The demo's DPO batch and length when the sweep began: a recipe names its own only
# where it differs, so the first recipes keep their names.
ROWS, STEPS = 16, 70


@dataclass(frozen=True)
class Recipe:
    """One DPO recipe: the dpo keys it sets (a loss's own knob only under that loss)."""

    loss: str = "sigmoid"
    beta: float = 0.05
    lr: float = 5e-4
    replay: float = 0.0
    replay_weight: float = 1.0
    nll_weight: float = 0.0
    lora: bool = False
    dpop_lambda: float = 50.0
    simpo_gamma: float = 0.5
    micro_batch_size: int = ROWS  # rows per step: replay rows take ``replay`` of them
    max_steps: int = STEPS

    @property
    def name(self) -> str:
        """Short, stable experiment name, e.g. ``dpo-sig-b05-lr5e4-r25w1``: beta, gamma,
        replay share and NLL weight in hundredths, lr as mantissa/exponent."""
        parts = ["dpo", LOSS_SHORT[self.loss]]
        if self.lora:
            parts.append("lora")
        if self.loss == "dpop":
            parts.append(f"l{self.dpop_lambda:g}")
        if self.loss == "simpo":
            parts.append(f"g{_hundredths(self.simpo_gamma)}")
        parts += [f"b{_hundredths(self.beta)}", f"lr{_lr(self.lr)}"]
        parts.append(f"r{round(self.replay * 100)}w{self.replay_weight:g}"
                     if self.replay else "r0")
        if self.nll_weight:
            parts.append(f"nll{_hundredths(self.nll_weight)}")
        if self.micro_batch_size != ROWS:
            parts.append(f"mb{self.micro_batch_size}")
        if self.max_steps != STEPS:
            parts.append(f"s{self.max_steps}")
        return "-".join(parts)

    def sets(self) -> list[str]:
        """The ``-S`` overrides: every swept key, the loss's own knob under its loss."""
        out = [f"dpo.loss={self.loss}"]
        out += [f"dpo.{k}={float(getattr(self, k))!r}" for k in
                ("beta", "lr", "replay", "replay_weight", "nll_weight")]
        out.append(f"dpo.lora={LORA if self.lora else 'null'}")
        out += [f"dpo.micro_batch_size={self.micro_batch_size}",
                f"dpo.max_steps={self.max_steps}"]
        if self.loss == "dpop":
            out.append(f"dpo.dpop_lambda={float(self.dpop_lambda)!r}")
        if self.loss == "simpo":
            out.append(f"dpo.simpo_gamma={float(self.simpo_gamma)!r}")
        return out

    def settings(self) -> dict[str, Any]:
        """The swept keys as params.yaml would hold them (the LoRA block or None)."""
        out = asdict(self)
        out["lora"] = ({"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["attn", "mlp"]}
                       if self.lora else None)
        return out


def _hundredths(x: float) -> str:
    """0.05 -> ``05``, 0.1 -> ``10``, 2 -> ``200``."""
    return f"{round(x * 100):02d}"


def _lr(lr: float) -> str:
    """5e-4 -> ``5e4``, 2.5e-4 -> ``2p5e4``."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{float(mantissa):g}".replace(".", "p") + f"e{-int(exponent)}"


FAST = {"beta": 0.05, "lr": 5e-4}  # the demo's "show the effect" setting
RECIPES: tuple[Recipe, ...] = (
    Recipe(**FAST),
    Recipe(**FAST, replay=0.25),
    Recipe(**FAST, replay=0.5),
    Recipe(**FAST, replay=0.25, replay_weight=3.0),
    Recipe(beta=0.1, lr=1e-4),
    Recipe(beta=0.1, lr=1e-4, replay=0.25),
    # LoRA trains ~3% of the weights and, as usual, takes a larger learning rate.
    Recipe(beta=0.05, lr=1e-3, lora=True),
    Recipe(beta=0.05, lr=1e-3, lora=True, replay=0.25),
    Recipe(**FAST, replay=0.25, nll_weight=0.2),
    Recipe("ipo", beta=0.1, lr=5e-4, replay=0.25),
    Recipe("ipo", beta=0.5, lr=5e-4),
    Recipe("dpop", **FAST, replay=0.25, dpop_lambda=50.0),
    Recipe("simpo", beta=2.0, lr=5e-4, simpo_gamma=0.5),
    Recipe("simpo", beta=2.0, lr=5e-4, simpo_gamma=0.5, replay=0.25),
    # Replay rows displace pairs at a fixed batch (0.538 at replay 0.25 against 0.587):
    # give the pairs back with more rows per step or more steps, or replay less.
    Recipe(**FAST, replay=0.2, micro_batch_size=20),
    Recipe(**FAST, replay=0.25, max_steps=93),
    Recipe(**FAST, replay=0.1),
    Recipe(beta=0.05, lr=7e-4, replay=0.2, micro_batch_size=20),
    # 93 steps at replay 0.25 (the pairs of 70 without replay) reached 0.578: a little more.
    Recipe(**FAST, replay=0.25, max_steps=120),
    Recipe(**FAST, replay=0.2, micro_batch_size=20, max_steps=93),
)


def command(recipe: Recipe) -> str:
    """The shell command ``queue_experiment`` runs for ``recipe``."""
    args = ["dvc", "exp", "run", "--queue", "-n", recipe.name]
    for s in recipe.sets():
        args += ["-S", s]
    return shlex.join(args)


def select(names: str | None, recipes: tuple[Recipe, ...] = RECIPES) -> list[Recipe]:
    """The recipes named (comma-separated), in the grid's order; all without names."""
    if not names:
        return list(recipes)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {r.name: r for r in recipes}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown recipe(s) {', '.join(unknown)}; known: "
                         + ", ".join(known))
    return [r for r in recipes if r.name in wanted]


def uncommitted_pipeline_files() -> list[str]:
    """params.yaml, dvc.yaml and dvc.lock where they differ from git's HEAD."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "params.yaml", "dvc.yaml",
                          "dvc.lock"], capture_output=True, text=True).stdout
    return [line[3:] for line in out.splitlines()]


def pipeline_problems() -> list[str]:
    """Why the workspace is no baseline to queue from: params.yaml, dvc.yaml or dvc.lock
    differing from HEAD (a queued experiment takes the workspace as it is, so the change
    would reach every recipe), or stages ``dvc status`` finds changed (dvc.lock behind
    params.yaml, say: every recipe would rerun them, pretraining included)."""
    problems = [f"uncommitted changes in {path}" for path in uncommitted_pipeline_files()]
    stale = sorted(json.loads(dvc("status", "--json") or "{}"))
    if stale:
        problems.append(f"stages not up to date: {', '.join(stale)} (dvc repro, then "
                        "commit dvc.lock)")
    return problems


def run_on_head() -> set[str]:
    """Names of the experiments already run on this commit (DVC's refs
    ``refs/exps/<HEAD[:2]>/<HEAD[2:]>/<name>``): queued again under the same name, one
    would run in full only to fail as a conflicting experiment."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if not head:
        return set()
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)",
                           f"refs/exps/{head[:2]}/{head[2:]}/"], capture_output=True,
                          text=True).stdout
    return {line.rsplit("/", 1)[1] for line in refs.splitlines()}


def queue(recipes: list[Recipe]) -> None:
    """Queue the recipes not yet run on this commit, run the queue one at a time, wait."""
    done = run_on_head()
    todo = [r for r in recipes if r.name not in done]
    for r in recipes:
        if r.name in done:
            print(f"{r.name}: already run on this commit, kept "
                  f"(dvc exp remove {r.name} to run it again)")
    for r in todo:
        queue_experiment(r.name, r.sets())
    if not todo:
        return
    start_queue(1)
    wait_for_queue(poll=20.0, report=lambda n: print(f"{n} experiment(s) queued or "
                                                     "running", flush=True))
    print(dvc("queue", "status"))


def finished(metrics: dict[str, Any] | None) -> bool:
    """Whether an experiment has the DPO model's results (a running one lists none)."""
    return bool(metrics and metrics.get("metrics/post.json", {}).get("dpo")
                and metrics.get("metrics/dpo.json"))


def _difference(dpo: dict[str, Any], sft: dict[str, Any]) -> dict[str, float | None]:
    """DPO minus SFT bits/byte, the two standard errors combined as independent (as
    lmforge.evaluate.stats does: both score the same documents, so it is conservative)."""
    se_a, se_b = dpo.get("bits_per_byte_stderr"), sft.get("bits_per_byte_stderr")
    se = math.hypot(se_a, se_b) if se_a is not None and se_b is not None else None
    return {"change": dpo["bits_per_byte"] - sft["bits_per_byte"], "stderr": se}


def forgetting_vs_sft(metrics: dict[str, Any]) -> dict[str, Any]:
    """The DPO model's forgetting against the SFT model: ``{"mix_weighted": {change,
    stderr}, "domains": {domain: {change, stderr}}}`` from the two models' val figures
    in post_detail.json; without that file, post.json's changes against the base model,
    DPO's minus SFT's (no standard errors then)."""
    val = metrics.get("metrics/post_detail.json", {}).get("val", {})
    if "dpo" in val and "sft" in val:
        dpo, sft = val["dpo"], val["sft"]
        domains = sorted(set(dpo["domains"]) & set(sft["domains"]))
        return {"mix_weighted": _difference(dpo["mix_weighted"], sft["mix_weighted"]),
                "domains": {d: _difference(dpo["domains"][d], sft["domains"][d])
                            for d in domains}}
    vs_base = metrics["metrics/post.json"]["forgetting_bits_per_byte"]
    dpo, sft = vs_base["dpo"], vs_base["sft"]
    changes = {d: {"change": dpo[d] - sft[d], "stderr": None} for d in sorted(dpo)
               if d in sft and d not in ("mix_weighted", "token_weighted")}
    return {"mix_weighted": {"change": dpo["mix_weighted"] - sft["mix_weighted"],
                             "stderr": None}, "domains": changes}


def settings(recipe: Recipe, params: dict[str, Any]) -> dict[str, Any]:
    """The swept keys as the experiment ran them (its params.yaml), else the recipe's."""
    ran = params.get("params.yaml", {}).get("dpo", {})
    wanted = recipe.settings()
    return {k: ran.get(k, wanted[k]) for k in SWEPT}


def row(recipe: Recipe, exp: dict[str, Any]) -> dict[str, Any]:
    """One recipe's figures from its experiment (``experiments()``'s entry)."""
    m = exp["metrics"]
    dpo_run, tuned = m["metrics/dpo.json"], m["metrics/post.json"]["dpo"]
    lm_eval = harness_figures(m.get("metrics/harness.json", {}), "dpo").get("lm_eval")
    return {"name": recipe.name, "settings": settings(recipe, exp.get("params", {})),
            "command": command(recipe),
            "pref_accuracy": tuned["pref_accuracy"],
            "pref_accuracy_stderr": tuned.get("pref_accuracy_stderr"),
            "reward_accuracy": tuned.get("reward_accuracy"),
            "forgetting_vs_sft": forgetting_vs_sft(m), "lm_eval": lm_eval,
            "val_kl_per_token": dpo_run.get("val_kl_per_token"),
            "dpo_seconds": dpo_run.get("wall_seconds")}


def mark_pareto(rows: list[dict[str, Any]]) -> None:
    """``pareto``: True where no other row has both higher preference accuracy and lower
    mixture-weighted forgetting against SFT."""
    def point(r: dict[str, Any]) -> tuple[float, float]:
        return r["pref_accuracy"], r["forgetting_vs_sft"]["mix_weighted"]["change"]

    for r in rows:
        acc, forgot = point(r)
        r["pareto"] = not any(point(o)[0] > acc and point(o)[1] < forgot
                              for o in rows if o is not r)


def collect(exps: dict[str, dict[str, Any]], recipes: list[Recipe] | tuple[Recipe, ...]
            = RECIPES) -> dict[str, Any]:
    """The results JSON: a row per recipe whose experiment finished, in the grid's order;
    ``missing``: the recipes without one."""
    rows, missing = [], []
    for r in recipes:
        e = exps.get(r.name)
        if e and e["state"] == "success" and finished(e["metrics"]):
            rows.append(row(r, e))
        else:
            missing.append(r.name)
    mark_pareto(rows)
    return {"bench": "bench/dpo_recipe_sweep.py", "issue": 45,
            "forgetting": "DPO minus SFT val bits/byte (evaluate_post)",
            "recipes": rows, "missing": missing}


def merge(earlier: dict[str, Any], results: dict[str, Any],
          recipes: tuple[Recipe, ...] = RECIPES) -> dict[str, Any]:
    """``results`` with the rows of an ``earlier`` results file that it lacks (recipes
    run in another batch, from the same baseline), in the grid's order, each with the
    grid's command and every swept key (a key the sweep added since: the value it ran
    with), the Pareto front recomputed over all of them."""
    known = {r.name: r for r in recipes}
    rows = {r["name"]: r for r in earlier.get("recipes", []) if r["name"] in known}
    rows.update({r["name"]: r for r in results["recipes"]})
    for name, row in rows.items():
        row["command"] = command(known[name])
        row["settings"] = {k: row["settings"].get(k, getattr(known[name], k) if k != "lora"
                                                  else known[name].settings()["lora"])
                           for k in SWEPT}
    ordered = [rows[r.name] for r in recipes if r.name in rows]
    mark_pareto(ordered)
    return {**results, "recipes": ordered,
            "missing": [r.name for r in recipes if r.name not in rows]}


def _num(value: float | None, spec: str, stderr: float | None = None) -> str:
    """``value`` formatted by ``spec`` (``n/a`` when unknown), ``± stderr`` if known."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    se = f" ± {stderr:.3f}" if stderr is not None and math.isfinite(stderr) else ""
    return format(value, spec) + se


def _setting_cells(s: dict[str, Any]) -> list[str]:
    """loss (with its own knob), beta, lr, replay share x weight, NLL weight, LoRA,
    rows per step x steps."""
    loss = {"dpop": f"dpop λ {s['dpop_lambda']:g}",
            "simpo": f"simpo γ {s['simpo_gamma']:g}"}.get(s["loss"], s["loss"])
    replay = f"{s['replay']:g} ×{s['replay_weight']:g}" if s["replay"] else "0"
    lora = f"r{s['lora']['rank']}" if s["lora"] else "no"
    batch = f"{s.get('micro_batch_size', ROWS)} × {s.get('max_steps', STEPS)}"
    return [loss, f"{s['beta']:g}", f"{s['lr']:g}", replay, f"{s['nll_weight']:g}", lora,
            batch]


def markdown(results: dict[str, Any]) -> str:
    """The results JSON as a markdown table: a row per recipe, settings, then figures;
    Pareto ``yes`` on the front of preference accuracy against forgetting."""
    rows = results["recipes"]
    if not rows:
        return "no DPO recipe experiments found (run bench/dpo_recipe_sweep.py)"
    domains = sorted({d for r in rows for d in r["forgetting_vs_sft"]["domains"]})
    head = ["recipe", "loss", "β", "lr", "replay ×weight", "NLL", "LoRA", "rows × steps",
            "pref acc", "reward acc", "Δ bpb vs SFT", *(f"Δ {d}" for d in domains),
            "lm-eval", "KL/token", "dpo s", "Pareto"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|" + "---|" * 7 + "---:|" * (len(head) - 9) + "---|"]
    for r in rows:
        f = r["forgetting_vs_sft"]
        mix = f["mix_weighted"]
        cells = [f"`{r['name']}`", *_setting_cells(r["settings"]),
                 _num(r["pref_accuracy"], ".3f", r["pref_accuracy_stderr"]),
                 _num(r["reward_accuracy"], ".3f"),
                 _num(mix["change"], "+.3f", mix["stderr"]),
                 *(_num(f["domains"].get(d, {}).get("change"), "+.3f") for d in domains),
                 _num(r["lm_eval"], ".3f"), _num(r["val_kl_per_token"], ".2f"),
                 _num(r["dpo_seconds"], ".0f"), "yes" if r["pareto"] else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Queue and run the recipes (or only report, or only print the commands)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true",
                    help="queue nothing: the table of the experiments already run")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the dvc commands it would queue, run nothing")
    ap.add_argument("--recipes", help="comma-separated recipe names (default: all)")
    ap.add_argument("--out", type=Path, help="also write the results JSON here")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="queue although params.yaml/dvc.yaml/dvc.lock differ from HEAD "
                    "or stages are not up to date")
    args = ap.parse_args(argv)
    recipes = select(args.recipes)
    if args.dry_run:
        print("\n".join(command(r) for r in recipes))
        return 0
    if not args.report_only:
        problems = [] if args.allow_dirty else pipeline_problems()
        if problems:
            print(f"error: {'; '.join(problems)}: each experiment would carry or rerun "
                  "that; fix it or pass --allow-dirty", file=sys.stderr)
            return 2
        queue(recipes)
    results = collect(experiments(), recipes)
    print(markdown(results))
    if results["missing"]:
        print(f"\nnot run or not finished: {', '.join(results['missing'])}", file=sys.stderr)
    if args.out:
        if args.out.is_file():  # other batches' recipes stay in the file
            results = merge(json.loads(args.out.read_text(encoding="utf-8")), results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n",
                            encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
