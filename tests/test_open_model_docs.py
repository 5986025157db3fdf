"""docs/open-models.md quotes the SmolLM2 walkthrough's figures from its record only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("open_model_docs",
                                                  REPO / "scripts/open_model_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_walkthrough_table_is_the_records_figures():
    mod = load_script()
    page = mod.PAGE.read_text(encoding="utf-8")
    assert "<!-- walkthrough -->" in page
    assert page == mod.render(page), "docs/open-models.md is stale: run " \
        "python scripts/open_model_docs.py"


def test_the_precision_table_is_the_benchs_figures_in_the_page_and_in_results():
    mod = load_script()
    record = json.loads((mod.RUN / "lora_precision.json").read_text())
    for path in (mod.PAGE, mod.RESULTS):
        page = path.read_text(encoding="utf-8")
        region = page.split("<!-- lora-precision -->")[1].split("<!-- /lora-precision -->")[0]
        assert page == mod.render(page), f"{path} is stale: run python scripts/open_model_docs.py"
        for side, run in record["runs"].items():
            assert f"| {mod.precision_label(side)} | {run['peak_rss_mib']:,} MiB" in region


def test_a_changed_figure_in_the_record_changes_the_table(tmp_path, monkeypatch):
    mod = load_script()
    for f in mod.RUN.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    post = json.loads((tmp_path / "post.json").read_text())
    post["sft"]["token_accuracy"] += 0.1234
    (tmp_path / "post.json").write_text(json.dumps(post))
    before = mod.table()
    monkeypatch.setattr(mod, "RUN", tmp_path)
    assert mod.table() != before
    assert f"{post['sft']['token_accuracy']:.3f}" in mod.table()
    precision = json.loads((tmp_path / "lora_precision.json").read_text())
    precision["runs"]["bf16"]["token_accuracy"] += 0.1234
    (tmp_path / "lora_precision.json").write_text(json.dumps(precision))
    assert f"{precision['runs']['bf16']['token_accuracy']:.3f}" in mod.precision_table()
