"""Under DVC a stage's ``init_from`` must be one of its deps (issue 43, item 7).

A folder named only by a param (``tokenizer.init_from: models/base``) was invisible to
``dvc status``: edited in place, the stage stayed "up to date" and its outputs stale. The
stages now stop in one line unless dvc.yaml lists the path (src/lmforge/stage_deps.py).
The DVC tests run the real tokenizer stage in a small repo with no git (a few seconds).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from demo_repo import run, stage_env

from lmforge import stage_deps
from lmforge.config import Params
from lmforge.errors import InputError
from lmforge.stage_deps import covered, normalise, require_dependency
from lmforge.train import runner

REPO = Path(__file__).resolve().parents[1]
LINE = ('tokenizer.init_from: models/base is not a dependency of the tokenizer stage, so '
        'dvc status would not see it change: add "- models/base" under '
        'stages.tokenizer.deps in dvc.yaml')


def tiny_tokenizer_json(folder: Path) -> Path:
    """A word-level tokenizer.json (all an import needs), built in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "alpha", "beta", "gamma", "text"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def pipeline(deps: list[str]) -> dict:
    """dvc.yaml with the repo's tokenizer stage command, its init_from param and ``deps``."""
    return {"stages": {"tokenizer": {
        "cmd": "python -m stages.tokenizer", "deps": deps,
        "params": ["tokenizer.init_from"],
        "outs": ["models/tokenizer", {"metrics/tokenizer.json": {"cache": False}}]}}}


def write_pipeline(root: Path, deps: list[str]) -> None:
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline(deps), sort_keys=False),
                                   encoding="utf-8")


def small_repo(root: Path, deps: list[str]) -> Path:
    """A DVC repo (no git) holding the tokenizer stage, a val split and models/base."""
    shutil.copytree(REPO / "stages", root / "stages",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for split in ("train", "val"):
        (root / "data" / "mixed" / split).mkdir(parents=True)
        pq.write_table(pa.table({"id": ["0", "1"], "text": ["alpha beta", "gamma text"],
                                 "domain": ["prose", "prose"]}),
                       root / "data" / "mixed" / split / "part-00000.parquet")
    tiny_tokenizer_json(root / "models" / "base")
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params["tokenizer"].update(init_from="models/base", num_threads=1)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False),
                                      encoding="utf-8")
    write_pipeline(root, deps)
    run(["dvc", "init", "--no-scm", "-q"], root, stage_env())
    return root


def dvc_status(root: Path) -> dict:
    return json.loads(run(["dvc", "status", "--json"], root, stage_env()) or "{}")


# ------------------------------------------------------------------ under a real dvc repro


