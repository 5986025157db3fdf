"""Typed params: params.yaml loaded into dataclasses and validated with one-line errors.

Each pipeline stage reads its own section (``ingest``, ``filter``, ...). Loading walks
the dataclass fields, so an unknown key, a wrong type or an impossible value stops the
stage with a line such as::

    params.yaml: model.n_embd: 250 is not divisible by model.n_head=8

and a typo gets the closest key suggested (``train.max_lrr: unknown key; did you mean
'max_lr'?``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

import yaml

# Names only, no rule code: every stage loads params, and imports are its DVC deps.
from lmforge.data.rule_names import LANGUAGE_CODES, PII_KINDS, RULE_NAMES, unknown_rules
from lmforge.errors import ConfigError

# --------------------------------------------------------------------------- sections

# The chat template's role markers, in id order (lmforge.finetune.template uses these).
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


@dataclass
class SourceConfig:
    """One input of the ingest stage: files matched by ``path`` (a glob) tagged with a domain."""

    path: str
    domain: str
    # json: an array of records (or JSON lines); csv/tsv: a header row, text_field names
    # the column.
    format: Literal["auto", "jsonl", "json", "csv", "tsv", "parquet", "txt"] = "auto"
    text_field: str = "text"
    id_field: str | None = "id"
    # txt only: one document per file, or one per blank-line-separated block.
    txt_split: Literal["file", "paragraph"] = "file"


@dataclass
class IngestConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    # Documents per output parquet part.
    part_docs: int = 2000
    # A record (JSON line, text cell) larger than this is rejected, not loaded.
    max_record_bytes: int = 64 * 1024 * 1024
    num_workers: int = 0  # 0 = all cores

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("ingest.sources: at least one source is needed")
        _positive(self, "part_docs", "max_record_bytes")
        _non_negative(self, "num_workers")


# Kinds of text a domain can declare; lmforge.data.kinds gives each its rules and
# thresholds (tests/test_filter_kinds.py keeps the two lists equal).
FilterKind = Literal["web", "prose", "verse", "reference", "math", "code", "dialogue", "short"]


@dataclass
class FilterConfig:
    """Quality rules, their thresholds, the loss guard and the PII step; ``domains``
    overrides any of them for one domain.

    A domain's ``kind`` decides which rules can run on it and moves some thresholds
    (lmforge.data.kinds; README "Filter kinds"); ``rules`` narrows that set (a domain's
    own ``rules`` list is taken as is) and ``skip`` takes rules out.
    """

    # Rule or group names (gopher_quality, gopher_repetition, c4, fineweb); null = all
    # of each domain's kind.
    rules: list[str] | None = None
    # Rules or groups taken out (handy in a domain override).
    skip: list[str] = field(default_factory=list)
    kind: FilterKind = "prose"
    # Loss guard: the stage stops when the rules remove more than this share of a
    # domain's documents (1.0 = any loss is expected), or leave fewer than min_docs.
    max_loss: float = 0.5
    min_docs: int = 10
    # --- the practice notes
    min_chars: int = 200
    # Share of non-empty lines that start with '#' (markdown/comment spam); code opts out.
    max_hash_line_ratio: float = 0.5
    # Share of the text taken by its single most frequent non-space character.
    max_char_repeat_ratio: float = 0.3
    # Share of control / replacement characters (mojibake, binary junk).
    max_control_char_ratio: float = 0.01
    # Lines matching the advertising / boilerplate patterns before a document is dropped.
    max_boilerplate_lines: int = 3
    # --- Gopher quality (Rae et al. 2021); a CJK character counts as a word
    gopher_min_words: int = 50
    gopher_max_words: int = 100_000
    gopher_min_avg_word_length: float = 3.0
    gopher_max_avg_word_length: float = 10.0
    gopher_max_symbol_word_ratio: float = 0.1
    gopher_max_bullet_lines_ratio: float = 0.9
    gopher_max_ellipsis_lines_ratio: float = 0.3
    gopher_min_alpha_words_ratio: float = 0.8
    gopher_min_stop_words: int = 2
    # --- Gopher repetition: shares of lines / paragraphs / characters that repeat
    gopher_max_dup_line_ratio: float = 0.3
    gopher_max_dup_para_ratio: float = 0.3
    gopher_max_dup_line_char_ratio: float = 0.2
    gopher_max_dup_para_char_ratio: float = 0.2
    gopher_max_top_2gram_ratio: float = 0.2
    gopher_max_top_3gram_ratio: float = 0.18
    gopher_max_top_4gram_ratio: float = 0.16
    gopher_max_dup_5gram_ratio: float = 0.15
    gopher_max_dup_6gram_ratio: float = 0.14
    gopher_max_dup_7gram_ratio: float = 0.13
    gopher_max_dup_8gram_ratio: float = 0.12
    gopher_max_dup_9gram_ratio: float = 0.11
    gopher_max_dup_10gram_ratio: float = 0.10
    # --- C4 (Raffel et al. 2020), as document-level rules
    c4_min_sentences: int = 5
    c4_max_javascript_lines: int = 0
    c4_max_policy_lines: int = 0
    # --- FineWeb (Penedo et al. 2024)
    fineweb_min_line_punct_ratio: float = 0.12
    fineweb_max_short_line_ratio: float = 0.67
    fineweb_short_line_chars: int = 30
    fineweb_max_dup_line_char_ratio: float = 0.01
    fineweb_max_newline_word_ratio: float = 0.3
    # --- code nobody wrote (the code kind; Codex's and StarCoder's file filters): the
    # longest line and the mean line length of a file, in characters
    code_max_line_length: int = 1000
    code_max_mean_line_length: float = 100.0
    # --- personal data: off, redact (replace with <EMAIL> ...), or drop the document
    pii: Literal["off", "redact", "drop"] = "off"
    pii_kinds: list[str] = field(default_factory=lambda: ["email", "phone", "ip", "cn_id"])
    # --- languages (lmforge.data.langid, fastText lid.176 codes: en, zh, ja ...): keep
    # only documents in these (null = every language); counted under the reason
    # 'language'. Every domain's language counts are in metrics/filter.json either way.
    languages: list[str] | None = None
    domains: dict[str, DomainFilterConfig] = field(default_factory=dict)
    num_workers: int = 0

    def validate(self) -> None:
        _non_negative(self, "num_workers")
        _check_filter_settings(self, "filter")
        for domain, override in self.domains.items():
            merged = dataclasses.replace(self, **{k: v for k, v in dataclasses.asdict(override).items()
                                                  if v is not None})
            _check_filter_settings(merged, f"filter.domains.{domain}")


def _check_filter_settings(cfg: FilterConfig, where: str) -> None:
    for key in ("rules", "skip"):
        bad = unknown_rules(getattr(cfg, key) or [])
        if bad:
            raise ConfigError(f"{where}.{key}: unknown rule(s) {', '.join(bad)} "
                              f"(known: {', '.join(sorted(RULE_NAMES))}, or a group)")
    bad = sorted(set(cfg.pii_kinds) - set(PII_KINDS))
    if bad:
        raise ConfigError(f"{where}.pii_kinds: unknown kind(s) {', '.join(bad)} "
                          f"(known: {', '.join(PII_KINDS)})")
    bad = sorted(set(cfg.languages or []) - LANGUAGE_CODES)
    if bad:
        raise ConfigError(f"{where}.languages: unknown code(s) {', '.join(bad)} (fastText lid.176 "
                          "codes: en, zh, ja, ko, ru, fa, de, fr ...; und = no letters)")
    if cfg.languages is not None and not cfg.languages:
        raise ConfigError(f"{where}.languages: an empty list keeps nothing; null keeps every language")
    for f in dataclasses.fields(FilterConfig):
        value = getattr(cfg, f.name)
        if f.type in ("int", "float") and value < 0:
            raise ConfigError(f"{where}.{f.name}: {value} must be >= 0")
        if f.name.endswith("_ratio") and not 0 <= value <= 1:
            raise ConfigError(f"{where}.{f.name}: {value} must be in [0, 1]")
    if cfg.min_chars <= 0:
        raise ConfigError(f"{where}.min_chars: {cfg.min_chars} must be > 0")
    if not 0 <= cfg.max_loss <= 1:
        raise ConfigError(f"{where}.max_loss: {cfg.max_loss} must be in [0, 1] "
                          "(1 = any loss is expected)")


# Per-domain overrides: every FilterConfig setting, optional (None = the default's value).
DomainFilterConfig = dataclasses.make_dataclass(
    "DomainFilterConfig",
    [(f.name, f"{f.type} | None", field(default=None))
     for f in dataclasses.fields(FilterConfig) if f.name not in ("domains", "num_workers")],
)
DomainFilterConfig.__module__ = __name__  # so type hints resolve in this module
DomainFilterConfig.__doc__ = "Per-domain overrides of any filter setting; unset ones use the defaults."


@dataclass
class DedupConfig:
    exact: bool = True
    near: bool = True
    num_perm: int = 128
    bands: int = 16
    rows: int = 8
    # Shingles: word n-grams for space-separated text, character n-grams for CJK.
    shingle: Literal["auto", "word", "char"] = "auto"
    word_ngram: int = 5
    char_ngram: int = 5
    # Signature scheme: "oph" (one-permutation hashing, densified: O(1) work per shingle)
    # or "affine32" (datasketch.MinHash's own values, O(num_perm) work per shingle).
    scheme: Literal["oph", "affine32"] = "oph"
    # Which document of a cluster survives: the first seen, the longest, or the one with
    # the best quality score (lmforge.data.quality).
    keep: Literal["first", "longest", "quality"] = "first"
    seed: int = 1
    num_workers: int = 0

    def validate(self) -> None:
        _positive(self, "num_perm", "bands", "rows", "word_ngram", "char_ngram")
        _non_negative(self, "num_workers")
        if self.bands * self.rows > self.num_perm:
            raise ConfigError(
                f"dedup.bands * dedup.rows = {self.bands * self.rows} exceeds "
                f"dedup.num_perm={self.num_perm}"
            )


@dataclass
class DecontamConfig:
    """Evaluation items checked for n-gram overlap with the training text (the GPT-3 /
    NeMo Curator 13-gram method; lmforge.data.decontam). The sets checked: the harness
    task folder, the SFT test splits and the preference test pairs named in params,
    and ``extra`` files or folders (a user's own lm-eval tasks)."""

    ngram: int = 13
    # Items of min_ngram..ngram-1 words are one n-gram; shorter ones are too short to tell.
    min_ngram: int = 8
    # An n-gram found in more than this many training documents is common, not counted.
    max_matches: int = 10
    # true: drop the training documents that hold an evaluation n-gram (counted).
    remove: bool = False
    extra: list[str] = field(default_factory=list)
    num_workers: int = 0

    def validate(self) -> None:
        _positive(self, "ngram", "min_ngram", "max_matches")
        _non_negative(self, "num_workers")
        if self.min_ngram > self.ngram:
            raise ConfigError(f"decontam.min_ngram: {self.min_ngram} must be <= "
                              f"decontam.ngram={self.ngram}")


@dataclass
class MixConfig:
    # Target share of each domain in the train split; normalised to sum to 1.
    weights: dict[str, float] = field(default_factory=dict)
    unit: Literal["chars", "tokens_estimate"] = "chars"
    # Up-sampling repeats a domain at most this many times.
    max_epochs: float = 4.0
    # A domain that cannot reach its share within max_epochs is reported (asked vs got in
    # metrics/mix.json); short by more than this fraction of its share, it is an error.
    max_shortfall: float = 0.2
    # Train size in units (characters); null = as large as the weights and caps allow.
    total: int | None = None
    # Val per domain: at least val_fraction of its documents, min_val_docs documents and
    # min_val_chars characters (enough to measure the domain, with an error bar), but
    # never more than max_val_fraction of them; whole dedup clusters at a time.
    val_fraction: float = 0.02
    min_val_docs: int = 20
    min_val_chars: int = 50_000
    max_val_fraction: float = 0.2
    part_docs: int = 2000
    seed: int = 1234
    num_workers: int = 0

    def validate(self) -> None:
        if not self.weights:
            raise ConfigError("mix.weights: give a weight for every domain")
        for domain, weight in self.weights.items():
            if not (isinstance(weight, (int, float)) and weight >= 0 and math.isfinite(weight)):
                raise ConfigError(f"mix.weights.{domain}: {weight!r} must be a number >= 0")
        if sum(self.weights.values()) <= 0:
            raise ConfigError("mix.weights: at least one weight must be > 0")
        if self.max_epochs < 1:
            raise ConfigError(f"mix.max_epochs: {self.max_epochs} must be >= 1")
        _fraction(self, "max_shortfall")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"mix.val_fraction: {self.val_fraction} must be in (0, 1)")
        if not self.val_fraction <= self.max_val_fraction < 1:
            raise ConfigError(f"mix.max_val_fraction: {self.max_val_fraction} must be in "
                              f"[mix.val_fraction={self.val_fraction}, 1)")
        _non_negative(self, "min_val_docs", "min_val_chars", "num_workers")
        _positive(self, "part_docs")


