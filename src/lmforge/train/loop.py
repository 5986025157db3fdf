"""The training loop: a ``Trainer`` that steps, then logs, evaluates, samples and
checkpoints when each is due; ``train`` builds one for the run ``params`` define.

The parts live beside it: the optimizer step (``step``), exact resume (``resume``),
objectives and data (``objectives``), model building (``build``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lmforge.config import Params, section_name
from lmforge.errors import InputError, LmforgeError
from lmforge.model.frozen import compile_step_model, resolve_base_dtype
from lmforge.model.llama import Llama
from lmforge.model.lora import trainable_parameters
from lmforge.model.saved import save_weights
from lmforge.train import checkpoint as ckpt
from lmforge.train import runs
from lmforge.train.build import build_model
from lmforge.train.compiler import resolve_compile
from lmforge.train.distributed import DistEnv
from lmforge.train.fsdp import AsyncShardSaver, compiled_scope, is_sharded, unsharded_copy
from lmforge.train.loss_choice import describe, fused_loss_for_run
from lmforge.train.objectives import (
    NextToken,
    Objective,
    TrainData,
    evaluate_loss,
    open_loader,
    open_shard_data,
)
from lmforge.train.optim import build_optimizer, set_learning_rates
from lmforge.train.precision import Precision, resolve_precision
from lmforge.train.probe import probe_micro_batch
from lmforge.train.reporting import Interval, final_metrics, log_interval, log_samples
from lmforge.train.resume import Live, Progress, load_resume_state, restore, save
from lmforge.train.step import optimizer_step
from lmforge.train.telemetry import NullRun, open_run, peak_flops
from lmforge.train.warm_start import adopt_architecture, ensure_outside, weights_sha256

# Where they lived before the split; importers may keep using these names from here.
__all__ = ["FP16_OVERFLOW_LIMIT", "NextToken", "Objective", "TrainData", "TrainResult",
           "Trainer", "build_model", "check_fp16_overflow", "evaluate_loss", "log_samples",
           "make_reproducible", "open_loader", "open_shard_data", "train"]


@dataclass
class TrainResult:
    """A finished run: the (unwrapped) model and what it measured."""

    model: Llama
    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    run_id: str | None
    fingerprint: str


@dataclass
class Outputs:
    """Where a run reports: MLflow (``track``), the log, and the fixed-prompt samples."""

    track: bool = True
    prompts: list[tuple[str, list[int]]] | None = None
    decode: Callable[[list[int]], str] | None = None
    log: Callable[[str], None] = print
    stage: str = "train"  # the MLflow run's stage: train, sft or dpo


@dataclass
class Setup:
    """What ``train`` builds before the loop: the live objects and the run's identity."""

    live: Live
    precision: Precision
    micro_batch: int
    accum: int
    run_dir: Path
    fingerprint: str
    start_note: str | None




def train(params: Params, data: TrainData, checkpoint_dir: str | Path, tokenizer_sha256: str,
          env: DistEnv, track: bool = True,
          prompts: list[tuple[str, list[int]]] | None = None,
          decode: Callable[[list[int]], str] | None = None,
          log: Callable[[str], None] = print, stage: str = "train") -> TrainResult:
    """Train (or resume) the run ``params`` defines; rank 0 logs and writes checkpoints.

    ``prompts`` are (text, token ids) pairs continued every ``train.sample_every`` steps
    and logged as MLflow text artifacts (``decode`` turns ids back into text). ``stage``
    names the MLflow run's stage (``train``, ``sft`` or ``dpo``).
    """
    log = log if env.is_main else _silent
    params, vocab = _run_params(params, data, env, log)
    with contextlib.ExitStack() as held:
        setup = _set_up(params, vocab, data, Path(checkpoint_dir), tokenizer_sha256, env,
                        held, log, stage)
        outputs = Outputs(track, prompts, decode, log, stage)
        return Trainer(params, data, setup, env, outputs).train()


