"""Evaluate stage: val loss / perplexity / bits-per-byte per domain, train/val gap, samples.

Reads models/final and data/shards/{val,train}; writes metrics/eval.json,
metrics/samples.md and plots/eval_domains.json, and adds all of it to the training
run in MLflow.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lmforge.config import Params
from lmforge.errors import InputError
from lmforge.evaluate import samples_markdown, score_split
from lmforge.evaluate.scoring import WEIGHTING
from lmforge.evaluate.tracking import log_to_mlflow
from lmforge.io import write_json, write_text
from lmforge.model import load_model
from lmforge.shards.format import file_sha256
from lmforge.shards.loader import ShardSet
from lmforge.stage import run_stage
from lmforge.tokenizer import Tokenizer

FINAL = Path("models/final")


def main(params: Params) -> None:
    cfg = params.evaluate
    if not (FINAL / "model.safetensors").is_file():
        raise InputError(f"{FINAL}/model.safetensors: no trained model (run the train stage)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else None
    model, _ = load_model(FINAL, device=device)
    tokenizer = Tokenizer.load(FINAL)  # the tokenizer beside the model
    seq_len = model.config.seq_len
    started = time.perf_counter()

    train_shards = ShardSet("data/shards/train")
    mixture = train_shards.domain_shares()
    val = score_split(model, ShardSet("data/shards/val"), seq_len, cfg.batch_size,
                      cfg.max_batches, device, amp).as_dict(mixture)
    for name, d in val["domains"].items():
        d["mix_weight_tokens"] = mixture.get(name, {}).get("tokens", 0.0)
        d["mix_weight_bytes"] = mixture.get(name, {}).get("bytes", 0.0)
    headline = val["mix_weighted"]
    results: dict = {"loss": headline["loss"], "bits_per_byte": headline["bits_per_byte"],
                     # Which model these figures belong to (evaluate_post checks it).
                     "model_sha256": file_sha256(FINAL / "model.safetensors"),
                     "weighting": {"headline": "loss and bits_per_byte are val.mix_weighted",
                                   **WEIGHTING},
                     "val": val}
    if cfg.train_batches:
        train = score_split(model, train_shards, seq_len, cfg.batch_size,
                            cfg.train_batches, device, amp).as_dict(mixture)
        results["train"] = {k: train[k] for k in ("mix_weighted", "token_weighted")}
        # Both sides weighted alike: the gap measures overfitting, not the val split's
        # domain shares.
        results["train_val_gap_mix_weighted"] = (headline["loss"]
                                                 - train["mix_weighted"]["loss"])

    samples = samples_markdown(model, tokenizer, cfg.prompts, cfg.temperatures,
                               cfg.max_new_tokens, cfg.top_k, cfg.seed)
    results["seconds"] = round(time.perf_counter() - started, 2)

    write_json("metrics/eval.json", results)
    write_text("metrics/samples.md", samples)
    write_json("plots/eval_domains.json", [
        {"domain": name, "bits_per_byte": d["bits_per_byte"],
         "bits_per_byte_stderr": d["bits_per_byte_stderr"], "loss": d["loss"],
         "loss_stderr": d["loss_stderr"]}
        for name, d in sorted(val["domains"].items())
    ])
    log_to_mlflow(results, samples, FINAL)
    pooled = val["token_weighted"]
    print(f"evaluate: val loss {headline['loss']:.4f} ± {headline['loss_stderr']:.4f}, "
          f"bits/byte {headline['bits_per_byte']:.4f} ± {headline['bits_per_byte_stderr']:.4f}"
          f" (mixture-weighted; token-weighted {pooled['loss']:.4f}, "
          f"{pooled['bits_per_byte']:.4f}) over {pooled['tokens']:,} tokens")


if __name__ == "__main__":
    run_stage(main)