@dataclass
class TokenizerConfig:
    model_type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = 8192
    character_coverage: float = 0.9995
    byte_fallback: bool = True
    split_digits: bool = True
    # "identity" keeps text exactly (lossless); "nfkc" is lossy and is reported as such.
    normalization: Literal["identity", "nfkc"] = "identity"
    # Characters sampled from mixed/train, balanced across domains.
    sample_chars: int = 20_000_000
    max_sentence_length: int = 16384
    seed: int = 42
    num_threads: int = 0  # 0 = all cores
    # An existing tokenizer (a tokenizer.model or tokenizer.json file, or a folder with
    # one, such as `lmforge import hf`'s output) used as is instead of training one: for
    # continued pretraining with train.init_from. The training settings above are unused.
    init_from: str | None = None
    # Control symbols at ids 4, 5, ... that encoding text never produces: the chat
    # template's role markers (lmforge.finetune.template.CHAT_MARKERS), reserved when the
    # tokenizer is trained so that fine-tuning never needs a new one.
    reserved_tokens: list[str] = field(default_factory=lambda: list(CHAT_MARKERS))

    def validate(self) -> None:
        if len(set(self.reserved_tokens)) != len(self.reserved_tokens) or not all(
                self.reserved_tokens):
            raise ConfigError("tokenizer.reserved_tokens: tokens must be distinct and "
                              "non-empty")
        if self.vocab_size < 260:
            raise ConfigError(
                f"tokenizer.vocab_size: {self.vocab_size} is too small for byte fallback "
                "(256 byte pieces + 4 special ids)"
            )
        if not 0.98 <= self.character_coverage <= 1.0:  # sentencepiece refuses less
            raise ConfigError(
                f"tokenizer.character_coverage: {self.character_coverage} must be in [0.98, 1]"
            )
        _positive(self, "sample_chars", "max_sentence_length")


