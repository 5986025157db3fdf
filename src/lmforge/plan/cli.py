"""``lmforge plan``: the command line, and the tables it prints.

The command reads the model and the run's knobs from params.yaml (a section, a preset
``--shape``, overrides), then prints the pretraining plan of :mod:`lmforge.plan.pretrain`
(per rank, DDP beside FSDP2) or, with ``--mode``, the fine-tuning plan of
:mod:`lmforge.plan.finetune` (one device, without and with activation checkpointing);
``--json`` prints the plan's document instead of its table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from lmforge.config import LoraConfig, ModelConfig, Params, load_params
from lmforge.errors import ConfigError
from lmforge.plan import finetune, pretrain
from lmforge.plan.finetune import Tune, finetune_plan, targets_from
from lmforge.plan.memory import FRAGMENTATION, RESERVE_GIB, reserve_bytes
from lmforge.plan.pretrain import NOT_APPLICABLE, ROWS, STRATEGIES, plan
from lmforge.plan.shapes import GIB, SHAPES, Setup, format_count, format_size

PRECISIONS = ("bf16", "fp16", "fp32")
TOKENIZER = Path("models/tokenizer")  # the pipeline's, beside params.yaml (either backend)
# train.fused_loss: auto. A plan on a GPU assumes the plain loss where the step fits with
# it, else the chunked one; on a CPU (--mode --device cpu) the chunked one, as a run takes.
AUTO = "auto"


# --------------------------------------------------------------------------- tables


def loss_knob(fused: bool, auto: bool = False) -> list[str]:
    """How a table's first line names the loss: nothing for the chunked one (the
    default before ``auto``), "plain loss", or what ``fused_loss: auto`` was planned as."""
    if auto:
        return [f"fused_loss auto: {'chunked' if fused else 'plain'} loss"]
    return [] if fused else ["plain loss"]


def format_table(p: dict[str, Any], source: str, auto_loss: bool = False) -> str:
    """The pretraining plan (:func:`lmforge.plan.pretrain.plan`) as the table ``lmforge plan``
    prints (``auto_loss``: its fused_loss was resolved from ``auto``)."""
    m = p["model"]
    knobs = ([p["precision"]] + (["activation checkpointing"] if p["activation_checkpointing"]
                                 else []) + loss_knob(p["fused_loss"], auto_loss)
             + (["doc_mask"] if m["doc_mask"] else []))
    lines = [f"lmforge plan: {format_count(p['params'])} parameters ({source}, vocab {p['vocab']}), "
             f"seq_len {m['seq_len']}, {', '.join(knobs)}, {p['world']} x "
             f"{p['device_bytes'] / GIB:g} GiB",
             f"{'':28}{'ddp':>13}{'fsdp':>13}"]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:28}" + "".join(f"{c:>13}" for c in cells))

    optimizer = "Muon/AdamW" if p["optimizer"] == "muon" else "AdamW"
    for key, label in ROWS:
        label = f"{label} ({optimizer})" if key == "optimizer" else label
        row(label, ["-" if key in NOT_APPLICABLE[st] else format_size(p[st][key])
                    for st in STRATEGIES])
    row("activations/seq", [format_size(p[st]["activations_per_seq"]) for st in STRATEGIES])
    mb = p["micro_batch"]
    row(f"total @ micro-batch {mb}", [format_size(p[st]["total"]) + ("" if p[st]["fits"] else "!")
                                      for st in STRATEGIES])
    if not p["fused_loss"]:  # Inductor fuses the plain loss: its fp32 passes never exist
        row("total, compiled", [format_size(p[st]["total_compiled"]) for st in STRATEGIES])
    row("fits micro-batch", [str(p[st]["max_micro_batch"]) for st in STRATEGIES])
    lines.append(f"budget {format_size(p['budget_bytes'])} = {p['device_bytes'] / GIB:g} GiB - "
                 f"reserve {format_size(p['reserve_bytes'])} (CUDA context and workspaces + "
                 f"{FRAGMENTATION:.0%} for allocator fragmentation); '!' = over budget")
    lines.append("assumes flash / memory-efficient SDPA (no s x s scores), eager autograd "
                 "(torch.compile keeps less; 'compiled': the plain loss fused), gradients "
                 "resident; GiB = 2^30 bytes")
    if p["optimizer"] == "muon":
        lines.append("optimizer: Muon (one fp32 buffer) on the blocks' matrices, AdamW on the "
                     "rest; fsdp plans AdamW, as Muon is refused under FSDP")
    return "\n".join(lines)


def format_finetune_table(p: dict[str, Any], source: str, auto_loss: bool = False) -> str:
    """The fine-tuning plan (:func:`lmforge.plan.finetune.finetune_plan`) as ``lmforge plan
    --mode`` prints it (``auto_loss`` as for :func:`format_table`)."""
    m = p["model"]
    what = {"full": "full fine-tuning",
            "lora": f"LoRA r={p.get('rank')} on {','.join(p.get('targets', []))}",
            "qlora": f"QLoRA (NF4 base) r={p.get('rank')} on {','.join(p.get('targets', []))}"}
    extra = (f", {format_count(p['adapter_params'])} adapter parameters"
             if p["mode"] != "full" else "")
    knobs = [p["precision"]] + loss_knob(p["fused_loss"], auto_loss) + (
        ["doc_mask"] if m["doc_mask"] else [])
    where = "GiB GPU" if p["device"] == "cuda" else "GiB CPU RAM"
    lines = [f"lmforge plan: {what[p['mode']]} of {format_count(p['params'])} parameters "
             f"({source}, vocab {p['vocab']}){extra}, seq_len {m['seq_len']}, "
             f"{', '.join(knobs)}, 1 x {p['device_bytes'] / GIB:g} {where}",
             f"{'':32}{'no AC':>13}{'AC':>13}"]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:32}" + "".join(f"{c:>13}" for c in cells))

    cols = ("no_ac", "ac")
    for key, label in p["labels"].items():
        row(label, [format_size(p[c][key]) for c in cols])
    row("activations/seq", [format_size(p[c]["activations_per_seq"]) for c in cols])
    row(f"total @ micro-batch {p['micro_batch']}",
        [format_size(p[c]["total"]) + ("" if p[c]["fits"] else "!") for c in cols])
    row("fits micro-batch", [str(p[c]["max_micro_batch"]) for c in cols])
    lines.append(f"budget {format_size(p['budget_bytes'])} = {p['device_bytes'] / GIB:g} GiB"
                 f" - reserve {format_size(p['reserve_bytes'])} (fixed + {FRAGMENTATION:.0%} "
                 "for fragmentation); '!' = over budget; AC = activation checkpointing")
    lines.append(f"verdict: {p['verdict']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _section_knobs(params: Params, section: str) -> tuple[Any, ModelConfig]:
    """The section's run knobs and the model it trains (fine-tuning's context and mask)."""
    cfg = getattr(params, section)
    model = params.model
    if section == "sft":
        model = dataclasses.replace(model, seq_len=params.sft_data.seq_len,
                                    doc_mask=params.sft.doc_mask)
    elif section == "dpo":
        model = dataclasses.replace(model, seq_len=params.dpo_data.seq_len, doc_mask=True)
    return cfg, model


def _vocab(args: argparse.Namespace, params: Params, preset: dict[str, Any] | None,
           params_path: Path) -> tuple[int, str]:
    """The vocabulary: --vocab, the preset's, the built tokenizer's, or tokenizer.vocab_size."""
    if args.vocab is not None:
        return args.vocab, "--vocab"
    if preset is not None:
        return preset["vocab"], "preset"
    from lmforge.tokenizer.files import find_tokenizer

    for path in (params.tokenizer.init_from, params_path.parent / TOKENIZER):
        if path and find_tokenizer(path) is not None:
            from lmforge.tokenizer import Tokenizer

            return Tokenizer.load(path).vocab_size, str(path)
    return params.tokenizer.vocab_size, "tokenizer.vocab_size"


OVERRIDES = ("n_layer", "n_head", "n_kv_head", "n_embd", "seq_len", "ffn_multiple_of",
             "tie_embeddings", "doc_mask")


def build_setup(args: argparse.Namespace,
                params: Params | None = None) -> tuple[Setup, int, dict[str, str]]:
    """The Setup the command line asks about, the micro-batch to total, and where the
    model, the vocabulary and, under ``fused_loss: auto``, the loss path came from
    (``params``: args.params, already loaded)."""
    for name, low in (("world", 1), ("vocab", 1), ("micro_batch", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ConfigError(f"plan: --{name.replace('_', '-')} must be >= {low}, got {value}")
    if not args.device_gb > 0 or args.reserve_gb < 0:
        raise ConfigError("plan: --device-gb must be > 0 and --reserve-gb >= 0")
    params = params or load_params(args.params)
    cfg, model = _section_knobs(params, args.section)
    preset = None
    source = f"model from {args.params}" + ("" if args.section == "train"
                                            else f" [{args.section}]")
    if args.shape is not None:
        preset = SHAPES[args.shape]
        model = dataclasses.replace(model, **{k: v for k, v in preset.items()
                                              if k not in ("vocab", "name")})
        source = preset["name"]
    changed = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    if changed:
        model = dataclasses.replace(model, **changed)
        source += ", " + " ".join(f"{k}={v}" for k, v in changed.items())
    try:
        model.validate()
    except ConfigError as e:
        raise ConfigError(f"plan: {e}") from None
    vocab, vocab_source = _vocab(args, params, preset, Path(args.params))
    precision = args.precision or cfg.precision
    precision = "bf16" if precision == "auto" else precision  # planning for a recent GPU
    fused = cfg.fused_loss if args.fused_loss is None else args.fused_loss
    if args.section == "dpo":
        fused = False  # DPO scores sequences from the full logits (train/preference.py)
    setup = Setup(model=model, vocab=vocab, precision=precision,
                  world=args.world or cfg.nproc,
                  activation_checkpointing=(cfg.activation_checkpointing
                                            if args.activation_checkpointing is None
                                            else args.activation_checkpointing),
                  fused_loss=fused is not False, optimizer=cfg.optimizer)
    micro_batch = args.micro_batch or cfg.micro_batch_size
    sources = {"model": source, "vocab": vocab_source}
    if fused == AUTO:  # planned as the run would hold it under the section's strategy
        setup = dataclasses.replace(setup, fused_loss=pretrain.auto_fused_loss(
            setup, cfg.strategy, micro_batch, _budget(args)))
        sources["fused_loss"] = AUTO
    return setup, micro_batch, sources


def _budget(args: argparse.Namespace) -> int:
    """The bytes a plan may fill: --device-gb less the reserve (as the plans count it)."""
    device = int(args.device_gb * GIB)
    return device - reserve_bytes(device, args.reserve_gb)


def build_tune(args: argparse.Namespace) -> tuple[Tune, int, dict[str, str]]:
    """The Tune ``lmforge plan --mode`` asks about, its micro-batch (default 1) and sources.

    Model, vocabulary and knobs as for the strategies table (``--section``, ``--shape``,
    overrides); one device unless ``--world`` says otherwise (then refused); rank and
    targets from ``--rank`` / ``--targets``, else the section's ``lora``, else
    :class:`lmforge.config.LoraConfig`'s defaults.
    """
    params = load_params(args.params)
    setup, _, source = build_setup(args, params)
    if args.world is None:
        setup = dataclasses.replace(setup, world=1)
    # Fine-tuning plans AdamW (the rows say so), whatever the section's optimizer: the
    # sft/dpo sections default to it, LoRA adapters always use it, and Muon is the
    # pretraining default (lmforge plan without --mode plans that).
    setup = dataclasses.replace(setup, optimizer="adamw")
    lora = getattr(getattr(params, args.section), "lora", None) or LoraConfig()
    tune = Tune(setup=setup, mode=args.mode,
                rank=args.rank if args.rank is not None else lora.rank,
                targets=targets_from(args.targets if args.targets is not None
                                     else lora.targets),
                device=args.device)
    micro_batch = args.micro_batch or 1
    if source.get("fused_loss") == AUTO:  # re-planned for this mode, device and batch
        fused = finetune.auto_fused_loss(tune, micro_batch, _budget(args))
        tune = dataclasses.replace(tune, setup=dataclasses.replace(setup, fused_loss=fused))
    return tune, micro_batch, source


def cmd_plan(args: argparse.Namespace) -> None:
    """``lmforge plan``: print the per-rank memory table (or its JSON); with ``--mode``,
    the fine-tuning table of one device (:mod:`lmforge.plan.finetune`)."""
    if args.mode is not None:
        tune, micro_batch, source = build_tune(args)
        result = finetune_plan(tune, args.device_gb, micro_batch, args.reserve_gb)
        if args.json:
            print(json.dumps({"source": source, **result}, indent=2))
        else:
            print(format_finetune_table(result, source["model"], source.get("fused_loss") == AUTO))
        return
    setup, micro_batch, source = build_setup(args)
    result = plan(setup, args.device_gb, micro_batch, args.reserve_gb)
    if args.json:
        print(json.dumps({"source": source, **result}, indent=2))
    else:
        print(format_table(result, source["model"], source.get("fused_loss") == AUTO))


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan``: per-rank memory under DDP and FSDP, and the micro-batch that fits."""
    p = subparsers.add_parser(
        "plan", help="per-rank memory of a training run under DDP and FSDP, before launch")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--section", choices=("train", "sft", "dpo"), default="train",
                   help="the section whose knobs (micro-batch, precision, ...) to plan")
    p.add_argument("--device-gb", type=float, default=80.0,
                   help="memory per device in GiB (default: 80)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default: the section's nproc)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: the tokenizer's)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: the section's (auto = bf16)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="micro-batch whose total to print (default: the section's)")
    p.add_argument("--reserve-gb", type=float, default=RESERVE_GIB,
                   help=f"fixed reserve in GiB, plus {FRAGMENTATION:.0%}% of the device for "
                        "fragmentation "
                        f"(default: {RESERVE_GIB:g})")
    p.add_argument("--shape", choices=list(SHAPES), default=None,
                   help="a preset model shape instead of params.yaml's (1b, 3b: Llama-3.2; "
                        "7b: Llama-2-7B; mistral-7b; 8b: Llama-3.1-8B; qwen2.5-7b)")
    for name in OVERRIDES[:6]:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    for name in ("tie_embeddings", "doc_mask", "activation_checkpointing", "fused_loss"):
        p.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                       default=None)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--mode", choices=("full", "lora", "qlora"), default=None,
                   help="fine-tuning on one device instead of the DDP/FSDP table: full, "
                        "LoRA (bf16 frozen base) or QLoRA (NF4 frozen base); micro-batch "
                        "1 unless --micro-batch")
    p.add_argument("--rank", type=int, default=None,
                   help="with --mode lora/qlora: adapter rank (default: the section's "
                        "lora, else 8)")
    p.add_argument("--targets", default=None,
                   help="with --mode lora/qlora: comma-separated Linears or groups "
                        "(attn, mlp; default: the section's lora, else attn,mlp)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="with --mode: a GPU of --device-gb, or that much CPU RAM")
    p.set_defaults(func=cmd_plan)
    return p
