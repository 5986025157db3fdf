"""LoRA adapters for :class:`~lmforge.model.llama.Llama` (the SFT stage's ``sft.lora``).

A wrapped layer computes ``y = W x + (alpha / r) * B A x`` with ``W`` frozen, ``A`` (r x in)
initialised like ``nn.Linear``'s weight (Kaiming uniform, a = sqrt(5)) and ``B`` (out x r)
zero, so an adapted model starts out equal to its base. Dropout, if any, applies to ``x``
on the adapter path only. Merging folds the adapter into ``W' = W + (alpha / r) * B A``
and puts a plain ``nn.Linear`` back, so saving, export and evaluation see an ordinary
Llama with the base's state_dict keys; the unmerged adapter is saved on its own
(:func:`save_adapter`: ``adapter.safetensors`` + ``adapter.json``).

Targets (leaf names of the Linear layers in llama.py, in every block):

* ``wq``, ``wk``, ``wv``, ``wo``: attention query/key/value/output projections
  (three separate Linears for q, k, v; llama.py concatenates their weights into one GEMM)
* ``w1``, ``w3``, ``w2``: SwiGLU gate, up and down projections (w1/w3 are one GEMM too)
* ``lm_head``: the output head; not allowed with ``tie_embeddings`` (the head *is* the
  frozen embedding table, and an adapter on it would either leave the head unmerged or
  change the input embedding on merge)
* groups: ``attn`` = wq, wk, wv, wo; ``mlp`` = w1, w2, w3

How llama.py sees a wrapped layer: ``wo``, ``w2`` and the head (when logits are
computed) are called as modules and take the cheap path ``base(x) + B(A(drop(x)))``; the
fused GEMMs (q/k/v, gate/up) run on the frozen base weights and add each adapter's
``delta(x)`` on its slice (``llama.fused_linear``), so they are as cheap and take dropout
too. Only the head under ``fused_loss`` reads ``.weight`` directly:
:attr:`LoRALinear.weight` is the *effective* weight ``W + (alpha / r) B A``,
differentiable in A and B, exact without dropout; ``dropout > 0`` is refused for that
target (:data:`WEIGHT_READ_TARGETS`) instead of silently ignored.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from lmforge.errors import ConfigError, InputError
from lmforge.io import atomic_dir, read_json_object, write_json

ATTN_TARGETS = ("wq", "wk", "wv", "wo")
MLP_TARGETS = ("w1", "w2", "w3")
TARGETS = ATTN_TARGETS + MLP_TARGETS + ("lm_head",)
GROUPS = {"attn": ATTN_TARGETS, "mlp": MLP_TARGETS}
# Layers whose ``.weight`` llama.py reads (the fused loss) instead of calling the module:
# adapter dropout cannot apply there.
WEIGHT_READ_TARGETS = ("lm_head",)

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"
ADAPTER_FORMAT = "lmforge-lora-1"


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (``.base``) plus a trainable low-rank update ``B A``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=w.device,
                                               dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device,
                                               dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear.reset_parameters
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def p_dropout(self) -> float:
        return self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight ``W + scaling * B A`` (gradients reach A and B, not W).

        For callers that read ``.weight`` instead of calling the module (llama.py's
        fused GEMMs); it costs a full out x in product per access, and no adapter dropout.
        """
        return self.base.weight + (self.lora_b @ self.lora_a) * self.scaling

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter path alone: ``scaling * B A dropout(x)``, r-wide in the middle."""
        return F.linear(F.linear(self.dropout(x), self.lora_a) * self.scaling, self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.delta(x)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + scaling * B A`` computed and returned in fp32, detached (a base held in
        16 bits, model/frozen.py, merges into an fp32 weight: the model it trained with)."""
        delta = (self.lora_b.float() @ self.lora_a.float()) * self.scaling
        return self.base.weight.float() + delta

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, alpha={self.alpha}, dropout={self.p_dropout}")


def resolve_targets(targets: Iterable[str], where: str = "sft.lora") -> list[str]:
    """Expand groups and check names -> leaf names in :data:`TARGETS` order."""
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)
    if not targets:
        raise ConfigError(f"{where}.targets: give at least one of {', '.join(TARGETS)} "
                          f"(or a group: {', '.join(GROUPS)})")
    wanted: set[str] = set()
    for t in targets:
        if t in GROUPS:
            wanted.update(GROUPS[t])
        elif t in TARGETS:
            wanted.add(t)
        else:
            raise ConfigError(f"{where}.targets: unknown target {t!r}; choose from "
                              f"{', '.join(TARGETS)} or a group ({', '.join(GROUPS)})")
    return [t for t in TARGETS if t in wanted]


