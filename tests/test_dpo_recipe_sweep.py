"""bench/dpo_recipe_sweep.py (issue 45) without running DVC: the commands it queues, the
recipes' keys against the real config, the table and its Pareto column from a hand-made
``dvc exp show --json``, forgetting as DPO minus SFT, the docs block."""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep():
    return load(REPO / "bench" / "dpo_recipe_sweep.py")


def test_dry_run_prints_the_exact_commands_of_the_recipes_named(sweep, capsys):
    names = "dpo-simpo-g50-b200-lr5e4-r0,dpo-sig-lora-b05-lr1e3-r25w1"
    assert sweep.main(["--dry-run", "--recipes", names]) == 0
    assert capsys.readouterr().out.splitlines() == [  # in the grid's order
        "dvc exp run --queue -n dpo-sig-lora-b05-lr1e3-r25w1 -S dpo.loss=sigmoid "
        "-S dpo.beta=0.05 -S dpo.lr=0.001 -S dpo.replay=0.25 -S dpo.replay_weight=1.0 "
        "-S dpo.nll_weight=0.0 "
        "-S 'dpo.lora={rank:8,alpha:16,dropout:0.0,targets:[attn,mlp]}' "
        "-S dpo.micro_batch_size=16 -S dpo.max_steps=70",
        "dvc exp run --queue -n dpo-simpo-g50-b200-lr5e4-r0 -S dpo.loss=simpo "
        "-S dpo.beta=2.0 -S dpo.lr=0.0005 -S dpo.replay=0.0 -S dpo.replay_weight=1.0 "
        "-S dpo.nll_weight=0.0 -S dpo.lora=null -S dpo.micro_batch_size=16 "
        "-S dpo.max_steps=70 -S dpo.simpo_gamma=0.5"]
    with pytest.raises(SystemExit, match="unknown recipe.*dpo-nope"):
        sweep.main(["--dry-run", "--recipes", "dpo-nope"])


def test_the_grid_is_issue_45s_and_every_recipe_is_a_valid_dpo_section(sweep, tmp_path):
    """At least 12 distinct recipes; each one's -S overrides, applied to params.yaml as
    DVC applies them (Hydra), give a params file lmforge loads with exactly the recipe."""
    from dvc.utils.hydra import apply_overrides

    from lmforge.config import load_params

    names = [r.name for r in sweep.RECIPES]
    assert len(names) >= 12 and len(set(names)) == len(names)
    assert "dpo-sig-b05-lr5e4-r25w1" in names and "dpo-dpop-l50-b05-lr5e4-r25w1" in names
    assert {r.loss for r in sweep.RECIPES} == {"sigmoid", "ipo", "dpop", "simpo"}
    for r in sweep.RECIPES:
        assert all(s.startswith("dpo.") for s in r.sets()), r.name
        path = tmp_path / f"{r.name}.yaml"
        shutil.copy(REPO / "params.yaml", path)
        apply_overrides(path, r.sets())
        dpo = load_params(path).dpo
        want = r.settings()
        got = {k: getattr(dpo, "max_lr" if k == "lr" else k) for k in want}
        got["lora"] = (None if dpo.lora is None else
                       {"rank": dpo.lora.rank, "alpha": dpo.lora.alpha,
                        "dropout": dpo.lora.dropout, "targets": dpo.lora.targets})
        assert got == want, r.name


def test_queueing_runs_the_dry_run_commands_and_skips_what_ran_on_this_commit(
        sweep, monkeypatch):
    from lmforge import experiments as exps

    calls = []
    monkeypatch.setattr(exps, "dvc", lambda *args: calls.append(list(args)) or "")
    monkeypatch.setattr(sweep, "run_on_head", lambda: {sweep.RECIPES[0].name})
    monkeypatch.setattr(sweep, "start_queue", lambda jobs: calls.append(["start", jobs]))
    monkeypatch.setattr(sweep, "wait_for_queue", lambda **k: calls.append(["wait"]))
    monkeypatch.setattr(sweep, "dvc", lambda *args: "")
    sweep.queue(list(sweep.RECIPES[:3]))
    assert calls == [shlex.split(sweep.command(r))[1:] for r in sweep.RECIPES[1:3]] + [
        ["start", 1], ["wait"]]


