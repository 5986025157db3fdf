"""``lmforge export hf`` / ``lmforge import hf``: our model dir <-> a Hugging Face folder.

Our model dir (``models/final``) holds ``model.safetensors``, ``config.json`` and
``tokenizer.model``; a Hugging Face folder of a Llama, Mistral, Qwen2 or Qwen3 model
holds ``config.json`` (``export.hf_config`` maps it, and refuses what we do not compute),
``model.safetensors`` (or shards + ``model.safetensors.index.json``),
``generation_config.json`` and tokenizer files. The weights are the same tensors under
other names, so both directions are exact.

A model whose tokenizer carries the chat markers (a fine-tuned one) is exported as a chat
model: tokenizer_config.json holds ``chat_template`` (so ``apply_chat_template`` gives our
``generation_prompt`` ids) and the markers are special tokens. For every chat model,
ours or imported, ``eos_token_id`` in config.json and generation_config.json lists the
template's end of turn (``<|end|>``, ``<|im_end|>``, ``<|eot_id|>``) and every other id
it stops at, with EOS, so ``generate`` stops at the end of the assistant's turn whether
or not EOS is that token (:mod:`lmforge.export.chat_stops`). An imported model's own
generation_config.json (kept by ``import hf``) goes out as it came in, its sampling
defaults included; only stop ids it lacks are added.

Both commands write a marker file (``.lmforge-export``) into their output folder, and
replace an existing folder only when it is empty or holds that marker: a folder the user
made, or the train stage's ``models/final``, is never deleted unless they pass --force.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lmforge import __version__
from lmforge.errors import InputError
from lmforge.export.chat_stops import ChatStops, chat_stops
from lmforge.export.hf_config import from_hf_config, to_hf_config
from lmforge.export.hf_names import hf_name, our_name, to_hf_state
from lmforge.export.hf_tokenizer import TOKENIZER_MODEL, write_hf_tokenizer
from lmforge.io import atomic_dir, read_json_object, write_json
from lmforge.model.llama import Llama
from lmforge.model.saved import CONFIG, WEIGHTS, load_model, model_state, save_model
from lmforge.tokenizer import HF_FILE, Tokenizer
from lmforge.tokenizer.files import copy_tokenizer, find_tokenizer, is_hf_file

HF_INDEX = "model.safetensors.index.json"
# Written by export and import alike: the one proof that a folder is ours to replace.
MARKER = ".lmforge-export"
GENERATION_CONFIG = "generation_config.json"
# What import copies beside the weights as it is (whichever exist): the tokenizer and the
# model's generation defaults.
TOKENIZER_FILES = (TOKENIZER_MODEL, HF_FILE, "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", GENERATION_CONFIG)


def export_hf(model_dir: str | Path, out_dir: str | Path, *, force: bool = False) -> Path:
    """Write ``model_dir`` (ours) as a Hugging Face Llama folder at ``out_dir``; return it.

    An existing ``out_dir`` is replaced only when it is empty or an earlier lmforge
    export/import, or when ``force`` is set.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    _check_writable(out_dir, model_dir, force)
    model, config = load_model(model_dir)
    tok_path = model_tokenizer(model_dir, config)
    special = config.get("special_ids") or {}
    chat = chat_stops(tok_path)
    state = to_hf_state(model_state(model))
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    hf_config = to_hf_config(model.config, model.vocab_size, special, dtype)
    generation = _generation_config(model_dir, special, chat)
    # config.json stops where generation_config.json does: some readers (vLLM, older
    # transformers pipelines) take the stop ids from config.json alone.
    hf_config["eos_token_id"] = generation.get("eos_token_id")
    with atomic_dir(out_dir) as tmp:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        write_json(tmp / CONFIG, hf_config)
        if is_hf_file(tok_path):  # a model's own tokenizer goes out as it came in
            copy_tokenizer(tok_path, tmp)
        else:
            write_hf_tokenizer(tok_path, tmp, special, model.config.seq_len,
                               chat_template=chat.template if chat is not None else None)
        # After the tokenizer's files, which include the source's generation_config.json:
        # this one adds the stop ids it may lack.
        _write_generation_config(tmp, model_dir, generation)
        _write_marker(tmp, "export hf", model_dir,
                      tokenizer="hf" if is_hf_file(tok_path) else "sentencepiece")
    return out_dir


