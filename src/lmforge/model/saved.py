"""The final model on disk: ``model.safetensors`` + ``config.json`` (+ the tokenizer)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lmforge.config import ModelConfig, from_dict
from lmforge.errors import ConfigError, InputError
from lmforge.io import atomic_dir, atomic_path, read_json_object, write_json
from lmforge.model.llama import Llama
from lmforge.tokenizer.files import copy_tokenizer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.model"


def model_state(model: Llama) -> dict[str, torch.Tensor]:
    """The weights to save: contiguous CPU tensors, a tied LM head stored once."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_weights(model: Llama, path: str | os.PathLike) -> None:
    """Write the model's weights as safetensors, atomically."""
    with atomic_path(path) as tmp:
        save_file(model_state(model), str(tmp), metadata={"format": "pt"})


def save_model(model: Llama, directory: str | os.PathLike,
               tokenizer: str | os.PathLike | None = None, **extra: Any) -> None:
    """Write ``directory`` whole (weights, config.json with ``extra``, tokenizer copy), atomically.

    ``tokenizer``: a tokenizer file or folder (``models/tokenizer``), either backend.
    """
    with atomic_dir(directory) as tmp:
        save_file(model_state(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
        write_json(tmp / CONFIG, model_config_dict(model, **extra))
        if tokenizer is not None:  # its files as they are, whichever backend
            copy_tokenizer(tokenizer, tmp)


def model_config_dict(model: Llama, **extra: Any) -> dict[str, Any]:
    """``config.json`` content: the model section, vocab size and ``extra`` fields."""
    return {"model": dataclasses.asdict(model.config), "vocab_size": model.vocab_size, **extra}


def load_model(directory: str | os.PathLike, device: str | torch.device = "cpu"
               ) -> tuple[Llama, dict[str, Any]]:
    """Load ``directory``/model.safetensors + config.json -> (model in eval mode, config dict).

    ``directory`` may also be a full training checkpoint file (``step-*.pt``).

    The config dict holds ``model`` (the ModelConfig fields), ``vocab_size``,
    ``special_ids`` and ``tokenizer_sha256`` as written by the train stage.
    """
    directory = Path(directory)
    if directory.is_file():
        return load_checkpoint_model(directory, device)
    cfg_path, weights_path = directory / CONFIG, directory / WEIGHTS
    model_cfg, vocab_size, config = read_config(directory)
    with torch.device("meta"):
        model = Llama(model_cfg, vocab_size)
    try:
        state = load_file(str(weights_path))
    except FileNotFoundError:
        raise InputError(f"{weights_path}: no weights file (run the train stage)") from None
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise InputError(f"{weights_path}: unreadable safetensors file ({e})") from None
    if model_cfg.tie_embeddings:
        state["lm_head.weight"] = state.get("tok_embeddings.weight")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, TypeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{weights_path}: weights do not match {cfg_path} ({first})") from None
    if model_cfg.tie_embeddings:
        model.lm_head.weight = model.tok_embeddings.weight
    # The RoPE tables are non-persistent buffers, still on the meta device: rebuild them.
    model.rope_cos, model.rope_sin = _rope_buffers(model_cfg)
    return model.to(device).eval(), config


def read_config(directory: str | os.PathLike) -> tuple[ModelConfig, int, dict[str, Any]]:
    """A model directory's ``config.json``, checked: (model config, vocab size, the dict)."""
    cfg_path = Path(directory) / CONFIG
    config = read_json_object(cfg_path, "no model config (run the train stage)")
    refuse_hf_config(Path(directory), config)
    try:
        model_cfg = from_dict(ModelConfig, config["model"], "model.")
        model_cfg.validate()
        vocab_size = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise InputError(f"{cfg_path}: bad model config ({e})") from None
    return model_cfg, vocab_size, config


def refuse_hf_config(directory: Path, config: dict[str, Any]) -> None:
    """One line sending a Hugging Face folder (a config.json with ``model_type`` or
    ``architectures``, not lmforge's ``model`` section) to ``import hf``, rather than
    "bad model config ('model')" from every command that loads a model."""
    if "model" not in config and ("model_type" in config or "architectures" in config):
        raise InputError(f"{directory} is a Hugging Face folder; import it with `lmforge "
                         f"import hf {directory} --out DIR` first, then use DIR")


def load_checkpoint_model(path: str | os.PathLike, device: str | torch.device = "cpu"
                          ) -> tuple[Llama, dict[str, Any]]:
    """The model of a full training checkpoint (``models/checkpoints/step-*.pt``)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or not a torch file
        raise InputError(f"{path}: unreadable checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or "model_config" not in state:
        raise InputError(f"{path}: not a full training checkpoint with its model config")
    try:
        model_cfg = from_dict(ModelConfig, state["model_config"], "model.")
        model_cfg.validate()
    except ConfigError as e:
        raise InputError(f"{path}: bad model config ({e})") from None
    if state.get("lora"):  # a LoRA run's checkpoint: adapters on the base it names
        model = _adapted_base(path, state, model_cfg)
    else:
        model = Llama(model_cfg, int(state["vocab_size"]))
        weights = state["model"]
        if state.get("sharded"):  # FSDP: the weights are the shards in step-N.dcp/
            weights = _load_shards(path.parent / state["sharded"], model)
        model.load_state_dict(weights)
    config = {"model": state["model_config"], "vocab_size": int(state["vocab_size"]),
              "step": state.get("step")}
    return model.to(device).eval(), config


def _adapted_base(path: Path, state: dict[str, Any], model_cfg: ModelConfig) -> Llama:
    """The base a LoRA checkpoint names, held in the dtype it trained with, its adapters
    loaded and merged (in fp32, as the fine-tuning stage saves its model)."""
    from lmforge.model.frozen import hold_frozen_in, restore_fp32
    from lmforge.model.lora import apply_lora, load_checkpoint_weights, merge_lora

    base = state.get("base")
    if not base or not ((Path(base) / WEIGHTS).is_file() or Path(base).is_file()):
        raise InputError(f"{path}: a LoRA run's checkpoint holds its adapters only, and its "
                         f"base model {base or '(unnamed)'} is not there")
    model = extend_context(load_model(base)[0], model_cfg.seq_len)
    lora = state["lora"]
    apply_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["targets"])
    hold_frozen_in(model, state.get("base_dtype", "fp32"))
    load_checkpoint_weights(model, state["model"])
    return restore_fp32(merge_lora(model))


def _load_shards(directory: Path, model: Llama) -> dict[str, torch.Tensor]:
    """The whole model's weights from an FSDP checkpoint's DCP shards, in this process
    (DCP reads every rank's shards when no process group is running)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(directory))
    except Exception as e:  # missing or partial shards
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"{directory}: unreadable sharded checkpoint ({first})") from None
    return state["model"]


def extend_context(model: Llama, seq_len: int) -> Llama:
    """The same model reading up to ``seq_len`` tokens (in place; never shortened).

    RoPE has no learned positions: only the cos/sin tables grow. For comparing a base
    model with a model fine-tuned at a longer context on the same sequences.
    """
    if seq_len > model.config.seq_len:
        model.config = dataclasses.replace(model.config, seq_len=seq_len)
        device = model.rope_cos.device
        cos, sin = _rope_buffers(model.config)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


def _rope_buffers(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    from lmforge.model.llama import rope_tables_for

    return rope_tables_for(cfg)
