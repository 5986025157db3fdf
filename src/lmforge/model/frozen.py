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

QLoRA (``nf4``): the frozen Linear weights of the blocks (attention and MLP, the bases
under LoRA adapters too) become torchao NF4 tensors (``to_nf4``: 4-bit codes, a scaler
per 64 weights, the scalers quantised in blocks of 256), quantised from their bf16 cast
on any device so a run's codes do not depend on where it runs; a matrix whose size is
whose 64-weight blocks do not divide into scaler blocks of 32 to 256 stays with the rest
(256, torchao's default, where it divides; else the largest divisor below it, so
SmolLM2's 576-wide projections are held in NF4 too). The rest
(embeddings, a tied or untied head, norms, biases) is held as ``auto`` holds a base on
the device: bf16 on a GPU (fp16 without bf16), fp32 on a CPU, where 16-bit storage costs
a cast per use and is slower (bench/RESULTS.md). torchao is optional
(``pip install 'lmforge[qlora]'``).

A weight stored in another form than it computes in (16 bits under fp32 compute, or
NF4) goes through :func:`frozen_linear`: cast or dequantised per matmul, in forward and
again in backward, with only the stored weight kept for the input's gradient (autograd
would keep the cast copy: an fp32 copy of a 16-bit base, a dequantised copy of an NF4
one).

Layers are given these rules by changing their class to :class:`CastLinear` /
:class:`CastEmbedding` (subclasses with the same parameters, so state_dict keys, LoRA
wrapping, merging and export see ordinary layers). :func:`restore_fp32` turns a model
back into plain fp32 layers, for saving a merged model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError
from lmforge.model.compiling import before_compile

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BASE_DTYPES = (*DTYPES, "nf4")
# torchao's to_nf4 defaults: 64 weights share a scaler; the scalers are quantised to int8
# in blocks of 256, so a matrix must hold a whole number of 64 * 256 weights. Where it
# does not (576 * 576 is 5,184 blocks), a smaller scaler block that divides is used: the
# scalers' factors cost 2 bytes a block of scalers, so any block from 32 up costs under
# 0.01 bit a weight more than 256.
NF4_BLOCK, NF4_SCALER_BLOCK, NF4_MIN_SCALER_BLOCK = 64, 256, 32
QLORA_EXTRA = "pip install 'lmforge[qlora]'"