def model_tokenizer(model_dir: Path, config: dict[str, Any]) -> Path:
    """The tokenizer file beside the model, checked against the one it was trained with
    (``tokenizer_sha256`` in its config.json); one line when missing or different."""
    tok_path = find_tokenizer(model_dir)
    if tok_path is None:
        raise InputError(f"{model_dir}: no tokenizer beside the model ({HF_FILE} or "
                         f"{TOKENIZER_MODEL}; run the train stage)")
    want = config.get("tokenizer_sha256")
    if want and _sha256(tok_path) != want:
        raise InputError(f"{tok_path}: does not match the tokenizer the model was trained with "
                         f"(sha256 {want[:12]})")
    return tok_path


def _generation_config(model_dir: Path, special: dict[str, int], chat: ChatStops | None
                       ) -> dict[str, Any]:
    """generation_config.json: the model's own when it came with one (``import hf`` keeps
    it beside the weights), else its bos/pad ids and our sampling defaults; either way
    ``eos_token_id`` holds every id its chat template stops at, the end of turn first,
    and the tokenizer's EOS."""
    stops = list(chat.ids) if chat is not None else []
    eos = special.get("eos", -1)
    if eos is not None and eos >= 0 and eos not in stops:
        stops.append(eos)
    if (model_dir / GENERATION_CONFIG).is_file():
        source = read_json_object(model_dir / GENERATION_CONFIG)
        return _with_stops(source, _stop_value(source.get("eos_token_id"), stops))
    ids = {f"{k}_token_id": special[k] for k in ("bos", "pad")
           if special.get(k) is not None and special[k] >= 0}
    return _with_stops({**ids, "do_sample": True, "temperature": 0.8, "top_k": 50},
                       _stop_value(None, stops))


def _write_generation_config(out_dir: Path, model_dir: Path, generation: dict[str, Any]
                             ) -> None:
    """The model's own file byte for byte when nothing in it changed, else ``generation``."""
    source = model_dir / GENERATION_CONFIG
    if source.is_file() and read_json_object(source) == generation:
        shutil.copyfile(source, out_dir / GENERATION_CONFIG)
    else:
        write_json(out_dir / GENERATION_CONFIG, generation)


def _stop_value(source: Any, stops: list[int]) -> int | list[int] | None:
    """``eos_token_id``: the source's ids in its order, then the stops it lacks; one id
    as a number (as transformers writes it), several as a list, none as None."""
    have = [i for i in (source if isinstance(source, list) else [source])
            if isinstance(i, int) and not isinstance(i, bool)]
    ids = have + [i for i in stops if i not in have]
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _with_stops(config: dict[str, Any], stops: int | list[int] | None) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k != "eos_token_id"}
    return out if stops is None else {**out, "eos_token_id": stops}


def import_hf(in_dir: str | Path, out_dir: str | Path, seq_len: int | None = None, *,
              force: bool = False) -> Path:
    """Convert a Hugging Face Llama folder into our model dir format at ``out_dir``; return it.

    ``seq_len`` caps the context (default: the checkpoint's ``max_position_embeddings``).
    The weights are stored in fp32, as training keeps them. The tokenizer files are
    copied along as they are (:data:`TOKENIZER_FILES`, whichever exist); the tokenizer
    (``tokenizer.json`` when present, else ``tokenizer.model``) gives ``tokenizer_sha256``
    and the special ids. A folder without a tokenizer we can load is refused.
    An existing ``out_dir`` is replaced only when it is empty or an earlier lmforge
    export/import, or when ``force`` is set.
    """
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    _check_writable(out_dir, in_dir, force)
    cfg_path = in_dir / CONFIG
    hf = read_json_object(cfg_path)
    cfg, vocab_size = from_hf_config(hf, str(cfg_path), seq_len)
    state = _our_state(_read_hf_weights(in_dir), cfg.tie_embeddings, in_dir)
    with torch.device("meta"):
        model = Llama(cfg, vocab_size)
    _check_tensor_names(state, model, in_dir, cfg_path)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
        raise InputError(f"{in_dir}: weights do not match {cfg_path} ({first})") from None
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_embeddings.weight
    tokenizer, files = _import_tokenizer(in_dir, vocab_size)
    special = _special_ids(tokenizer)
    extra: dict[str, Any] = {"special_ids": special, "source": {"hf": str(in_dir.resolve())},
                             "tokenizer_sha256": tokenizer.sha256}
    # save_model writes the folder the train stage writes; the outer atomic_dir adds the
    # marker and swaps model, tokenizer and marker into place together.
    with atomic_dir(out_dir) as tmp:
        save_model(model, tmp, None, **extra)
        for name in files:
            shutil.copyfile(in_dir / name, tmp / name)
        _write_marker(tmp, "import hf", in_dir)
    return out_dir


