"""Tiny open chat models as they come from the hub, built offline: a random Qwen2
(Qwen2.5-Instruct's layout) or Llama (Llama 3.1 Instruct's) with a byte-level tokenizer,
the model's own chat template, and its generation_config.json -- several stop ids and
its sampling defaults -- then imported as ``lmforge import hf`` does.

Qwen2.5-Instruct's EOS is its end of turn (``<|im_end|>``) and its generation config
stops at ``[<|im_end|>, <|endoftext|>]``; Llama 3.1 Instruct's EOS is ``<|eot_id|>`` and
it stops at ``[<|end_of_text|>, <|eom_id|>, <|eot_id|>]``. ``eos=`` gives the tokenizer
another EOS (a base tokenizer's, as a fine-tune of a base model has it), and
``generation=False`` leaves generation_config.json out.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hf_tokenizers import build
from test_model_template import LLAMA3, QWEN25

from lmforge.export import import_hf

LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
# kind -> (tokenizer style, specials, template, bos, eos, generation config with token
# texts in place of ids, transformers class prefix)
KINDS = {
    "qwen2.5": ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN25, None,
                "<|im_end|>",
                {"bos_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>",
                 "do_sample": True, "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
                 "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
                "Qwen2"),
    "llama3.1": ("llama3", LLAMA31_SPECIALS, LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
                 {"bos_token_id": "<|begin_of_text|>", "do_sample": True,
                  "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                  "temperature": 0.6, "top_p": 0.9},
                 "Llama"),
}


def token_ids(folder: Path) -> dict[str, int]:
    """``{added token text: id}`` of the tokenizer.json in ``folder``."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return {t["content"]: int(t["id"]) for t in data["added_tokens"]}


def generation_config(kind: str, ids: dict[str, int]) -> dict:
    """The model's generation_config.json as its hub folder has it, ids resolved."""
    def resolve(v):
        if isinstance(v, list):
            return [ids[t] for t in v]
        return ids[v] if isinstance(v, str) else v
    return {k: (resolve(v) if k.endswith("token_id") else v)
            for k, v in KINDS[kind][5].items()}


def hf_chat_model(tmp_path: Path, kind: str = "qwen2.5", *, eos: str | None = None,
                  generation: bool = True) -> Path:
    """The Hugging Face folder (``tmp_path/hf``) of a tiny ``kind`` chat model."""
    style, specials, template, bos, own_eos, _, cls = KINDS[kind]
    eos = eos or own_eos
    tok_dir = build(tmp_path / "tok", style=style, specials=specials, special_markers=False,
                    bos=bos, eos=eos)
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    ids = token_ids(tok_dir)
    vocab = len(json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]) + 7
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{cls}Config")(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=ids.get(bos or "<|endoftext|>"),
        eos_token_id=ids[eos])
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    gen = hf_dir / "generation_config.json"
    gen.unlink(missing_ok=True)
    if generation:
        gen.write_text(json.dumps(generation_config(kind, ids)), encoding="utf-8")
    return hf_dir


def chat_model(tmp_path: Path, kind: str = "qwen2.5", **kw) -> Path:
    """:func:`hf_chat_model`, imported into our format at ``tmp_path/ours``."""
    return import_hf(hf_chat_model(tmp_path, kind, **kw), tmp_path / "ours")