@dataclass
class ShardsConfig:
    shard_tokens: int = 50_000_000
    bos: bool = False
    eos: bool = True
    num_workers: int = 0

    def validate(self) -> None:
        _positive(self, "shard_tokens")
        _non_negative(self, "num_workers")


@dataclass
class ExecutorConfig:
    """Where the data stages run their per-part tasks (``lmforge.executor``). The output
    bytes are the same either way, so no stage lists this section as a DVC param."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = None  # ray: the cluster; else RAY_ADDRESS, else a local instance
    num_cpus: float = 1.0  # ray: CPUs reserved per task
    memory_mb: int = 0  # ray: memory reserved per task (0 = none reserved)
    max_retries: int = 3  # ray: reruns of a task whose worker or node died

    def validate(self) -> None:
        _positive(self, "num_cpus")
        _non_negative(self, "memory_mb", "max_retries")


@dataclass
class RopeScalingConfig:
    """Llama 3.1's RoPE frequency scaling (``rope_scaling: {rope_type: llama3, ...}``):
    wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, shorter than ``... / high_freq_factor`` kept, and those
    between interpolated (transformers' ``_compute_llama3_parameters``)."""

    kind: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self) -> None:
        if not (self.factor >= 1 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ConfigError("model.rope_scaling: needs factor >= 1 and 0 < low_freq_factor "
                              "< high_freq_factor")
        _positive(self, "original_max_position_embeddings")


# The open families the decoder computes exactly: each is the Llama block with options.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # grouped-query attention; None = n_head
    n_embd: int = 256
    seq_len: int = 256
    # SwiGLU hidden size: 8/3 * n_embd rounded up to a multiple of this.
    ffn_multiple_of: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0
    # Stop attention at document boundaries (needs the shard document index).
    doc_mask: bool = False
    # Which Hugging Face class the model exports as (an imported model keeps its own).
    family: Literal["llama", "mistral", "qwen2", "qwen3"] = "llama"
    # Width of one attention head; null = n_embd / n_head (Qwen3 sets its own).
    head_dim: int | None = None
    # Biases on the query, key and value projections (Qwen2).
    qkv_bias: bool = False
    # RMSNorm over each query and key head before RoPE (Qwen3).
    qk_norm: bool = False
    # Llama 3.1 RoPE scaling; null = plain RoPE.
    rope_scaling: RopeScalingConfig | None = None
    # Attention and MLP output projections (wo, w2) start at zero, so each block starts
    # as the identity on the residual stream (the modded-nanogpt speedrun's init). An
    # init only: the model exports as before.
    zero_init_proj: bool = False

    def head_size(self) -> int:
        """Width of one attention head (``head_dim``, or n_embd / n_head)."""
        return self.head_dim or self.n_embd // self.n_head

    def validate(self) -> None:
        _positive(self, "n_layer", "n_head", "n_embd", "seq_len", "ffn_multiple_of")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd: {self.n_embd} is not divisible by model.n_head={self.n_head}"
            )
        head_dim = self.head_size()
        if head_dim % 2 or head_dim < 2:
            given = "model.head_dim" if self.head_dim else "model.n_embd/model.n_head"
            raise ConfigError(
                f"{given}: head_dim {head_dim} is odd; RoPE rotates pairs of dimensions, so "
                "it must be even"
            )
        if self.rope_scaling is not None:
            self.rope_scaling.validate()
        kv = self.n_kv_head or self.n_head
        if self.n_head % kv:
            raise ConfigError(
                f"model.n_kv_head: {kv} must divide model.n_head={self.n_head}"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout: {self.dropout} must be in [0, 1)")
        if self.rope_base <= 1 or self.norm_eps <= 0:
            raise ConfigError("model.rope_base must be > 1 and model.norm_eps > 0")


@dataclass
class LoraConfig:
    """Low-rank adapters (lmforge.model.lora): the base is frozen, only adapters train."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Layer names (wq wk wv wo w1 w2 w3 lm_head) or groups (attn, mlp).
    targets: list[str] = field(default_factory=lambda: ["attn", "mlp"])
    # The dtype the frozen base is held in (model/frozen.py): auto = bf16 on a GPU (fp16
    # without bf16), fp32 on a CPU; adapters and their optimizer state stay fp32.
    # nf4 (QLoRA): the blocks' Linear weights in torchao NF4, the rest as auto holds it
    # (pip install 'lmforge[qlora]'; not with strategy: fsdp).
    base_dtype: Literal["auto", "fp32", "bf16", "fp16", "nf4"] = "auto"

    def validate(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.targets:
            raise ConfigError("lora: rank must be >= 1, alpha > 0, dropout in [0, 1), and "
                              "targets non-empty")


@dataclass
class TrainConfig:
    max_steps: int = 1000
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    max_lr: float = 1e-3
    min_lr_ratio: float = 0.1
    # Warmup in optimizer steps; if < 1 it is a fraction of max_steps.
    warmup: float = 0.05
    schedule: Literal["cosine", "linear", "wsd"] = "cosine"
    # wsd only: the share of max_steps spent in the final decay.
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    # Loss straight from the hidden states in cache-sized chunks, never building the
    # B x T x vocab logits (model/loss.py); false = plain lm_head + cross_entropy.
    fused_loss: bool = True
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    device: str = "auto"
    # torch.compile the training step: auto = wherever Inductor can build (train/compiler.py).
    compile: Literal["auto", True, False] = "auto"
    activation_checkpointing: bool = False
    # Stop after this many consecutive non-finite steps.
    max_bad_steps: int = 5
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 20
    sample_every: int = 0  # 0 = never during training
    # Prompts continued every sample_every steps (MLflow text artifacts); none = from BOS.
    sample_prompts: list[str] = field(default_factory=list)
    # Start from these weights instead of a random init (continued pretraining): a model
    # dir (models/final, `lmforge import hf` output) or a step-*.pt checkpoint.
    init_from: str | None = None
    # Run the quick self-check (10 batches, 2 optimizer steps) before training.
    self_check: bool = False
    # CUDA only: find the largest micro-batch that fits; accumulation keeps the global batch.
    probe_micro_batch: bool = False
    ckpt_every: int = 200
    light_every: int = 0  # model-only checkpoints; 0 = none
    keep_last: int = 2
    seed: int = 1337
    # Number of processes (torchrun --nproc_per_node); 1 = plain python.
    nproc: int = 1
    # With several processes: ddp (each rank holds the whole model and optimizer state)
    # or fsdp (FSDP2: both sharded over the ranks; lmforge.train.fsdp).
    strategy: Literal["ddp", "fsdp"] = "ddp"
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = all cores
    # Train LoRA adapters on a frozen model instead of every weight (null = all weights).
    lora: LoraConfig | None = None
    # adamw, or muon: torch.optim.Muon on the blocks' 2-D weights (attention and MLP
    # matrices), AdamW (max_lr, betas, weight_decay above) on the rest (lmforge.train.optim).
    optimizer: Literal["adamw", "muon"] = "adamw"
    # Muon's peak learning rate, following the same schedule as max_lr.
    muon_lr: float = 0.02
    muon_momentum: float = 0.95  # Nesterov momentum
    # Decoupled: each step multiplies the weights by 1 - lr * muon_weight_decay.
    muon_weight_decay: float = 0.0
    # original: lr * sqrt(max(1, rows/cols)) (Keller Jordan's); match_rms_adamw:
    # lr * 0.2 * sqrt(max(rows, cols)) (Moonshot's; then muon_lr is an AdamW-sized rate).
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    # shuffled: windows in a seeded permutation (the mixture holds over the run); stratified:
    # every batch's domain shares follow the mixture too (lmforge.shards.loader).
    batch_sampling: Literal["shuffled", "stratified"] = "shuffled"

    def validate(self) -> None:
        if self.lora is not None:
            self.lora.validate()
        self._check_optimizer()
        _positive(self, "max_steps", "micro_batch_size", "grad_accum_steps", "log_every",
                  "eval_batches", "ckpt_every", "keep_last", "nproc", "max_bad_steps")
        _non_negative(self, "eval_every", "sample_every", "light_every", "num_threads",
                      "weight_decay", "label_smoothing", "z_loss", "warmup")
        if not 0 < self.max_lr < 1:
            raise ConfigError(f"{section_name(self)}.{yaml_name(type(self), 'max_lr')}: "
                              f"{self.max_lr} must be in (0, 1)")
        _fraction(self, "min_lr_ratio", "decay_fraction")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("train.beta1 and train.beta2 must be in [0, 1)")
        self._check_warmup()
        if self.grad_clip < 0 or self.label_smoothing >= 1:
            raise ConfigError("train.grad_clip must be >= 0 and train.label_smoothing < 1")
        if self.strategy == "fsdp" and self.probe_micro_batch:
            # Each rank probes alone; under FSDP every forward is a collective.
            raise ConfigError(f"{section_name(self)}.probe_micro_batch: not with strategy fsdp "
                              "(every rank would probe alone); `lmforge plan` gives the "
                              "micro-batch that fits")

    def _check_optimizer(self) -> None:
        """Muon's own knobs, and the one strategy it does not support."""
        section = section_name(self)
        if not 0 < self.muon_lr < 1 or not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"{section}.muon_lr must be in (0, 1) and {section}.muon_momentum "
                              "in [0, 1)")
        _non_negative(self, "muon_weight_decay")
        if self.optimizer == "muon" and self.strategy == "fsdp":
            # Newton-Schulz needs the whole matrix; on a row shard it would orthogonalise
            # each rank's rows alone: a silently different update.
            raise ConfigError(f"{section}.optimizer: muon is not supported with "
                              f"{section}.strategy: fsdp (Newton-Schulz needs whole "
                              "matrices); use strategy ddp or optimizer adamw")

    def _check_warmup(self) -> None:
        """The warmup must leave the decay at least one step (a run of one step has none
        and trains at the peak): a warmup that ends on the last step never decays."""
        section, steps, warmup = section_name(self), self.max_steps, self.warmup_steps()
        if warmup > steps or (steps > 1 and warmup == steps):
            given = (f"{self.warmup:g} of {steps} steps rounds to {warmup} steps" if
                     self.warmup < 1 else f"{warmup} steps")
            raise ConfigError(
                f"{section}.warmup: {given}, which leaves no step of {section}.max_steps="
                f"{steps} to decay; warm up over at most {max(steps - 1, 1)} steps")

    def warmup_steps(self) -> int:
        """Warmup in optimizer steps (``warmup`` may be given as a fraction of max_steps)."""
        return int(round(self.warmup * self.max_steps)) if self.warmup < 1 else int(self.warmup)


