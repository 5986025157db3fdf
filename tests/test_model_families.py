"""The open families through import, our decoder and export, against transformers itself:
Llama 3 (llama3 RoPE scaling), Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms, its own
head width) and SmolLM2's tied Llama. Each is a tiny random model transformers builds
from a config (offline); its logits must equal ours in fp32 at import, after export (as
the same class), and after a LoRA step and merge."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from lmforge.config import ModelConfig, RopeScalingConfig
from lmforge.errors import InputError
from lmforge.export.hf import export_hf, import_hf
from lmforge.export.hf_config import from_hf_config, to_hf_config
from lmforge.model.lora import apply_lora, merge_lora
from lmforge.model.saved import load_model, save_model

transformers = pytest.importorskip("transformers")

VOCAB = 300
SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)),
}


def hf_model(kind: str) -> torch.nn.Module:
    """A random model of the family, every weight (biases and norms too) perturbed so
    each one bears on the logits."""
    config_cls, model_cls, extra = FAMILIES[kind]
    config = getattr(transformers, config_cls)(**SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save_hf(model: torch.nn.Module, directory: Path) -> Path:
    """``save_pretrained`` with a tokenizer beside it, as a downloaded folder has."""
    from test_train_loop import write_tokenizer

    model.save_pretrained(directory)
    write_tokenizer(directory / "tokenizer.model")
    return directory


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def our_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).float()


IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_family_imports_exports_as_itself_and_computes_what_transformers_does(
        tmp_path, kind):
    theirs = hf_model(kind)
    source = save_hf(theirs, tmp_path / "hf")
    import_hf(source, tmp_path / "ours")
    ours, config = load_model(tmp_path / "ours")
    expected = FAMILIES[kind][1].removesuffix("ForCausalLM").lower()
    assert ours.config.family == expected and config["model"]["family"] == expected
    reference = hf_logits(theirs, IDS)
    assert (our_logits(ours, IDS) - reference).abs().max() < 1e-4

    export_hf(tmp_path / "ours", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == FAMILIES[kind][1]
    assert (hf_logits(back, IDS) - reference).abs().max() < 1e-4
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [FAMILIES[kind][1]]
    assert written["tie_word_embeddings"] == theirs.config.tie_word_embeddings


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_after_a_lora_step_and_merge_the_export_computes_our_merged_model(tmp_path, kind):
    source = save_hf(hf_model(kind), tmp_path / "hf")
    import_hf(source, tmp_path / "base")
    model, config = load_model(tmp_path / "base")
    model.train()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["attn", "mlp"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # B moves off zero, so the merge changes every adapted weight
        model(IDS[:, :-1], IDS[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
    merged = merge_lora(model).eval()
    save_model(merged, tmp_path / "tuned", tmp_path / "base" / "tokenizer.model",
               **{k: v for k, v in config.items() if k not in ("model", "vocab_size")})
    export_hf(tmp_path / "tuned", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == FAMILIES[kind][1]
    mine = our_logits(merged, IDS)
    assert (hf_logits(back, IDS) - mine).abs().max() < 1e-4
    base = our_logits(load_model(tmp_path / "base")[0], IDS)
    assert (mine - base).abs().max() > 1e-3  # the step changed the model


def test_llama3_scaling_changes_the_frequencies_as_transformers_does():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lmforge.model.llama import rope_frequencies

    config = transformers.LlamaConfig(**SHAPE, **FAMILIES["llama3"][2])
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    scaling = RopeScalingConfig(factor=8.0, original_max_position_embeddings=16)
    ours = rope_frequencies(16, 500000.0, scaling)
    assert torch.allclose(ours.float(), theirs, rtol=1e-6)
    plain = rope_frequencies(16, 500000.0)
    assert not torch.allclose(ours, plain)  # long wavelengths were stretched


UNSUPPORTED = [
    ({"model_type": "gemma2"}, r"model_type 'gemma2' is not supported"),
    ({"model_type": "qwen2_moe"}, r"model_type 'qwen2_moe' is not supported"),
    ({"model_type": "mistral", "sliding_window": 16},
     r"sliding_window 16 is shorter than the context \(64\).*--seq-len 16"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32},
     r"sliding_window 32 is shorter"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope_scaling.rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     r"rope_scaling.rope_type 'linear' is not supported"),
    ({"attention_bias": True}, r"attention_bias=true is not supported"),
    ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"num_local_experts": 8}, r"num_local_experts=8: mixture-of-experts"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor is not supported"),
]


@pytest.mark.parametrize(("change", "message"), UNSUPPORTED)
def test_a_feature_we_do_not_compute_is_refused_in_one_line(change, message):
    config = {"model_type": "llama", **SHAPE, **change}
    with pytest.raises(InputError, match=rf"^cfg.json: {message}") as refused:
        from_hf_config(config, "cfg.json")
    assert "\n" not in str(refused.value)


def test_a_window_as_long_as_the_context_is_full_attention():
    cfg, _ = from_hf_config({"model_type": "mistral", **SHAPE, "sliding_window": 64},
                            "cfg.json")
    assert cfg.family == "mistral"
    cfg, _ = from_hf_config({"model_type": "mistral", **SHAPE, "sliding_window": 16},
                            "cfg.json", seq_len=16)
    assert cfg.seq_len == 16


def test_an_unsupported_checkpoint_is_never_half_imported(tmp_path):
    source = save_hf(hf_model("mistral"), tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    with pytest.raises(InputError, match="sliding_window 8"):
        import_hf(source, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize(("family", "option"), [("llama", "qk_norm"), ("qwen3", "qkv_bias"),
                                                ("mistral", "qkv_bias")])
def test_a_model_its_family_cannot_hold_is_not_exported(family, option):
    bias, norm = option == "qkv_bias", option == "qk_norm"
    cfg = ModelConfig(family=family, qkv_bias=bias, qk_norm=norm or family == "qwen3")
    with pytest.raises(InputError, match=rf"^model\.{option}: True has no place"):
        to_hf_config(cfg, VOCAB, {})


def test_the_sharded_build_draws_the_family_options_as_the_eager_model():
    from lmforge.model.llama import Llama
    from lmforge.train.distributed import DistEnv
    from lmforge.train.fsdp import build_sharded, ensure_process_group, full_state

    env = DistEnv(0, 1, 0, torch.device("cpu"))
    ensure_process_group(env)
    qwen2 = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=32,
                        family="qwen2", qkv_bias=True)
    qwen3 = dataclasses.replace(qwen2, family="qwen3", qkv_bias=False, qk_norm=True,
                                head_dim=32)
    for cfg in (qwen2, qwen3):
        torch.manual_seed(0)
        eager = Llama(cfg, VOCAB).state_dict()
        torch.manual_seed(0)
        sharded = full_state(build_sharded(cfg, VOCAB, env, bf16=False))
        assert eager.keys() == sharded.keys()
        for name, value in eager.items():
            assert torch.equal(sharded[name], value), name
        assert any(name.endswith(("wq.bias", "q_norm.weight")) for name in eager)


def test_runs_from_before_the_family_keys_keep_their_identity():
    from lmforge.config import TrainConfig
    from lmforge.train.checkpoint import run_identity

    identity = run_identity(ModelConfig(), TrainConfig(), 1, {}, {}, "t" * 64)
    assert "family" not in identity["model"] and "qk_norm" not in identity["model"]
    qwen = run_identity(ModelConfig(family="qwen3", qk_norm=True), TrainConfig(), 1, {}, {},
                        "t" * 64)
    assert qwen["model"]["family"] == "qwen3" and qwen["model"]["qk_norm"] is True
