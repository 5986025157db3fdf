"""The training loop: accumulation, clipping, the non-finite guard, eval, checkpoints, logs."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import math
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.exc import TorchDynamoException
from torch.nn.parallel import DistributedDataParallel

from lmforge.config import Params, section_name
from lmforge.errors import InputError, LmforgeError
from lmforge.model.frozen import frozen_dtype, hold_frozen_in, resolve_base_dtype
from lmforge.model.generate import generate
from lmforge.model.llama import Llama
from lmforge.model.lora import (
    apply_lora,
    checkpoint_weights,
    load_checkpoint_weights,
    lora_modules,
    lora_settings,
    trainable_parameters,
)
from lmforge.model.loss import IGNORE_INDEX
from lmforge.model.saved import WEIGHTS, save_weights
from lmforge.shards.loader import mixture_mean
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs
from lmforge.train.compiler import resolve_compile
from lmforge.train.distributed import DistEnv, all_gather_objects, rank_batches
from lmforge.train.fsdp import (
    AsyncShardSaver,
    build_sharded,
    ensure_process_group,
    is_sharded,
    load_sharded,
    shard_model,
    unsharded_copy,
)
from lmforge.train.optim import build_optimizer, set_learning_rates
from lmforge.train.precision import Precision, resolve_precision
from lmforge.train.probe import probe_micro_batch
from lmforge.train.replay import ReplayLoader
from lmforge.train.telemetry import NullRun, format_duration, memory_mb, open_run, peak_flops
from lmforge.train.warm_start import (
    adopt_architecture,
    check_model_dir,
    ensure_outside,
    warm_start,
    weights_sha256,
)


@dataclass
class TrainData:
    """What the loop reads: the train/val shard sets and the loader functions for them."""

    train: Any  # lmforge.shards.loader.ShardSet (or anything with the same attributes)
    val: Any
    make_loader: Callable[..., Any]  # WindowLoader(shards, seq_len, batch_size, seed, rank, ws)
    eval_batches: Callable[..., Iterable[dict]]  # eval_batches(shards, seq_len, bs, max_batches)
    # Fine-tuning: pretraining shards whose windows fill ``replay_share`` of the rows.
    replay: Any = None
    replay_share: float = 0.0
    # What a micro-batch's loss is and how val is scored; None = next-token prediction.
    objective: Any = None


class NextToken:
    """The objective of pretraining and SFT: mean cross-entropy over the target tokens.

    An objective tells the loop what one micro-batch weighs (``count``: its share of the
    step is count / the step's total), its mean loss, and the val figures. ``stats``
    names the extra per-step sums ``loss`` returns (none here; DPO has its own).
    """

    # The first counts the items the others are sums over (means are sum / count).
    stats: tuple[str, ...] = ()

    def make_loader(self, data: TrainData, seq_len: int, batch_size: int, seed: int,
                    env: DistEnv, doc_mask: bool, stratified: bool = False) -> Any:
        """This rank's training batches (``stratified``: see ``train.batch_sampling``)."""
        return open_loader(data, seq_len, batch_size, seed, env, doc_mask, stratified)

    def count(self, batch: list[torch.Tensor]) -> int:
        """Target tokens in the micro-batch."""
        return int((batch[1] != IGNORE_INDEX).sum())

    def loss(self, model: torch.nn.Module, batch: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss over the batch's targets, per-step stat sums or None)."""
        extra = {"positions": batch[2]} if len(batch) > 2 else {}
        _, loss = model(batch[0], batch[1], **extra)
        return loss, None

    def evaluate(self, model: Llama, data: TrainData, params: Params, precision: Precision,
                 env: DistEnv) -> dict[str, float]:
        """``{"val_loss": mixture-weighted val loss}``."""
        return {"val_loss": evaluate_loss(model, data, params, precision, env)}


def open_shard_data(train_dir: str | Path, val_dir: str | Path) -> TrainData:
    """The real shard sets and loader of ``lmforge.shards.loader``."""
    from lmforge.shards.loader import ShardSet, WindowLoader, eval_batches

    return TrainData(ShardSet(train_dir), ShardSet(val_dir), WindowLoader, eval_batches)


@dataclass
class TrainResult:
    """A finished run: the (unwrapped) model and what it measured."""

    model: Llama
    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    run_id: str | None
    fingerprint: str


@dataclass
class _Interval:
    """Running sums between two log lines."""

    start_time: float = field(default_factory=time.perf_counter)
    start_step: int = 0
    excluded: float = 0.0  # seconds spent in eval / checkpoints, not training
    loss_sum: float = 0.0
    loss_n: int = 0
    stats: dict[str, float] = field(default_factory=dict)  # the objective's step sums


def train(params: Params, data: TrainData, checkpoint_dir: str | Path, tokenizer_sha256: str,
          env: DistEnv, track: bool = True,
          prompts: list[tuple[str, list[int]]] | None = None,
          decode: Callable[[list[int]], str] | None = None,
          log: Callable[[str], None] = print, stage: str = "train") -> TrainResult:
    """Train (or resume) the run ``params`` defines; rank 0 logs and writes checkpoints.

    ``prompts`` are (text, token ids) pairs continued every ``train.sample_every`` steps
    and logged as MLflow text artifacts (``decode`` turns ids back into text). ``stage``
    names the MLflow run's stage (``train`` or ``sft``).
    """
    cfg = params.train
    device = env.device
    checkpoint_dir = Path(checkpoint_dir)
    vocab = int(data.train.vocab_size)
    if int(data.val.vocab_size) != vocab:
        raise InputError(f"train shards have vocab_size {vocab} but val shards "
                         f"{data.val.vocab_size}; rebuild the shards")
    log = log if env.is_main else _silent
    key = f"{section_name(cfg)}.init_from"  # train, sft or dpo: what messages name
    if cfg.init_from:  # the architecture (and vocabulary) of the weights it starts from
        model_cfg, vocab, note = adopt_architecture(params.model, vocab, cfg.init_from, key)
        params = dataclasses.replace(params, model=model_cfg)
        if note:
            log(note)
    mcfg = params.model

    make_reproducible(device)
    precision = resolve_precision(cfg.precision, device)
    if cfg.lora is not None:  # the dtype the frozen base is held in, resolved for the device
        held = resolve_base_dtype(cfg.lora.base_dtype, device, cfg.strategy,
                                  f"{section_name(cfg)}.lora.base_dtype")
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_dtype=held))
        params = dataclasses.replace(params, train=cfg)
    bf16, compile_blocks = precision.name == "bf16", resolve_compile(cfg.compile, device)[0]
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, start_note = build_model(params, vocab, env, bf16, compile_blocks, tokenizer_sha256)
    # After sharding: an optimizer built before would hold the unsharded parameters.
    optimizer = build_optimizer(model, cfg, device, log)
    scaler = precision.grad_scaler()
    micro_batch, accum = cfg.micro_batch_size, cfg.grad_accum_steps
    if cfg.probe_micro_batch:
        micro_batch, accum = probe_micro_batch(model, optimizer, precision, mcfg, cfg, vocab,
                                               device, log)
    objective = data.objective or NextToken()
    # Only when asked: an objective with its own loader (DPO's pairs) has no such option.
    sampling = {"stratified": True} if cfg.batch_sampling == "stratified" else {}
    loader = objective.make_loader(data, mcfg.seq_len, micro_batch, cfg.seed, env,
                                   mcfg.doc_mask, **sampling)
    if cfg.init_from:  # runs prune their own old checkpoints (keep_last)
        ensure_outside(cfg.init_from, checkpoint_dir, "where runs prune their checkpoints", key)
    identity = ckpt.run_identity(mcfg, cfg, env.world_size, data.train.manifest,
                                 data.val.manifest, tokenizer_sha256,
                                 weights_sha256(cfg.init_from, key) if cfg.init_from else None,
                                 replay_manifest=(data.replay.manifest if data.replay is not None
                                                  and data.replay_share > 0 else None),
                                 stage=stage)
    fp = ckpt.fingerprint_of(identity)
    torch.manual_seed(cfg.seed + env.rank)  # per-rank dropout streams

    with contextlib.ExitStack() as held:
        run_dir = _open_run_dir(checkpoint_dir, fp, identity, cfg.max_steps, env, held, log)
        return _train_run(params, data, objective, model, optimizer, precision, scaler,
                          loader, micro_batch, accum, run_dir, fp, start_note, env, track,
                          prompts, decode, log, stage)


