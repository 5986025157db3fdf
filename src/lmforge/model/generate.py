"""Token-by-token generation with a KV cache: greedy, temperature, top-k and top-p."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lmforge.model.llama import KVCache, Llama


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> int:
    """Pick one token id from a (V,) logits vector (greedy when ``temperature`` is 0)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    # On the CPU: one (V,) vector is cheap to move, and a CPU generator then works
    # whatever device the model is on.
    logits = logits.detach().float().cpu() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_p.cumsum(0) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: Llama, idx: torch.Tensor | list[int], max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None,
             generator: torch.Generator | None = None) -> Iterator[int]:
    """Stream up to ``max_new_tokens`` new token ids after the prompt ``idx``.

    ``idx`` is a 1-D prompt (or a (1, T) batch). A prompt longer than ``seq_len`` keeps
    its last ``seq_len - 1`` tokens. When the context fills up, the cache is rebuilt
    from the last half of the context (a sliding window, re-prefilled in one pass).
    Stops after ``eos_id`` (which is yielded).
    """
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        prompt = torch.as_tensor(idx, dtype=torch.long, device=device).reshape(-1)
        if prompt.numel() == 0:
            raise ValueError("generate: the prompt is empty")
        seq_len = model.config.seq_len
        context = prompt[-(seq_len - 1):].tolist()
        dtype = next(model.parameters()).dtype
        cache = KVCache.empty(model, 1, device, dtype)
        logits = model(torch.tensor([context], device=device), cache=cache)[0, -1]
        for _ in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            yield token
            if eos_id is not None and token == eos_id:
                return
            context.append(token)
            if cache.pos >= seq_len:
                context = context[-(seq_len // 2):]
                cache.pos = 0
                logits = model(torch.tensor([context], device=device), cache=cache)[0, -1]
            else:
                logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]
    finally:
        model.train(was_training)
