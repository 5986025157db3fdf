"""The data stages' params sections: ingest, filter, dedup, decontam, mix, tokenizer,
shards, and the executor their tasks run on."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

# Names only, no rule code: every stage loads params, and imports are its DVC deps.
from lmforge.config.checks import fraction, key, non_negative, positive, section_name
from lmforge.data.rule_names import LANGUAGE_CODES, PII_KINDS, RULE_NAMES, unknown_rules
from lmforge.errors import ConfigError

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
            raise ConfigError(f"{key(self, 'sources')}: at least one source is needed")
        positive(self, "part_docs", "max_record_bytes")
        non_negative(self, "num_workers")


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
        non_negative(self, "num_workers")
        _check_filter_settings(self, section_name(self))
        for domain, override in self.domains.items():
            merged = dataclasses.replace(self, **{k: v for k, v in dataclasses.asdict(override).items()
                                                  if v is not None})
            _check_filter_settings(merged, f"{key(self, 'domains')}.{domain}")


def _check_filter_settings(cfg: FilterConfig, where: str) -> None:
    for name in ("rules", "skip"):
        bad = unknown_rules(getattr(cfg, name) or [])
        if bad:
            raise ConfigError(f"{where}.{name}: unknown rule(s) {', '.join(bad)} "
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
        positive(self, "num_perm", "bands", "rows", "word_ngram", "char_ngram")
        non_negative(self, "num_workers")
        if self.bands * self.rows > self.num_perm:
            raise ConfigError(
                f"{key(self, 'bands')} * {key(self, 'rows')} = {self.bands * self.rows} "
                f"exceeds {key(self, 'num_perm')}={self.num_perm}"
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
    # A string of CJK characters alone (a poem line, a short answer) is one n-gram from
    # this many characters: a character is a word, and a 5-character line is particular.
    min_cjk_chars: int = 5
    # An n-gram found in more than this many training documents is common, not counted.
    max_matches: int = 10
    # true: drop the training documents that hold an evaluation n-gram (counted).
    remove: bool = False
    extra: list[str] = field(default_factory=list)
    num_workers: int = 0

    def validate(self) -> None:
        positive(self, "ngram", "min_ngram", "min_cjk_chars", "max_matches")
        non_negative(self, "num_workers")
        if self.min_ngram > self.ngram:
            raise ConfigError(f"{key(self, 'min_ngram')}: {self.min_ngram} must be <= "
                              f"{key(self, 'ngram')}={self.ngram}")
        if self.min_cjk_chars > self.min_ngram:
            raise ConfigError(f"{key(self, 'min_cjk_chars')}: {self.min_cjk_chars} must be <= "
                              f"{key(self, 'min_ngram')}={self.min_ngram}")


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
            raise ConfigError(f"{key(self, 'weights')}: give a weight for every domain")
        for domain, weight in self.weights.items():
            if not (isinstance(weight, (int, float)) and weight >= 0 and math.isfinite(weight)):
                raise ConfigError(f"{key(self, 'weights')}.{domain}: {weight!r} must be a number "
                                  ">= 0")
        if sum(self.weights.values()) <= 0:
            raise ConfigError(f"{key(self, 'weights')}: at least one weight must be > 0")
        if self.max_epochs < 1:
            raise ConfigError(f"{key(self, 'max_epochs')}: {self.max_epochs} must be >= 1")
        fraction(self, "max_shortfall")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"{key(self, 'val_fraction')}: {self.val_fraction} must be in (0, 1)")
        if not self.val_fraction <= self.max_val_fraction < 1:
            raise ConfigError(f"{key(self, 'max_val_fraction')}: {self.max_val_fraction} must be "
                              f"in [{key(self, 'val_fraction')}={self.val_fraction}, 1)")
        non_negative(self, "min_val_docs", "min_val_chars", "num_workers")
        positive(self, "part_docs")


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
            raise ConfigError(f"{key(self, 'reserved_tokens')}: tokens must be distinct and "
                              "non-empty")
        if self.vocab_size < 260:
            raise ConfigError(
                f"{key(self, 'vocab_size')}: {self.vocab_size} is too small for byte fallback "
                "(256 byte pieces + 4 special ids)"
            )
        if not 0.98 <= self.character_coverage <= 1.0:  # sentencepiece refuses less
            raise ConfigError(
                f"{key(self, 'character_coverage')}: {self.character_coverage} must be in "
                "[0.98, 1]"
            )
        positive(self, "sample_chars", "max_sentence_length")


@dataclass
class ShardsConfig:
    shard_tokens: int = 50_000_000
    bos: bool = False
    eos: bool = True
    num_workers: int = 0

    def validate(self) -> None:
        positive(self, "shard_tokens")
        non_negative(self, "num_workers")


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
        positive(self, "num_cpus")
        non_negative(self, "memory_mb", "max_retries")