def _run_params(params: Params, data: TrainData, env: DistEnv, log: Callable[[str], None]
                ) -> tuple[Params, int]:
    """(the params the run trains with, its vocabulary size): the architecture of the
    weights ``init_from`` names, and LoRA's frozen-base dtype resolved for the device."""
    cfg = params.train
    vocab = int(data.train.vocab_size)
    if int(data.val.vocab_size) != vocab:
        raise InputError(f"train shards have vocab_size {vocab} but val shards "
                         f"{data.val.vocab_size}; rebuild the shards")
    key = f"{section_name(cfg)}.init_from"  # train, sft or dpo: what messages name
    if cfg.init_from:  # the architecture (and vocabulary) of the weights it starts from
        model_cfg, vocab, note = adopt_architecture(params.model, vocab, cfg.init_from, key)
        params = dataclasses.replace(params, model=model_cfg)
        if note:
            log(note)
    if cfg.lora is not None:  # the dtype the frozen base is held in, resolved for the device
        held = resolve_base_dtype(cfg.lora.base_dtype, env.device, cfg.strategy,
                                  f"{section_name(cfg)}.lora.base_dtype")
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_dtype=held))
        params = dataclasses.replace(params, train=cfg)
    return params, vocab


def _set_up(params: Params, vocab: int, data: TrainData, checkpoint_dir: Path,
            tokenizer_sha256: str, env: DistEnv, held: contextlib.ExitStack,
            log: Callable[[str], None], stage: str) -> Setup:
    """Model, optimizer, scaler, loader and objective; the run's fingerprint and its
    directory (rank 0 holds its lock in ``held``)."""
    cfg, mcfg, device = params.train, params.model, env.device
    make_reproducible(device)
    precision = resolve_precision(cfg.precision, device)
    bf16, compile_blocks = precision.name == "bf16", resolve_compile(cfg.compile, device)[0]
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, start_note = build_model(params, vocab, env, bf16, compile_blocks, tokenizer_sha256)
    if data.objective is None:  # the loss of targets (DPO's objective scores the logits)
        # train.fused_loss: auto probes on CUDA; a sharded step compiles its loss too.
        model.fused_loss = fused_loss_for_run(cfg, mcfg, model, precision, env,
                                              compile_blocks,
                                              cfg.micro_batch_size, log)
    # After sharding: an optimizer built before would hold the unsharded parameters.
    optimizer = build_optimizer(model, cfg, device, log, env.distributed)
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
    identity = _run_identity(params, data, checkpoint_dir, tokenizer_sha256, env, stage)
    fp = ckpt.fingerprint_of(identity)
    torch.manual_seed(cfg.seed + env.rank)  # per-rank dropout streams
    run_dir = _open_run_dir(checkpoint_dir, fp, identity, cfg.max_steps, env, held, log)
    return Setup(Live(model, optimizer, scaler, loader, objective), precision, micro_batch,
                 accum, run_dir, fp, start_note)


def _run_identity(params: Params, data: TrainData, checkpoint_dir: Path,
                  tokenizer_sha256: str, env: DistEnv, stage: str) -> dict[str, Any]:
    """What makes a run this run (``ckpt.run_identity``): its fingerprint's contents."""
    cfg = params.train
    key = f"{section_name(cfg)}.init_from"
    if cfg.init_from:  # runs prune their own old checkpoints (keep_last)
        ensure_outside(cfg.init_from, checkpoint_dir, "where runs prune their checkpoints", key)
    replay = (data.replay.manifest if data.replay is not None and data.replay_share > 0
              else None)
    return ckpt.run_identity(params.model, cfg, env.world_size, data.train.manifest,
                             data.val.manifest, tokenizer_sha256,
                             weights_sha256(cfg.init_from, key) if cfg.init_from else None,
                             replay_manifest=replay, stage=stage)


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


def _is_compile_error(error: BaseException) -> bool:
    """Whether ``error`` is torch.compile's (a ``TorchDynamoException``). Only a process
    that compiled has ``torch._dynamo`` loaded; importing it to ask would cost 1.4 s in
    every training process."""
    exc = sys.modules.get("torch._dynamo.exc")
    return exc is not None and isinstance(error, exc.TorchDynamoException)


