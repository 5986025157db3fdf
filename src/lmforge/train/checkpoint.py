"""Full training checkpoints: save atomically, keep the last few, resume the same run.

A checkpoint holds only tensors and plain Python values, so it loads with
``torch.load(weights_only=True)`` (no pickle code execution). Its ``fingerprint`` names
the run it belongs to: the model and training params that shape the trajectory, the
data (shard manifests) and the tokenizer. A checkpoint is resumed only into the run
with the same fingerprint; each run keeps its checkpoints in a directory of its own
(``lmforge.train.runs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.config import DpoConfig, ModelConfig, TrainConfig
from lmforge.io import atomic_path

FORMAT = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")
# Keys that change how a run is observed or saved, not what it computes.
NON_RUN_KEYS = frozenset({
    "log_every", "eval_every", "eval_batches", "sample_every", "ckpt_every",
    "light_every", "keep_last", "num_threads", "max_bad_steps", "nproc",
    "sample_prompts", "self_check",
    # Splits the same per-rank batch differently; the loader hands out the same windows.
    "probe_micro_batch",
    # The same step computed by other kernels (equal up to float rounding).
    "compile", "fused_loss", "activation_checkpointing",
    # Where the initial weights lie; their sha256 is fingerprinted instead.
    "init_from",
})
_REQUIRED = ("format", "fingerprint", "step", "model", "optimizer", "ranks", "progress")
# Model keys added with the open families, at the values every earlier run had: left out
# of a run's identity when so, so a run started before they existed resumes after.
_LATER_MODEL_KEYS = {"family": "llama", "head_dim": None, "qkv_bias": False,
                     "qk_norm": False, "rope_scaling": None, "zero_init_proj": False}
# Train keys added with Muon and stratified batches (issue 24), likewise left out at
# these values; the muon_* keys are also left out whenever the optimizer is adamw (they
# change nothing then).
_LATER_TRAIN_KEYS = {"optimizer": "adamw", "batch_sampling": "shuffled"}
_MUON_KEYS = ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_adjust_lr")


def run_identity(model_cfg: ModelConfig, train_cfg: TrainConfig, world_size: int,
                 train_manifest: dict, val_manifest: dict, tokenizer_sha256: str,
                 init_sha256: str | None = None, replay_manifest: dict | None = None,
                 stage: str = "train") -> dict[str, Any]:
    """Everything that defines a run's trajectory, as plain values (kept in run.json).

    ``init_sha256``: the weights ``train.init_from`` starts from, so a run never resumes
    on top of a different starting model kept under the same path. ``replay_manifest``:
    the pretraining shards fine-tuning replays; ``stage``: ``sft`` for a fine-tuning run
    (pretraining runs record no stage, so their identities are as before).
    """
    train = _train_identity(train_cfg)
    model = {k: v for k, v in dataclasses.asdict(model_cfg).items()
             if k not in _LATER_MODEL_KEYS or v != _LATER_MODEL_KEYS[k]}
    blob = {
        "model": model,
        "train": train,
        # The process count, not train.nproc: a multi-node torchrun sets its own.
        "world_size": world_size,
        "data": [manifest_digest(train_manifest), manifest_digest(val_manifest)],
        "tokenizer_sha256": tokenizer_sha256,
    }
    if train.get("lora") and train["lora"].get("base_dtype") in ("fp32", "auto"):
        del train["lora"]["base_dtype"]  # fp32: what every LoRA run before the key held
    if train.get("strategy") == "ddp":
        del train["strategy"]  # the default: runs from before the key keep their names
    else:
        # DCP reshards on load, and the loader's position counts windows over all ranks,
        # so an FSDP run resumes on any number of processes that keeps its global batch.
        blob["global_batch"] = (train.pop("micro_batch_size") * train.pop("grad_accum_steps")
                                * blob.pop("world_size"))
    if init_sha256 is not None:
        blob["init_sha256"] = init_sha256
    if replay_manifest is not None:
        blob["data"].append(manifest_digest(replay_manifest))
    if stage != "train":
        blob["stage"] = stage
    return blob


def _train_identity(train_cfg: TrainConfig) -> dict[str, Any]:
    """The train keys that shape a run, without those at their pre-existing values."""
    train = {k: v for k, v in dataclasses.asdict(train_cfg).items()
             if k not in NON_RUN_KEYS and not (k in _LATER_TRAIN_KEYS
                                               and v == _LATER_TRAIN_KEYS[k])}
    if train_cfg.optimizer == "adamw":
        for k in _MUON_KEYS:
            train.pop(k, None)
    if isinstance(train_cfg, DpoConfig):  # its loss and replay keys (issue 45), likewise
        for k in train_cfg.identity_omits():
            del train[k]
    return train


def fingerprint_of(identity: dict[str, Any]) -> str:
    """sha256 of a run identity: the name of the run."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def fingerprint(model_cfg: ModelConfig, train_cfg: TrainConfig, world_size: int,
                train_manifest: dict, val_manifest: dict, tokenizer_sha256: str,
                init_sha256: str | None = None) -> str:
    """sha256 over everything that defines a run's trajectory (see ``run_identity``)."""
    return fingerprint_of(run_identity(model_cfg, train_cfg, world_size, train_manifest,
                                       val_manifest, tokenizer_sha256, init_sha256))


