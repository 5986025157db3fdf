"""GGUF export read by llama.cpp itself (llama-cpp-python), and the cost of each type.

1. Continuation: the base model exported as f32 and f16; llama.cpp's greedy continuation
   of each ``evaluate.prompts`` prompt against ``lmforge generate``'s (greedy, stopping at
   EOS as it does), token by token, and the log-probabilities of our tokens under both
   (the largest absolute difference over every vocabulary entry at every position).
2. Chat: the SFT (and DPO) model exported as f32; ``create_chat_completion`` (the file's
   ``tokenizer.chat_template``, stopping at its end-of-turn token) against ``lmforge
   chat``'s greedy reply, for each ``evaluate_post.prompts`` question.
3. Types: each ``--types`` export of the base model, its file size and its val
   bits/byte on the demo val split (the evaluate stage's windows and mixture weighting,
   ``lmforge.evaluate.scoring``), computed from llama.cpp's logits, and from transformers'
   GGUF reader (it dequantises the weights and computes in fp32, so it isolates the weight
   rounding from llama.cpp's own arithmetic); ratios against f32 and our own model.

    pip install llama-cpp-python   # builds llama.cpp from source (cmake), minutes
    python bench/bench_gguf.py --base models/final --sft models/sft --dpo models/dpo
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from lmforge.chat import ChatSession
from lmforge.evaluate.scoring import score_split
from lmforge.export.gguf import export_gguf
from lmforge.model.generate import generate
from lmforge.model.saved import load_model
from lmforge.shards.loader import ShardSet
from lmforge.tokenizer import Tokenizer

TYPES = ["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]


class LlamaCppLM(torch.nn.Module):
    """llama.cpp's logits behind our model's call: (B, T) ids -> (B, T, V) logits."""

    def __init__(self, llm) -> None:
        super().__init__()
        self.llm = llm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = []
        for row in x.tolist():
            self.llm.reset()
            self.llm.eval(row)
            rows.append(torch.from_numpy(np.array(self.llm.scores[:len(row)], np.float32)))
        return torch.stack(rows)


class HFLM(torch.nn.Module):
    """transformers' model behind our model's call."""

    def __init__(self, hf) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(x).logits


def open_llama(path: Path, n_ctx: int):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, seed=0)


def llama_greedy(llm, prompt: list[int], n: int, eos: int) -> list[int]:
    """llama.cpp's greedy tokens after ``prompt`` (stopping after EOS, as we do)."""
    llm.reset()
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == n or token == eos:
            break
    return out


def continuation(model_dir: Path, gguf_path: Path, prompts: list[str], n: int) -> dict:
    """Per prompt: tokens equal before the first difference, and the log-prob gap."""
    model, _ = load_model(model_dir)
    tok = Tokenizer.load(model_dir)
    llm = open_llama(gguf_path, model.config.seq_len)
    rows = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        their_ids = llm.tokenize(prompt.encode(), add_bos=False, special=False)
        ours = list(generate(model, ids, n, eos_id=tok.eos_id))
        theirs = llama_greedy(llm, ids, n, tok.eos_id)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                    min(len(ours), len(theirs)))
        seq = ids + ours[:-1] if ours else ids
        with torch.no_grad():
            our_lp = torch.log_softmax(model(torch.tensor([seq]))[0].float(), -1)
        their_lp = torch.log_softmax(LlamaCppLM(llm)(torch.tensor([seq]))[0], -1)
        rows.append({"prompt": prompt, "tokenize_equal": their_ids == ids,
                     "tokens": len(ours), "equal_prefix": same,
                     "equal": ours == theirs,
                     "max_abs_logprob_diff": float((our_lp - their_lp).abs().max()),
                     "max_abs_logprob_diff_chosen": float(
                         (our_lp - their_lp)[len(ids) - 1:].gather(
                             1, torch.tensor(ours).view(-1, 1)).abs().max())})
    return {"rows": rows, "all_equal": all(r["equal"] for r in rows),
            "min_tokens": min(r["tokens"] for r in rows),
            "max_abs_logprob_diff": max(r["max_abs_logprob_diff"] for r in rows)}