def test_an_init_from_that_is_no_dep_stops_the_stage_in_one_line(tmp_path):
    root = small_repo(tmp_path, ["data/mixed/val"])
    proc = subprocess.run(["dvc", "repro"], cwd=root, env=stage_env(), capture_output=True,
                          text=True)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if "init_from" in line]
    assert ours == [f"error: {LINE}"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (root / "models" / "tokenizer").exists()  # stopped before any work


def test_a_listed_init_from_runs_and_its_edits_show_in_dvc_status(tmp_path):
    root = small_repo(tmp_path, ["data/mixed/val", "models/base"])  # as the docs say
    run(["dvc", "repro"], root, stage_env())
    assert (root / "models" / "tokenizer" / "tokenizer.json").is_file()
    assert dvc_status(root) == {}
    source = root / "models" / "base" / "tokenizer.json"
    source.write_text(source.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    assert dvc_status(root) == {"tokenizer": [{"changed deps": {"models/base": "modified"}}]}

    # The defect, for comparison: with the path only a param, DVC records no hash of its
    # files, so the same edit leaves `dvc status` clean and models/tokenizer stale.
    write_pipeline(root, ["data/mixed/val"])
    run(["dvc", "commit", "-f", "-q"], root, stage_env())
    assert dvc_status(root) == {}
    source.write_text(source.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    assert dvc_status(root) == {}


def test_stage_deps_reads_dvc_yaml_as_dvc_does(tmp_path, monkeypatch):
    # A dep templated from params (`- ${tokenizer.init_from}`, fine while it is set) is
    # the resolved path; an unknown stage or no dvc.yaml here: DVC cannot say (None).
    root = small_repo(tmp_path, ["data/mixed/val", "${tokenizer.init_from}"])
    monkeypatch.chdir(root)
    assert stage_deps.stage_deps("tokenizer") == ["data/mixed/val", "models/base"]
    assert stage_deps.stage_deps("train") is None
    monkeypatch.chdir(root / "data")
    assert stage_deps.stage_deps("tokenizer") is None


# ------------------------------------------------------------------ the logic


def test_covered_compares_normalised_paths_relative_to_the_repo(tmp_path):
    repo, outside = tmp_path / "repo", tmp_path / "elsewhere" / "base"
    roots = [repo]
    for path in ("models/base", "./models/base/", "models/base/tokenizer.json",
                 str(repo / "models" / "base"), "models/../models/base"):
        assert covered(path, ["models/base"], roots), path
    assert covered("models/base", [str(repo / "models" / "base")], roots)  # absolute dep
    assert covered("models/base/tokenizer.json", ["models"], roots)  # a folder above
    assert covered("models/base", ["."], roots)
    for path in ("models/basement", "models", "data/base", str(outside)):
        assert not covered(path, ["models/base"], roots), path
    # Outside the repo: listed as is (an external dep), or not at all.
    assert normalise(str(outside), roots) == outside.as_posix()
    assert covered(str(outside), [str(outside)], roots)
    assert covered(str(outside / "tokenizer.json"), [str(outside.parent)], roots)
    assert not covered("../elsewhere/base", ["elsewhere/base"], roots)
    assert covered("../elsewhere/base", [str(outside)], roots)


def fail_if_read(stage: str) -> list[str]:
    raise AssertionError("dvc.yaml read where nothing is to be checked")


def test_nothing_is_checked_outside_dvc_or_without_init_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no dvc.yaml either
    monkeypatch.setattr(stage_deps, "stage_deps", fail_if_read)
    monkeypatch.delenv("DVC_STAGE", raising=False)
    require_dependency("tokenizer", "models/base")
    require_dependency("train", "/anywhere/base")
    monkeypatch.setenv("DVC_STAGE", "tokenizer")
    require_dependency("tokenizer", None)
    require_dependency("tokenizer", "")


def test_under_dvc_the_running_stages_deps_decide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    asked = []
    monkeypatch.setattr(stage_deps, "stage_deps",
                        lambda stage: asked.append(stage) or ["data/sft", "models/final"])
    monkeypatch.setenv("DVC_STAGE", "sft")
    require_dependency("sft", "models/final")
    require_dependency("sft", str(tmp_path / "models" / "final"))
    with pytest.raises(InputError) as e:
        require_dependency("sft", str(tmp_path / "models" / "base"))
    assert str(e.value) == (
        f"sft.init_from: {tmp_path / 'models' / 'base'} is not a dependency of the sft "
        'stage, so dvc status would not see it change: add "- models/base" under '
        "stages.sft.deps in dvc.yaml")
    # A dvc.yaml elsewhere: DVC_STAGE is "<path>:<name>"; the name is the stage's.
    monkeypatch.setenv("DVC_STAGE", "sub/dvc.yaml:dpo")
    with pytest.raises(InputError, match=r"^dpo.init_from: /ext/m .* add \"- /ext/m\" under "
                                         r"stages\.dpo\.deps"):
        require_dependency("dpo", "/ext/m")
    assert asked == ["sft", "sft", "sft", "dpo"]


def test_a_dep_written_in_dvc_yaml_is_found_without_dvcs_loader(tmp_path, monkeypatch):
    """sft and dpo check their listed defaults on every run: dvc.yaml as written answers
    (milliseconds); DVC's loader (~0.3 s) only for what it does not list literally."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"sft": {
        "cmd": "x", "deps": ["data/sft", "models/final", {"params.yaml": ["sft.lr"]}]}}}))
    asked = []
    monkeypatch.setattr(stage_deps, "stage_deps", lambda stage: asked.append(stage) or [])
    monkeypatch.setenv("DVC_STAGE", "sft")
    require_dependency("sft", "models/final")
    assert asked == []
    with pytest.raises(InputError, match="models/base"):
        require_dependency("sft", "models/base")
    assert asked == ["sft"]


def test_the_mix_sweeps_frozen_tokenizer_needs_no_dep(tmp_path, monkeypatch):
    # A queued proxy runs in a temp copy inside the original repo (DVC_ROOT) and names
    # the frozen tokenizer by its absolute path in the original: exempt, dvc.yaml unread.
    from lmforge.mixture import sweep

    original = tmp_path / "repo"
    copy = original / ".dvc" / "tmp" / "exps" / "tmp1234"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.setenv("DVC_ROOT", str(original))
    monkeypatch.setenv("DVC_STAGE", "tokenizer")
    monkeypatch.setattr(stage_deps, "stage_deps", fail_if_read)
    frozen = (original / sweep.SWEEPS / "mixsweep" / "tokenizer.model").resolve()
    require_dependency("tokenizer", str(frozen))
    # Any other path of the original repo is checked as its relative form.
    monkeypatch.setattr(stage_deps, "stage_deps", lambda stage: ["data/mixed/val"])
    with pytest.raises(InputError, match='add "- models/base" under'):
        require_dependency("tokenizer", str(original / "models" / "base"))


def test_the_training_stages_check_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_STAGE", "train")
    monkeypatch.setattr(stage_deps, "stage_deps", lambda stage: ["data/shards"])

    def no_work(*args):
        raise AssertionError("the stage did work before the check")

    spec = runner.StageSpec("train", "stages.train", tmp_path / "tok", tmp_path / "ckpt",
                            tmp_path / "final", open_data=no_work, write_outputs=no_work)
    params = Params()
    params.train.init_from = "models/base"
    params.train.nproc = 2  # not even torchrun is launched
    monkeypatch.setattr(runner, "relaunched", no_work)
    with pytest.raises(InputError, match=r"^train.init_from: models/base is not a "
                                         r"dependency of the train stage"):
        runner.run_training_stage(params, spec)
