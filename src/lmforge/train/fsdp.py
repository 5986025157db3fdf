"""FSDP2 (``train.strategy: fsdp``): shard the model and its optimizer state over ranks,
and checkpoint the shards with ``torch.distributed.checkpoint`` (DCP).

torchtitan's order (models/llama3/infra/parallelize.py): activation checkpointing, then
compile (per block over several ranks; the whole forward on one), then ``fully_shard`` on
each block and finally on the root, and the optimizer built only after sharding (one
built before would hold the unsharded parameters and train nothing). On GPUs with bf16
the parameters are gathered in bf16 and gradients reduced in fp32
(``MixedPrecisionPolicy``); the sharded master weights and the optimizer state stay fp32.
On CPU (gloo) everything is fp32, which is what the tests run.

A sharded checkpoint is a DCP directory, ``step-NNNNNN.dcp/``: each rank writes its own
shards (``__<rank>_0.distcp``) and rank 0 the metadata. DCP can load it into another
world size; the model's full weights are gathered only for export.

FSDP and DCP are imported where they are used: every training and evaluation process
imports this module, and ``torch.distributed.checkpoint`` alone takes 0.6 s to import.
"""

from __future__ import annotations

import contextlib
import copy
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from lmforge.config import LoraConfig, ModelConfig
from lmforge.model.compiling import before_compile
from lmforge.model.llama import Llama, init_parameter, rope_tables_for
from lmforge.model.lora import apply_lora, lora_modules, lora_settings
from lmforge.train.distributed import DistEnv


def ensure_process_group(env: DistEnv) -> None:
    """A one-process group when there is no torchrun: FSDP and DCP need one, and a run
    then saves the same sharded checkpoints at any world size, 1 included."""
    if not dist.is_initialized():
        backend = "nccl" if env.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shard_model(model: Llama, env: DistEnv, bf16: bool, compile_blocks: bool = False) -> Llama:
    """``fully_shard`` each block, then the root, over all ranks (in place).

    Each block is its own FSDP unit only with more than one rank, where gathering block
    by block bounds memory and overlaps the collectives with compute; a block frees its
    gathered weights after its forward (``reshard_after_forward``) except the last,
    whose backward comes next (torchtitan's default). On one rank there is nothing to
    overlap and the gathered copy is the whole weight anyway, while each unit costs
    host time in its hooks every step (on an H200, 12 units left the GPU idle 21 of
    66 ms a step, issue 44): there the root is the only unit.

    ``compile_blocks`` compiles as much as the units allow (:func:`compile_sharded`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 and env.device.type == "cuda" else MixedPrecisionPolicy())
    if compile_blocks:
        compile_sharded(model, whole=env.world_size == 1)
    last = len(model.layers) - 1
    for i, block in enumerate(model.layers):
        if env.world_size > 1:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < last)
    # The root holds the embeddings, the final norm and the head (tied or not).
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def compiled_scope(world_size: int) -> str:
    """What :func:`shard_model` compiles at ``world_size``, as a run's first line says it."""
    return "whole forward" if world_size == 1 else "per block"


def compile_sharded(model: Llama, whole: bool) -> None:
    """Compile what runs between FSDP's hooks, before sharding.

    ``whole`` (the root the only unit, on one rank): the root's forward, all of it, as
    the plain step compiles the model. FSDP's hooks run around it (gather before, the
    reduce-scatter after backward), so Dynamo never traces them and the step is one
    graph each way. Compiled block by block instead, its 12 graphs and their guards cost
    the host more than the GPU's whole step at GPT-2 small's size on an H200 (44 ms a
    step against 35 for the plain step, GPU busy 32 ms in both; issue 44).

    Otherwise each block, and ``Llama.output`` (final norm, head, loss), which would
    otherwise run eager in the root's forward: the plain loss then fuses as in the
    compiled plain step.
    """
    before_compile()
    if whole:
        model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
        return
    model.output = torch.compile(model.output)  # type: ignore[method-assign]
    for block in model.layers:
        block.compile()