def chat(model_dir: Path, gguf_path: Path, questions: list[str], n: int) -> dict:
    """``lmforge chat``'s greedy reply and ``create_chat_completion``'s, per question."""
    model, _ = load_model(model_dir)
    tok = Tokenizer.load(model_dir)
    llm = open_llama(gguf_path, model.config.seq_len)
    rows = []
    for q in questions:
        session = ChatSession(model, tok, max_new_tokens=n)
        ours = session.reply(q)
        stopped = bool(session.last_ids) and session.last_ids[-1] in session.stop_ids
        got = llm.create_chat_completion([{"role": "user", "content": q}], temperature=0.0,
                                         top_k=1, repeat_penalty=1.0,
                                         max_tokens=n)["choices"][0]
        prompt_ids = llama_prompt_ids(llm, gguf_path, [("user", q)])
        # llama-cpp-python drops the bytes of an incomplete character; we write U+FFFD.
        rows.append({"question": q, "lmforge": ours, "llama_cpp": got["message"]["content"],
                     "equal": ours.replace("\ufffd", "") == got["message"]["content"],
                     "prompt_ids_equal": prompt_ids == session.format.generation_prompt(
                         [("user", q)]),
                     "lmforge_stopped": stopped, "llama_cpp_finish": got["finish_reason"]})
    return {"rows": rows, "all_equal": all(r["equal"] for r in rows),
            "prompt_ids_equal": all(r["prompt_ids_equal"] for r in rows)}


def llama_prompt_ids(llm, gguf_path: Path, turns: list[tuple[str, str]]) -> list[int]:
    """The ids llama-cpp-python's chat handler feeds the model: the file's template
    rendered by its Jinja formatter, tokenized with special tokens parsed."""
    from gguf import GGUFReader
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = {k: f.contents() for k, f in GGUFReader(str(gguf_path)).fields.items()
            if k.startswith(("tokenizer.chat", "tokenizer.ggml.bos", "tokenizer.ggml.eos"))}
    fmt = Jinja2ChatFormatter(meta["tokenizer.chat_template"],
                              eos_token=llm.detokenize([meta["tokenizer.ggml.eos_token_id"]],
                                                       special=True).decode(),
                              bos_token=llm.detokenize([meta["tokenizer.ggml.bos_token_id"]],
                                                       special=True).decode())
    text = fmt(messages=[{"role": r, "content": c} for r, c in turns]).prompt
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def bits_per_byte(lm: torch.nn.Module, seq_len: int, batch_size: int, max_batches: int
                  ) -> float:
    """The evaluate stage's headline: val bits/byte, mixture-weighted."""
    mixture = ShardSet("data/shards/train").domain_shares()
    score = score_split(lm, ShardSet("data/shards/val"), seq_len, batch_size, max_batches)
    return score.as_dict(mixture)["mix_weighted"]["bits_per_byte"]


def type_table(base: Path, out_dir: Path, types: list[str], llama_types: set[str],
               external: list[str], batch_size: int, max_batches: int) -> list[dict]:
    """Size and val bits/byte (transformers' reader; llama.cpp for ``llama_types``) of each
    exported type, and of ``external`` NAME=PATH files (llama-quantize's k-quants)."""
    model, _ = load_model(base)
    seq_len = model.config.seq_len
    rows = [{"type": "lmforge (safetensors)", "mib": (base / "model.safetensors").stat().st_size
             / 2**20, "bpb_transformers": bits_per_byte(model, seq_len, batch_size, max_batches)}]
    files = []
    for qtype in types:
        path = out_dir / f"base-{qtype}.gguf"
        t0 = time.perf_counter()
        export_gguf(base, path, qtype=qtype)
        files.append((qtype, path, time.perf_counter() - t0))
    files += [(n, Path(p), None) for n, p in (e.split("=", 1) for e in external)]
    for name, path, seconds in files:
        row = {"type": name, "mib": path.stat().st_size / 2**20, "export_s": seconds,
               "bpb_transformers": gguf_bits_per_byte(path, seq_len, batch_size, max_batches)}
        if name in llama_types:
            with torch.no_grad():
                row["bpb_llama_cpp"] = bits_per_byte(LlamaCppLM(open_llama(path, seq_len)),
                                                     seq_len, batch_size, max_batches)
        rows.append(row)
        print("  " + json.dumps(row), flush=True)
    return rows


