"""The tiny sentencepiece tokenizer the chat, fine-tuning and evaluation tests share:
500 pieces over a small English/Chinese/code corpus, the chat markers reserved (ids 4-7).
Trained once per session by conftest's ``chat_tokenizer``; ``train`` makes variants."""

from __future__ import annotations

import random
from pathlib import Path

from lmforge.config import TokenizerConfig
from lmforge.finetune.template import CHAT_MARKERS
from lmforge.tokenizer.train import train_model

CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学"
WORDS = ["the", "model", "reads", "every", "token", "of", "corpus", "and", "learns", "which",
         "user", "end", "system", "assistant"]

def corpus(seed: int = 0, words: list[str] = WORDS, code_tail: str = " <|end|>") -> list[str]:
    """300 documents: English words, CJK characters and Python-like code, a third each;
    ``code_tail`` ends each code line (by default a chat marker inside plain text)."""
    rng = random.Random(seed)
    docs = []
    for i in range(300):
        if i % 3 == 0:
            docs.append(" ".join(rng.choices(words, k=40)) + ".\n")
        elif i % 3 == 1:
            docs.append("".join(rng.choices(CJK, k=60)) + "。\n")
        else:
            docs.append(f"def {rng.choice(words)}(x):\n    if x > {rng.randint(0, 99)}:\n"
                        f"        return x * 2\n\treturn None{code_tail}\n")
    return docs


def train(path: Path, reserved=CHAT_MARKERS, **kw) -> Path:
    cfg = TokenizerConfig(vocab_size=500, character_coverage=1.0, num_threads=1, **kw)
    path.write_bytes(train_model(corpus(), cfg, reserved_tokens=reserved)[0])
    return path