def build_model(params: Params, vocab: int, env: DistEnv, bf16: bool, compile_blocks: bool,
                tokenizer_sha256: str) -> tuple[Llama, str | None]:
    """The model a run starts from: initialised (or ``init_from``'s weights), with LoRA
    adapters if asked, sharded under FSDP; and the warm start's log line, if any.

    Under FSDP the model is built on the meta device and filled shard by shard, reading
    only this rank's rows of ``init_from`` when it is a model directory; from a
    ``step-*.pt`` it is loaded whole on each rank first, then sharded.
    """
    cfg, mcfg = params.train, params.model
    source = Path(cfg.init_from) if cfg.init_from else None
    key = f"{section_name(cfg)}.init_from"
    if cfg.strategy == "fsdp" and (source is None or source.is_dir()):
        ensure_process_group(env)  # FSDP and DCP need one, even in a single process
        note = (check_model_dir(mcfg, vocab, source, tokenizer_sha256, key)
                if source is not None else None)
        model = build_sharded(mcfg, vocab, env, bf16, compile_blocks,
                              weights=source / WEIGHTS if source is not None else None,
                              lora=cfg.lora)
    else:
        model = Llama(mcfg, vocab).to(env.device)
        # Starting weights before adapters wrap the layers (a resumed run overwrites both).
        note = (warm_start(model, source, tokenizer_sha256, key) if source is not None
                else None)
        if cfg.lora is not None:
            lora = cfg.lora
            apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
            # After wrapping, so adapters stay fp32; resolved here too for direct callers.
            hold_frozen_in(model, resolve_base_dtype(lora.base_dtype, env.device, cfg.strategy,
                                                     f"{section_name(cfg)}.lora.base_dtype"))
        if cfg.strategy == "fsdp":  # from a checkpoint file: whole, then sharded
            ensure_process_group(env)
            shard_model(model, env, bf16, compile_blocks)
    model.label_smoothing, model.z_loss = cfg.label_smoothing, cfg.z_loss
    model.fused_loss = cfg.fused_loss
    model.activation_checkpointing = cfg.activation_checkpointing
    return model, note


