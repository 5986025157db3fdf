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
from lmforge.evaluate.tracking import log_to_mlflow
from lmforge.io import write_json, write_text
from lmforge.model import load_model
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
    tokenizer = Tokenizer.load(FINAL / "tokenizer.model")
    seq_len = model.config.seq_len
    started = time.perf_counter()

    val = score_split(model, ShardSet("data/shards/val"), seq_len, cfg.batch_size,
                      cfg.max_batches, device, amp).as_dict()
    results: dict = {"val": val, "bits_per_byte": val["bits_per_byte"]}
    if cfg.train_batches:
        train = score_split(model, ShardSet("data/shards/train"), seq_len, cfg.batch_size,
                            cfg.train_batches, device, amp).as_dict()
        results["train"] = {k: train[k] for k in ("loss", "perplexity", "bits_per_byte",
                                                  "tokens")}
        results["train_val_gap"] = val["loss"] - train["loss"]

    samples = samples_markdown(model, tokenizer, cfg.prompts, cfg.temperatures,
                               cfg.max_new_tokens, cfg.top_k, cfg.seed)
    results["seconds"] = round(time.perf_counter() - started, 2)

    write_json("metrics/eval.json", results)
    write_text("metrics/samples.md", samples)
    write_json("plots/eval_domains.json", [
        {"domain": name, "bits_per_byte": d["bits_per_byte"], "loss": d["loss"]}
        for name, d in sorted(val["domains"].items())
    ])
    log_to_mlflow(results, samples, FINAL)
    print(f"evaluate: val loss {val['loss']:.4f}, ppl {val['perplexity']:.2f}, "
          f"bits/byte {val['bits_per_byte']:.4f} over {val['tokens']:,} tokens")


if __name__ == "__main__":
    run_stage(main)