class Trainer:
    """One run's loop and its state: the step, the streaks the guards count, the models
    it steps (DDP- or compile-wrapped) and the log interval.

    ``train()`` reads top to bottom: one optimizer step, then whatever is due (log, eval,
    samples, light snapshot, checkpoint); the methods below it do one thing each.
    """

    def __init__(self, params: Params, data: TrainData, setup: Setup, env: DistEnv,
                 outputs: Outputs) -> None:
        self.params, self.cfg, self.data, self.env = params, params.train, data, env
        self.setup, self.live, self.precision = setup, setup.live, setup.precision
        self.outputs, self.log = outputs, outputs.log
        self.progress = Progress()
        self.step, self.tokens_seen, self.skipped = 0, 0, 0
        self.history: dict[int, dict] = {}
        self.bad_streak, self.overflow_streak = 0, 0
        self.sharded = is_sharded(self.live.model)  # FSDP2: blocks gather weights as they run
        self.saver = AsyncShardSaver() if self.sharded else None
        self.ddp: DistributedDataParallel | None = None
        self.step_model: torch.nn.Module = self.live.model
        self.eager_model: torch.nn.Module = self.live.model
        # Inductor compiles lazily: what the first compiled step changes, to retry it eager.
        self.fallback: tuple[dict, dict] | None = None
        self.run: Any = NullRun()
        self.t0 = time.perf_counter()
        self.interval = Interval()

    def train(self) -> TrainResult:
        """Resume or start the run in its own directory and train it to ``max_steps``."""
        cfg = self.cfg
        self._resume()
        self._wrap_model()
        self._open_tracking()
        status = "FAILED"
        try:
            while self.step < cfg.max_steps:
                rates = set_learning_rates(self.live.optimizer, self.step, cfg)
                figures = self._step()
                if figures is None:  # torch.compile failed: the same step again, eager
                    continue
                self._account(*figures)
                if self._due(cfg.log_every) or self.step == cfg.max_steps:
                    self._log(rates, figures[1])
                paused = time.perf_counter()
                if self._due(cfg.eval_every) and self.step < cfg.max_steps:
                    self._evaluate()
                # Samples decode on rank 0 alone, which a sharded model cannot do (its
                # blocks gather from every rank): the final model is sampled instead.
                if self.env.is_main and self._due(cfg.sample_every) and not self.sharded:
                    self._sample()
                if self._due(cfg.light_every):
                    self._snapshot()
                # The last step too: a finished run rerun (its outputs deleted) rebuilds
                # them from there instead of training again.
                if ((self._due(cfg.ckpt_every) or self.step == cfg.max_steps)
                        and self.bad_streak == 0):
                    self._checkpoint()
                self.interval.excluded += time.perf_counter() - paused
            result = self._finish()
            status = "FINISHED"
            return result
        except BaseException as e:
            status = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"
            if self.saver is not None:  # the checkpoint being written is kept, whatever
                _commit_on_the_way_out(self.saver, self.log)
            raise
        finally:
            self.run.finish(status)
            if self.env.is_main:
                runs.update_run(self.setup.run_dir, status=status.lower(),
                                mlflow_run_id=self.run.run_id)

    def _due(self, every: int) -> bool:
        return bool(every) and self.step % every == 0

    def _resume(self) -> None:
        """Restore the newest checkpoint of this run, if there is one."""
        state = load_resume_state(self.setup.run_dir, self.setup.fingerprint, self.env,
                                  self.log)
        if state is not None:
            self.progress = restore(state, self.live, self.env, self.cfg.seed)
            self.log(f"train: resuming from {state['path']} at step {self.progress.step}/"
                     f"{self.cfg.max_steps}")
            del state
        elif self.setup.start_note:
            self.log(self.setup.start_note)
        p = self.progress
        self.step, self.tokens_seen, self.skipped, self.history = (p.step, p.tokens_seen,
                                                                   p.skipped, p.history)

    def _wrap_model(self) -> None:
        """DDP over the ranks (FSDP shards itself) and torch.compile where asked."""
        model, device = self.live.model, self.env.device
        if self.env.distributed and not self.sharded:
            self.ddp = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
            self.step_model = self.ddp
        self.eager_model = self.step_model
        compiled, self.compiled_how = resolve_compile(self.cfg.compile, device)
        if self.sharded:
            self.compiled_how += f" {compiled_scope(self.env.world_size)}" if compiled else ""
            compiled = False  # the blocks were compiled before sharding, if at all
        elif compiled:
            self.step_model = compile_step_model(self.step_model, model,
                                                 self.precision.autocast_dtype)
        # A broken toolchain shows at the first step: keep what it changes, so compile:
        # auto can retry that step eager from the same point.
        self.fallback = ((copy.deepcopy(self.live.loader.state_dict()),
                          ckpt.capture_rng(device)) if compiled else None)

    def _open_tracking(self) -> None:
        """The MLflow run (rank 0), the step's size in tokens and FLOPs, the first line."""
        cfg, env, model, setup = self.cfg, self.env, self.live.model, self.setup
        if self.outputs.track and env.is_main:
            self.run = open_run(self.params, self.progress.run_id, self.outputs.stage)
        self.tokens_per_step = (setup.micro_batch * self.params.model.seq_len * setup.accum
                                * env.world_size)
        self.flops_per_step = model.flops_per_token() * self.tokens_per_step
        self.peak = peak_flops(env.device, self.precision.name)
        if env.is_main:
            trained = trainable_parameters(model)
            self.log(f"train: {model.num_params():,} parameters"
                     + (f" ({trained:,} trained: LoRA)" if cfg.lora is not None else "")
                     + f", {self.tokens_per_step:,} tokens/step, "
                     f"{self.precision.name} on {env.device}"
                     + (f" x{env.world_size} ({'fsdp' if self.sharded else 'ddp'})"
                        if env.distributed else "")
                     + f", {self.compiled_how}"
                     + (f", {describe(model.fused_loss, cfg.fused_loss)}"
                        if isinstance(self.live.objective, NextToken) else ""))
        self.t0 = time.perf_counter()
        p = self.progress
        self.interval = Interval(start_step=self.step, loss_sum=p.loss_sum, loss_n=p.loss_n,
                                  stats=dict(p.stats))

    def _step(self) -> tuple[float, float, dict[str, float]] | None:
        """One optimizer step -> (loss, grad norm, the objective's stats); None when the
        first compiled step failed to compile and must run again eager."""
        live = self.live
        try:
            figures = optimizer_step(self.step_model, self.ddp, live.model, live.optimizer,
                                     live.scaler, self.precision, live.loader,
                                     self.setup.accum, self.cfg.grad_clip, self.env,
                                     live.objective)
        except Exception as e:
            # Only a compile error, and only at the first compiled step, falls back.
            if self.fallback is None or not _is_compile_error(e):
                raise
            self._fall_back_to_eager(e)
            return None
        self.fallback = None
        return figures

    def _fall_back_to_eager(self, error: Exception) -> None:
        """``compile: auto``: rewind the loader and RNG, and train eager from here."""
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        if self.cfg.compile is True:
            raise LmforgeError(f"train.compile: true, but torch.compile failed ({reason}); "
                               "set train.compile to auto or false") from None
        self.log(f"train: torch.compile failed ({reason}); training eager")
        assert self.fallback is not None
        self.live.loader.load_state_dict(self.fallback[0])
        ckpt.restore_rng(self.fallback[1], self.env.device)
        self.live.optimizer.zero_grad(set_to_none=True)
        self.step_model, self.fallback = self.eager_model, None

    def _account(self, loss: float, grad_norm: float, stats: dict[str, float]) -> None:
        """Count the step; a non-finite one is skipped, and too many in a row stop the run."""
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        self.overflow_streak = check_fp16_overflow(loss, grad_norm, self.precision,
                                                   self.live.scaler, self.overflow_streak,
                                                   self.step)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.bad_streak = 0
            self.interval.loss_sum += loss
            self.interval.loss_n += 1
            for name, value in stats.items():
                self.interval.stats[name] = self.interval.stats.get(name, 0.0) + value
        elif not (self.precision.name == "fp16" and math.isfinite(loss)):
            # (fp16 overflow in the grads is routine: GradScaler skips and rescales.)
            self.skipped += 1
            self.bad_streak += 1
            self.log(f"train: step {self.step}: non-finite loss {loss} / grad_norm "
                     f"{grad_norm}; update skipped ({self.bad_streak} in a row)")
            if self.bad_streak >= self.cfg.max_bad_steps:
                self._stop_on_bad_steps()

    def _stop_on_bad_steps(self) -> None:
        if self.saver is not None:  # every rank is here (the loss is all-reduced)
            self.saver.finish()
        raise LmforgeError(
            f"train: {self.bad_streak} consecutive steps with a non-finite loss or "
            f"gradient (last at step {self.step}); stopped. Last good checkpoint: "
            f"{_newest_checkpoint(self.setup.run_dir)}. Lower train.max_lr, raise "
            "train.warmup, or check the data")

    def _log(self, rates: dict[str, float], grad_norm: float) -> None:
        self.history[self.step] = log_interval(
            self.step, rates, grad_norm, self.interval, self.skipped, self.tokens_per_step,
            self.flops_per_step, self.peak, self.env.device, self.cfg.max_steps, self.run,
            self.log, getattr(self.live.objective, "stat_denominators", None))

    def _evaluate(self) -> None:
        """The val figures in the history, MLflow and the log."""
        vals = self._val_figures()
        self.run.log_metrics(vals, self.step)
        self.log(f"train: step {self.step}: " + _figures(vals))

    def _val_figures(self) -> dict[str, float]:
        """The objective's val figures, kept in the history."""
        vals = self.live.objective.evaluate(self.live.model, self.data, self.params,
                                            self.precision, self.env)
        self.history.setdefault(self.step, {"step": self.step}).update(vals)
        return vals

    def _sample(self) -> None:
        log_samples(self.live.model, self.outputs.prompts or [], self.outputs.decode,
                    self.cfg.seed, self.step, self.run)

    def _snapshot(self) -> None:
        """A model-only snapshot, kept in the run's directory and never pruned."""
        model = self.live.model
        whole = unsharded_copy(model, self.env) if self.sharded else model  # all ranks gather
        if self.env.is_main:
            path = self.setup.run_dir / "light" / f"step-{self.step:06d}.safetensors"
            save_weights(whole, path)

    def _checkpoint(self) -> None:
        interval = self.interval
        done = Progress(self.step, self.tokens_seen, self.skipped, self.history,
                        self.run.run_id, None, self._wall_seconds(), interval.loss_sum,
                        interval.loss_n, dict(interval.stats))
        save(self.setup.run_dir, self.setup.fingerprint, done, self.live, self.env,
             self.cfg.keep_last, self.saver, self.cfg.init_from)
        if self.saver is not None and self.step == self.cfg.max_steps:
            self.saver.finish()  # the last checkpoint is on disk before the outputs

    def _wall_seconds(self) -> float:
        return self.progress.wall_seconds + time.perf_counter() - self.t0

    def _finish(self) -> TrainResult:
        """The final val figures, metrics/train.json's contents, the whole model."""
        vals = self._val_figures()
        val, step = vals["val_loss"], self.step
        rows = [self.history[s] for s in sorted(self.history)]
        metrics = final_metrics(rows, val, step, self.tokens_seen, self.skipped,
                                 self.live.model, self.precision, self.env, self.progress,
                                 self._wall_seconds())
        metrics.update({k: v for k, v in vals.items() if k != "val_loss"})
        self.run.log_metrics({"final_val_loss": val, "skipped_steps": self.skipped}, step)
        self.log(f"train: done, step {step}, " + _figures(vals))
        # After FSDP, rank 0 hands on the whole model (export, evaluation are unchanged).
        final = unsharded_copy(self.live.model, self.env) if self.sharded else self.live.model
        return TrainResult(final, metrics, rows, self.run.run_id, self.setup.fingerprint)


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
        if "torch._inductor.config" in sys.modules:  # compiling: Inductor's copy too
            torch.use_deterministic_algorithms(True, warn_only=True)
        else:
            # That call would import torch._inductor and torch._dynamo (1.4 s) in runs
            # that never compile; before_compile() sets Inductor's copy when one does.
            torch._C._set_deterministic_algorithms(True, warn_only=True)


# GradScaler halves its scale at each overflow; this many in a row (65536 -> 2^-14) means
# the gradients overflow fp16 whatever the scale, and training has stopped updating.
FP16_OVERFLOW_LIMIT = 30


def check_fp16_overflow(loss: float, grad_norm: float, precision: Precision,
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
