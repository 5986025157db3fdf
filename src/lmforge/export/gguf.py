"""``lmforge export gguf OUT.gguf``: a model folder as one GGUF file for llama.cpp, Ollama
and LM Studio, with an Ollama ``Modelfile`` beside it.

Written with gguf-py (llama.cpp's own writer): weights and hyperparameters as
:mod:`lmforge.export.gguf_tensors` lays them out, the tokenizer and chat template as
:mod:`lmforge.export.gguf_vocab` does. Every model lmforge holds goes out: ours
(pretrained, SFT, DPO -- LoRA already merged into the saved weights) as the ``llama``
architecture, imported families as ``llama`` (Llama, Mistral), ``qwen2`` or ``qwen3``.

Refusals, as ``export hf``: a model GGUF cannot express, in one line; an existing file
that an earlier ``export gguf`` did not write (it carries the ``lmforge.export`` key; a
Modelfile, our header line) is never replaced unless ``--force``. The file is written
beside its final path and renamed into place, so a failed export leaves nothing.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

from lmforge import __version__
from lmforge.errors import InputError, LmforgeError
from lmforge.export.gguf_modelfile import HEADER, modelfile_path, modelfile_text
from lmforge.export.gguf_tensors import (
    TYPES,
    encode_tensor,
    gguf_arch,
    gguf_tensors,
    write_hparams,
)
from lmforge.export.gguf_vocab import read_vocab, write_vocab
from lmforge.export.hf import model_tokenizer
from lmforge.io import atomic_path
from lmforge.model.saved import load_model, model_state

# The key that marks a file as ours to replace (llama.cpp ignores keys it does not know).
MARKER_KEY = "lmforge.export"


def export_gguf(model_dir: str | Path, out_path: str | Path, *, qtype: str = "f32",
                force: bool = False) -> Path:
    """Write ``model_dir`` as the GGUF file ``out_path`` (and its Modelfile); return it.

    ``qtype``: one of :data:`~lmforge.export.gguf_tensors.TYPES` (f32, f16, bf16, q8_0,
    q5_1, q5_0, q4_1, q4_0).
    """
    gguf = _import_gguf()
    model_dir, out_path = Path(model_dir), Path(out_path)
    if qtype not in TYPES:
        raise InputError(f"--type {qtype}: not one of {', '.join(TYPES)}")
    mfile = modelfile_path(out_path)
    _check_writable(out_path, mfile, force)
    model, config = load_model(model_dir)
    cfg = model.config
    arch = gguf_arch(cfg)  # refuse before reading the tokenizer or writing anything
    tok_path = model_tokenizer(model_dir, config)
    vocab = read_vocab(tok_path, config.get("special_ids") or {}, model.vocab_size)
    tensor_type, file_type = TYPES[qtype]
    with atomic_path(out_path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(model_dir.resolve().name)
        writer.add_string(MARKER_KEY, json.dumps({
            "version": __version__, "source": str(model_dir), "type": qtype,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
        write_hparams(writer, cfg, model.vocab_size, file_type)
        write_vocab(writer, vocab)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, value in gguf_tensors(model_state(model), cfg, arch):
            data, dtype = encode_tensor(name, value, tensor_type)
            writer.add_tensor(name, data, raw_dtype=dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    bos = vocab.tokens[vocab.special["bos"]] if "bos" in vocab.special else None
    with atomic_path(mfile) as tmp:
        tmp.write_text(modelfile_text(out_path, vocab.chat_template, vocab.stop_tokens, bos,
                                      tok_path), encoding="utf-8")
    return out_path


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise LmforgeError("export gguf needs the gguf package (pip install gguf)") from None
    return gguf


def _check_writable(out_path: Path, mfile: Path, force: bool) -> None:
    """Refuse a folder, or (unless forced) a file an earlier export gguf did not write."""
    if out_path.suffix != ".gguf":
        raise InputError(f"{out_path}: the output file must end in .gguf")
    if out_path.is_dir():
        raise InputError(f"{out_path}: is a folder; give the .gguf file to write")
    if force:
        return
    if out_path.exists() and not is_ours(out_path):
        raise InputError(f"{out_path}: exists and is not an earlier lmforge export (no "
                         f"{MARKER_KEY} key); refusing to replace it: pass --force, or "
                         "choose another path")
    if mfile.exists() and not _modelfile_is_ours(mfile):
        raise InputError(f"{mfile}: exists and lmforge did not write it; refusing to replace "
                         "it: pass --force, or choose another path")


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a GGUF file an earlier ``export gguf`` wrote."""
    from gguf import GGUFReader

    try:
        return MARKER_KEY in GGUFReader(str(path)).fields
    except Exception:  # not a GGUF file at all (GGUFReader raises ValueError and others)
        return False


def _modelfile_is_ours(path: Path) -> bool:
    try:
        return path.read_text(encoding="utf-8").startswith(HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def cmd_export_gguf(args: argparse.Namespace) -> None:
    """``lmforge export gguf OUT.gguf``."""
    out = export_gguf(args.model, args.out, qtype=args.type, force=args.force)
    size = out.stat().st_size / 2**20
    print(f"exported {args.model} -> {out} ({args.type}, {size:.1f} MiB); "
          f"Ollama: ollama create NAME -f {modelfile_path(out)}")


def add_gguf_parser(formats: argparse._SubParsersAction) -> None:
    """Register ``export gguf OUT.gguf [--model DIR] [--type T] [--force]``."""
    p = formats.add_parser("gguf", help="one GGUF file for llama.cpp, Ollama, LM Studio "
                                        "(and an Ollama Modelfile beside it)")
    p.add_argument("out", help="the .gguf file to write (replaced only if an earlier export)")
    p.add_argument("--model", default="models/final", help="our model folder")
    p.add_argument("--type", default="f32", choices=list(TYPES),
                   help="tensor type (norms stay f32); k-quants: llama-quantize the f16 file")
    p.add_argument("--force", action="store_true",
                   help="replace OUT (and its Modelfile) even if lmforge did not write them")
    p.set_defaults(func=cmd_export_gguf)
