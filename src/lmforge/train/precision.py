"""Numeric precision: bf16 autocast, fp16 autocast + GradScaler, or plain fp32."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lmforge.errors import ConfigError


@dataclass
class Precision:
    """The resolved precision of a run: ``name`` is fp32, bf16 or fp16."""

    name: str
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (bf16 has fp32's exponent range)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16")


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """``auto``: bf16 on a CUDA GPU that has it, fp16 on one without, fp32 on CPU."""
    cuda = device.type == "cuda"
    if requested == "auto":
        if not cuda:
            return Precision("fp32", device.type)
        return Precision("bf16" if torch.cuda.is_bf16_supported() else "fp16", "cuda")
    if requested == "fp16" and not cuda:
        raise ConfigError("train.precision: fp16 needs a CUDA device; use bf16 or fp32 on "
                          f"{device.type}")
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision: this GPU has no bf16; use fp16 or auto")
    return Precision(requested, device.type)