def open_loader(data: TrainData, seq_len: int, batch_size: int, seed: int, env: DistEnv,
                doc_mask: bool, stratified: bool = False) -> Any:
    """This rank's training batches: the train shards, or with replay both shard sets.

    ``stratified``: every batch's domain shares follow the mixture (each set's own, with
    replay: its rows are drawn one at a time in stratified order)."""
    options = {"return_doc_info": True} if doc_mask else {}
    if stratified:
        options["stratified"] = True
    if data.replay is None or data.replay_share == 0:
        return data.make_loader(data.train, seq_len, batch_size, seed, rank=env.rank,
                                world_size=env.world_size, **options)
    rows = [data.make_loader(shards, seq_len, 1, seed + i, rank=env.rank,
                             world_size=env.world_size, **options)
            for i, shards in enumerate((data.train, data.replay))]
    return ReplayLoader(*rows, data.replay_share, batch_size)


def _open_run_dir(root: Path, fp: str, identity: dict[str, Any], max_steps: int,
                  env: DistEnv, held: contextlib.ExitStack,
                  log: Callable[[str], None]) -> Path:
    """Rank 0 creates (or reopens) the run's own directory and holds its lock."""
    directory = runs.run_dir(root, fp)
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        runs.adopt_legacy(root, log)
        directory.mkdir(parents=True, exist_ok=True)
        held.enter_context(runs.locked(directory))
        runs.start_run_dir(root, fp, identity, max_steps,
                           {"dvc_exp_name": os.environ.get("DVC_EXP_NAME") or None})
    return directory