def test_a_stale_or_uncommitted_pipeline_stops_a_sweep_before_it_queues(
        sweep, monkeypatch, capsys):
    """dvc.lock behind params.yaml would make every recipe rerun pretraining."""
    status = {"train": [{"changed deps": {"params.yaml": {"train.fused_loss": "modified"}}}],
              "sft": [{"changed deps": {"models/final": "modified"}}]}
    monkeypatch.setattr(sweep, "dvc", lambda *args: json.dumps(status))
    monkeypatch.setattr(sweep, "uncommitted_pipeline_files", lambda: ["params.yaml"])
    assert sweep.pipeline_problems() == [
        "uncommitted changes in params.yaml",
        "stages not up to date: sft, train (dvc repro, then commit dvc.lock)"]
    monkeypatch.setattr(sweep, "queue", lambda recipes: pytest.fail("queued"))
    assert sweep.main([]) == 2
    assert "stages not up to date: sft, train" in capsys.readouterr().err
    monkeypatch.setattr(sweep, "dvc", lambda *args: "{}")
    monkeypatch.setattr(sweep, "uncommitted_pipeline_files", lambda: [])
    assert sweep.pipeline_problems() == []


# --- the table, from the shape `dvc exp show --json --all-commits` has (DVC 3) ---

BASE_BPB, SFT_BPB = 2.40, 2.50
SFT_DOMAINS = {"en_tech": 2.20, "zh_classical": 3.00}


def detail_files(pref: float, dpo_bpb: float, zh: float) -> dict:
    """An experiment's committed metrics/*.json, as evaluate_post, dpo and harness write
    them (only the keys the sweep reads, and the base-model forgetting it must not)."""
    dpo_domains = {"en_tech": 2.25, "zh_classical": zh}

    def val(mix, se, domains):
        return {"mix_weighted": {"bits_per_byte": mix, "bits_per_byte_stderr": se},
                "token_weighted": {"bits_per_byte": mix},
                "domains": {d: {"bits_per_byte": b, "bits_per_byte_stderr": 0.01}
                            for d, b in domains.items()}}

    vs_base = {m: {"mix_weighted": b - BASE_BPB, "token_weighted": 0.0,
                   **{d: v - 2.0 for d, v in doms.items()}}
               for m, b, doms in (("dpo", dpo_bpb, dpo_domains),
                                  ("sft", SFT_BPB, SFT_DOMAINS))}
    return {
        "metrics/post.json": {
            "sft": {"pref_accuracy": 0.46, "pref_accuracy_stderr": 0.02},
            "dpo": {"pref_accuracy": pref, "pref_accuracy_stderr": 0.02,
                    "reward_accuracy": 0.70},
            "forgetting_bits_per_byte": vs_base},
        "metrics/post_detail.json": {"val": {"dpo": val(dpo_bpb, 0.03, dpo_domains),
                                             "sft": val(SFT_BPB, 0.04, SFT_DOMAINS)}},
        "metrics/dpo.json": {"wall_seconds": 155.4, "val_kl_per_token": 0.5},
        "metrics/harness.json": {"chance": {"demo_a": 0.5, "demo_b": 0.25},
                                 "dpo": {"demo_a": {"acc": 0.6}, "demo_b": {"acc": 0.3}}}}


def exp_show(sweep, states: dict) -> tuple[list, dict]:
    """``dvc exp show --json --all-commits`` output and the files committed per rev."""
    def entry(name, state, params):
        data = {"rev": "r-" + name,
                "metrics": {"metrics/headline.json": {"data": {"dpo": {"bpb": 3.0}}}}
                if state == "success" else {},
                "params": {"params.yaml": {"data": {"dpo": params}}}}
        return {"revs": [{"rev": "r-" + name, "name": name, "data": data}],
                "executor": {"state": state}, "name": name}

    recipes = {r.name: r for r in sweep.RECIPES}
    shown = [{"rev": "workspace", "name": None, "data": {}, "experiments": None},
             {"rev": "abc", "name": "main", "data": {}, "experiments": [
                 entry(n, state, recipes[n].settings() if n in recipes else {})
                 for n, (state, _) in states.items()]}]
    files = {"r-" + n: detail_files(*figs) for n, (_, figs) in states.items() if figs}
    return shown, files


