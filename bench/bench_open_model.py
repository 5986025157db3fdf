"""An open base model beside the demo model on the demo's val text: bits per byte.

Both models read the same documents of ``data/mixed/val`` (the first of each domain, up
to ``--bytes-per-domain`` UTF-8 bytes), each through its own tokenizer, in
non-overlapping windows of ``--window`` tokens after a document-start token; every token
of a document is predicted once, and its bits are divided by the document's bytes, so
the figures compare across vocabularies. Printed per domain (with the stderr over
documents), equal-weighted over domains, and as the ratio open / demo. Also the greedy
chat check: the reply to one question, ours beside transformers'.

    python scripts/get_smollm2.py models/smollm2-hf
    lmforge import hf models/smollm2-hf --out models/base --seq-len 2048
    python bench/bench_open_model.py --model models/base --demo models/final
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from lmforge.model.saved import load_model
from lmforge.tokenizer import Tokenizer

QUESTION = "What is the capital of France?"


def val_documents(mixed_val: Path, budget: int) -> dict[str, list[str]]:
    """The first documents of each domain, up to ``budget`` bytes per domain."""
    docs: dict[str, list[str]] = defaultdict(list)
    used: dict[str, int] = defaultdict(int)
    for part in sorted(mixed_val.glob("*.parquet")):
        table = pq.read_table(part, columns=["domain", "text"]).to_pylist()
        for row in table:
            d, text = row["domain"], row["text"]
            if used[d] < budget:
                take = text.encode()[:budget - used[d]].decode("utf-8", "ignore")
                docs[d].append(take)
                used[d] += len(take.encode())
    return dict(sorted(docs.items()))


def start_id(tok: Tokenizer) -> int:
    """The token a document follows: ``<|endoftext|>`` where the vocabulary has it (the
    open models' document separator), else EOS (ours ends each document with it)."""
    found = tok.token_to_id("<|endoftext|>")
    return found if found is not None else max(tok.eos_id, 0)


@torch.no_grad()
def document_bits(model: torch.nn.Module, ids: list[int], window: int) -> float:
    """Bits of every token of ``ids[1:]``, in non-overlapping windows."""
    bits = 0.0
    for i in range(0, len(ids) - 1, window):
        x = torch.tensor([ids[i:i + window]])
        y = torch.tensor([ids[i + 1:i + window + 1]])
        logits = model(x[:, :y.shape[1]])
        bits += F.cross_entropy(logits[0].float(), y[0], reduction="sum").item() / math.log(2)
    return bits


def score(model_dir: Path, docs: dict[str, list[str]], window: int) -> dict[str, dict]:
    """Per domain: bits per byte over its documents, the stderr over documents, tokens."""
    model, _ = load_model(model_dir)
    tok = Tokenizer.load(model_dir)
    out = {}
    for domain, texts in docs.items():
        per_doc, tokens, nbytes = [], 0, 0
        for text in texts:
            ids = [start_id(tok), *tok.encode(text)]
            b = len(text.encode())
            per_doc.append((document_bits(model, ids, window), b))
            tokens += len(ids) - 1
            nbytes += b
        total = sum(bits for bits, _ in per_doc)
        rates = np.array([bits / b for bits, b in per_doc if b])
        err = float(rates.std(ddof=1) / math.sqrt(len(rates))) if len(rates) > 1 else None
        out[domain] = {"bits_per_byte": total / nbytes, "stderr": err, "docs": len(texts),
                       "bytes": nbytes, "tokens": tokens}
    return out


def chat_check(model_dir: Path, hf_dir: Path | None) -> dict[str, str]:
    """The greedy reply to one question from ``lmforge chat``'s session and, with the
    Hugging Face folder, from transformers."""
    from lmforge.chat import ChatSession

    model, _ = load_model(model_dir)
    session = ChatSession(model, Tokenizer.load(model_dir), max_new_tokens=32)
    out = {"lmforge": session.reply(QUESTION)}
    if hf_dir is not None:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        gen = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
        out["transformers"] = tok.decode(gen, skip_special_tokens=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/base"))
    ap.add_argument("--demo", type=Path, default=Path("models/final"))
    ap.add_argument("--hf", type=Path, help="the open model's Hugging Face folder (chat check)")
    ap.add_argument("--val", type=Path, default=Path("data/mixed/val"))
    ap.add_argument("--bytes-per-domain", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    docs = val_documents(args.val, args.bytes_per_domain)
    figures: dict = {"bytes_per_domain": args.bytes_per_domain, "window": args.window}
    for name, path in (("open", args.model), ("demo", args.demo)):
        t0 = time.perf_counter()
        figures[name] = score(path, docs, args.window)
        figures[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{'domain':<16}{'open bpb':>10}{'demo bpb':>10}{'open/demo':>11}")
    for d in docs:
        o, m = figures["open"][d], figures["demo"][d]
        print(f"{d:<16}{o['bits_per_byte']:>10.3f}{m['bits_per_byte']:>10.3f}"
              f"{o['bits_per_byte'] / m['bits_per_byte']:>11.2f}")
    for name in ("open", "demo"):
        figures[f"{name}_equal_weighted"] = float(np.mean(
            [v["bits_per_byte"] for v in figures[name].values()]))
    print(f"{'equal-weighted':<16}{figures['open_equal_weighted']:>10.3f}"
          f"{figures['demo_equal_weighted']:>10.3f}"
          f"{figures['open_equal_weighted'] / figures['demo_equal_weighted']:>11.2f}")
    figures["chat"] = chat_check(args.model, args.hf)
    print(json.dumps(figures["chat"], ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
