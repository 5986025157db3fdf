"""A frozen base held in low precision: what a LoRA run keeps of the model it adapts.

Training keeps every parameter in fp32 (autocast computes in 16 bits), which for a
frozen base is waste: its weights get no gradient and no optimizer state, so at 7B they
are 28 GB of fp32 that only ever feed 16-bit matmuls. :func:`hold_frozen_in` casts each
frozen matrix (Linear weights and the embedding table, a tied head with it) to bf16 or
fp16 in place; norm gains and biases stay fp32 (tiny, and the norms' arithmetic wants
them), and the adapters, their gradients and AdamW's moments stay fp32.

Computing with it:

* under autocast (a GPU run's bf16/fp16) the matmuls take the 16-bit weights as they are;
* without autocast (fp32 on a CPU) a weight is cast to the activations' dtype where it is
  used (:func:`compute_weight`): the base is *stored* in 16 bits and *computed* in fp32,
  so the run's memory halves while its matmuls stay fp32 ones;
* the embedding's rows come out in fp32, so the residual stream is fp32 as in training.

Layers are given these rules by changing their class to :class:`CastLinear` /
:class:`CastEmbedding` (subclasses with the same parameters, so state_dict keys, LoRA
wrapping, merging and export see ordinary layers). :func:`restore_fp32` turns a model
back into plain fp32 layers, for saving a merged model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_base_dtype(requested: str, device: torch.device, strategy: str = "ddp",
                       where: str = "sft.lora.base_dtype") -> str:
    """``auto``: bf16 on a GPU that has it, fp16 on one without, fp32 on a CPU (the
    measured default there: bench/RESULTS.md, "LoRA with a low-precision base").

    Under FSDP the sharded base stays fp32 and FSDP's mixed-precision policy gathers it
    in 16 bits for compute, so an explicit 16-bit base is refused there.
    """
    if requested not in (*DTYPES, "auto"):
        raise ConfigError(f"{where}: {requested!r} must be auto, fp32, bf16 or fp16")
    if strategy == "fsdp":
        if requested not in ("auto", "fp32"):
            raise ConfigError(f"{where}: {requested} with strategy: fsdp; FSDP shards the "
                              "fp32 base and gathers it in bf16 for compute; use auto or fp32")
        return "fp32"
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def compute_weight(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w`` as the matmul with ``x`` needs it: as it is under autocast (which casts
    both) or when the dtypes agree, else cast to ``x``'s dtype (a 16-bit stored weight in
    an fp32 computation)."""
    if w.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return w
    return w.to(x.dtype)


class CastLinear(nn.Linear):
    """An ``nn.Linear`` whose weight may be stored in another dtype than it computes in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else compute_weight(self.bias, x)
        return F.linear(x, compute_weight(self.weight, x), bias)


class CastEmbedding(nn.Embedding):
    """An ``nn.Embedding`` stored in 16 bits whose rows come out in fp32."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx).float()


def hold_frozen_in(model: nn.Module, dtype: str) -> int:
    """Cast every frozen Linear weight and embedding table of ``model`` to ``dtype``, in
    place; returns the bytes this saves. fp32 changes nothing."""
    target = DTYPES[dtype]
    if target == torch.float32:
        return 0
    saved, seen = 0, set()
    for module in model.modules():
        swap = {nn.Linear: CastLinear, nn.Embedding: CastEmbedding}.get(type(module))
        if swap is None or module.weight.requires_grad:
            continue
        module.__class__ = swap
        w = module.weight
        if id(w) not in seen and w.dtype != target:  # a tied head shares the table
            seen.add(id(w))
            saved += w.numel() * (w.element_size() - target.itemsize)
            w.data = w.data.to(target)
    return saved


def restore_fp32(model: nn.Module) -> nn.Module:
    """Plain fp32 layers again (after :func:`hold_frozen_in`), in place."""
    back = {CastLinear: nn.Linear, CastEmbedding: nn.Embedding}
    for module in model.modules():
        if type(module) in back:
            module.__class__ = back[type(module)]
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def frozen_dtype(model: nn.Module) -> str:
    """The dtype the model's frozen matrices are held in (``fp32`` with none frozen)."""
    names = {v: k for k, v in DTYPES.items()}
    for p in model.parameters():
        if not p.requires_grad and p.dim() >= 2:
            return names.get(p.dtype, str(p.dtype))
    return "fp32"