def _train_run(params: Params, data: TrainData, objective: Any, model: Llama,
               optimizer: torch.optim.Optimizer, precision: Precision,
               scaler: torch.amp.GradScaler, loader: Any, micro_batch: int, accum: int,
               checkpoint_dir: Path, fp: str, start_note: str | None, env: DistEnv,
               track: bool, prompts: list[tuple[str, list[int]]] | None,
               decode: Callable[[list[int]], str] | None,
               log: Callable[[str], None], stage: str) -> TrainResult:
    """Resume or start run ``fp`` in its own ``checkpoint_dir`` and train it to the end."""
    cfg, mcfg = params.train, params.model
    device = env.device
    state = _load_resume_state(checkpoint_dir, fp, env, log)
    progress = _Progress()
    if state is not None:
        progress = _restore(state, model, optimizer, scaler, loader, env, objective,
                            cfg.seed)
        log(f"train: resuming from {state['path']} at step {progress.step}/{cfg.max_steps}")
        del state
    elif start_note:
        log(start_note)
    step, tokens_seen, skipped, history = (progress.step, progress.tokens_seen,
                                           progress.skipped, progress.history)

    ddp = None
    step_model: torch.nn.Module = model
    sharded = is_sharded(model)  # FSDP2: each block gathers its weights as it runs
    saver = AsyncShardSaver() if sharded else None
    if env.distributed and not sharded:
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                      else None)
        step_model = ddp
    eager_model = step_model
    compiled, how = resolve_compile(cfg.compile, device)
    if sharded:
        how += " per block" if compiled else ""
        compiled = False  # the blocks were compiled before sharding, if at all
    elif compiled:
        step_model = torch.compile(step_model)
    # Inductor compiles lazily, so a broken toolchain shows at the first step: keep what
    # it changes, so compile: auto can retry that step eager from the same point.
    fallback = ((copy.deepcopy(loader.state_dict()), ckpt.capture_rng(device))
                if compiled else None)

    run = open_run(params, progress.run_id, stage) if (track and env.is_main) else NullRun()
    tokens_per_step = micro_batch * mcfg.seq_len * accum * env.world_size
    flops_per_step = model.flops_per_token() * tokens_per_step
    peak = peak_flops(device, precision.name)
    if env.is_main:
        trained = trainable_parameters(model)
        log(f"train: {model.num_params():,} parameters"
            + (f" ({trained:,} trained: LoRA)" if cfg.lora is not None else "")
            + f", {tokens_per_step:,} tokens/step, "
            f"{precision.name} on {device}"
            + (f" x{env.world_size} ({'fsdp' if sharded else 'ddp'})" if env.distributed else "")
            + f", {how}")
    t0 = time.perf_counter()
    interval = _Interval(start_step=step, loss_sum=progress.loss_sum, loss_n=progress.loss_n,
                         stats=dict(progress.stats))
    bad_streak, overflow_streak = 0, 0
    status = "FAILED"
    try:
        while step < cfg.max_steps:
            rates = set_learning_rates(optimizer, step, cfg)
            try:
                loss_val, grad_norm, stats = _optimizer_step(
                    step_model, ddp, model, optimizer, scaler, precision, loader, accum,
                    cfg.grad_clip, env, objective)
            except TorchDynamoException as e:
                if fallback is None:  # not the first compiled step
                    raise
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                if cfg.compile is True:
                    raise LmforgeError(f"train.compile: true, but torch.compile failed "
                                       f"({reason}); set train.compile to auto or false"
                                       ) from None
                log(f"train: torch.compile failed ({reason}); training eager")
                loader.load_state_dict(fallback[0])
                ckpt.restore_rng(fallback[1], device)
                optimizer.zero_grad(set_to_none=True)
                step_model, fallback = eager_model, None
                continue
            fallback = None
            step += 1
            tokens_seen += tokens_per_step
            overflow_streak = _check_fp16_overflow(loss_val, grad_norm, precision, scaler,
                                                   overflow_streak, step)
            if math.isfinite(loss_val) and math.isfinite(grad_norm):
                bad_streak = 0
                interval.loss_sum += loss_val
                interval.loss_n += 1
                for name, value in stats.items():
                    interval.stats[name] = interval.stats.get(name, 0.0) + value
            elif not (precision.name == "fp16" and math.isfinite(loss_val)):
                # (fp16 overflow in the grads is routine: GradScaler skips and rescales.)
                skipped += 1
                bad_streak += 1
                log(f"train: step {step}: non-finite loss {loss_val} / grad_norm {grad_norm}; "
                    f"update skipped ({bad_streak} in a row)")
                if bad_streak >= cfg.max_bad_steps:
                    if saver is not None:  # every rank is here (the loss is all-reduced)
                        saver.finish()
                    raise LmforgeError(
                        f"train: {bad_streak} consecutive steps with a non-finite loss or "
                        f"gradient (last at step {step}); stopped. Last good checkpoint: "
                        f"{_newest_checkpoint(checkpoint_dir)}. Lower train.max_lr, raise "
                        "train.warmup, or check the data")

            if step % cfg.log_every == 0 or step == cfg.max_steps:
                history[step] = _log_step(step, rates, grad_norm, interval, skipped,
                                          tokens_per_step, flops_per_step, peak, device,
                                          cfg.max_steps, run, log)
            paused = time.perf_counter()
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
                vals = objective.evaluate(model, data, params, precision, env)
                history.setdefault(step, {"step": step}).update(vals)
                run.log_metrics(vals, step)
                log(f"train: step {step}: " + _figures(vals))
            # Samples decode on rank 0 alone, which a sharded model cannot do (its blocks
            # gather their weights from every rank): the final model is sampled instead.
            if env.is_main and cfg.sample_every and step % cfg.sample_every == 0 and not sharded:
                log_samples(model, prompts or [], decode, cfg.seed, step, run)
            if cfg.light_every and step % cfg.light_every == 0:
                # Model-only snapshots, kept in the run's directory and never pruned.
                whole = unsharded_copy(model, env) if sharded else model  # all ranks gather
                if env.is_main:
                    save_weights(whole, checkpoint_dir / "light" / f"step-{step:06d}.safetensors")
            # The last step too: a finished run rerun (its outputs deleted, `dvc repro -f`)
            # rebuilds them from there instead of training again.
            if (step % cfg.ckpt_every == 0 or step == cfg.max_steps) and bad_streak == 0:
                done = _Progress(step, tokens_seen, skipped, history, run.run_id, None,
                                 progress.wall_seconds + time.perf_counter() - t0,
                                 interval.loss_sum, interval.loss_n, dict(interval.stats))
                _save(checkpoint_dir, fp, done, model, optimizer, scaler, loader, env,
                      cfg.keep_last, objective, saver, cfg.init_from)
                if saver is not None and step == cfg.max_steps:
                    saver.finish()  # the last checkpoint is on disk before the outputs
            interval.excluded += time.perf_counter() - paused

        vals = objective.evaluate(model, data, params, precision, env)
        val = vals["val_loss"]
        history.setdefault(step, {"step": step}).update(vals)
        rows = [history[s] for s in sorted(history)]
        metrics = _final_metrics(rows, val, step, tokens_seen, skipped, model, precision, env,
                                 progress, progress.wall_seconds + time.perf_counter() - t0)
        metrics.update({k: v for k, v in vals.items() if k != "val_loss"})
        run.log_metrics({"final_val_loss": val, "skipped_steps": skipped}, step)
        log(f"train: done, step {step}, " + _figures(vals))
        status = "FINISHED"
        # After FSDP, rank 0 hands on the whole model (export, evaluation are unchanged).
        final = unsharded_copy(model, env) if sharded else model
        return TrainResult(final, metrics, rows, run.run_id, fp)
    except BaseException as e:
        status = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"
        if saver is not None:  # the checkpoint being written is kept, whatever stopped us
            _commit_on_the_way_out(saver, log)
        raise
    finally:
        run.finish(status)
        if env.is_main:
            runs.update_run(checkpoint_dir, status=status.lower(), mlflow_run_id=run.run_id)