def manifest_digest(manifest: dict) -> str:
    """sha256 of a shard manifest; it lists every shard's checksum, so it pins the data."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def checkpoint_path(directory: Path, step: int) -> Path:
    """``directory/step-000050.pt``."""
    return Path(directory) / f"step-{step:06d}.pt"


def sharded_path(directory: Path, step: int) -> Path:
    """``directory/step-000050.dcp``: an FSDP checkpoint's shards (its ``.pt`` holds the
    rest: progress, loader positions, RNG states)."""
    return Path(directory) / f"step-{step:06d}.dcp"


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest step first."""
    found = []
    for p in Path(directory).glob("step-*.pt"):
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``state`` as ``step-NNNNNN.pt`` (temp file, fsync, rename), then prune old ones.

    ``directory`` is one run's own directory: keep-last-K never reaches another run.
    """
    path = checkpoint_path(directory, step)
    with atomic_path(path, durable=True) as tmp:
        torch.save(state, tmp)
    for old in list_checkpoints(directory)[:-keep_last]:
        old.unlink(missing_ok=True)
        shutil.rmtree(old.with_suffix(".dcp"), ignore_errors=True)
    return path


def load_resumable(directory: Path, fp: str,
                   log: Callable[[str], None] = print) -> tuple[dict[str, Any], Path] | None:
    """The newest readable checkpoint of run ``fp`` in its directory, or None (start fresh).

    A truncated or corrupt checkpoint is set aside (``*.pt.bad``) and the previous one
    tried. A file of another run (copied in by hand) is skipped and left where it is:
    nothing here deletes what another run wrote.
    """
    directory = Path(directory)
    for tmp in directory.glob(".step-*.tmp"):  # left by a process killed mid-write
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    for shards in directory.glob("step-*.dcp"):  # shards whose .pt was never written
        if not shards.with_suffix(".pt").exists():
            shutil.rmtree(shards, ignore_errors=True)
    for path in reversed(list_checkpoints(directory)):
        try:
            state = read_checkpoint(path)
        except Exception as e:  # any unreadable file: report it, set it aside, fall back
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            # Set it aside rather than delete it: the error may be transient (I/O, memory)
            # or a newer format, and it may be the only copy of a long run.
            bad = path.with_name(path.name + ".bad")
            log(f"train: checkpoint {path} is unreadable ({reason}); moved to {bad.name}, "
                "trying the previous one")
            path.replace(bad)
            continue
        if state["fingerprint"] != fp:
            log(f"train: {path} belongs to run {str(state['fingerprint'])[:16]}, not this "
                f"run {fp[:16]}; skipped (left in place)")
            continue
        return state, path
    return None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load one checkpoint (tensors and plain values only) and check its shape."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"not a full checkpoint: no {', '.join(missing)}")
    if state["format"] != FORMAT:
        raise ValueError(f"checkpoint format {state['format']}, this lmforge reads {FORMAT}")
    if state.get("sharded") and not (path.parent / state["sharded"] / ".metadata").is_file():
        raise ValueError(f"its shards {state['sharded']}/ are missing or incomplete")
    return state


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as tensors and plain Python values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back the RNG states ``capture_rng`` took."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