def validate_lora(rank: Any, alpha: Any, dropout: Any, targets: Iterable[str],
                  where: str = "sft.lora") -> list[str]:
    """Check an ``sft.lora`` section (one-line ConfigErrors) -> resolved target names."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{where}.rank: {rank!r} must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"{where}.alpha: {alpha!r} must be a number > 0")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0 <= dropout < 1:
        raise ConfigError(f"{where}.dropout: {dropout!r} must be in [0, 1)")
    names = resolve_targets(targets, where)
    fused = [t for t in names if t in WEIGHT_READ_TARGETS]
    if dropout > 0 and fused:
        raise ConfigError(
            f"{where}.dropout: {dropout} cannot apply to {', '.join(fused)} (llama.py reads "
            "their weights for a fused GEMM, skipping the adapter's input dropout); set "
            "dropout: 0 or target only wo, w2")
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA-wrapped layers by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _is_tied_head(model: nn.Module) -> bool:
    head, emb = getattr(model, "lm_head", None), getattr(model, "tok_embeddings", None)
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_embeddings", False)) or (
        head is not None and emb is not None and head.weight is emb.weight)


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               targets: Sequence[str] = ("attn",)) -> list[str]:
    """Wrap the Linear layers named by ``targets`` in :class:`LoRALinear`, in place.

    Every other parameter is frozen (``requires_grad=False``); only the adapters train.
    Returns the wrapped module names (e.g. ``layers.0.attn.wq``).
    """
    names = validate_lora(rank, alpha, dropout, targets)
    if lora_modules(model):
        raise ConfigError("sft.lora: the model already has LoRA adapters (merge_lora first, "
                          "or load the adapter into a fresh base model)")
    if "lm_head" in names and _is_tied_head(model):
        raise ConfigError("sft.lora.targets: lm_head is tied to the input embedding "
                          "(model.tie_embeddings); drop it from targets")
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names]
    missing = set(names) - {n.rsplit(".", 1)[-1] for n, _ in found}
    if missing:
        raise ConfigError(f"sft.lora.targets: {', '.join(sorted(missing))} match no "
                          "nn.Linear layer in the model")
    model.requires_grad_(False)
    for name, linear in found:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoRALinear(linear, rank, alpha, dropout))
    return [n for n, _ in found]


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each :class:`LoRALinear` by a plain ``nn.Linear`` holding the merged weight.

    In place (``copy.deepcopy`` first to keep training the adapters). The merged weights
    keep the base's ``requires_grad`` (False); the state_dict keys are the base's again.
    """
    for name, lora in lora_modules(model).items():
        base = lora.base
        merged = nn.Linear(lora.in_features, lora.out_features, bias=False, device="meta")
        merged.weight = nn.Parameter(lora.merged_weight(),
                                     requires_grad=base.weight.requires_grad)
        merged.bias = base.bias
        merged.train(base.training)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, merged)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only: ``{module}.lora_a`` / ``{module}.lora_b``, CPU, contiguous."""
    state = {}
    for name, m in lora_modules(model).items():
        state[f"{name}.lora_a"] = m.lora_a.detach().cpu().contiguous()
        state[f"{name}.lora_b"] = m.lora_b.detach().cpu().contiguous()
    return state


def checkpoint_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a training checkpoint keeps of ``model``: with adapters, the adapters alone
    (the frozen base is the run's ``init_from``, whose sha256 is in the run's identity,
    so a resumed run rebuilds it from there); without, the whole state."""
    return lora_state_dict(model) if lora_modules(model) else model.state_dict()


def load_checkpoint_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load :func:`checkpoint_weights` (or a whole state, as LoRA checkpoints held before)
    into ``model``: every key it names must be the model's, and whatever it leaves out
    must be frozen."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trained & set(missing):
        bad = sorted(unexpected) or sorted(trained & set(missing))
        raise InputError(f"checkpoint weights do not fit the model ({len(bad)} keys, e.g. "
                         f"{bad[0]}): another model's checkpoint")


def lora_settings(model: nn.Module) -> dict[str, Any]:
    """rank / alpha / dropout / targets / modules of the model's adapters."""
    mods = lora_modules(model)
    if not mods:
        raise ConfigError("sft.lora: the model has no LoRA adapters")
    first = next(iter(mods.values()))
    if any((m.rank, m.alpha, m.p_dropout) != (first.rank, first.alpha, first.p_dropout)
           for m in mods.values()):
        raise ConfigError("sft.lora: adapters with different rank/alpha/dropout")
    leaves = {n.rsplit(".", 1)[-1] for n in mods}
    return {"rank": first.rank, "alpha": first.alpha, "dropout": first.p_dropout,
            "targets": [t for t in TARGETS if t in leaves], "modules": sorted(mods)}


