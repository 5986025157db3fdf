"""``lmforge plan --mode full|lora|qlora``: one device's memory for fine-tuning a model.

The pretraining plan (:mod:`lmforge.plan.pretrain`) answers for DDP and FSDP2; this module
answers the fine-tuner's question: does full fine-tuning, LoRA or QLoRA of this model
fit this card (or this much CPU RAM), at which micro-batch, and what fills it. Each
mode is planned with and without activation checkpointing, side by side.

What each mode holds (P parameters; n adapter parameters, ``lora_param_count_formula``):

* **full**: as pretraining on one device (the plan's DDP column with one rank): fp32
  weights, gradients and AdamW's two moments, 16 P bytes, under autocast.
* **lora**: the frozen base in bf16 (fp16 where bf16 is missing; fp32 when asked), 2 P
  bytes and no gradient; the adapters (rank r on the chosen targets: ``attn`` = wq, wk,
  wv, wo; ``mlp`` = w1, w2, w3), their gradients and AdamW's moments in fp32: 4 + 4 + 8
  bytes per adapter parameter. Autocast caches a 16-bit cast of each adapter (2 n).
* **qlora**: as lora, but the frozen Linear weights of the blocks are torchao NF4
  tensors (``to_nf4`` of torchao.dtypes.nf4tensor, in torchao 0.18
  torchao.quantization.quantize_.workflows.nf4.nf4_tensor; block 64, scalers
  double-quantised in blocks of 256): per weight matrix of N elements, N/2 bytes of
  4-bit codes, N/64 int8 block scalers, N/(64*256) 16-bit scaler factors, one 16-bit
  scaler mean and the 16-entry 16-bit NF4 table (checked against torchao's tensor when
  torchao is installed; quantised from bf16 whatever the rest is held in). Embeddings,
  norms, biases, the head and any block matrix that is not a whole number of 64 * 256
  weights stay at the base's dtype (``--precision``: bf16, or fp32 as a CPU run holds
  them).

Activations under LoRA (counted tensor by tensor, checked against
``saved_tensors_hooks`` in tests/test_finetune_plan.py): a frozen GEMM ``x W^T`` keeps W
for x's gradient but not x (W wants no gradient), so a block keeps what pretraining's
keeps (:func:`lmforge.plan.memory.layer_activation_bytes`) except the GEMM inputs of
unadapted Linears; each adapted Linear keeps its input (for A's gradient) and its r-wide
intermediate (for B's). The residual stream is the base's dtype. Before the first
adapter nothing needs a gradient: the first block's input norm keeps nothing, and
neither does its q/k/v GEMM. The token ids are not saved
(the embedding is frozen) but are alive as the batch, so they are counted as in
pretraining. The fused loss makes no head gradient (the head is frozen). With
activation checkpointing the count has the pretraining plan's structure (every block's
input, plus one block being recomputed), not checked against autograd.

``fused_linear`` (llama.py) joins q|k|v and gate|up into one GEMM only where a weight
trains (full fine-tuning: the pretraining plan's "weight copies"); a group of frozen
weights runs as separate GEMMs, each keeping its own frozen weight (a parameter, no
copy) for the input's gradient, so LoRA and QLoRA keep no joined copy of the base.
QLoRA is planned as torchao's ``linear_nf4``, which keeps the NF4 weight itself and
dequantizes one matrix at a time: its eager ``get_original_weight`` peaks at 14 bytes per
element (two int64 code tensors, 8; their 16-bit lookups, 2; the scaled halves, 2; the
stacked result, 2), planned for the largest frozen matrix ("dequantized weight",
transient).

Not modelled (beyond the pretraining plan's own list): adapter dropout > 0 (a mask and
a dropped copy of each adapted input), adapters on ``lm_head`` (refused), Qwen3's
qk-norm, the AdamW ``step`` scalars (4 bytes per adapter tensor), torch.compile, the
optimizer's transient update buffers, and paged or CPU-offloaded optimizer states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lmforge.config import LoraConfig, ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.frozen import NF4_BLOCK, nf4_fits, nf4_scaler_block
from lmforge.model.llama import ffn_hidden_size
from lmforge.model.lora import (
    ATTN_TARGETS,
    MLP_TARGETS,
    lora_param_count_formula,
    resolve_targets,
)
from lmforge.plan import memory
from lmforge.plan.shapes import GIB, SHAPES, Setup, format_size, linear_shapes, num_params

MODES = ("full", "lora", "qlora")
DEVICES = ("cuda", "cpu")
BLOCK_TARGETS = ATTN_TARGETS + MLP_TARGETS
NF4_LEVELS = 16
NF4_DEQUANT_BYTES = 14  # eager get_original_weight's peak per element (module docstring)


@dataclass(frozen=True)
class Tune:
    """A fine-tuning run to plan: the model and knobs (one device), mode and adapters."""

    setup: Setup
    mode: str = "lora"
    rank: int = 8
    targets: tuple[str, ...] = BLOCK_TARGETS
    device: str = "cuda"


# --------------------------------------------------------------------------- weights


def base_bytes(precision: str) -> int:
    """Bytes per frozen weight (and per residual-stream element) of a LoRA base: 4 in
    fp32, else 2 (bf16, or fp16 where bf16 is missing)."""
    return 4 if precision == "fp32" else 2


def nf4_bytes(numel: int, scale_bytes: int = 2) -> int:
    """Bytes of torchao's NF4Tensor of ``numel`` weights quantised from a 16-bit tensor
    (``scale_bytes`` 4 from an fp32 one).

    numel/2 (two 4-bit codes a byte) + numel/64 (int8 block scalers) + 2 numel/(64*s)
    (a factor per block of s scalers, :func:`nf4_scaler_block`) + 2 (the scalers' mean)
    + 16 * 2 (the NF4 table).
    """
    scaler_block = nf4_scaler_block(numel)
    if not scaler_block:
        raise ConfigError(f"plan: a frozen matrix of {numel} weights has no NF4 scaler "
                          f"block (its {NF4_BLOCK}-weight blocks do not divide into 32-256)")
    blocks = numel // NF4_BLOCK
    factors = blocks // scaler_block
    # With one scaler block torchao's factor is a 1-element view of an s-element tensor
    # (double_quantize_scalers' [:, 0] stays "contiguous"), so s factors stay allocated.
    held_factors = scaler_block if factors == 1 else factors
    return numel // 2 + blocks + scale_bytes * (held_factors + 1 + NF4_LEVELS)


def adapter_params(t: Tune) -> int:
    """n = L * sum over targets of r * (in + out)."""
    return lora_param_count_formula(t.setup.model, t.setup.vocab, t.rank, t.targets)


def weight_rows(t: Tune) -> dict[str, int]:
    """The frozen base: ``weights`` (P bf16, or the NF4 block Linears) and, in QLoRA,
    ``weights_16`` (embeddings, norms, biases, head and any block matrix that is not a
    whole number of NF4 scaler blocks, at the base's dtype), as
    :func:`lmforge.model.frozen.hold_frozen_in` holds them (NF4 quantised from bf16)."""
    cfg, vocab = t.setup.model, t.setup.vocab
    total = num_params(cfg, vocab)
    b = base_bytes(t.setup.precision)
    if t.mode == "lora":
        return {"weights": b * total}
    sizes = [o * i for o, i in linear_shapes(cfg).values() if nf4_fits(o * i)]
    nf4 = cfg.n_layer * sum(nf4_bytes(n) for n in sizes)
    return {"weights": nf4, "weights_16": b * (total - cfg.n_layer * sum(sizes))}


# --------------------------------------------------------------------------- rows


def _grad_flows(targets: tuple[str, ...]) -> tuple[bool, bool]:
    """(q/k/v adapted, any attention Linear adapted): where the first block's stream
    starts to need a gradient."""
    qkv = any(n in targets for n in ("wq", "wk", "wv"))
    return qkv, qkv or "wo" in targets


def lora_loss_buffer_bytes(t: Tune, micro_batch: int) -> int:
    """The fused loss with a frozen head: no weight gradient, only one chunk of fp32
    logits (+ its 16-bit copy): (4 [+ 2]) * V * chunk tokens; 0 without the fused loss."""
    s = t.setup
    if not s.fused_loss:
        return 0
    chunk = memory.loss_chunk_tokens(s, micro_batch, t.device)
    return chunk * s.vocab * (4 + (2 if s.precision != "fp32" else 0))


def rows_bytes(t: Tune, micro_batch: int) -> dict[str, int]:
    """The table's rows other than activations (keys as in :func:`row_labels`)."""
    s = t.setup
    if t.mode == "full":
        one = dataclasses.replace(s, world=1)
        full = memory.rows_bytes(one, "ddp", micro_batch)
        return {"weights": full["params"], "grads": full["grads"],
                "optimizer": full["optimizer"], "weight_copies": full["weight_copies"],
                "loss_buffers": memory.loss_buffer_bytes(one, "ddp", micro_batch, t.device)}
    n = adapter_params(t)
    rows = weight_rows(t)
    rows.update(adapters=4 * n, grads=4 * n, optimizer=8 * n,
                adapter_casts=0 if s.precision == "fp32" else 2 * n)
    if t.mode == "qlora":
        largest = max(o * i for o, i in linear_shapes(s.model).values())
        rows["dequant"] = NF4_DEQUANT_BYTES * largest
    rows["loss_buffers"] = lora_loss_buffer_bytes(t, micro_batch)
    return rows


def row_labels(t: Tune) -> list[tuple[str, str]]:
    """(key, label) of the mode's rows, in print order."""
    dtype = t.setup.precision
    if t.mode == "full":
        return [("weights", "weights (fp32)"), ("grads", "grads (fp32)"),
                ("optimizer", "AdamW moments (fp32)"), ("weight_copies", "weight copies"),
                ("loss_buffers", "loss buffers")]
    frozen = ([("weights", f"frozen base ({dtype})")] if t.mode == "lora" else
              [("weights", "frozen Linears (NF4)"),
               ("weights_16", f"embeddings, norms, head ({dtype})")])
    casts = [] if dtype == "fp32" else [("adapter_casts", f"adapter casts ({dtype})")]
    tail = [] if t.mode == "lora" else [("dequant", "dequantized weight")]
    return (frozen + [("adapters", "adapters (fp32)"), ("grads", "adapter grads (fp32)"),
                      ("optimizer", "adapter AdamW (fp32)")]
            + casts + tail + [("loss_buffers", "loss buffers")])


# --------------------------------------------------------------------------- activations


def lora_layer_activation_bytes(cfg: ModelConfig, a: int, rank: int,
                                targets: tuple[str, ...], grad_in: bool = True) -> int:
    """Bytes one block keeps per token under LoRA (a: the base's bytes, also the residual's).

    ``grad_in``: whether the block's input needs a gradient (every block but the first).
    a*d + 4 per RMSNorm whose input needs a gradient (input, fp32 rstd); a*d for the
    q/k/v GEMM input if q, k or v is adapted; the attention's a*(kv + d) + 4H (roped q|k,
    v or the repeated k and v, the output, the log-sum-exp; as pretraining) once q/k/v
    need a gradient, else a*d (wo's input) if wo is adapted; a*d for the MLP GEMM input
    if w1 or w3 is; a*3F (gate|up, silu(gate)) once the MLP needs a gradient; a*F (w2's
    input) if w2 is adapted; a*r per adapter (its r-wide intermediate); 2d of dropout
    masks with model dropout.
    """
    d, heads = cfg.n_embd, cfg.n_head
    kv_heads, hd, f = cfg.n_kv_head or heads, cfg.head_size(), ffn_hidden_size(cfg)
    kv = (heads + kv_heads) * hd + ((heads + 2 * kv_heads) * hd if kv_heads == heads
                                    else 2 * heads * hd)
    qkv, attn = _grad_flows(targets)
    total = a * rank * sum(t in targets for t in BLOCK_TARGETS)
    total += (a * d + 4) if grad_in else 0
    total += a * d if qkv else 0
    if grad_in or qkv:
        total += a * (kv + d) + 4 * heads
    elif "wo" in targets:
        total += a * d
    mlp_in = grad_in or attn
    total += (a * d + 4) if mlp_in else 0
    gate = "w1" in targets or "w3" in targets
    total += a * d if gate else 0
    total += 3 * a * f if (mlp_in or gate) else 0
    total += a * f if "w2" in targets else 0
    return total + (2 * d if cfg.dropout > 0 and grad_in else 0)


def lora_activation_bytes_per_seq(t: Tune) -> int:
    """Bytes per micro-batch sequence under LoRA/QLoRA.

    s * (first block + (L-1) blocks + a*d + 4 (final norm) + 8 (token ids) + loss), the
    loss fused: a*d (the final norm's output) + a*d (the hidden states' gradient), plain:
    a*d + 12 V; with activation checkpointing the blocks become L * a*d (their inputs) +
    one block being recomputed. ``doc_mask`` adds what it adds in pretraining.
    """
    cfg, seq, s = t.setup.model, t.setup.model.seq_len, t.setup
    a = base_bytes(s.precision)
    layer = lora_layer_activation_bytes(cfg, a, t.rank, t.targets)
    if s.activation_checkpointing:
        blocks, mask_layers = cfg.n_layer * a * cfg.n_embd + layer, 1
    else:
        first = lora_layer_activation_bytes(cfg, a, t.rank, t.targets, grad_in=False)
        blocks, mask_layers = first + (cfg.n_layer - 1) * layer, cfg.n_layer
    loss = 2 * a * cfg.n_embd if s.fused_loss else a * cfg.n_embd + 12 * s.vocab
    total = seq * (blocks + a * cfg.n_embd + 4 + 8 + loss)
    if cfg.doc_mask:
        total += seq * seq + 8 * cfg.head_size() * seq + mask_layers * a * seq * seq
    return total


def activation_bytes_per_seq(t: Tune) -> int:
    """Per micro-batch sequence: pretraining's single-device count for full, else LoRA's."""
    if t.mode == "full":
        return memory.activation_bytes_per_seq(dataclasses.replace(t.setup, world=1), "ddp")
    return lora_activation_bytes_per_seq(t)


def total_bytes(t: Tune, micro_batch: int) -> int:
    """The rows + micro_batch * activations per sequence."""
    return sum(rows_bytes(t, micro_batch).values()) + micro_batch * activation_bytes_per_seq(t)


# --------------------------------------------------------------------------- plan


def _column(t: Tune, micro_batch: int, budget: int) -> dict[str, Any]:
    per_seq = activation_bytes_per_seq(t)
    total = total_bytes(t, micro_batch)
    return {**rows_bytes(t, micro_batch), "activations_per_seq": per_seq,
            "activations": micro_batch * per_seq, "total": total, "fits": total <= budget,
            "max_micro_batch": memory.largest_fitting(lambda b: total_bytes(t, b), per_seq,
                                                      budget)}


def check(t: Tune) -> None:
    """Refuse what the plan does not model (one-line ConfigErrors)."""
    if t.mode not in MODES or t.device not in DEVICES:
        raise ConfigError(f"plan: --mode must be one of {', '.join(MODES)} and --device one "
                          f"of {', '.join(DEVICES)}")
    if t.setup.world != 1:
        raise ConfigError("plan: --mode plans one device; drop --world (or use the "
                          "strategies table, without --mode)")
    if t.mode != "full":
        if "lm_head" in t.targets:
            raise ConfigError("plan: adapters on lm_head are not modelled; target the "
                              "blocks' Linears (attn, mlp)")
        if t.rank < 1 or not t.targets:
            raise ConfigError("plan: --rank must be >= 1 and --targets non-empty")


def auto_fused_loss(t: Tune, micro_batch: int, budget: int) -> bool:
    """The ``fused_loss`` a ``fused_loss: auto`` fine-tuning run is planned with: True
    (chunked) on a CPU, as the run takes it there; on a GPU as
    :func:`lmforge.plan.pretrain.auto_fused_loss`, with this plan's total."""
    if t.device != "cuda":
        return True
    plain = dataclasses.replace(t, setup=dataclasses.replace(t.setup, fused_loss=False))
    return total_bytes(plain, micro_batch) > budget


def finetune_plan(t: Tune, device_gib: float, micro_batch: int,
                  reserve_gib: float = memory.RESERVE_GIB) -> dict[str, Any]:
    """Every figure of the fine-tuning plan, in bytes (the ``--json`` document)."""
    check(t)
    device = int(device_gib * GIB)
    budget = device - memory.reserve_bytes(device, reserve_gib)
    s = t.setup
    out: dict[str, Any] = {
        "mode": t.mode, "params": num_params(s.model, s.vocab), "vocab": s.vocab,
        "model": dataclasses.asdict(s.model), "precision": s.precision,
        "fused_loss": s.fused_loss, "device": t.device, "device_bytes": device,
        "reserve_bytes": device - budget, "budget_bytes": budget, "micro_batch": micro_batch,
    }
    if t.mode != "full":
        out.update(rank=t.rank, targets=list(t.targets), adapter_params=adapter_params(t))
    for key, ac in (("no_ac", False), ("ac", True)):
        run = dataclasses.replace(t, setup=dataclasses.replace(s, activation_checkpointing=ac))
        out[key] = _column(run, micro_batch, budget)
    out["labels"] = dict(row_labels(t))
    out["verdict"] = verdict(out)
    return out


def largest_part(p: dict[str, Any], column: str) -> tuple[str, int]:
    """The column's largest part (label, bytes) in a :func:`finetune_plan` document: a
    row, or the activations at the micro-batch."""
    parts = {label: p[column][key] for key, label in p["labels"].items()}
    parts[f"activations @ micro-batch {p['micro_batch']}"] = p[column]["activations"]
    return max(parts.items(), key=lambda kv: kv[1])


def verdict(p: dict[str, Any]) -> str:
    """One line: whether the micro-batch fits, with or without checkpointing, and why."""
    no, ac, budget = p["no_ac"], p["ac"], p["budget_bytes"]
    mb, seq = p["micro_batch"], p["model"]["seq_len"]
    size, at = format_size, f"micro-batch {mb} x {seq} tokens"
    if no["fits"]:
        label, big = largest_part(p, "no_ac")
        return (f"fits: {at} takes {size(no['total'])} of the {size(budget)} budget (up to "
                f"micro-batch {no['max_micro_batch']}, {ac['max_micro_batch']} with "
                f"activation checkpointing); largest part: {label} {size(big)}")
    if ac["fits"]:
        label, big = largest_part(p, "no_ac")
        return (f"fits only with activation checkpointing: {at} takes {size(ac['total'])} "
                f"of the {size(budget)} budget (up to micro-batch {ac['max_micro_batch']}); "
                f"without it {size(no['total'])}, largest part: {label} {size(big)}")
    label, big = largest_part(p, "ac")
    states = ac["total"] - ac["activations"]
    if states > budget:
        return (f"does not fit: before any activation the model states take "
                f"{size(states)} of the {size(budget)} budget; largest part: {label} "
                f"{size(big)}")
    return (f"does not fit: {at} takes {size(ac['total'])} even with activation "
            f"checkpointing, over the {size(budget)} budget; largest part: {label} "
            f"{size(big)}")


def preset_tune(key: str, mode: str = "lora", device: str = "cuda") -> Tune:
    """A preset shape (:data:`lmforge.plan.shapes.SHAPES`) with the command's defaults:
    bf16, fused loss, no document mask, rank and targets of
    :class:`lmforge.config.LoraConfig`."""
    shape = SHAPES[key]
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k not in ("vocab", "name")})
    lora = LoraConfig()
    return Tune(Setup(cfg, shape["vocab"]), mode, lora.rank, targets_from(lora.targets),
                device)


def targets_from(spec: str | list[str]) -> tuple[str, ...]:
    """``attn,mlp`` / ``["wq", "wv"]`` -> leaf names in lora.TARGETS order (one-line errors)."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    return tuple(resolve_targets([n.strip() for n in names if n.strip()], where="plan"))