@pytest.fixture
def results(sweep, monkeypatch):
    from lmforge import experiments as exps

    r = sweep.RECIPES
    states = {r[0].name: ("success", (0.60, 3.10, 4.20)),    # today's demo: front
              r[1].name: ("success", (0.58, 2.55, 3.10)),    # replay: front
              r[12].name: ("success", (0.55, 2.60, 3.05)),   # dominated by r[1]
              r[6].name: ("success", (0.50, 3.10, 4.00)),    # dominated by r[1]
              r[2].name: ("running", None),
              r[3].name: ("failed", None),
              "forget-full-r00": ("success", (0.9, 2.0, 2.0))}  # not a recipe
    shown, files = exp_show(sweep, states)
    monkeypatch.setattr(exps, "dvc", lambda *a: json.dumps(shown))
    monkeypatch.setattr(exps, "committed_json", lambda rev, *a, **k: files.get(rev, {}))
    return sweep.collect(exps.experiments())


def test_forgetting_is_dpo_minus_sft_not_against_the_base_model(sweep, results):
    rows = {row["name"]: row for row in results["recipes"]}
    f = rows["dpo-sig-b05-lr5e4-r25w1"]["forgetting_vs_sft"]
    assert f["mix_weighted"]["change"] == pytest.approx(2.55 - SFT_BPB)  # not - BASE_BPB
    assert f["mix_weighted"]["stderr"] == pytest.approx(math.hypot(0.03, 0.04))
    assert f["domains"]["en_tech"]["change"] == pytest.approx(0.05)
    assert f["domains"]["zh_classical"]["change"] == pytest.approx(0.10)
    assert f["domains"]["zh_classical"]["stderr"] == pytest.approx(math.hypot(0.01, 0.01))
    # Without post_detail.json: post.json's changes against the base, DPO's minus SFT's.
    metrics = detail_files(0.58, 2.55, 3.10)
    del metrics["metrics/post_detail.json"]
    fallback = sweep.forgetting_vs_sft(metrics)
    assert fallback["mix_weighted"] == {"change": pytest.approx(0.05), "stderr": None}
    assert fallback["domains"]["zh_classical"]["change"] == pytest.approx(0.10)


def test_rows_in_grid_order_with_their_figures_and_the_pareto_front(sweep, results):
    r = sweep.RECIPES
    assert [row["name"] for row in results["recipes"]] == [r[0].name, r[1].name,
                                                           r[6].name, r[12].name]
    assert results["missing"] == [x.name for x in r if x.name not in
                                  {r[0].name, r[1].name, r[6].name, r[12].name}]
    rows = {row["name"]: row for row in results["recipes"]}
    assert {n for n, row in rows.items() if row["pareto"]} == {r[0].name, r[1].name}
    lora = rows[r[6].name]
    assert lora["settings"]["lora"]["rank"] == 8 and lora["settings"]["lr"] == 1e-3
    assert lora["lm_eval"] == pytest.approx(0.45) and lora["dpo_seconds"] == 155.4
    assert lora["reward_accuracy"] == 0.70