@dataclass
class EvaluateConfig:
    # Val windows to score; 0 = a full pass over the val shards.
    max_batches: int = 0
    batch_size: int = 16
    # Windows of train data scored for the train/val gap.
    train_batches: int = 20
    prompts: list[str] = field(default_factory=lambda: ["It is a truth universally"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.8])
    max_new_tokens: int = 64
    top_k: int = 50
    seed: int = 7

    def validate(self) -> None:
        _non_negative(self, "max_batches", "train_batches", "top_k")
        _positive(self, "batch_size", "max_new_tokens")
        if not all(t >= 0 for t in self.temperatures):  # NaN fails this too
            raise ConfigError("evaluate.temperatures: temperatures must be numbers >= 0")
        if not all(self.prompts):
            raise ConfigError("evaluate.prompts: a prompt is empty")


@dataclass
class SftDataConfig:
    """Instruction/chat records -> masked, packed token shards (the sft_data stage)."""

    # JSON-lines files (globs): chat `messages`, Alpaca, or prompt/completion records.
    sources: list[str] = field(
        default_factory=lambda: ["data/instructions/demo/train.jsonl.gz"])
    # Packed row length, which is the fine-tuning context: no example crosses a row.
    seq_len: int = 256
    # Share of examples held out for the val loss during fine-tuning (by a seeded hash).
    val_fraction: float = 0.05
    max_record_bytes: int = 64 * 1024 * 1024
    seed: int = 1234

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("sft_data.sources: give at least one file or glob")
        _positive(self, "seq_len", "max_record_bytes")
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"sft_data.val_fraction: {self.val_fraction} must be in (0, 0.5)")


