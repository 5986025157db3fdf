"""A model's weights and hyperparameters as llama.cpp reads them from a GGUF file.

Names: our parameter -> its Hugging Face name (:mod:`lmforge.export.hf_names`) -> the
GGUF name gguf-py's ``TensorNameMap`` gives for the architecture (``blk.0.attn_q.weight``),
the table llama.cpp's own converter uses.

q/k layout: our RoPE rotates dimension i with i + d/2 (Hugging Face's rotate-half).
llama.cpp's ``llama`` architecture applies RoPE to adjacent pairs (2i, 2i+1), so the rows
of the query and key projections are permuted within each head, exactly as
``convert_hf_to_gguf.py`` does for Llama and Mistral (and transformers' GGUF reader undoes
on load). Its ``qwen2``/``qwen3`` architectures rotate halves (NeoX style) and take the
rows as they are.

Types: f32, f16, bf16 and the block types gguf-py can quantize (q8_0, q5_1, q5_0, q4_1,
q4_0). As in llama.cpp's converter, 1-D tensors and norms stay f32, and a tensor whose
rows do not split into whole blocks falls back to f16. K-quants (q4_k_m and friends) are
made from an f16/f32 file by llama.cpp's ``llama-quantize`` (docs/deployment.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from lmforge.config import ModelConfig
from lmforge.errors import InputError
from lmforge.export.hf_config import CLASSES, OPTIONS
from lmforge.export.hf_names import hf_name
from lmforge.model.llama import ffn_hidden_size, rope_frequencies

# Our family -> the llama.cpp architecture that computes it.
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# --type -> (gguf.GGMLQuantizationType name, gguf.LlamaFileType name).
TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"),
         "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
         "q5_1": ("Q5_1", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
         "q4_1": ("Q4_1", "MOSTLY_Q4_1"), "q4_0": ("Q4_0", "MOSTLY_Q4_0")}


def gguf_arch(cfg: ModelConfig) -> str:
    """The llama.cpp architecture for ``cfg``; one line refusing what none computes."""
    bias, norm = OPTIONS[cfg.family]
    if cfg.qkv_bias != bias or cfg.qk_norm != norm:
        raise InputError(f"model.family {cfg.family} with qkv_bias={cfg.qkv_bias}, "
                         f"qk_norm={cfg.qk_norm}: no GGUF architecture computes this "
                         f"({CLASSES[cfg.family]} has qkv_bias={bias}, qk_norm={norm})")
    arch = ARCHS[cfg.family]
    if cfg.rope_scaling is not None and arch != "llama":
        raise InputError(f"model.rope_scaling ({cfg.rope_scaling.kind}) on a {cfg.family} "
                         "model: llama.cpp scales RoPE this way for the llama architecture "
                         "only")
    return arch


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias) from rotate-half to llama.cpp's adjacent pairs:
    within each head, rows [0..d/2) and [d/2..d) interleave as 0, d/2, 1, d/2+1, ..."""
    shape = w.shape
    return (w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:])
            .transpose(1, 2).reshape(shape))


def gguf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, arch_name: str
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, fp32 tensor) for each weight of ``state`` (a tied head left out), plus
    ``rope_freqs.weight`` for Llama 3.1 RoPE scaling."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, cfg.n_layer)
    n_kv = cfg.n_kv_head or cfg.n_head
    for ours, value in state.items():
        theirs = hf_name(ours)
        name = names.get_name(theirs, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise InputError(f"{theirs}: no {arch_name} tensor in GGUF for it")
        value = value.detach().float().cpu()
        if arch_name == "llama" and ours.endswith(("attn.wq.weight", "attn.wq.bias")):
            value = permute_qk(value, cfg.n_head)
        elif arch_name == "llama" and ours.endswith(("attn.wk.weight", "attn.wk.bias")):
            value = permute_qk(value, n_kv)
        yield name, value
    if cfg.rope_scaling is not None:
        # llama.cpp divides each frequency by its factor: plain / scaled is that factor.
        plain = rope_frequencies(cfg.head_size(), cfg.rope_base, None)
        scaled = rope_frequencies(cfg.head_size(), cfg.rope_base, cfg.rope_scaling)
        yield (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
               (plain / scaled).float())


def encode_tensor(name: str, value: torch.Tensor, qtype_name: str) -> tuple[np.ndarray, object]:
    """(data, gguf.GGMLQuantizationType) of one tensor in the file's type, by llama.cpp's
    converter's rules: 1-D tensors, norms and RoPE factors f32; rows that do not split
    into whole blocks f16."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    data = value.numpy()
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        qtype = gguf.GGMLQuantizationType.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        qtype = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(data, qtype), qtype


def write_hparams(writer, cfg: ModelConfig, vocab_size: int, file_type: str) -> None:
    """The architecture's ``{arch}.*`` keys: context, widths, heads, RoPE, norm eps."""
    import gguf

    writer.add_context_length(cfg.seq_len)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(ffn_hidden_size(cfg))
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_kv_head or cfg.n_head)
    writer.add_rope_dimension_count(cfg.head_size())
    if cfg.head_size() * cfg.n_head != cfg.n_embd:  # Qwen3's own head width
        writer.add_key_length(cfg.head_size())
        writer.add_value_length(cfg.head_size())
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType[file_type])
