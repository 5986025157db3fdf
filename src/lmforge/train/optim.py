"""The optimizer: AdamW, or Muon on the hidden matrices with AdamW on the rest.

``train.optimizer: muon`` gives the blocks' 2-D weights (attention wq wk wv wo, MLP w1
w2 w3) to ``torch.optim.Muon`` and everything else (embedding, an untied head, norm
gains, biases) to AdamW, as nanochat and the modded-nanogpt speedrun do. The two
optimizers are presented to the loop as one (:class:`CompositeOptimizer`): one
``param_groups``, ``step``, ``zero_grad`` and ``state_dict``, so accumulation, clipping,
the non-finite guard, GradScaler, DDP and checkpoints work unchanged. Each group has its
own peak learning rate (``max_lr`` or ``muon_lr``), both following the run's schedule.
Muon's Newton-Schulz runs in the dtype that is fast on the device (:mod:`.muon`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import TrainConfig
from lmforge.train.muon import Muon, newton_schulz_dtype
from lmforge.train.schedule import lr_at

# Devices with a fused AdamW kernel in torch >= 2.4.
_FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def param_groups(model: nn.Module, weight_decay: float,
                 decay_embeddings: bool = False,
                 exclude: set[int] | None = None) -> list[dict]:
    """Two AdamW groups: decayed (>= 2-D weights) and not (norm gains, embeddings).

    Embedding tables are excluded unless ``decay_embeddings``: decay pulls rarely seen
    tokens' rows to zero. A tied LM head shares the embedding's tensor and follows it.
    ``exclude``: ids of parameters another optimizer (Muon) holds.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    exclude = exclude or set()
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if not p.requires_grad or id(p) in exclude:
            continue
        is_embedding = id(p) in embeddings
        if p.dim() >= 2 and (decay_embeddings or not is_embedding):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def muon_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The hidden matrices Muon takes: the weight of every plain ``nn.Linear`` inside
    the transformer blocks (``layers.*``), i.e. wq wk wv wo w1 w2 w3.

    Not the embedding or the head (Muon's authors keep those on AdamW: an embedding's
    gradient is row-sparse and the head's rows are per-token classifiers, neither a
    hidden linear map), not norm gains or biases (1-D), and not LoRA adapters: a LoRA
    layer is not a plain Linear, its frozen base has no gradient, and its two thin
    factors stay on AdamW (see :func:`build_optimizer`).
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    found = []
    for name, module in layers.named_modules(prefix="layers"):
        if type(module) is nn.Linear and module.weight.requires_grad:
            found.append((f"{name}.weight", module.weight))
    return found