@dataclass
class SftConfig(TrainConfig):
    """Supervised fine-tuning: the train loop's knobs, plus replay and document masking.

    The peak learning rate is ``lr`` here (``max_lr`` in ``train``).
    """

    YAML_NAMES: ClassVar[dict[str, str]] = {"max_lr": "lr"}

    max_steps: int = 150
    max_lr: float = 1e-3
    warmup: float = 0.1
    weight_decay: float = 0.0
    # The model fine-tuning starts from (a model dir or a step-*.pt checkpoint).
    init_from: str | None = "models/final"
    # Share of each batch's rows drawn from the pretraining shards (the notes' 9:1 to
    # 7:3 is 0.1 to 0.3): general text keeps the model from forgetting it.
    replay: float = 0.0
    # Attention stops at example boundaries in packed rows (positions restart at 0).
    doc_mask: bool = True

    def validate(self) -> None:
        super().validate()
        if not self.init_from:
            raise ConfigError("sft.init_from: name the model to fine-tune (e.g. models/final)")
        if not 0 <= self.replay < 1:
            raise ConfigError(f"sft.replay: {self.replay} must be in [0, 1)")


@dataclass
class DpoDataConfig:
    """Preference pairs -> masked, packed token shards (the dpo_data stage)."""

    # JSON-lines files (globs) of prompt/chosen/rejected records (TRL's shape: strings or
    # message lists); bad records are rejected with a reason and counted.
    sources: list[str] = field(
        default_factory=lambda: ["data/preferences/demo/train.jsonl.gz"])
    # Packed row length: each row holds whole pairs (chosen, then rejected).
    seq_len: int = 256
    # Share of pairs held out for the val figures during training (by a seeded hash).
    val_fraction: float = 0.05
    max_record_bytes: int = 64 * 1024 * 1024
    seed: int = 1234

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("dpo_data.sources: give at least one file or glob")
        _positive(self, "seq_len", "max_record_bytes")
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"dpo_data.val_fraction: {self.val_fraction} must be in (0, 0.5)")