def build_sharded(cfg: ModelConfig, vocab_size: int, env: DistEnv, bf16: bool,
                  compile_blocks: bool = False, weights: Path | None = None,
                  lora: LoraConfig | None = None, keep_rng: bool = True) -> Llama:
    """The model as the eager path makes it under the current seed (``Llama(cfg,
    vocab_size)``, then ``weights`` copied in, then ``lora`` adapters applied), but built
    on the meta device, sharded, and filled shard by shard: no rank ever holds more than
    one whole parameter (the embedding, at most).

    Bit-identical to the eager model: first every layer's own constructor-time init is
    replayed on a throwaway copy, one layer at a time (its random draws put the generator
    where ``Llama.reset_parameters`` starts), then each parameter's full value is drawn
    as ``reset_parameters`` draws it and this rank keeps its dim-0 chunk, as FSDP2
    shards it (``torch.chunk``). With ``weights`` (a safetensors file) the draws are
    still made, so the adapters' draws that follow are the eager path's, but the chunk
    kept is read from the file: only this rank's rows are read. ``keep_rng=False`` (a
    frozen model from ``weights``, such as DPO's reference) skips those draws: nothing
    random follows, and on a large model they are most of the build's time.
    """
    replay = keep_rng or weights is None
    with torch.device("meta"):
        model = Llama(cfg, vocab_size)
    for module in model.modules() if replay else ():  # registration = construction order
        own = list(module.parameters(recurse=False))
        if module is not model and own and hasattr(module, "reset_parameters"):
            scratch = copy.deepcopy(module).to_empty(device="cpu")
            scratch.reset_parameters()
    if lora is not None:  # on meta: its draws are made below, in the eager order
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
    adapters = lora_modules(model)
    shard_model(model, env, bf16, compile_blocks)
    model.to_empty(device=env.device)
    with contextlib.ExitStack() as stack:
        source = (stack.enter_context(safe_open(str(weights), framework="pt"))
                  if weights is not None else None)
        for name, p in model.named_parameters():
            if name.endswith((".lora_a", ".lora_b")):
                continue
            plain = name.replace(".base.", ".")  # a wrapped layer's weight: its file name
            if replay:
                full = torch.empty(p.shape)
                init_parameter(plain, full, cfg.n_layer, cfg.zero_init_proj)
            if source is None:
                _fill_chunk(p, env, lambda lo, hi, full=full: full[lo:hi])
            else:
                _fill_chunk(p, env, lambda lo, hi, key=plain: source.get_slice(key)[lo:hi])
    for layer in adapters.values():  # as LoRALinear.__init__ draws them, in apply order
        a = torch.empty(layer.lora_a.shape)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        _fill_chunk(layer.lora_a, env, lambda lo, hi, a=a: a[lo:hi])
        _fill_chunk(layer.lora_b, env, lambda lo, hi, b=layer.lora_b: torch.zeros(
            hi - lo, *b.shape[1:]))
    # Buffers are derived from the config: compute them where the model now lives.
    cos, sin = rope_tables_for(cfg)
    model.rope_cos, model.rope_sin = cos.to(env.device), sin.to(env.device)
    return model


def _fill_chunk(p: torch.Tensor, env: DistEnv,
                rows_of: Callable[[int, int], torch.Tensor]) -> None:
    """Copy rows ``[lo, hi)`` of a parameter's full value, this rank's dim-0 chunk as
    FSDP2 shards it (``torch.chunk``: equal chunks, the last short), into ``p``."""
    local = p.to_local() if hasattr(p, "to_local") else p
    if not local.numel():
        return
    rows = -(-p.shape[0] // env.world_size)
    lo = env.rank * rows
    with torch.no_grad():
        local.copy_(rows_of(lo, lo + local.shape[0]))


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model`` was sharded by :func:`shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU of rank 0 (an empty dict elsewhere).

    A collective: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def unsharded_copy(model: Llama, env: DistEnv) -> Llama | None:
    """A plain (unsharded) copy of ``model`` on rank 0, None elsewhere; a collective.

    What the loop hands on after FSDP training: evaluation, samples and export then
    work on an ordinary module, as after DDP. A model with LoRA adapters gets the same
    adapters (merged or saved by the caller, as after DDP).
    """
    state = full_state(model)
    if not env.is_main:
        return None
    with torch.random.fork_rng(devices=[]):  # building the copy leaves the run's RNG as is
        plain = Llama(model.config, model.vocab_size)
        if lora_modules(model):  # the same adapters, so the state's keys and trainability match
            s = lora_settings(model)
            apply_lora(plain, s["rank"], s["alpha"], s["dropout"], s["targets"])
    for attr in ("label_smoothing", "z_loss", "fused_loss", "activation_checkpointing"):
        setattr(plain, attr, getattr(model, attr))
    plain.load_state_dict(state)
    return plain.to(env.device)


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters and of the optimizer state (its shards)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    state = sum(local(v).numel() * v.element_size()
                for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return {"params": int(params), "optimizer": int(state)}


class AsyncShardSaver:
    """Sharded checkpoints written in the background (``dcp.async_save``).

    At a checkpoint step the state is staged (copied off the live tensors) and training
    goes on while a thread writes it; the checkpoint is committed (renamed into place,
    then ``commit`` writes its ``.pt``) at the next checkpoint or at :meth:`finish`, which
    the loop calls at the last step and on every way out of a run that stopped early (an
    error, Ctrl-C). Only a kill before the commit leaves just a hidden temporary: the run
    then resumes from the previous checkpoint. DCP's own collectives run on a separate gloo group, so they
    never interleave with the training step's.
    """

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.pending: tuple[Any, Path, Path, Callable[[], None] | None] | None = None

    def save(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             commit: Callable[[], None] | None) -> None:
        """Commit the previous checkpoint, then start writing this one (every rank)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.finish()
        tmp = path.with_name(f".{path.name}.tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        future = dcp.async_save({"model": model_state, "optimizer": optim_state},
                                checkpoint_id=str(tmp), process_group=self.group)
        self.pending = (future, tmp, path, commit)

    def finish(self, collective: bool = True) -> None:
        """Wait for the checkpoint being written and commit it.

        ``collective`` (the usual way): every rank calls it, and barriers keep every rank
        from going on before rank 0 has committed. A run stopping on an error calls it
        with ``collective=False``: there a rank cannot count on the others reaching a
        barrier (one rank's data read may have failed alone), and need not, since DCP
        gathers every rank's write result before rank 0's save completes: once it has,
        every shard and the metadata are on disk, and rank 0 commits alone.
        """
        if self.pending is None:
            return
        future, tmp, path, commit = self.pending
        self.pending = None
        result = getattr(future, "upload_completion", future)  # AsyncSaveResponse or Future
        result.result()
        if collective:
            dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
            tmp.replace(path)
            if commit is not None:
                commit()
        if collective:
            dist.barrier()


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a DCP checkpoint into the sharded model and optimizer (any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
