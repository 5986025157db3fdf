"""metrics/headline.json and headline.md: the figures `dvc metrics show` prints and the
per-model table, read from the stages' detail files; one row a 200-column terminal shows
without wrapping."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmforge.experiments import committed_json
from lmforge.headline import MODELS, SCREEN, headline, headline_markdown, screen, write_headline

REPO = Path(__file__).resolve().parents[1]
METRICS = REPO / "metrics"


def load(name: str) -> dict:
    return json.loads((METRICS / f"{name}.json").read_text(encoding="utf-8"))


def mix_row(model: str, measure: str) -> dict:
    (row,) = [r for r in load("post_detail")["forgetting"][model][measure]
              if r["domain"] == "mix_weighted"]
    return row


def test_headline_values_come_from_the_detail_files():
    rows = headline(METRICS)
    assert sorted(rows) == sorted(MODELS)
    val = load("eval")["val"]["mix_weighted"]
    base = rows["base"]
    assert (base["loss"], base["loss_se"]) == (val["loss"], val["loss_stderr"])
    assert (base["bpb"], base["bpb_se"]) == (val["bits_per_byte"], val["bits_per_byte_stderr"])
    for model in ("sft", "dpo"):
        bpb, loss = mix_row(model, "bits_per_byte"), mix_row(model, "loss")
        assert (rows[model]["bpb"], rows[model]["bpb_se"]) == (bpb["tuned"], bpb["tuned_stderr"])
        assert (rows[model]["loss"], rows[model]["loss_se"]) == (loss["tuned"],
                                                                 loss["tuned_stderr"])
        # Forgetting is the difference of the two rows' bits/byte.
        assert rows[model]["bpb"] - base["bpb"] == pytest.approx(
            load("post")["forgetting_bits_per_byte"][model]["mix_weighted"])
    for model, stage in (("base", "train"), ("sft", "sft"), ("dpo", "dpo")):
        assert rows[model]["tok_s"] == round(load(stage)["tokens_per_sec"])
    post, harness = load("post"), load("harness")
    for model in MODELS:
        assert rows[model]["tok_acc"] == post[model]["token_accuracy"]
        assert rows[model]["pref_acc"] == post[model]["pref_accuracy"]
        assert rows[model]["resp_loss"] == post[model]["response_loss"]
        for task, scores in harness[model].items():
            assert rows[model][task.removeprefix("demo_")] == scores["acc"]
        accs = [scores["acc"] for scores in harness[model].values()]
        assert rows[model]["lm_eval"] == pytest.approx(sum(accs) / len(accs))
    assert rows["dpo"]["reward_acc"] == post["dpo"]["reward_accuracy"]
    assert "reward_acc" not in rows["base"]


def test_committed_headline_files_are_up_to_date():
    """The committed metrics/headline.json and .md are what the stage writes from the
    committed detail files (dvc repro -s headline)."""
    rows = headline(METRICS)
    committed = json.loads((METRICS / "headline.json").read_text(encoding="utf-8"))
    assert committed == screen(rows)
    assert list(committed) == list(MODELS)  # pipeline order: dvc exp show keeps it
    assert {m: list(r) for m, r in committed.items()} == {m: list(k) for m, k in SCREEN.items()}
    assert (METRICS / "headline.md").read_text(encoding="utf-8") == headline_markdown(rows)


def test_screen_takes_the_dozen_and_the_table_every_column():
    rows = {"base": {"bpb": 1.0, "loss": 2.0, "tok_s": 5}, "sft": {"tok_acc": 0.5}}
    assert screen(rows) == {"base": {"bpb": 1.0, "tok_s": 5}, "sft": {"tok_acc": 0.5},
                            "dpo": {}}
    table = headline_markdown(rows).splitlines()
    assert table[0] == "| model | bpb | loss | tok_acc | tok_s |"
    assert table[2:] == ["| base | 1.000 | 2.000 |  | 5 |", "| sft |  |  | 0.500 |  |",
                         "| dpo |  |  |  |  |"]


def test_a_missing_detail_file_leaves_its_columns_out(tmp_path):
    for name in ("eval", "train"):
        shutil.copy(METRICS / f"{name}.json", tmp_path / f"{name}.json")
    out_json, out_md = tmp_path / "out" / "headline.json", tmp_path / "out" / "headline.md"
    assert write_headline(tmp_path, out_json, out_md) == [out_json, out_md]
    rows = json.loads(out_json.read_text(encoding="utf-8"))
    assert rows == {"base": {"bpb": pytest.approx(rows["base"]["bpb"]),
                             "bpb_se": pytest.approx(rows["base"]["bpb_se"]),
                             "tok_s": rows["base"]["tok_s"]}, "sft": {}, "dpo": {}}
    assert out_md.read_text(encoding="utf-8").splitlines()[0] == (
        "| model | bpb | bpb_se | loss | loss_se | tok_s |")


def test_only_the_headline_files_are_metrics_and_details_stay_outputs():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    metrics = [next(iter(m)) for s in stages.values() for m in s.get("metrics", [])]
    assert metrics == ["metrics/headline.json"]
    outs = {next(iter(o)) if isinstance(o, dict) else o: o
            for s in stages.values() for o in s.get("outs", [])}
    for name in ("ingest", "filter", "dedup", "decontam", "mix", "tokenizer", "shards",
                 "train", "eval", "sft_data", "sft", "dpo_data", "dpo", "post",
                 "post_detail", "harness"):
        out = outs[f"metrics/{name}.json"]
        assert out[f"metrics/{name}.json"] == {"cache": False}, name
    deps = set(stages["headline"]["deps"])
    assert {f"metrics/{n}.json" for n in ("eval", "train", "sft", "dpo", "post",
                                          "post_detail", "harness")} <= deps


def test_dvc_metrics_show_fits_a_200_column_terminal():
    # The venv's dvc, whether or not the venv is on PATH (pytest run as .venv/bin/pytest).
    dvc = Path(sys.executable).parent / "dvc"
    proc = subprocess.run([str(dvc), "metrics", "show"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout  # one file: a header and a row
    assert max(len(line) for line in lines) <= 200, proc.stdout
    # Every figure under its own short name: no column is named by file and key.
    assert lines[0].split()[1:] == sorted(f"{m}.{k}" for m, keys in SCREEN.items()
                                          for k in keys)


def test_committed_json_reads_a_revisions_metrics(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "eval.json").write_text('{"loss": 1.5}')
    (tmp_path / "metrics" / "notes.md").write_text("# not json")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "one")
    (tmp_path / "metrics" / "eval.json").write_text('{"loss": 9.0}')  # not committed
    assert committed_json("HEAD", cwd=str(tmp_path)) == {"metrics/eval.json": {"loss": 1.5}}
    assert committed_json("no-such-rev", cwd=str(tmp_path)) == {}