@dataclass
class DpoConfig(TrainConfig):
    """Direct preference optimisation: the train loop's knobs, plus beta and the reference.

    The policy starts from ``init_from`` (the SFT model); the reference is that same
    model, frozen, its log-probabilities computed once per pair and cached.
    """

    YAML_NAMES: ClassVar[dict[str, str]] = {"max_lr": "lr"}

    max_steps: int = 100
    max_lr: float = 5e-5
    warmup: float = 0.1
    weight_decay: float = 0.0
    init_from: str | None = "models/sft"
    # The KL penalty's strength: larger keeps the policy closer to the reference.
    # (Attention always restarts at each sequence of a packed row: a rejected response
    # must never see its pair's chosen one.)
    beta: float = 0.1
    # Weight of the chosen responses' NLL (per token) added to the loss: DPO + NLL, as
    # RPO (Pang et al. 2024) and Llama 3 use it; it keeps the likelihood of the preferred
    # answers from falling and the policy nearer its start. 0 = plain DPO.
    nll_weight: float = 0.0

    def validate(self) -> None:
        super().validate()
        if not self.init_from:
            raise ConfigError("dpo.init_from: name the model to start from (e.g. models/sft)")
        if not self.beta > 0:
            raise ConfigError(f"dpo.beta: {self.beta} must be > 0")
        if self.batch_sampling != "shuffled":
            raise ConfigError("dpo.batch_sampling: only shuffled (preference pairs have "
                              "no domains to stratify)")
        if not self.nll_weight >= 0:
            raise ConfigError(f"dpo.nll_weight: {self.nll_weight} must be >= 0")