def nf4_module(where: str = "lora.base_dtype") -> Any:
    """torchao's NF4 module (``to_nf4``, ``NF4Tensor``), or a one-line ConfigError naming
    the extra that installs it."""
    import importlib
    import importlib.util
    import logging

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{where}: nf4 needs torchao, which is not installed: "
                          f"{QLORA_EXTRA}")
    # torchao logs a warning per CUDA-only kernel library it cannot load on a CPU build
    # (NF4 uses none of them), and torch one about an Enum torchao registers.
    logs = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        for name in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor",  # >= 0.16
                     "torchao.dtypes.nf4tensor"):
            try:
                return importlib.import_module(name)
            except ModuleNotFoundError as e:  # not this version's path; anything else raises
                if e.name is None or not name.startswith(e.name):
                    raise
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)
    raise ConfigError(f"{where}: the installed torchao has no NF4 tensor: {QLORA_EXTRA}")


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torchao NF4 tensor (checked without importing torchao).

    By its type's name, not its MRO: Dynamo cannot iterate a type's ``__mro__``, and
    that graph break, in every frozen Linear, split a compiled LoRA step into ~5 graphs
    per layer (tests/test_lora_frozen_base.py::test_a_lora_model_traces_as_one_graph)."""
    return type(t).__name__ == "NF4Tensor"


def nf4_scaler_block(numel: int) -> int:
    """The scaler block size a matrix of ``numel`` weights is quantised with: the largest
    from 256 down to 32 that divides its number of 64-weight blocks; 0 if none does."""
    if numel % NF4_BLOCK:
        return 0
    blocks = numel // NF4_BLOCK
    return next((s for s in range(NF4_SCALER_BLOCK, NF4_MIN_SCALER_BLOCK - 1, -1)
                 if blocks % s == 0), 0)


def nf4_fits(numel: int) -> bool:
    """Whether a matrix of ``numel`` weights can be held in NF4 (see :func:`nf4_scaler_block`)."""
    return nf4_scaler_block(numel) > 0


def nf4_nbytes(t: torch.Tensor) -> int:
    """Bytes an NF4 tensor holds (its codes, scalers, factors, mean and table)."""
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).untyped_storage().nbytes() for n in names)


def resolve_base_dtype(requested: str, device: torch.device, strategy: str = "ddp",
                       where: str = "sft.lora.base_dtype") -> str:
    """``auto``: bf16 on a GPU that has it, fp16 on one without, fp32 on a CPU (the
    measured default there: bench/RESULTS.md, "LoRA with a low-precision base").

    Under FSDP the sharded base stays fp32 and FSDP's mixed-precision policy gathers it
    in 16 bits for compute, so an explicit 16-bit base is refused there.
    """
    if requested not in (*BASE_DTYPES, "auto"):
        raise ConfigError(f"{where}: {requested!r} must be auto, fp32, bf16, fp16 or nf4")
    if requested == "nf4" and strategy == "fsdp":
        raise ConfigError(f"{where}: nf4 with strategy: fsdp is not supported; use ddp (one "
                          "device holds a 4-bit base) or a 16-bit base_dtype")
    if requested == "nf4":
        nf4_module(where)  # fail here, before a model is built, if torchao is missing
        return "nf4"
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


class _StoredWeightMatmul(torch.autograd.Function):
    """``x W^T`` with a frozen W stored in another form than ``dtype``: W is cast (or
    dequantised) for the forward matmul and again for the backward one, and only the
    stored W is saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(w)
        ctx.x_dtype = x.dtype
        return F.linear(x.to(dtype), w.to(dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (w,) = ctx.saved_tensors
        return (grad @ w.to(grad.dtype)).to(ctx.x_dtype), None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a frozen weight held in any form: as it is when it computes in its
    own dtype (or an fp32/16-bit one under autocast, which casts it); through
    :class:`_StoredWeightMatmul` when it must be cast outside autocast or is NF4
    (dequantised to autocast's dtype, or to ``x``'s without autocast)."""
    autocast = torch.is_autocast_enabled(x.device.type)
    if is_nf4(weight) or (not autocast and weight.dtype != x.dtype):
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        out = _StoredWeightMatmul.apply(x, weight, dtype)
        return out if bias is None else out + compute_weight(bias, out)
    return F.linear(x, weight, None if bias is None else compute_weight(bias, x))


class CastLinear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight may be stored in another dtype (or NF4) than
    it computes in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


class CastEmbedding(nn.Embedding):
    """An ``nn.Embedding`` stored in 16 bits whose rows come out in fp32."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx).float()


def hold_frozen_in(model: nn.Module, dtype: str) -> int:
    """Hold every frozen Linear weight and embedding table of ``model`` in ``dtype``
    (``nf4``: the blocks' Linear weights in NF4, the rest as :func:`nf4_rest_dtype`
    says), in place; returns the bytes this saves. fp32 changes nothing."""
    if dtype == "nf4":
        rest = nf4_rest_dtype(next(model.parameters()).device)
        return quantize_block_linears(model) + hold_frozen_in(model, rest)
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


def nf4_rest_dtype(device: torch.device) -> str:
    """What a QLoRA run holds outside NF4 (embeddings, head, norms): ``auto``'s choice."""
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def quantize_block_linears(model: nn.Module) -> int:
    """The frozen ``nn.Linear`` weights under ``layers.`` (attention, MLP, LoRA bases) as
    NF4 quantised from their bf16 cast, in place; returns the bytes this saves."""
    to_nf4 = nf4_module().to_nf4
    saved = 0
    for name, module in model.named_modules():
        if (type(module) is not nn.Linear or not name.startswith("layers.")
                or module.weight.requires_grad or not nf4_fits(module.weight.numel())):
            continue
        w = module.weight
        nf4 = to_nf4(w.detach().to(torch.bfloat16).contiguous(), NF4_BLOCK,
                     nf4_scaler_block(w.numel()))
        saved += w.numel() * w.element_size() - nf4_nbytes(nf4)
        module.__class__ = CastLinear
        module.weight = nn.Parameter(nf4, requires_grad=False)
    return saved


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` sharing its NF4 weights instead of cloning them: they are
    frozen, and torchao's clone re-quantises with its default scaler block, which fails
    for the smaller blocks :func:`nf4_scaler_block` picks (and would cost a second base)."""
    return copy.deepcopy(model, {id(p): p for p in model.parameters() if is_nf4(p)})


def restore_fp32(model: nn.Module) -> nn.Module:
    """Plain fp32 layers again (after :func:`hold_frozen_in`; NF4 weights dequantised),
    in place."""
    back = {CastLinear: nn.Linear, CastEmbedding: nn.Embedding}
    for module in model.modules():
        if type(module) in back:
            module.__class__ = back[type(module)]
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and is_nf4(w):
            module.weight = nn.Parameter(w.to(torch.float32), requires_grad=w.requires_grad)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def stored_apart(model: nn.Module, compute_dtype: torch.dtype | None) -> bool:
    """Whether the frozen base computes in another form than it is stored in: NF4, or a
    16-bit base under fp32 compute (``compute_dtype`` None: no autocast)."""
    held = frozen_dtype(model)
    return held == "nf4" or (held in ("bf16", "fp16") and DTYPES[held] != compute_dtype)


class StoredWeightsCompiled(nn.Module):
    """A compiled module whose backward recomputes a frozen weight's cast or dequantised
    form from the stored weight rather than saving it.

    Inductor's partitioner bans recomputing anything backward must materialise, and any
    op outside its allowlist (NF4's table lookup), so it saved the fp32 cast of every
    16-bit frozen matrix, and the dequantised bf16 of every NF4 one, for backward: a
    16-bit or NF4 base then held more in a step than an fp32 one (bench/RESULTS.md). The
    two bans are lifted while the compiled module runs forward, which is when
    AOTAutograd partitions the graph; a cast or a dequantisation is cheap beside the
    matmul that reads it. (An fp32 base, or a 16-bit one under 16-bit autocast, is
    compiled as it was.)
    """

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(ban_recompute_materialized_backward=False,
                                    ban_recompute_not_in_allowlist=False):
            return self.compiled(*args, **kwargs)


def compile_step_model(step_model: nn.Module, model: nn.Module,
                       compute_dtype: torch.dtype | None) -> nn.Module:
    """``torch.compile(step_model)``, keeping only the stored frozen weights for backward
    where ``model``'s base is :func:`stored_apart` (:class:`StoredWeightsCompiled`)."""
    before_compile()
    compiled = torch.compile(step_model)
    return StoredWeightsCompiled(compiled) if stored_apart(model, compute_dtype) else compiled


def frozen_dtype(model: nn.Module) -> str:
    """The dtype the model's frozen matrices are held in (``nf4`` if any is NF4; ``fp32``
    with none frozen)."""
    names = {v: k for k, v in DTYPES.items()}
    if any(is_nf4(p) for p in model.parameters()):
        return "nf4"
    for p in model.parameters():
        if not p.requires_grad and p.dim() >= 2:
            return names.get(p.dtype, str(p.dtype))
    return "fp32"