def test_the_markdown_table(sweep, results):
    lines = sweep.markdown(results).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[-1] == "Pareto" and "Δ zh_classical" in head
    assert len(lines) == 2 + len(results["recipes"])
    cells = {}
    for line in lines[2:]:
        row = dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True))
        cells[row["recipe"].strip("`")] = row
    replay = cells["dpo-sig-b05-lr5e4-r25w1"]
    assert replay["Pareto"] == "yes" and replay["replay ×weight"] == "0.25 ×1"
    assert replay["Δ bpb vs SFT"] == "+0.050 ± 0.050"
    assert replay["Δ zh_classical"] == "+0.100" and replay["pref acc"] == "0.580 ± 0.020"
    simpo = cells["dpo-simpo-g50-b200-lr5e4-r0"]
    assert simpo["Pareto"] == "" and simpo["loss"] == "simpo γ 0.5" and simpo["β"] == "2"
    assert cells["dpo-sig-lora-b05-lr1e3-r0"]["LoRA"] == "r8"
    assert cells["dpo-sig-lora-b05-lr1e3-r0"]["Pareto"] == ""
    assert sweep.markdown({"recipes": [], "missing": []}).startswith("no DPO recipe")


def test_the_docs_block_is_the_committed_json_or_a_note(sweep, results, tmp_path):
    docs = load(REPO / "scripts" / "demo_docs.py")
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "dpo_recipe_sweep.py", tmp_path / "bench")
    page = "<!-- gen:dpo_recipes -->\n<!-- /gen:dpo_recipes -->\n"
    note = docs.render(page, {}, tmp_path)
    assert "Not yet measured" in note and len(note.splitlines()) == 3
    out = tmp_path / "bench" / "results" / "dpo_recipes.json"
    out.parent.mkdir()
    out.write_text(json.dumps(results, allow_nan=False), encoding="utf-8")
    table = docs.render(page, {}, tmp_path)
    assert table == ("<!-- gen:dpo_recipes -->\n" + sweep.markdown(results)
                     + "\n<!-- /gen:dpo_recipes -->\n")


def test_a_recipe_names_its_batch_and_length_only_where_they_differ(sweep):
    """The first recipes keep their names; a recipe with more rows or steps says so,
    and sets both keys always (so it means the same run whatever params.yaml holds)."""
    plain = sweep.Recipe(beta=0.05, lr=5e-4, replay=0.25)
    wider = sweep.Recipe(beta=0.05, lr=5e-4, replay=0.2, micro_batch_size=20)
    longer = sweep.Recipe(beta=0.05, lr=5e-4, replay=0.25, max_steps=93)
    assert plain.name == "dpo-sig-b05-lr5e4-r25w1"
    assert wider.name == "dpo-sig-b05-lr5e4-r20w1-mb20"
    assert longer.name == "dpo-sig-b05-lr5e4-r25w1-s93"
    assert {"dpo.micro_batch_size=16", "dpo.max_steps=70"} <= set(plain.sets())
    assert {"dpo.micro_batch_size=20", "dpo.max_steps=70"} <= set(wider.sets())
    assert wider.name in {r.name for r in sweep.RECIPES}


def test_out_keeps_an_earlier_batchs_rows_and_recomputes_the_front(sweep, results):
    """Two batches of one sweep: the second's --out keeps the first's rows (with the
    grid's command and the keys added since filled in), in grid order; the Pareto column
    is over both."""
    first = json.loads(json.dumps(results))
    r = sweep.RECIPES
    old = first["recipes"][0]
    old["settings"].pop("micro_batch_size")
    old["settings"].pop("max_steps")
    old["command"] = "an older command"
    dominating = json.loads(json.dumps(first["recipes"][1]))
    dominating.update(name=r[-1].name, pref_accuracy=0.99)
    dominating["forgetting_vs_sft"]["mix_weighted"]["change"] = -1.0
    second = {**results, "recipes": [dominating], "missing": []}
    merged = sweep.merge(first, second)
    names = [row["name"] for row in merged["recipes"]]
    assert names == [row["name"] for row in first["recipes"]] + [r[-1].name]
    assert merged["recipes"][0]["command"] == sweep.command(r[0])
    assert merged["recipes"][0]["settings"]["micro_batch_size"] == 16
    assert merged["recipes"][0]["settings"]["max_steps"] == 70
    assert [row["name"] for row in merged["recipes"] if row["pareto"]] == [r[-1].name]
    assert r[-1].name not in merged["missing"] and r[2].name in merged["missing"]
