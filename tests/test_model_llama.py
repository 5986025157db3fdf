"""The Llama decoder: RoPE, causality, KV-cache generation, size formula, init, save/load."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import InputError
from lmforge.model import (
    KVCache,
    Llama,
    generate,
    load_model,
    model_config_dict,
    param_count_formula,
    save_model,
)
from lmforge.model.llama import apply_rope, rope_tables

VOCAB = 97


def tiny(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, seq_len=48, ffn_multiple_of=16)
    base.update(kw)
    return ModelConfig(**base)


def make(seed: int = 0, **kw) -> Llama:
    torch.manual_seed(seed)
    return Llama(tiny(**kw), VOCAB).eval()


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    d, T = 16, 40
    cos, sin = rope_tables(T, d, 10000.0)
    q, k = torch.randn(d), torch.randn(d)
    # Place the same q and k at every position; score(i, j) must depend on i - j only.
    qs = apply_rope(q.expand(1, 1, T, d), cos, sin)[0, 0]
    ks = apply_rope(k.expand(1, 1, T, d), cos, sin)[0, 0]
    scores = qs @ ks.T
    for offset in (0, 3, 17):
        diag = torch.diagonal(scores, offset=-offset)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-4)
    assert not torch.allclose(scores[5, 5], scores[5, 2])  # but it does depend on the gap


def test_future_tokens_never_change_earlier_logits():
    model = make(n_kv_head=2)
    idx = torch.randint(0, VOCAB, (2, 30))
    changed = idx.clone()
    changed[:, 20:] = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-5)
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-3)


@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
def test_kv_cache_generation_equals_full_forward_argmax(n_kv_head):
    model = make(seed=1, n_kv_head=n_kv_head)
    prompt = torch.randint(0, VOCAB, (7,))
    streamed = list(generate(model, prompt, max_new_tokens=25))
    seq = prompt.tolist()
    with torch.no_grad():
        for _ in range(25):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert streamed == seq[7:]


def test_kv_cache_logits_match_full_forward():
    model = make(seed=2, n_kv_head=2)
    idx = torch.randint(0, VOCAB, (1, 20))
    cache = KVCache.empty(model, 1, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        full = model(idx)
        pre = model(idx[:, :12], cache=cache)
        steps = [model(idx[:, t:t + 1], cache=cache) for t in range(12, 20)]
    got = torch.cat([pre] + steps, dim=1)
    assert torch.allclose(got, full, atol=1e-5)


def test_generation_past_seq_len_and_eos_and_long_prompt():
    model = make(seed=3)
    long_prompt = torch.randint(0, VOCAB, (200,))  # > seq_len: cropped, not an error
    out = list(generate(model, long_prompt, max_new_tokens=120, temperature=0.9, top_k=10,
                        top_p=0.9, generator=torch.Generator().manual_seed(0)))
    assert len(out) == 120 and all(0 <= t < VOCAB for t in out)
    first = list(generate(model, long_prompt, max_new_tokens=5))[0]
    stopped = list(generate(model, long_prompt, max_new_tokens=50, eos_id=first))
    assert stopped == [first]


def test_sampling_is_seeded():
    model = make(seed=4)
    prompt = [1, 2, 3]
    runs = [list(generate(model, prompt, 30, temperature=1.0, top_p=0.95,
                          generator=torch.Generator().manual_seed(s))) for s in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 2, "tie_embeddings": False},
                                {"n_kv_head": 1, "n_embd": 48, "ffn_multiple_of": 64}])
def test_param_count_matches_formula(kw):
    cfg = tiny(**kw)
    model = Llama(cfg, VOCAB)
    assert model.num_params() == param_count_formula(cfg, VOCAB)
    assert model.flops_per_token() > 6 * (model.num_params() - VOCAB * cfg.n_embd)


def test_initial_loss_is_near_uniform():
    vocab = 512
    torch.manual_seed(0)
    model = Llama(tiny(), vocab)
    idx, targets = torch.randint(0, vocab, (2, 4, 48))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(vocab)) < 0.5


def test_scaled_init_and_tied_head():
    model = Llama(tiny(n_layer=8, n_embd=128, ffn_multiple_of=64), VOCAB)
    assert model.lm_head.weight is model.tok_embeddings.weight
    wo = model.layers[0].attn.wo.weight.std().item()
    wq = model.layers[0].attn.wq.weight.std().item()
    assert wq == pytest.approx(0.02, rel=0.1)
    assert wo == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert all(not n.endswith("bias") for n, _ in model.named_parameters())


def test_ignore_index_label_smoothing_and_z_loss():
    model = make(seed=5)
    idx = torch.randint(0, VOCAB, (2, 16))
    targets = idx.clone()
    targets[:, 8:] = -100
    _, loss = model(idx, targets)
    logits = model(idx)
    ref = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, VOCAB),
                                            targets[:, :8].reshape(-1))
    assert torch.allclose(loss, ref, atol=1e-6)
    model.z_loss = 1e-2
    _, with_z = model(idx, targets)
    model.z_loss, model.label_smoothing = 0.0, 0.1
    _, smoothed = model(idx, targets)
    assert with_z > loss and not torch.allclose(smoothed, loss)


def test_activation_checkpointing_gives_the_same_gradients():
    idx = torch.randint(0, VOCAB, (2, 24))
    grads = []
    for ac in (False, True):
        model = make(seed=6).train()
        model.activation_checkpointing = ac
        model(idx, idx)[1].backward()
        grads.append(model.layers[0].attn.wq.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_round_trip(tmp_path, tie):
    model = make(seed=7, tie_embeddings=tie, n_kv_head=2)
    tok = tmp_path / "tok.model"
    tok.write_bytes(b"tokenizer")
    save_model(model, tmp_path / "final", tok, special_ids={"eos": 2}, tokenizer_sha256="ab")
    loaded, config = load_model(tmp_path / "final")
    idx = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    assert config["special_ids"] == {"eos": 2} and config["vocab_size"] == VOCAB
    assert (tmp_path / "final" / "tokenizer.model").read_bytes() == b"tokenizer"
    assert (loaded.lm_head.weight is loaded.tok_embeddings.weight) == tie


def test_load_model_reports_a_mismatched_config(tmp_path):
    model = make(seed=8)
    save_model(model, tmp_path / "m")
    cfg = model_config_dict(model)
    cfg["model"]["n_layer"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="do not match"):
        load_model(tmp_path / "m")
    with pytest.raises(InputError, match="no model config"):
        load_model(tmp_path / "missing")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_forward_on_gpu_matches_fp32():
    model = make(seed=9).cuda()
    idx = torch.randint(0, VOCAB, (2, 32), device="cuda")
    with torch.no_grad():
        ref = model(idx)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(idx)
    assert torch.allclose(low.float(), ref, atol=5e-2)


# --------------------------------------------------------------------------- document mask

def _positions_for(lengths: list[int], first_offset: int = 0) -> torch.Tensor:
    """Offsets in document for documents of ``lengths`` back to back (the first continued)."""
    parts = [torch.arange(n) + (first_offset if i == 0 else 0) for i, n in enumerate(lengths)]
    return torch.cat(parts).unsqueeze(0)


def test_document_attention_matches_a_loop_reference():
    from lmforge.model.llama import document_attention

    pos = torch.cat([_positions_for([5, 3, 7], first_offset=40),
                     _positions_for([1, 14])])
    ids, mask = document_attention(pos)
    for b in range(2):
        doc, start = 0, 0
        docs, firsts = [], []
        for t in range(pos.size(1)):
            if pos[b, t] == 0:
                doc, start = doc + 1, t
            docs.append(doc)
            firsts.append(start)
        assert ids[b].tolist() == [t - f for t, f in enumerate(firsts)]
        for i in range(pos.size(1)):
            for j in range(pos.size(1)):
                assert bool(mask[b, 0, i, j]) == (j <= i and docs[i] == docs[j])


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_document_mask_makes_each_document_independent(n_kv_head):
    model = make(seed=10, n_kv_head=n_kv_head)
    first, second = 13, 19
    idx = torch.randint(0, VOCAB, (1, first + second))
    pos = _positions_for([first, second], first_offset=100)  # the first one is continued
    changed = idx.clone()
    changed[:, :first] = torch.randint(0, VOCAB, (1, first))
    with torch.no_grad():
        packed = model(idx, positions=pos)
        other_prefix = model(changed, positions=pos)
        alone = model(idx[:, first:])  # the second document on its own, positions 0..
        head_alone = model(idx[:, :first])
        unmasked = model(idx)
    assert torch.allclose(packed[:, first:], alone, atol=1e-5)
    assert torch.allclose(packed[:, :first], head_alone, atol=1e-5)
    assert torch.allclose(packed[:, first:], other_prefix[:, first:], atol=1e-5)
    # Without the mask the second document does see the first.
    assert not torch.allclose(unmasked[:, first:], alone, atol=1e-3)


def test_document_mask_gradients_with_activation_checkpointing():
    idx = torch.randint(0, VOCAB, (2, 24))
    pos = torch.cat([_positions_for([10, 14]), _positions_for([24], first_offset=7)])
    grads = []
    for ac in (False, True):
        model = make(seed=11).train()
        model.activation_checkpointing = ac
        model(idx, idx, positions=pos)[1].backward()
        grads.append(model.layers[0].attn.wq.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert grads[0].abs().sum() > 0


def test_native_gqa_equals_repeated_kv_in_forward_and_backward(monkeypatch):
    """SDPA's enable_gqa (taken on a CPU without a mask) gives the logits and gradients
    of k and v repeated to every head, the path it replaces."""
    import lmforge.model.llama as llama

    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 16))

    def loss_and_grads(native: bool):
        monkeypatch.setattr(llama, "native_gqa", lambda q, mask: native)
        model = make(n_kv_head=2).train()
        loss = model(idx, idx)[1]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    (l1, g1), (l2, g2) = loss_and_grads(True), loss_and_grads(False)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_native_gqa_only_where_the_chosen_kernel_has_it():
    from lmforge.model.llama import native_gqa

    q32, q16 = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    assert native_gqa(q32, None) and native_gqa(q16, None)  # CPU flash takes any dtype
    assert not native_gqa(q32, torch.ones(1, 1, 2, 2, dtype=torch.bool))  # masked: math
    meta32 = torch.zeros(1, 4, 2, 8, device="meta")  # a non-CPU fp32 q: mem-efficient
    assert not native_gqa(meta32, None)
    assert native_gqa(meta32.to(torch.bfloat16), None)