@dataclass
class HarnessConfig:
    """lm-evaluation-harness on our models, offline, over task files shipped in the repo."""

    # lm-eval YAML task files over local JSONL (nothing is downloaded).
    task_dir: str = "data/tasks/demo"
    tasks: list[str] = field(default_factory=list)  # empty = every task in task_dir
    # Label -> model directory; each is exported to Hugging Face format and evaluated.
    models: dict[str, str] = field(default_factory=lambda: {
        "base": "models/final", "sft": "models/sft", "dpo": "models/dpo"})
    batch_size: int = 32
    limit: int = 0  # items per task; 0 = all
    device: str = "auto"

    def validate(self) -> None:
        _positive(self, "batch_size")
        _non_negative(self, "limit")
        if not self.models:
            raise ConfigError("harness.models: name at least one model directory")


@dataclass
class EvaluatePostConfig:
    """The evaluate_post stage: held-out tasks, forgetting, chat samples."""

    test: str = "data/instructions/demo/test.jsonl.gz"
    # Multiple-choice records (`choices`, `answer`); null = none.
    test_mc: str | None = "data/instructions/demo/test_mc.jsonl.gz"
    # Held-out preference pairs (prompt/chosen/rejected); null = none.
    test_pref: str | None = "data/preferences/demo/test.jsonl.gz"
    batch_size: int = 16
    # User messages answered by the base and the fine-tuned model in metrics/post_samples.md.
    prompts: list[str] = field(default_factory=lambda: ["Give the antonym of the adjective \"hot\"."])
    max_new_tokens: int = 48

    def validate(self) -> None:
        _positive(self, "batch_size", "max_new_tokens")


@dataclass
class MixSweepConfig:
    """``lmforge mix sweep`` / ``mix fit``: choose ``mix.weights`` by proxy experiments
    (RegMix, Data Mixing Laws). Read by those commands only, never by a stage."""

    proxies: int = 16
    seed: int = 0
    # Mixtures come from a Dirichlet around each domain's natural share (its share of the
    # text available for training), alpha = concentration x share: larger = nearer it.
    concentration: float = 3.0
    bounds: dict[str, list[float]] = field(default_factory=dict)  # domain: [min, max] share
    # A proxy is the model section with these keys replaced, trained max_steps steps of
    # micro_batch_size windows, and scored on evaluate.max_batches = eval_batches.
    proxy_model: dict[str, int] = field(default_factory=lambda: {
        "n_layer": 2, "n_head": 4, "n_embd": 128})
    max_steps: int = 150
    micro_batch_size: int = 8
    eval_batches: int = 32
    jobs: int = 1  # proxies run at once (dvc queue start -j)
    name: str = "mixsweep"  # experiment names: <name>-00, <name>-01, ...
    # What the chosen mixture minimises: "weighted" = the val bits-per-byte of the domains
    # weighted by objective_weights (empty = equally), the same weights for every proxy;
    # "target" = target_domain's bits-per-byte, no other domain's more than max_increase
    # (a fraction) above its value predicted for today's mix.weights.
    objective: Literal["weighted", "target"] = "weighted"
    objective_weights: dict[str, float] = field(default_factory=dict)
    target_domain: str | None = None
    max_increase: float = 0.02
    candidates: int = 100_000  # mixtures the fitted law scores
    top_k: int = 100  # the recommendation averages the best top_k of them (RegMix)
    # Below this held-out rank correlation the fit is reported, not recommended from.
    min_rank_corr: float = 0.6

    def validate(self) -> None:
        _positive(self, "proxies", "max_steps", "micro_batch_size", "eval_batches", "jobs",
                  "candidates", "top_k", "concentration")
        _non_negative(self, "max_increase")
        if self.objective == "target" and not self.target_domain:
            raise ConfigError("mix_sweep.target_domain: name the domain that objective: "
                              "target minimises")
        for domain, pair in self.bounds.items():
            if len(pair) != 2 or not 0 <= pair[0] <= pair[1] <= 1:
                raise ConfigError(f"mix_sweep.bounds.{domain}: {pair} must be [min, max] "
                                  "with 0 <= min <= max <= 1")
        if not -1 <= self.min_rank_corr <= 1:
            raise ConfigError(f"mix_sweep.min_rank_corr: {self.min_rank_corr} must be in "
                              "[-1, 1]")


