"""AdamW with weight decay on weight matrices only."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.config import TrainConfig

# Devices with a fused AdamW kernel in torch >= 2.4.
_FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def param_groups(model: nn.Module, weight_decay: float,
                 decay_embeddings: bool = False) -> list[dict]:
    """Two AdamW groups: decayed (>= 2-D weights) and not (norm gains, embeddings).

    Embedding tables are excluded unless ``decay_embeddings``: decay pulls rarely seen
    tokens' rows to zero. A tied LM head shares the embedding's tensor and follows it.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if not p.requires_grad:
            continue
        is_embedding = id(p) in embeddings
        if p.dim() >= 2 and (decay_embeddings or not is_embedding):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW from ``cfg``, with the fused kernel on CUDA and CPU.

    Fused, the whole update is one pass over each parameter's memory; on a CPU the
    default per-op path makes ~10 passes and took 7.6x longer (bench/bench_train.py).
    """
    groups = param_groups(model, cfg.weight_decay, cfg.decay_embeddings)
    fused = device.type in _FUSED_ADAMW_DEVICES or None
    return torch.optim.AdamW(groups, lr=cfg.max_lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=fused)