def _read_hf_weights(in_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index lists."""
    index = in_dir / HF_INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputError(f"{index}: no 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif (in_dir / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        found = [p.name for p in in_dir.glob("*.bin")]
        hint = (f"; found {found[0]}: convert it to safetensors first"
                if found else "")
        raise InputError(f"{in_dir}: no {WEIGHTS} or {HF_INDEX}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = in_dir / name
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 -- safe_open has no __iter__
                    tensors[key] = f.get_tensor(key)
        except FileNotFoundError:
            raise InputError(f"{path}: listed in {HF_INDEX} but missing") from None
        except Exception as e:  # safetensors raises its own error types
            raise InputError(f"{path}: unreadable safetensors file ({e})") from None
    return tensors


def _our_state(tensors: dict[str, torch.Tensor], tied: bool, in_dir: Path
               ) -> dict[str, torch.Tensor]:
    """Rename to our names and upcast to fp32; a tied head is taken from the embedding."""
    state: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        try:
            name = our_name(key)
        except KeyError:
            raise InputError(f"{in_dir}: tensor '{key}' has no counterpart in lmforge's "
                             "decoder (not a Llama, Mistral, Qwen2 or Qwen3 weight)") from None
        if name is not None:
            state[name] = value.float() if value.is_floating_point() else value
    if tied:
        # Some exports store the tied head anyway; it must be the embedding itself.
        head = state.pop("lm_head.weight", None)
        emb = state.get("tok_embeddings.weight")
        if head is not None and emb is not None and not torch.equal(head, emb):
            raise InputError(f"{in_dir}: tie_word_embeddings is true but lm_head.weight "
                             "differs from the embedding")
        if emb is not None:
            state["lm_head.weight"] = emb
    return state


def _check_tensor_names(state: dict[str, torch.Tensor], model: Llama, in_dir: Path,
                        cfg_path: Path) -> None:
    """The checkpoint's tensors are exactly those of the model its config.json describes;
    one line naming the first that is not (in the checkpoint's own names)."""
    expected = set(model.state_dict())
    extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
    family = model.config.family
    if extra:
        raise InputError(f"{in_dir}: tensor '{hf_name(extra[0])}' does not belong to the "
                         f"{family} model {cfg_path} describes")
    if missing:
        raise InputError(f"{in_dir}: no tensor '{hf_name(missing[0])}', which the {family} "
                         f"model {cfg_path} describes has")


def _import_tokenizer(in_dir: Path, vocab_size: int) -> tuple[Tokenizer, list[str]]:
    """The tokenizer of an HF folder, loaded, and the files to copy with it.

    A folder without one, a file we cannot load, or ids past the embedding are refused
    in one line: a model is never imported without its tokenizer. A folder that
    ``export hf`` wrote from a sentencepiece model brings back that ``tokenizer.model``
    alone (its tokenizer.json is a conversion of it), so the model keeps its identity.
    """
    path = find_tokenizer(in_dir)
    if path is None:
        raise InputError(f"{in_dir}: no tokenizer ({HF_FILE} or {TOKENIZER_MODEL}); the "
                         "model is imported with its own tokenizer or not at all")
    files = [n for n in TOKENIZER_FILES if (in_dir / n).is_file()]
    if _exported_from_sentencepiece(in_dir):
        path, files = in_dir / TOKENIZER_MODEL, [TOKENIZER_MODEL]
    tokenizer = Tokenizer.load(path)  # an unloadable file: InputError naming it
    if tokenizer.vocab_size > vocab_size:
        raise InputError(f"{path}: {tokenizer.vocab_size} tokens, but the model's embedding "
                         f"has {vocab_size} rows")
    return tokenizer, files


def _exported_from_sentencepiece(in_dir: Path) -> bool:
    """Whether ``export hf`` wrote ``in_dir`` from a model with a tokenizer.model."""
    if not (_is_ours(in_dir) and (in_dir / TOKENIZER_MODEL).is_file()):
        return False
    marker = json.loads((in_dir / MARKER).read_text(encoding="utf-8"))
    # Exports before the Hugging Face backend all came from sentencepiece models.
    return (marker.get("command") == "export hf"
            and marker.get("tokenizer", "sentencepiece") == "sentencepiece")


def _special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """bos/eos/pad/unk ids of the tokenizer (an HF tokenizer's from tokenizer_config.json,
    else config.json beside it); -1 where there is none."""
    return tokenizer.special_ids()


def _check_writable(out_dir: Path, src: Path, force: bool) -> None:
    """Refuse to replace the input, or (unless forced) a folder lmforge did not write."""
    out, inp = out_dir.resolve(), src.resolve()
    # Replacing these would delete the input itself: --force does not cover that.
    if out == inp:
        raise InputError(f"{out_dir}: output folder is the input folder")
    if out in inp.parents:
        raise InputError(f"{out_dir}: output folder holds the input {src}; choose another path")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: exists and is not a folder")
    if force or not out_dir.exists() or not any(out_dir.iterdir()) or _is_ours(out_dir):
        return
    raise InputError(f"{out_dir}: exists and is not an earlier lmforge export (no {MARKER}); "
                     "refusing to replace it: pass --force, or choose another path")


def _is_ours(directory: Path) -> bool:
    """Whether ``directory`` holds the marker an earlier ``export hf``/``import hf`` wrote."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("tool") == "lmforge"


def _write_marker(directory: Path, command: str, source: Path, **facts: str) -> None:
    """Record in ``directory`` that lmforge wrote it (and may replace it next time)."""
    # The source path as the user gave it: an absolute path would leak into uploads.
    write_json(directory / MARKER, {
        "tool": "lmforge", "version": __version__, "command": command, "source": str(source),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **facts})


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cmd_export(args: argparse.Namespace) -> None:
    """``lmforge export hf OUT_DIR``."""
    out = export_hf(args.model, args.out_dir, force=args.force)
    cls = read_json_object(out / CONFIG)["architectures"][0]
    print(f"exported {args.model} -> {out} (transformers.{cls}.from_pretrained)")


def cmd_import(args: argparse.Namespace) -> None:
    """``lmforge import hf IN_DIR --out DIR``."""
    out = import_hf(args.in_dir, args.out, seq_len=args.seq_len, force=args.force)
    print(f"imported {args.in_dir} -> {out}")


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Register ``export hf OUT_DIR [--model DIR] [--force]``; return the formats'
    subparsers, where ``export gguf`` registers too."""
    export = subparsers.add_parser("export", help="export a trained model to another format")
    formats = export.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("hf", help="Hugging Face format (the model's family: Llama, "
                                       "Mistral, Qwen2 or Qwen3)")
    hf.add_argument("out_dir", help="folder to write (replaced only if empty or an earlier "
                                    "export/import)")
    hf.add_argument("--model", default="models/final", help="our model folder")
    hf.add_argument("--force", action="store_true",
                    help="replace OUT_DIR even if lmforge did not write it")
    hf.set_defaults(func=cmd_export)
    return formats


def add_import_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``import hf IN_DIR --out DIR [--seq-len N] [--force]``."""
    imp = subparsers.add_parser("import", help="import a model from another format")
    formats = imp.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("hf", help="a Hugging Face folder (Llama, Mistral, Qwen2, Qwen3)")
    hf.add_argument("in_dir", help="folder with config.json + safetensors")
    # No default: the old one, models/final, is the train stage's output, which DVC
    # deletes before training and train.init_from refuses; the user names the folder.
    hf.add_argument("--out", required=True,
                    help="our model folder to write, e.g. models/base (replaced only if "
                         "empty or an earlier export/import)")
    hf.add_argument("--force", action="store_true",
                    help="replace --out even if lmforge did not write it")
    hf.add_argument("--seq-len", type=int, default=None,
                    help="context length (default: max_position_embeddings)")
    hf.set_defaults(func=cmd_import)