@dataclass
class Params:
    """All of params.yaml. Each stage validates the whole file but reads only its section."""

    ingest: IngestConfig = field(default_factory=IngestConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    sft_data: SftDataConfig = field(default_factory=SftDataConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    dpo_data: DpoDataConfig = field(default_factory=DpoDataConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    evaluate_post: EvaluatePostConfig = field(default_factory=EvaluatePostConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    mix_sweep: MixSweepConfig = field(default_factory=MixSweepConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        domains = {s.domain for s in self.ingest.sources}
        missing = sorted(domains - set(self.mix.weights))
        if missing:
            raise ConfigError(
                f"mix.weights: no weight for domain(s) {', '.join(missing)} "
                f"(ingest.sources has {', '.join(sorted(domains))})"
            )
        unknown = sorted(set(self.mix.weights) - domains)
        if unknown:
            raise ConfigError(
                f"mix.weights: domain(s) {', '.join(unknown)} appear in no ingest source"
            )
        sweep = self.mix_sweep
        named = {**sweep.bounds, **sweep.objective_weights,
                 **({sweep.target_domain: 0} if sweep.target_domain else {})}
        unknown = sorted(set(named) - domains)
        if unknown:
            raise ConfigError(
                f"mix_sweep: domain(s) {', '.join(unknown)} appear in no ingest source")
        unknown = sorted(set(self.filter.domains) - domains)
        if unknown:
            raise ConfigError(
                f"filter.domains: domain(s) {', '.join(unknown)} appear in no ingest source"
            )


# --------------------------------------------------------------------------- loading


def load_params(path: str | os.PathLike = "params.yaml") -> Params:
    """Read, type-check and validate ``path``; raise ConfigError with a one-line message."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such params file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}:{where}: invalid YAML: {problem}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        params = from_dict(Params, raw if raw is not None else {}, "")
        params.validate()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return params


def from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys and value types."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {_kind(data)}")
    names = yaml_keys(cls)  # params.yaml key -> field name
    fields = {key: f for f in dataclasses.fields(cls)
              for key in [yaml_name(cls, f.name)]}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{prefix}{key}: unknown key{hint}")
    for name, f in fields.items():
        required = (f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING)
        if required and name not in data:
            raise ConfigError(f"{prefix}{name}: required key missing")
    values = {names[k]: _coerce(hints[names[k]], v, f"{prefix}{k}") for k, v in data.items()}
    return cls(**values)


def yaml_name(cls: type, field_name: str) -> str:
    """The params.yaml key of a config field (a section may rename one, as sft's lr)."""
    return getattr(cls, "YAML_NAMES", {}).get(field_name, field_name)


def yaml_keys(cls: type) -> dict[str, str]:
    """``{params.yaml key: field name}`` for a config dataclass."""
    return {yaml_name(cls, f.name): f.name for f in dataclasses.fields(cls)}


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against type hint ``tp`` (recursing into containers/dataclasses)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        choices = get_args(tp)
        # Typed: 0 and 1 equal False and True, but are not the booleans a key allows.
        if not any(value == c and type(value) is type(c) for c in choices):
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{key}: {value!r} is not one of {', '.join(map(str, choices))}{hint}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_kind(value)}")
        (item,) = get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {_kind(value)}")
        _, item = get_args(tp)
        return {str(k): _coerce(item, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, f"{key}.")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML reads "5e-4" (no dot) as a string; accept it as the number it means.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config type {tp!r} for {key} is not supported")  # a bug in this file


def section_dict(section: Any) -> dict[str, Any]:
    """A params section as a plain dict of params.yaml keys (for MLflow and metrics)."""
    return {yaml_name(type(section), k): v for k, v in dataclasses.asdict(section).items()}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are kept as values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --------------------------------------------------------------------------- checks


def section_name(obj: Any) -> str:
    """The params.yaml section a config object is read from (``train``, ``sft``, ...)."""
    return {
        IngestConfig: "ingest", FilterConfig: "filter", DedupConfig: "dedup",
        MixConfig: "mix", TokenizerConfig: "tokenizer", ShardsConfig: "shards",
        ExecutorConfig: "executor",
        ModelConfig: "model", TrainConfig: "train", EvaluateConfig: "evaluate",
        SftDataConfig: "sft_data", SftConfig: "sft", DpoConfig: "dpo",
        EvaluatePostConfig: "evaluate_post",
        LoraConfig: "lora",
        RopeScalingConfig: "model.rope_scaling",
    }.get(type(obj), type(obj).__name__)


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        if getattr(obj, n) <= 0:
            raise ConfigError(f"{section_name(obj)}.{n}: {getattr(obj, n)} must be > 0")


def _non_negative(obj: Any, *names: str) -> None:
    for n in names:
        if getattr(obj, n) < 0:
            raise ConfigError(f"{section_name(obj)}.{n}: {getattr(obj, n)} must be >= 0")


def _fraction(obj: Any, *names: str) -> None:
    for n in names:
        if not 0 <= getattr(obj, n) <= 1:
            raise ConfigError(f"{section_name(obj)}.{n}: {getattr(obj, n)} must be in [0, 1]")


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
