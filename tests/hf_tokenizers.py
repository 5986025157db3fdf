"""Hugging Face test tokenizers, built offline: byte-level BPE as Llama 3 and Qwen2 ship it.

Each is trained here on a few hundred strings with ``tokenizers`` and saved by
transformers' ``PreTrainedTokenizerFast.save_pretrained`` (tokenizer.json +
tokenizer_config.json), as a model folder on the hub holds them.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as RustTokenizer

# The pre-tokenizer regexes of Llama 3 and Qwen2 (Qwen2 splits digits one by one).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Text every tokenizer must keep: CJK, code indentation, emoji, CRLF, a BOM, tabs.
HARD_TEXTS = ["Hello, world! It's 2024.", "数据模型，全角标点。", "def f(x):\n    return x\n\n",
              "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧", "line one\r\nline two\r\n", "\ufeffBOM first",
              "\ttab\t\tand  spaces   ", "e\u0301 (e + combining acute)", "", " ",
              "mixed 中文 English 123456 😀\n"]


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    """A few hundred strings in the languages and layouts of HARD_TEXTS."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "数据", "模型", "训练", "return", "def", "x", "😀",
             "the", "model", "token", "    ", "\n", "\r\n", "1234", "，", "。"]
    return [" ".join(rng.choices(words, k=rng.randint(3, 30))) for _ in range(n)] + HARD_TEXTS


def build(out: Path, *, style: str = "llama3", specials: list[str] | None = None,
          special_markers: bool = True, vocab_size: int = 600, bos: str | None = None,
          eos: str | None = "<|endoftext|>", pad: str | None = None,
          nfc: bool = False) -> Path:
    """Train a byte-level BPE and save it in ``out`` as transformers does; return ``out``.

    ``specials`` are added special tokens; with ``special_markers`` the chat markers are
    added too (as special tokens, or as plain added tokens when it is ``"plain"``).
    """
    from transformers import PreTrainedTokenizerFast

    split = LLAMA3_SPLIT if style == "llama3" else QWEN2_SPLIT
    tok = RustTokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = list(QWEN_SPECIALS if specials is None else specials)
    if special_markers is True:
        specials += CHAT_MARKERS
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if special_markers == "plain":
        tok.add_tokens(CHAT_MARKERS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   pad_token=pad)
    fast.save_pretrained(str(out))
    return out
