"""``lmforge checkpoints``: runs listed with what differs from params.yaml; prune on request."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from test_train_loop import CPU, REPO, make_inputs, open_data, tiny_params

from lmforge.cli import main
from lmforge.tokenizer.files import tokenizer_sha256
from lmforge.train import runs
from lmforge.train.loop import train

TRAIN_A = dict(max_steps=10, eval_every=0, warmup=3.0)  # as params.yaml loads it


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    """A workspace with shards, params.yaml for run A, and runs A and B trained."""
    paths = make_inputs(tmp_path)
    sha = tokenizer_sha256(paths.tokenizer)
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    a = tiny_params(**TRAIN_A)
    params["model"] = {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 32}
    params["train"] = {k: v for k, v in dataclasses.asdict(a.train).items()
                       if k in params["train"] or k in TRAIN_A or k == "num_threads"}
    params["train"].update(compile=False, self_check=False, sample_prompts=[])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    ck = tmp_path / "models" / "checkpoints"
    fps = {}
    for name, p in (("a", a), ("b", tiny_params(**TRAIN_A, max_lr=1e-3))):
        fps[name] = train(p, open_data(paths), ck, sha, CPU, track=False,
                          log=lambda _: None).fingerprint
    monkeypatch.chdir(tmp_path)
    return ck, fps


def test_list_shows_each_run_and_what_differs_from_params_yaml(repo, capsys):
    ck, fps = repo
    main(["checkpoints"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["run", "step", "status", "size"]
    line_a = next(line for line in out if line.startswith(runs.run_id(fps["a"])))
    line_b = next(line for line in out if line.startswith(runs.run_id(fps["b"])))
    assert "10/10" in line_a and "finished" in line_a
    assert "this is the run params.yaml trains" in line_a
    assert "train.max_lr: 0.001 (now 0.003)" in line_b
    assert "KB" in line_b or "MB" in line_b


def test_prune_removes_only_when_asked_and_keeps_the_current_run(repo, capsys):
    ck, fps = repo
    main(["checkpoints", "prune", "--dry-run"])
    assert f"would remove {runs.run_id(fps['b'])}" in capsys.readouterr().out
    assert len(list(ck.iterdir())) == 2
    main(["checkpoints", "prune"])
    assert [d.name for d in ck.iterdir()] == [runs.run_id(fps["a"])]
    assert "removed 1 run(s), kept 1" in capsys.readouterr().out


def test_prune_keeps_runs_named_by_prefix_and_never_one_being_trained(repo, capsys):
    ck, fps = repo
    with runs.locked(ck / runs.run_id(fps["a"])):
        main(["checkpoints", "prune", "--keep", runs.run_id(fps["b"])[:6]])
    assert "being trained now; kept" in capsys.readouterr().out
    assert len(list(ck.iterdir())) == 2
    with pytest.raises(SystemExit) as stop:
        main(["checkpoints", "prune", "--keep", "zzz"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: checkpoints prune --keep zzz: matches 0")
    assert len(list(ck.iterdir())) == 2


def test_a_run_without_a_recorded_identity_says_so(repo, capsys):
    ck, fps = repo
    record = runs.read_run(ck / runs.run_id(fps["b"]))
    del record["identity"]
    from lmforge.io import write_json

    write_json(ck / runs.run_id(fps["b"]) / runs.RUN_FILE, record)
    main(["checkpoints", "--dir", str(ck)])
    assert "params not recorded" in capsys.readouterr().out


def test_prune_refuses_when_the_current_run_cannot_be_told(repo, tmp_path, capsys):
    ck, _ = repo
    (tmp_path / "models" / "tokenizer" / "tokenizer.model").unlink()  # not built (yet)
    with pytest.raises(SystemExit) as stop:
        main(["checkpoints", "prune"])
    assert stop.value.code == 2
    assert "no run matches params.yaml" in capsys.readouterr().err
    assert len(list(ck.iterdir())) == 2  # nothing removed
    with pytest.raises(SystemExit):  # a bare --keep keeps nothing: refused by the parser
        main(["checkpoints", "prune", "--keep"])
    assert len(list(ck.iterdir())) == 2


def fake_sharded_run(root, fp: str, steps: tuple[int, ...]) -> dict[str, int]:
    """A run directory as an FSDP run leaves it: per step a small .pt and a .dcp/ of
    shards. Its files' sizes, by kind."""
    d = root / runs.run_id(fp)
    runs.start_run_dir(root, fp, None, 10)
    runs.update_run(d, status="finished", last_step=steps[-1])
    sizes = {"pt": 0, "dcp": 0}
    for step in steps:
        (d / f"step-{step:06d}.pt").write_bytes(b"p" * 100)
        shards = d / f"step-{step:06d}.dcp"
        shards.mkdir()
        for name, n in ((".metadata", 300), ("__0_0.distcp", 2000), ("__1_0.distcp", 2000)):
            (shards / name).write_bytes(b"s" * n)
            sizes["dcp"] += n
        sizes["pt"] += 100
    sizes["all"] = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    return sizes


def test_a_sharded_checkpoints_size_counts_its_dcp_directory(tmp_path, capsys):
    ck = tmp_path / "checkpoints"
    sizes = fake_sharded_run(ck, "a" * 64, (4, 8))
    (listed,) = runs.list_runs(ck)
    assert listed.size_bytes == sizes["all"] >= sizes["pt"] + sizes["dcp"] == 8800
    main(["checkpoints", "--dir", str(ck), "--params", str(REPO / "params.yaml")])
    out = capsys.readouterr().out.splitlines()
    line = next(line for line in out if line.startswith("a" * 16))
    # The .pt files, the shards and run.json; not the 200 B of the .pt files alone.
    assert f" {sizes['all'] / 1024:.1f} KB " in line, line
    assert out[-1].startswith("size: all of a run's files (each step-*.pt with its "
                              "step-*.dcp/ shards"), out[-1]


def test_prune_removes_a_sharded_run_with_its_dcp_directories(tmp_path, capsys):
    ck = tmp_path / "checkpoints"
    fake_sharded_run(ck, "a" * 64, (8,))
    gone = fake_sharded_run(ck, "b" * 64, (4, 8))
    main(["checkpoints", "prune", "--dir", str(ck), "--keep", "aaaa", "--dry-run"])
    out = capsys.readouterr().out
    assert f"would remove {'b' * 16} (step 8, finished, " in out
    assert ".dcp shards included)" in out
    assert out.rstrip().endswith(f"would free {gone['all'] / 1024:.1f} KB"), out
    assert len(list(ck.iterdir())) == 2
    main(["checkpoints", "prune", "--dir", str(ck), "--keep", "aaaa"])
    assert f"freed {gone['all'] / 1024:.1f} KB" in capsys.readouterr().out
    assert [d.name for d in ck.iterdir()] == ["a" * 16]  # the .pt files and .dcp/ alike
    assert sorted(f.name for f in (ck / ("a" * 16)).iterdir() if f.name.startswith("step-")
                  ) == ["step-000008.dcp", "step-000008.pt"]