def gguf_bits_per_byte(path: Path, seq_len: int, batch_size: int, max_batches: int) -> float:
    """Val bits/byte of a GGUF file through transformers' reader (dequantised, fp32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return bits_per_byte(HFLM(hf), seq_len, batch_size, max_batches)


def print_table(rows: list[dict]) -> None:
    f32 = next(r for r in rows if r["type"] == "f32")
    f32.setdefault("bpb_llama_cpp", None)
    print(f"{'type':<22}{'MiB':>8}{'size/f32':>10}{'bpb llama.cpp':>15}{'/f32':>8}"
          f"{'bpb transformers':>18}{'/f32':>8}")
    for r in rows:
        cpp = r.get("bpb_llama_cpp")
        cpp_s = (f"{cpp:>15.4f}{cpp / f32['bpb_llama_cpp']:>8.4f}"
                 if cpp and f32["bpb_llama_cpp"] else f"{'-':>15}{'':>8}")
        print(f"{r['type']:<22}{r['mib']:>8.2f}{r['mib'] / f32['mib']:>10.3f}{cpp_s}"
              f"{r['bpb_transformers']:>18.4f}"
              f"{r['bpb_transformers'] / f32['bpb_transformers']:>8.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=Path("models/final"))
    ap.add_argument("--sft", type=Path, default=Path("models/sft"))
    ap.add_argument("--dpo", type=Path, default=None)
    ap.add_argument("--out-dir", type=Path, default=Path("gguf-bench"))
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--llama-cpp-types", nargs="+", default=TYPES,
                    help="types also scored through llama.cpp's logits")
    ap.add_argument("--external", nargs="*", default=[],
                    help="NAME=PATH GGUF files made elsewhere (llama-quantize), scored too")
    ap.add_argument("--sections", nargs="+", default=["continuation", "chat", "types"])
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-batches", type=int, default=8)
    ap.add_argument("--json", type=Path, help="also write the figures here (after each part)")
    args = ap.parse_args()
    params = yaml.safe_load(Path("params.yaml").read_text())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict = {"tokens": args.tokens, "max_batches": args.max_batches,
                     "batch_size": args.batch_size}
    for qtype in ("f32", "f16") if "continuation" in args.sections else ():
        path = export_gguf(args.base, args.out_dir / f"base-{qtype}.gguf", qtype=qtype)
        figures[f"continuation_{qtype}"] = c = continuation(
            args.base, path, params["evaluate"]["prompts"], args.tokens)
        print(f"continuation {qtype}: all equal {c['all_equal']} (>= {c['min_tokens']} "
              f"tokens each), max |dlogprob| {c['max_abs_logprob_diff']:.2e}", flush=True)
        save(args.json, figures)
    for name, model_dir in (("sft", args.sft), ("dpo", args.dpo)):
        if model_dir is None or "chat" not in args.sections:
            continue
        path = export_gguf(model_dir, args.out_dir / f"{name}-f32.gguf")
        figures[f"chat_{name}"] = c = chat(model_dir, path, params["evaluate_post"]["prompts"],
                                           params["evaluate_post"]["max_new_tokens"])
        print(f"chat {name}: all equal {c['all_equal']}, prompt ids equal "
              f"{c['prompt_ids_equal']}", flush=True)
        for r in c["rows"]:
            print("  " + json.dumps(r, ensure_ascii=False), flush=True)
        save(args.json, figures)
    if "types" in args.sections:
        figures["types"] = type_table(args.base, args.out_dir, args.types,
                                      set(args.llama_cpp_types), args.external,
                                      args.batch_size, args.max_batches)
        save(args.json, figures)
        print_table(figures["types"])


def save(path: Path | None, figures: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
