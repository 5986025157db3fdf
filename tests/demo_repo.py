"""A temporary git+DVC repo holding the pipeline, tiny params and a slice of the demo.

Shared by the end-to-end tests (test_pipeline_e2e, test_tracking_queue): the data stages
(ingest to shards) run once per session in a template repo (conftest's
``demo_data_repo``); each test module copies it and reproduces the rest.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "raw" / "demo"
INSTRUCTIONS = REPO / "data" / "instructions" / "demo"
PREFERENCES = REPO / "data" / "preferences" / "demo"
DOCS_PER_DOMAIN = 40
VOCAB = 2000
# The stages up to the shards: what both the full pipeline and the queue tests share.
DATA_STAGES = ("ingest", "filter", "dedup", "decontam", "mix", "tokenizer", "shards")

# The stages' torch threads. The models here are tiny: on a small machine shared with
# pytest, DVC and other jobs, a second intra-op thread per stage buys nothing and its
# spin-waits cost a lot (evaluate_post on this slice: 63 s with 2 threads, 12 s with 1,
# on a busy 2-core VM).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def tiny_params() -> dict:
    """The repo's params.yaml, shrunk so the whole pipeline runs in about a minute."""
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params["ingest"]["part_docs"] = 50
    params["mix"]["part_docs"] = 50
    params["tokenizer"].update(vocab_size=VOCAB, sample_chars=400_000, character_coverage=0.98)
    params["model"].update(n_layer=2, n_head=2, n_embd=64, seq_len=64)
    params["train"].update(max_steps=24, micro_batch_size=4, warmup=4, ckpt_every=8,
                           eval_every=12, eval_batches=2, log_every=4, compile=False)
    # 16 batches spread over the val split, as the real params do (a full pass scores
    # ~3,800 windows each time evaluate or evaluate_post runs); every domain still has
    # 4-8 documents scored.
    params["evaluate"].update(max_batches=16, batch_size=8, train_batches=2,
                              max_new_tokens=8, prompts=["It is a truth", "床前明月光"])
    params["sft_data"].update(seq_len=128, val_fraction=0.1)
    params["sft"].update(max_steps=6, micro_batch_size=4, warmup=2, eval_every=3,
                         eval_batches=2, log_every=2, ckpt_every=3, compile=False, replay=0.25)
    params["dpo_data"].update(seq_len=128, val_fraction=0.1)
    params["dpo"].update(max_steps=4, micro_batch_size=4, warmup=1, eval_every=2,
                         eval_batches=1, log_every=2, ckpt_every=2, compile=False)
    params["evaluate_post"].update(batch_size=8, max_new_tokens=8, prompts=["Hi"])
    params["harness"].update(limit=6, batch_size=8)
    # One torch thread per stage (see ONE_THREAD): figures stay those of one thread count.
    for section in ("train", "sft", "dpo"):
        params[section]["num_threads"] = 1
    return params


def stage_env(tracking: bool = False) -> dict[str, str]:
    """This environment for git, DVC and the stages: this venv first, no outer MLflow or
    DVC experiment, a git identity, one torch thread; MLflow tracking on when asked (else
    the suite's default, off: see conftest)."""
    e = dict(os.environ)
    if tracking:
        e["LMFORGE_TRACKING"] = "on"
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    for name in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_EXP_NAME"):
        e.pop(name, None)
    e.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
             GIT_COMMITTER_EMAIL="t@t", DVC_NO_ANALYTICS="1", **ONE_THREAD)
    return e


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-4000:]}"
    return out


def slice_records(source: Path, dest: Path, counts: dict[str, int]) -> None:
    """The first records of each of ``source``'s ``<name>.jsonl.gz`` files."""
    for name, n in counts.items():
        with gzip.open(source / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(n), f, strict=False)]
        dest.mkdir(parents=True, exist_ok=True)
        with gzip.open(dest / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(lines)


def slice_demo(dest: Path) -> None:
    """The first few documents of each domain's first part, as the repo ships them."""
    for domain_dir in sorted(p for p in DEMO.iterdir() if p.is_dir()):
        first = sorted(domain_dir.glob("*.jsonl.gz"))[0]
        with gzip.open(first, "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(DOCS_PER_DOMAIN), f, strict=False)]
        out = dest / domain_dir.name / first.name
        out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(out, "wt", encoding="utf-8") as f:
            f.writelines(lines)


def build_data_repo(root: Path, env: dict[str, str]) -> str:
    """The pipeline, tiny params and the demo slice in a new git+DVC repo at ``root``,
    with the data stages reproduced and committed; DVC's output."""
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(REPO / name, root / name)
    shutil.copytree(REPO / "stages", root / "stages",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "src", root / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    slice_demo(root / "data" / "raw" / "demo")
    shutil.copytree(REPO / "data" / "tasks", root / "data" / "tasks")  # lm-eval's task files
    slice_records(INSTRUCTIONS, root / "data" / "instructions" / "demo",
                  {"train": 300, "test": 60, "test_mc": 20})
    slice_records(PREFERENCES, root / "data" / "preferences" / "demo",
                  {"train": 300, "test": 40})
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False),
                                      encoding="utf-8")
    run(["git", "init", "-q"], root, env)
    # `dvc exp run` commits through its own git library: give the repo an identity.
    run(["git", "config", "user.name", "lmforge test"], root, env)
    run(["git", "config", "user.email", "test@lmforge.invalid"], root, env)
    run(["dvc", "init", "-q"], root, env)
    run(["dvc", "config", "core.analytics", "false"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "init"], root, env)
    out = run(["dvc", "repro", *DATA_STAGES], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "data stages"], root, env)
    return out


def copy_repo(template: Path, dest: Path) -> Path:
    """A copy of the template repo (git history, DVC cache and lock, outputs), without
    DVC's scratch directory (.dvc/tmp: locks and state of the template's own paths)."""
    def scratch(directory: str, names: list[str]) -> list[str]:
        return ["tmp"] if Path(directory).name == ".dvc" and "tmp" in names else []
    shutil.copytree(template, dest, symlinks=True, ignore=scratch, dirs_exist_ok=True)
    return dest