def _commit_on_the_way_out(saver: AsyncShardSaver, log: Callable[[str], None]) -> None:
    """Finish and commit the sharded checkpoint still being written when a run stops
    early, without collectives (the other ranks may not be stopping the same way); a
    failure here is reported and the run's own error goes on."""
    try:
        saver.finish(collective=False)
    except Exception as e:  # the run's own error is the one to raise
        log(f"train: the checkpoint being written could not be committed ({e})")


def _newest_checkpoint(directory: Path) -> str:
    """The newest committed checkpoint of the run (a file on disk), or ``none``."""
    found = ckpt.list_checkpoints(directory)
    return str(found[-1]) if found else "none"


def _silent(_: str) -> None:
    pass


def _figures(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in values.items())


def make_reproducible(device: torch.device) -> None:
    """On CPU, deterministic kernels: a resumed run ends bit-identical to an unbroken one.

    Without it, parallel kernels that accumulate with atomics (Inductor's embedding
    backward, among others) sum in thread order, and two runs drift apart from the first
    step. Measured on the bench model: no slower (bench/RESULTS.md). CUDA keeps its fast
    non-deterministic kernels (flash attention's backward has no deterministic twin).
    """
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)


# GradScaler halves its scale at each overflow; this many in a row (65536 -> 2^-14) means
# the gradients overflow fp16 whatever the scale, and training has stopped updating.
FP16_OVERFLOW_LIMIT = 30


def _check_fp16_overflow(loss: float, grad_norm: float, precision: Precision,
                         scaler: torch.amp.GradScaler, streak: int, step: int) -> int:
    """Count consecutive fp16 overflow skips; stop the run when they never end."""
    if precision.name != "fp16" or not math.isfinite(loss) or math.isfinite(grad_norm):
        return 0
    streak += 1
    if streak >= FP16_OVERFLOW_LIMIT:
        raise LmforgeError(
            f"train: fp16 gradients overflowed {streak} steps in a row (step {step}, loss "
            f"scale now {scaler.get_scale():.3g}); the updates have stopped. Use "
            "train.precision: bf16 or fp32, or lower train.max_lr")
    return streak


@dataclass
class _Progress:
    """How far a run got: what a checkpoint restores besides model/optimizer/loader/RNG."""

    step: int = 0
    tokens_seen: int = 0
    skipped: int = 0
    history: dict[int, dict] = field(default_factory=dict)
    run_id: str | None = None
    resumed_from: str | None = None
    wall_seconds: float = 0.0  # training time of the sessions so far
    loss_sum: float = 0.0  # the open log interval, so resumed logs match uninterrupted ones
    loss_n: int = 0
    stats: dict[str, float] = field(default_factory=dict)


