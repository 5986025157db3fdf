"""Samples from fixed prompts at several temperatures, as a readable markdown page."""

from __future__ import annotations

import torch

from lmforge.model.generate import generate


def complete(model: torch.nn.Module, tokenizer, prompt: str, max_new_tokens: int,
             temperature: float, top_k: int, seed: int) -> str:
    """The model's continuation of ``prompt`` (decoded text, prompt excluded)."""
    device = next(model.parameters()).device
    prompt_ids = tokenizer.encode(prompt)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = list(generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                        eos_id=tokenizer.eos_id, generator=gen))
    # Decode with the prompt, then cut it off: decoding the continuation alone would drop
    # its first piece's leading space when the tokenizer uses a dummy prefix (nfkc).
    return tokenizer.decode(prompt_ids + out)[len(tokenizer.decode(prompt_ids)):]


def samples_markdown(model: torch.nn.Module, tokenizer, prompts: list[str],
                     temperatures: list[float], max_new_tokens: int, top_k: int,
                     seed: int) -> str:
    """One section per prompt, one fenced block per temperature."""
    lines = ["# Samples", ""]
    for prompt in prompts:
        lines += [f"## {prompt!r}", ""]
        for t in temperatures:
            text = complete(model, tokenizer, prompt, max_new_tokens, t, top_k, seed)
            label = "greedy" if t == 0 else f"temperature {t}"
            lines += [f"**{label}**", "", "````text", prompt + text, "````", ""]
    return "\n".join(lines)