def save_adapter(model: nn.Module, path: str | os.PathLike,
                 config: dict[str, Any] | None = None) -> None:
    """Write directory ``path``: ``adapter.safetensors`` + ``adapter.json``, atomically.

    ``adapter.json`` holds rank, alpha, dropout, targets and modules, plus ``config``'s
    entries (e.g. ``{"base_model_sha256": ...}``), which may not contradict them.
    """
    meta = {"format": ADAPTER_FORMAT, **lora_settings(model)}
    for key, value in (config or {}).items():
        if key in meta and meta[key] != value:
            raise ConfigError(f"save_adapter: {key}={value!r} contradicts the model's "
                              f"adapters ({meta[key]!r})")
        meta[key] = value
    with atomic_dir(path) as tmp:
        save_file(lora_state_dict(model), str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        write_json(tmp / ADAPTER_CONFIG, meta)


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    """``path``/adapter.json, checked."""
    cfg_path = Path(path) / ADAPTER_CONFIG
    meta = read_json_object(cfg_path, "no adapter config (not a save_adapter directory)")
    if meta.get("format") != ADAPTER_FORMAT:
        raise InputError(f"{cfg_path}: not an {ADAPTER_FORMAT} adapter")
    try:
        validate_lora(meta["rank"], meta["alpha"], meta["dropout"], meta["targets"],
                      where=str(cfg_path))
    except KeyError as e:
        raise InputError(f"{cfg_path}: missing {e.args[0]!r}") from None
    except ConfigError as e:
        raise InputError(str(e)) from None
    return meta


def load_adapter(model: nn.Module, path: str | os.PathLike,
                 base_model_sha256: str | None = None) -> list[str]:
    """Load a :func:`save_adapter` directory into ``model``; returns the adapted modules.

    A plain base model is adapted first (:func:`apply_lora` with the saved settings); an
    adapted one must have the same modules and rank. With ``base_model_sha256`` given and
    recorded in adapter.json, the two must agree.
    """
    path = Path(path)
    meta = read_adapter_config(path)
    recorded = meta.get("base_model_sha256")
    if base_model_sha256 and recorded and base_model_sha256 != recorded:
        raise InputError(f"{path}: adapter was trained on base model {recorded[:12]}, "
                         f"not {base_model_sha256[:12]}")
    weights = path / ADAPTER_WEIGHTS
    try:
        state = load_file(str(weights))
    except FileNotFoundError:
        raise InputError(f"{weights}: no adapter weights") from None
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise InputError(f"{weights}: unreadable safetensors file ({e})") from None
    if not lora_modules(model):
        apply_lora(model, meta["rank"], meta["alpha"], meta["dropout"], meta["targets"])
    mods = lora_modules(model)
    expected = {f"{n}.{p}" for n in mods for p in ("lora_a", "lora_b")}
    if set(state) != expected:
        diff = sorted(set(state) ^ expected)
        raise InputError(f"{weights}: adapter tensors do not match the model's adapters "
                         f"({len(diff)} differ, e.g. {diff[0]})")
    with torch.no_grad():
        for key, tensor in state.items():
            module, _, param = key.rpartition(".")
            target = getattr(mods[module], param)
            if target.shape != tensor.shape:
                raise InputError(f"{weights}: {key} has shape {tuple(tensor.shape)}, the "
                                 f"model expects {tuple(target.shape)}")
            target.copy_(tensor)
    return sorted(mods)


def trainable_parameters(model: nn.Module) -> int:
    """Parameters with ``requires_grad`` (a shared tensor counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def adamw_state_bytes(n_trainable: int) -> int:
    """AdamW optimizer state: two fp32 moments (exp_avg, exp_avg_sq) per trainable parameter."""
    return 2 * 4 * n_trainable


def lora_param_count_formula(cfg: Any, vocab_size: int, rank: int,
                             targets: Iterable[str]) -> int:
    """Adapter parameters ``r * (in + out)`` summed over targets, from the config alone."""
    from lmforge.model.llama import ffn_hidden_size

    d, hd = cfg.n_embd, cfg.head_size()
    q, kv, ff = cfg.n_head * hd, (cfg.n_kv_head or cfg.n_head) * hd, ffn_hidden_size(cfg)
    shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
              "w1": (d, ff), "w3": (d, ff), "w2": (ff, d)}
    per_layer = sum(rank * sum(shapes[t]) for t in resolve_targets(targets) if t in shapes)
    head = rank * (d + vocab_size) if "lm_head" in resolve_targets(targets) else 0
    return cfg.n_layer * per_layer + head