def _restore(state: dict[str, Any], model: Llama, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, loader: Any, env: DistEnv,
             objective: Any = None, seed: int = 0) -> _Progress:
    """Load a checkpoint into the live objects; return the run's progress.

    ``seed``: the run's ``train.seed``, from which a rank the checkpoint did not have
    draws its RNG stream (see ``_rank_state``)."""
    if state.get("sharded"):  # FSDP: every rank reads its shards from the DCP directory
        load_sharded(Path(state["path"]).parent / state["sharded"], model, optimizer)
    else:
        load_checkpoint_weights(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    p = state["progress"]
    mine = _rank_state(state["ranks"], env.rank, env.world_size, seed, p["step"])
    loader.load_state_dict(mine["loader"])
    if mine.get("objective") is not None and objective is not None:
        objective.load_state_dict(mine["objective"])
    elif mine.get("objective_parts") and hasattr(objective, "merge_state_dicts"):
        objective.load_state_dict(objective.merge_state_dicts(mine["objective_parts"]))
    _apply_rng(mine["rng"], env.device)
    return _Progress(p["step"], p["tokens_seen"], p["skipped"],
                     {row["step"]: row for row in p["history"]}, p["run_id"],
                     Path(state["path"]).name, p["wall_seconds"], p["loss_sum"], p["loss_n"],
                     p.get("stats", {}))


def _rank_state(saved: list[dict[str, Any]], rank: int, world_size: int, seed: int,
                step: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world_size`` restores from a checkpoint's per-rank states.

    The same world size: its own. Another (FSDP resharding): the loader position, which
    counts windows over all ranks, is the same on every rank; a rank the checkpoint had
    keeps its RNG stream, and a new one gets a fresh stream of its own, ``{"seed": n}``
    with ``n`` from the run's seed, the rank and the step: reusing a saved stream
    (``saved[rank % len(saved)]``) would give ranks 0 and 1 of a 1 -> 2 resume the same
    dropout masks. Deterministic, so resuming the same checkpoint twice agrees.
    """
    if len(saved) == world_size:
        return saved[rank]
    rng = (saved[rank]["rng"] if rank < len(saved)
           else {"seed": _fresh_rng_seed(seed, rank, step)})
    # Per-rank objective states (DPO's reference cache) are no rank's own any more: every
    # rank gets all of them, for the objective to merge.
    parts = [s["objective"] for s in saved if s.get("objective") is not None]
    return {"loader": saved[0]["loader"], "rng": rng, "objective_parts": parts}


def _fresh_rng_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for ``(seed, rank, step)``; hashed, so it is none of the
    ``seed + rank`` seeds a fresh run starts its ranks with."""
    digest = hashlib.sha256(f"lmforge-rank-rng/{seed}/{rank}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _apply_rng(rng: dict[str, Any], device: torch.device) -> None:
    """Restore a saved RNG state, or seed every generator from a fresh ``{"seed": n}``."""
    if "seed" not in rng:
        ckpt.restore_rng(rng, device)
        return
    n = int(rng["seed"])
    random.seed(n)
    np.random.seed(n % 2**32)
    torch.manual_seed(n)  # the CPU and every CUDA generator


def _final_metrics(rows: list[dict], val: float, step: int, tokens: int, skipped: int,
                   model: Llama, precision: Precision, env: DistEnv, progress: _Progress,
                   wall_seconds: float) -> dict[str, Any]:
    """metrics/train.json."""
    train_losses = [r["loss"] for r in rows if r.get("loss") is not None]
    speeds = sorted(r["tokens_per_sec"] for r in rows if r.get("tokens_per_sec"))
    return {
        "train_loss": train_losses[-1] if train_losses else None,
        "val_loss": val,
        "steps": step,
        "tokens": tokens,
        # The median log interval: robust to the first (warm-up) one and to load spikes.
        "tokens_per_sec": speeds[len(speeds) // 2] if speeds else None,
        "params": model.num_params(),
        "wall_seconds": round(wall_seconds, 3),
        "resumed_from": progress.resumed_from,
        "skipped_steps": skipped,
        "precision": precision.name,
        "world_size": env.world_size,
    }


def _optimizer_step(step_model: torch.nn.Module, ddp: DistributedDataParallel | None,
                    model: Llama, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, precision: Precision, loader: Any,
                    accum: int, clip: float, env: DistEnv, objective: Any = None
                    ) -> tuple[float, float, dict[str, float]]:
    """One optimizer step over ``accum`` micro-batches -> (mean loss, grad norm pre-clip,
    the objective's stat sums over the step's micro-batches and ranks).

    The loss is the mean over every target token of the step (all micro-batches, all
    ranks): each micro-batch weighs by its share of those tokens, so one with few targets
    (a short prompt-masked fine-tuning example) counts little and one with none counts
    zero, never NaN. With equal counts, as in pretraining, that is the plain mean of the
    micro-batch losses, computed as ``loss / accum`` exactly as before.

    A non-finite loss or grad norm skips the update. That test needs one host sync per
    optimizer step; loss and grad norm travel in it, so logging costs nothing more.
    """
    # (inputs, targets) or, with document masking, (inputs, targets, positions).
    objective = objective or NextToken()
    batches = [[torch.as_tensor(t) for t in loader.next_batch()] for _ in range(accum)]
    counts = [objective.count(b) for b in batches]
    # Pretraining windows (no loss mask) are all targets on every rank: the step's count
    # is known without asking the other ranks.
    masked = getattr(getattr(loader, "shards", None), "has_loss_mask", True)
    total = _step_target_count(sum(counts), env) if masked else sum(counts) * env.world_size
    loss_sum = torch.zeros((), device=env.device)
    stat_sums = torch.zeros(len(objective.stats), device=env.device)
    for micro, (host, count) in enumerate(zip(batches, counts, strict=True)):
        batch = [t.to(env.device, non_blocking=True) for t in host]
        # Gradients are all-reduced only on the last micro-batch.
        sync = (ddp.no_sync() if ddp is not None and micro < accum - 1
                else contextlib.nullcontext())
        with sync:
            with precision.autocast():
                loss, stats = objective.loss(step_model, batch)
            if stats is not None:
                stat_sums += stats.detach().float()
            if count:
                # DDP averages over ranks, hence the world size in the share.
                weighted = loss / (total / (count * env.world_size))
                loss_sum += weighted.detach().float()
            else:  # its loss is NaN (no targets), its gradient zero: weigh it zero
                weighted = loss * 0.0
            scaler.scale(weighted).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor of partial norms; the global one
        norm = norm.full_tensor()
    stats = torch.stack([loss_sum, norm.float()])
    if env.distributed:
        dist.all_reduce(stats, op=dist.ReduceOp.AVG if env.device.type == "cuda"
                        else dist.ReduceOp.SUM)
        if env.device.type != "cuda":  # gloo has no AVG
            stats /= env.world_size
        if len(objective.stats):
            dist.all_reduce(stat_sums)  # sums over ranks
    loss_val, norm_val = stats.tolist()
    if math.isfinite(loss_val) and (math.isfinite(norm_val) or scaler.is_enabled()):
        scaler.step(optimizer)  # with fp16, skips by itself when the grads overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_val, norm_val, dict(zip(objective.stats, stat_sums.tolist(), strict=True))


def _step_target_count(local: int, env: DistEnv) -> int:
    """Target tokens of this optimizer step over all ranks (at least 1)."""
    if env.distributed:
        t = torch.tensor([local], dtype=torch.int64, device=env.device)
        dist.all_reduce(t)
        local = int(t.item())
    return max(local, 1)


@torch.no_grad()
def evaluate_loss(model: Llama, data: TrainData, params: Params, precision: Precision,
                  env: DistEnv) -> float:
    """Val loss over ``train.eval_batches`` deterministic batches, mixture-weighted.

    Each domain's mean loss is weighted by its share of the train split's tokens, as the
    evaluate stage's headline is: the figure compares with the training loss, whatever
    share of the val split each domain happens to have.
    """
    model.eval()
    names = list(data.val.domain_names)
    sums = torch.zeros(2, len(names), dtype=torch.float64, device=env.device)
    doc_info = {"return_doc_info": True} if params.model.doc_mask else {}
    batches = data.eval_batches(data.val, params.model.seq_len, params.train.micro_batch_size,
                                max_batches=params.train.eval_batches, **doc_info)
    # Ranks split the batches, then sum; a sharded model's ranks run in step.
    for batch, counted in rank_batches(batches, env, lockstep=is_sharded(model)):
        inputs = torch.as_tensor(batch["input"]).to(env.device)
        targets = torch.as_tensor(batch["target"]).to(env.device)
        domains = torch.as_tensor(batch["domain"]).to(env.device).flatten()
        positions = batch.get("positions")
        with precision.autocast():
            logits = model(inputs, positions=None if positions is None
                           else torch.as_tensor(positions).to(env.device))
        # Plain cross-entropy, so val loss stays comparable when label smoothing is on.
        nats = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="none")
        keep = (targets.flatten() != IGNORE_INDEX) & counted
        sums[0].index_add_(0, domains[keep], nats[keep].double())
        sums[1].index_add_(0, domains[keep], torch.ones_like(nats[keep], dtype=torch.float64))
    if env.distributed:
        dist.all_reduce(sums)
    model.train()
    losses = {d: n / t for d, n, t in zip(names, *sums.tolist(), strict=True) if t}
    shares = data.train.domain_shares()
    return mixture_mean(losses, {d: w["tokens"] for d, w in shares.items()})


def _log_step(step: int, rates: dict[str, float], grad_norm: float, interval: _Interval, skipped: int,
              tokens_per_step: int, flops_per_step: float, peak: float | None,
              device: torch.device, max_steps: int, run: Any,
              log: Callable[[str], None]) -> dict[str, Any]:
    """Report the interval since the last log line; return its plots/train.tsv row.

    ``rates``: ``lr`` and, with Muon, ``lr_muon`` (each group's current rate)."""
    now = time.perf_counter()
    steps = step - interval.start_step
    seconds = max(now - interval.start_time - interval.excluded, 1e-9)
    loss = interval.loss_sum / interval.loss_n if interval.loss_n else float("nan")
    tps = steps * tokens_per_step / seconds
    lr = rates["lr"]
    metrics = {"loss": loss, **rates, "grad_norm": grad_norm, "tokens_per_sec": tps,
               "skipped_steps": skipped, "memory_mb": memory_mb(device),
               "tflops": steps * flops_per_step / seconds / 1e12}
    averaged = _stat_means(interval.stats)
    metrics.update(averaged)
    if peak:
        metrics["mfu"] = metrics["tflops"] * 1e12 / peak
    run.log_metrics(metrics, step)
    eta = (max_steps - step) * seconds / max(steps, 1)
    log(f"step {step:>6}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
        f"grad_norm {grad_norm:.3f} | {tps:,.0f} tok/s | eta {format_duration(eta)}"
        + "".join(f" | {k} {v:.3f}" for k, v in averaged.items()))
    interval.start_time, interval.start_step, interval.excluded = now, step, 0.0
    interval.loss_sum, interval.loss_n, interval.stats = 0.0, 0, {}
    return {"step": step, "loss": loss, **rates, "grad_norm": grad_norm,
            "tokens_per_sec": tps, **averaged}


def _stat_means(sums: dict[str, float]) -> dict[str, float]:
    """An objective's interval sums as means over the items the first stat counts.

    Objectives return sums (e.g. ``pairs``, then per-pair figures summed), so a mean
    over micro-batches, ranks and steps weighs every item once.
    """
    if not sums:
        return {}
    names = list(sums)
    n = sums[names[0]]
    return {name: sums[name] / n if n else float("nan") for name in names[1:]}


def log_samples(model: Llama, prompts: list[tuple[str, list[int]]],
                decode: Callable[[list[int]], str] | None, seed: int, step: int,
                run: Any, max_new_tokens: int = 64) -> str | None:
    """Continue each fixed prompt; attach them as ``samples/step-NNNNNN.txt``; return the text.

    Each prompt gets its own generator seeded with ``seed``, so a prompt's samples differ
    between steps only because the weights did, and the training RNG is untouched.
    """
    if not prompts or decode is None:
        return None
    parts = []
    for text, ids in prompts:
        gen = torch.Generator().manual_seed(seed)
        out = list(generate(model, ids, max_new_tokens, temperature=0.8, top_k=50,
                            generator=gen))
        parts.append(f"### {text or '(unconditional)'}\n{text}{decode(out)}\n")
    body = f"step {step}\n\n" + "\n".join(parts)
    run.log_text(body, f"samples/step-{step:06d}.txt")
    return body


def _load_resume_state(directory: Path, fp: str, env: DistEnv,
                       log: Callable[[str], None]) -> dict[str, Any] | None:
    """Rank 0 picks the checkpoint (and cleans up); every rank then reads that file."""
    chosen: list[Any] = [None]
    found = None
    if env.is_main:
        found = ckpt.load_resumable(directory, fp, log)
        chosen[0] = str(found[1]) if found else None
    if env.distributed:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    state = found[0] if found else ckpt.read_checkpoint(Path(chosen[0]))
    if len(state["ranks"]) != env.world_size and state.get("sharded"):
        log(f"train: {chosen[0]} was saved by {_processes(len(state['ranks']))}, this run has "
            f"{env.world_size}: DCP reshards the weights and optimizer state, and the loader "
            "continues at the same window")
    elif len(state["ranks"]) != env.world_size:
        raise LmforgeError(f"{chosen[0]}: saved by {_processes(len(state['ranks']))}, "
                           f"this run has {env.world_size}")
    state["path"] = chosen[0]
    return state


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _save(directory: Path, fp: str, progress: _Progress, model: Llama,
          optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, loader: Any,
          env: DistEnv, keep_last: int, objective: Any = None,
          saver: AsyncShardSaver | None = None, init_from: str | None = None) -> None:
    """Gather every rank's loader, RNG and objective state; rank 0 writes the checkpoint.

    With FSDP (``saver``) every rank's shards are written in the background and the
    checkpoint is committed at the next save (or ``saver.finish()``). A LoRA run's
    checkpoint holds its adapters, not another copy of the base (``init_from``)."""
    mine = {"loader": loader.state_dict(), "rng": ckpt.capture_rng(env.device)}
    if hasattr(objective, "state_dict"):  # e.g. DPO's reference cache, per rank
        mine["objective"] = objective.state_dict()
    ranks = all_gather_objects(mine, env)
    sharded = ckpt.sharded_path(directory, progress.step) if saver is not None else None
    if not env.is_main:
        if saver is not None and sharded is not None:  # this rank's shards, in the background
            saver.save(sharded, model, optimizer, None)
        return
    p = dataclasses.asdict(progress)
    p["history"] = [progress.history[s] for s in sorted(progress.history)]
    weights = ({"model": {}, "optimizer": {}, "sharded": sharded.name} if sharded else
               {"model": checkpoint_weights(model), "optimizer": optimizer.state_dict()})
    if lora_modules(model) and not sharded:  # adapters only: name the base they adapt
        weights.update(lora=lora_settings(model), base=init_from,
                       base_dtype=frozen_dtype(model))
    state = {
        "format": ckpt.FORMAT, "fingerprint": fp, "step": progress.step, **weights,
        "scaler": scaler.state_dict(), "ranks": ranks, "progress": p,
        # Enough to rebuild the model from this file alone (`lmforge generate --model`).
        "model_config": dataclasses.asdict(model.config),
        "vocab_size": model.vocab_size,
    }

    def commit() -> None:  # the .pt is the commit point: written after the shards
        path = ckpt.save_checkpoint(directory, progress.step, state, keep_last)
        runs.update_run(directory, last_step=progress.step, last_checkpoint=path.name)

    if saver is not None and sharded is not None:
        saver.save(sharded, model, optimizer, commit)  # committed at the next save or finish
    else:
        commit()
