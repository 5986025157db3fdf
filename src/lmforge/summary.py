"""A short console summary of a pipeline run, from the metrics files (`make demo` ends with it)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def summary(metrics_dir: str | Path = "metrics") -> str:
    """Data counts, training figures and per-domain evaluation as a few readable lines."""
    m = Path(metrics_dir)
    lines = []
    for stage in ("ingest", "filter", "dedup", "mix"):
        total = _load(m / f"{stage}.json").get("total", {})
        if total:
            rejected = sum(total.get("rejected", {}).values())
            lines.append(f"{stage:<9} {total['in']:>6,} in  {total['kept']:>6,} kept  "
                         f"{rejected:>5,} rejected")
    tok, train, ev = _load(m / "tokenizer.json"), _load(m / "train.json"), _load(m / "eval.json")
    if tok:
        lines.append(f"tokenizer vocab {tok['vocab_size']:,}, "
                     f"{tok['chars_per_token']['all']} chars/token, lossless={tok['lossless']}")
    if train:
        lines.append(f"train     {train['params']:,} params, {train['steps']} steps, "
                     f"{train['tokens']:,} tokens, {train['tokens_per_sec']:,.0f} tok/s, "
                     f"{train['wall_seconds']:.0f} s")
    if ev:
        vocab = tok.get("vocab_size")
        ref = f" (ln vocab = {math.log(vocab):.2f})" if vocab else ""
        val = ev["val"]
        mix, pooled = val.get("mix_weighted"), val.get("token_weighted", val)
        if mix:
            lines.append(f"evaluate  val loss {mix['loss']:.3f} ± {mix['loss_stderr']:.3f}"
                         f"{ref}, bits/byte {mix['bits_per_byte']:.3f} ± "
                         f"{mix['bits_per_byte_stderr']:.3f}  (mixture-weighted)")
        lines.append(f"          val loss {pooled['loss']:.3f}, bits/byte "
                     f"{pooled['bits_per_byte']:.3f}  (token-weighted, "
                     f"{pooled['tokens']:,} tokens)")
        gap = ev.get("train_val_gap_mix_weighted")
        if gap is not None:
            lines.append(f"          train/val gap {gap:+.3f} (val - train, mixture-weighted)")
        for name, d in sorted(val["domains"].items()):
            err = (f" ± {d['loss_stderr']:.3f}", f" ± {d['bits_per_byte_stderr']:.3f}"
                   ) if "loss_stderr" in d else ("", "")
            lines.append(f"          {name:<14} loss {d['loss']:.3f}{err[0]}  "
                         f"bits/byte {d['bits_per_byte']:.3f}{err[1]}  "
                         f"({d.get('docs', '?')} docs)")
    lines += post_training_lines(m)
    return "\n".join(lines)


def post_training_lines(m: Path) -> list[str]:
    """sft_data, sft and evaluate_post in a few lines: counts, run, task scores, forgetting."""
    data, sft, post = (_load(m / "sft_data.json"), _load(m / "sft.json"),
                       _load(m / "post.json"))
    lines = []
    if data:
        c = data["counts"]
        lines.append(f"sft_data  {c['in']:>6,} in  {c['kept']:>6,} kept  "
                     f"{c['in'] - c['kept']:>5,} rejected   ({data['train']['rows']:,} rows "
                     f"of {data['seq_len']}, {data['train']['target_share']:.0%} answer tokens)")
    if sft:
        lines.append(f"sft       {sft['mode']}, {sft['trainable_params']:,} trained params, "
                     f"{sft['steps']} steps, replay {sft['replay_row_share']:g} of rows, "
                     f"{sft['wall_seconds']:.0f} s")
    dpo = _load(m / "dpo.json")
    if dpo:
        lines.append(_dpo_line(dpo))
    if post:
        b, t = post["base"], post["sft"]
        lines.append(f"post      token accuracy {b['token_accuracy']:.3f} -> "
                     f"{t['token_accuracy']:.3f} ± {t['token_accuracy_stderr']:.3f}, "
                     f"response loss {b['response_loss']:.3f} -> {t['response_loss']:.3f}  "
                     "(base -> fine-tuned, held-out test)")
        if "mc_acc" in t:
            lines.append(f"          exact match {b['exact_match']:.3f} -> "
                         f"{t['exact_match']:.3f}, multiple choice {b['mc_acc']:.3f} -> "
                         f"{t['mc_acc']:.3f} (chance {t['mc_chance']:.2f})")
        d = post.get("dpo")
        if d and "pref_accuracy" in d:
            lines.append(f"          preference accuracy {b['pref_accuracy']:.3f} / "
                         f"{t['pref_accuracy']:.3f} / {d['pref_accuracy']:.3f} "
                         "(base / sft / dpo, held-out pairs, chance 0.5); dpo reward "
                         f"accuracy {d.get('reward_accuracy', float('nan')):.3f}")
        forgetting = post.get("forgetting_bits_per_byte", {})
        for name in ("sft", "dpo"):
            forgot = forgetting.get(name, {})
            if "mix_weighted" in forgot:
                lines.append(f"          forgetting ({name}): val bits/byte "
                             f"{forgot['mix_weighted']:+.3f} (mixture-weighted; per domain "
                             "in metrics/forgetting.md)")
    return lines


def _dpo_line(dpo: dict) -> str:
    """metrics/dpo.json in one line: the loss and replay when not plain DPO's, and the
    KL to the reference when there is one (SimPO has none)."""
    # Training's reward accuracy (margin > 0), under its old name in older metrics.
    reward = dpo.get("val_reward_accuracy", dpo.get("val_pref_accuracy", float("nan")))
    loss = dpo.get("loss", "sigmoid")
    kl = dpo.get("val_kl_per_token")
    return (f"dpo       {dpo['mode']}" + (f", {loss} loss" if loss != "sigmoid" else "")
            + f", beta {dpo['beta']:g}, {dpo['steps']} steps, {dpo['train_pairs']:,} pairs"
            + (f", replay {dpo['replay_row_share']:g} of rows"
               if dpo.get("replay_row_share") else "")
            + f"; val reward accuracy {reward:.3f}"
            + (f", KL to reference {kl:.4f}/token" if kl is not None else "")
            + f", {dpo['wall_seconds']:.0f} s")


if __name__ == "__main__":
    print(summary())
