"""Render the README's two pictures from the committed demo outputs.

docs/img/loss.png: the training curves (plots/{train,val,sft,sft_val,dpo,dpo_val}.tsv);
docs/img/bits_per_byte.png: val bits per byte per domain with standard errors for the
base model (plots/eval_domains.json) and the fine-tuned ones (metrics/post_detail.json).
Each PNG records the sha256 of the files it was drawn from (a ``Source`` text chunk), so
tests/test_demo_docs.py fails when a picture is older than its data. ``make demo`` runs
this after ``dvc repro``. Usage: ``python scripts/demo_pictures.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CURVES = {"pretraining": ("plots/train.tsv", "plots/val.tsv"),
          "SFT": ("plots/sft.tsv", "plots/sft_val.tsv"),
          "DPO": ("plots/dpo.tsv", "plots/dpo_val.tsv")}
DOMAINS = ("plots/eval_domains.json", "metrics/post_detail.json")
PICTURES = {"loss.png": [p for pair in CURVES.values() for p in pair], "bits_per_byte.png":
            list(DOMAINS)}


def source_digest(paths: list[str], root: Path = REPO) -> str:
    """sha256 over the named files' bytes, in order: what a picture was drawn from."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode() + b"\0" + (root / p).read_bytes())
    return h.hexdigest()


def read_tsv(path: Path) -> dict[str, list[float]]:
    """A plots/*.tsv file as columns of floats."""
    with path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return {k: [float(r[k]) for r in rows] for k in rows[0]} if rows else {}


def draw_loss(root: Path, out: Path) -> None:
    """Train and val loss of pretraining, SFT and DPO, one panel each."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(12, 3.4))
    for ax, (title, (train, val)) in zip(axes, CURVES.items(), strict=True):
        t, v = read_tsv(root / train), read_tsv(root / val)
        ax.plot(t["step"], t["loss"], label="train", linewidth=1)
        ax.plot(v["step"], v["val_loss"], "o-", label="val", markersize=3)
        ax.set(title=title, xlabel="step", ylabel="loss (nats/token)" if title ==
               "pretraining" else None)
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, out, PICTURES["loss.png"], root)


def domain_rows(root: Path) -> dict[str, dict[str, tuple[float, float]]]:
    """``{model: {domain: (bits_per_byte, stderr)}}``: base from plots/eval_domains.json,
    sft and dpo as evaluate_post measured them (metrics/post_detail.json)."""
    base = json.loads((root / DOMAINS[0]).read_text(encoding="utf-8"))
    rows = {"base": {d["domain"]: (d["bits_per_byte"], d["bits_per_byte_stderr"])
                     for d in base}}
    detail = json.loads((root / DOMAINS[1]).read_text(encoding="utf-8"))
    forgetting = detail.get("forgetting", {})
    for model in sorted(forgetting, key=lambda m: (m != "sft", m)):  # in training order
        measures = forgetting[model]
        rows[model] = {r["domain"]: (r["tuned"], r["tuned_stderr"])
                       for r in measures["bits_per_byte"] if r["domain"] in rows["base"]}
    return rows


def draw_domains(root: Path, out: Path) -> None:
    """Val bits per byte per domain, a bar per model, standard errors as whiskers."""
    import matplotlib.pyplot as plt

    rows = domain_rows(root)
    domains = sorted(rows["base"])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    height = 0.8 / len(rows)
    for i, (model, figures) in enumerate(rows.items()):
        ys = [j + (i - (len(rows) - 1) / 2) * height for j in range(len(domains))]
        ax.barh(ys, [figures[d][0] for d in domains], height,
                xerr=[figures[d][1] for d in domains], label=model, capsize=2)
    ax.set_yticks(range(len(domains)), domains)
    ax.invert_yaxis()
    ax.set(xlabel="val bits per byte (lower is better)", title="Per-domain val bits/byte")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, out, PICTURES["bits_per_byte.png"], root)


def save(fig, out: Path, sources: list[str], root: Path) -> None:
    """Write the PNG atomically, its sources' digest in a text chunk, no version stamp."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, metadata={"Software": None,
                                        "Source": source_digest(sources, root)})
    plt.close(fig)
    tmp.replace(out)


def png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (keyword -> text)."""
    data, found, pos = path.read_bytes(), {}, 8
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            found[key.decode("latin-1")] = text.decode("latin-1")
        pos += 12 + length
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    draw_loss(REPO, args.out / "loss.png")
    draw_domains(REPO, args.out / "bits_per_byte.png")
    print(f"wrote {args.out / 'loss.png'} and {args.out / 'bits_per_byte.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
