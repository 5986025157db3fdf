"""README.md and docs/ quote the demo's figures from the committed metrics only, the
pictures are drawn from the committed plots, and the README stays a short front page."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def docs():
    return load("demo_docs")


@pytest.mark.parametrize("page", load("demo_docs").PAGES)
def test_every_quoted_demo_figure_is_the_metrics(docs, page):
    text = (REPO / page).read_text(encoding="utf-8")
    assert text == docs.render(text, docs.metrics()), (
        f"{page} quotes figures that differ from metrics/: run python scripts/demo_docs.py")


def test_a_changed_metric_changes_the_page(docs, tmp_path):
    shutil.copytree(REPO / "metrics", tmp_path / "metrics")
    shutil.copytree(REPO / "plots", tmp_path / "plots")
    page = ("steps <!--= train.steps | d -->0<!--/-->, loss "
            "<!--= headline.base.loss | .3f -->0<!--/-->\n"
            "<!-- gen:headline -->\n<!-- /gen:headline -->\n")
    before = docs.render(page, docs.metrics(tmp_path), tmp_path)
    train = tmp_path / "metrics" / "train.json"
    figures = json.loads(train.read_text(encoding="utf-8"))
    steps = figures["steps"] + 1
    train.write_text(json.dumps({**figures, "steps": steps}), encoding="utf-8")
    # The base model's headline loss is eval.json's mixture-weighted val loss.
    ev_path = tmp_path / "metrics" / "eval.json"
    ev = json.loads(ev_path.read_text(encoding="utf-8"))
    ev["val"]["mix_weighted"]["loss"] = 1.25
    ev_path.write_text(json.dumps(ev), encoding="utf-8")
    after = docs.render(page, docs.metrics(tmp_path), tmp_path)
    assert f"-->{steps}<!--/-->" in after and "-->1.250<!--/-->" in after
    assert "| base | " in after and "1.250" in after.split("gen:headline")[1]
    assert before != after


def test_the_ablation_table_is_the_bench_json(docs, tmp_path):
    """docs/training.md's time-to-quality table is bench/results' JSON: a changed run
    changes its row, its difference from the baseline and its tokens/s ratio."""
    shutil.copytree(REPO / "bench" / "results", tmp_path / "bench" / "results")
    shutil.copy(REPO / "bench" / "ttq_table.py", tmp_path / "bench" / "ttq_table.py")
    page = "<!-- gen:ablation_demo -->\n<!-- /gen:ablation_demo -->\n"
    before = docs.render(page, {}, tmp_path)
    path = tmp_path / "bench" / "results" / "time_to_quality_demo_200steps.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    base = results["runs"]["baseline/tokens/seed1337"]
    muon = results["runs"]["muon/tokens/seed1337"]
    muon.update(bpb=base["bpb"] - 0.25, tokens_per_sec=base["tokens_per_sec"] / 2)
    path.write_text(json.dumps(results), encoding="utf-8")
    after = docs.render(page, {}, tmp_path)
    row = next(line for line in after.splitlines() if line.startswith("| muon |"))
    assert f"| {base['bpb'] - 0.25:.3f} ± " in row and "| -0.250 | 0.50x |" in row
    assert before != after and len(after.splitlines()) == len(before.splitlines())


def test_a_figure_that_names_no_metric_is_one_clear_error(docs):
    with pytest.raises(ValueError, match=r"train\.no_such_key"):
        docs.render("<!--= train.no_such_key | .3f -->1<!--/-->", docs.metrics())
    with pytest.raises(ValueError, match="unknown block gen:nope"):
        docs.render("<!-- gen:nope -->\n<!-- /gen:nope -->", docs.metrics())


def test_readme_is_a_short_front_page_linking_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README does not link docs/{page.name}"
    for picture in ("docs/img/loss.png", "docs/img/bits_per_byte.png"):
        assert f"]({picture})" in readme
    for command in ("make demo", "make test", "dvc repro", "dvc exp run -S", "mlflow ui",
                    "dvc metrics diff", "dvc metrics show", "lmforge "):
        assert command in readme, command


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md"] + sorted(
    f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))
def test_relative_links_reach_a_file_and_heading(page):
    path = REPO / page
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{page}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), re.M)
            assert anchor in {slug(h) for h in headings}, f"{page}: no heading #{anchor}"


def test_the_pictures_were_drawn_from_todays_plots():
    pics = load("demo_pictures")
    for name, sources in pics.PICTURES.items():
        recorded = pics.png_text(REPO / "docs" / "img" / name).get("Source")
        assert recorded == pics.source_digest(sources), (
            f"docs/img/{name} is older than {sources}: run python scripts/demo_pictures.py")


def test_the_pictures_script_draws_both(tmp_path):
    pytest.importorskip("matplotlib")
    pics = load("demo_pictures")
    assert pics.main(["--out", str(tmp_path)]) == 0
    for name, sources in pics.PICTURES.items():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert pics.png_text(tmp_path / name)["Source"] == pics.source_digest(sources)
    rows = pics.domain_rows(REPO)
    assert list(rows) == ["base", "sft", "dpo"]
    assert set(rows["sft"]) == set(rows["base"])