class CompositeOptimizer:
    """Several optimizers as one: the loop sees one ``param_groups`` list (the groups of
    each optimizer in order), ``step``, ``zero_grad``, ``state_dict``, ``state``.

    ``peak_lrs``: each group's peak learning rate, in the order of ``param_groups``; the
    schedule scales each (:func:`set_learning_rates`). They live here, not in the groups,
    so that loading a checkpoint's groups cannot drop them.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer], peaks: dict[str, float]
                 ) -> None:
        self.parts = parts
        self.peak_lrs = [peaks[name] for name, opt in parts.items() for _ in opt.param_groups]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every part's groups (the same dicts: setting ``lr`` here sets it there)."""
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """Per-parameter state of every part (read-only view, e.g. for memory counts)."""
        merged: dict[Any, Any] = {}
        for opt in self.parts.values():
            merged.update(opt.state)
        return merged

    def step(self, closure: Any = None) -> None:
        """One step of every part (the gradients are already complete)."""
        if closure is not None:
            raise ValueError("CompositeOptimizer.step takes no closure")
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{part name: that optimizer's state_dict}``."""
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load every part's state; refuse a checkpoint of other parts."""
        if set(state) != set(self.parts):
            raise ValueError(f"optimizer state has parts {sorted(state)}, this run's "
                             f"optimizer {sorted(self.parts)}; train.optimizer changed")
        for name, opt in self.parts.items():
            opt.load_state_dict(state[name])


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device,
                    log: Any = None, distributed: bool = False
                    ) -> torch.optim.Optimizer | CompositeOptimizer:
    """AdamW from ``cfg``, or (``optimizer: muon``) Muon and AdamW as one.

    ``distributed``: every rank of the process group builds it together (DDP), so the
    ranks agree on Muon's Newton-Schulz dtype (:func:`muon_dtype`).

    AdamW uses the fused kernel on CUDA and CPU: fused, the whole update is one pass over
    each parameter's memory; on a CPU the default per-op path makes ~10 passes and took
    7.6x longer (bench/bench_train.py).
    """
    matrices = muon_parameters(model) if cfg.optimizer == "muon" else []
    if cfg.optimizer == "muon" and not matrices and log is not None:
        # LoRA: the adapters' factors A (r x in) and B (out x r) stay on AdamW. Muon's
        # step is the orthogonalised update of a whole weight; orthogonalising each thin
        # factor apart is not that of their product B A (the weight's change), B starts
        # at zero, and LoRA's alpha / rank scaling and rates are tuned for Adam.
        log("train: optimizer muon: no trainable hidden matrices (LoRA adapters stay on "
            "AdamW); training with AdamW alone")
    groups = param_groups(model, cfg.weight_decay, cfg.decay_embeddings,
                          exclude={id(p) for _, p in matrices})
    fused = device.type in _FUSED_ADAMW_DEVICES or None
    adamw = torch.optim.AdamW(groups, lr=cfg.max_lr, betas=(cfg.beta1, cfg.beta2),
                              eps=cfg.eps, fused=fused)
    if not matrices:
        return adamw
    muon = Muon([p for _, p in matrices],
                ns_dtype=muon_dtype(matrices, device, log, distributed),
                lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay,
                momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn=cfg.muon_adjust_lr)
    return CompositeOptimizer({"adamw": adamw, "muon": muon},
                              {"adamw": cfg.max_lr, "muon": cfg.muon_lr})


def muon_dtype(matrices: list[tuple[str, nn.Parameter]], device: torch.device,
               log: Any = None, distributed: bool = False) -> str:
    """The Newton-Schulz dtype for this run's Muon matrices on ``device``
    (:func:`~lmforge.train.muon.newton_schulz_dtype` at the largest matrix's shape).

    Under DDP (``distributed``) every rank must orthogonalise alike or their weights
    drift apart, and a timed probe may differ between ranks: rank 0's choice is
    broadcast (on a GPU the choice is by capability, the same on every rank).
    """
    largest = max((p.shape for _, p in matrices), key=lambda s: s.numel())
    name, why = newton_schulz_dtype(device, (int(largest[0]), int(largest[1])))
    if distributed and device.type == "cpu":
        flag = torch.tensor([name == "bfloat16"], dtype=torch.int32)
        dist.broadcast(flag, src=0)
        name = "bfloat16" if flag.item() else "float32"
    if log is not None:
        log(f"train: Muon orthogonalises in {name} ({why})")
    return name


def set_learning_rates(optimizer: Any, step: int, cfg: TrainConfig) -> dict[str, float]:
    """Set every group's rate for optimizer step ``step``: its own peak (``max_lr`` for a
    plain AdamW) on the run's schedule. Returns the rates to log: ``lr`` (AdamW's) and,
    with Muon, ``lr_muon``."""
    peaks = getattr(optimizer, "peak_lrs", None) or [cfg.max_lr] * len(optimizer.param_groups)
    for group, peak in zip(optimizer.param_groups, peaks, strict=True):
        group["lr"] = lr_at(step, cfg, peak)
    rates = {"lr": lr_at(step, cfg)}
    if isinstance(optimizer, CompositeOptimizer) and "muon" in optimizer.parts:
        rates["lr_muon"] = lr_at(step, cfg, cfg.muon_lr)
    return rates
