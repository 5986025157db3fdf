"""lm-evaluation-harness (``lm-eval``) on our models, offline.

Each model directory (ours: ``model.safetensors``, ``config.json``, the tokenizer)
is exported once to a Hugging Face Llama folder (``lmforge.export.export_hf``) under
``models/hf/<label>-<key>``, where the key hashes the weights, the tokenizer and the
exporting code's versions, so an unchanged model is not exported again. That folder is
a cache, not a pipeline output: it ignores itself in git (``models/hf/.gitignore``) and
holds one export per label.

lm-eval then runs its ``hf`` model (``HFLM``) over YAML task files from a task folder
(``data/tasks/demo``): multiple-choice tasks over local JSON-lines files, so nothing is
downloaded (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` are set while it runs). A task's
``data_files`` are relative to its YAML file; they are resolved into a temporary copy
of the YAML, so the run works from any working directory.

The first token. HFLM runs with ``add_bos_token=False``: each task's text names its own
first token, ``</s>`` for plain text (pretraining puts EOS between documents and no BOS,
``shards.bos: false``) and ``<s>`` for chat-format tasks (our chat template starts with
BOS). The exported tokenizer maps both strings, and the chat markers, to their ids, so
the ids lm-eval scores are exactly those ``lmforge.evaluate.tasks`` would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from lmforge import __version__
from lmforge.errors import InputError, LmforgeError
from lmforge.export import export_hf
from lmforge.tokenizer.files import SP_FILE, find_tokenizer, tokenizer_files

HF_CACHE = Path("models/hf")
# lm-eval's keys for the figures we keep ("acc,none": metric "acc", filter "none").
FIGURES = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "TQDM_DISABLE": "1"}  # lm-eval's per-task progress bars


# --------------------------------------------------------------------------- tasks


def read_task_yaml(path: Path) -> dict[str, Any]:
    """A task file as a dict with a ``task`` name; an ``InputError`` naming the file else."""
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path}: not a readable YAML task file ({first})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("task"), str):
        raise InputError(f"{path}: no 'task' name (an lm-eval task file needs one)")
    return cfg


def task_files(task_dir: str | Path) -> dict[str, Path]:
    """``{task name: yaml path}`` of every ``*.yaml`` in ``task_dir``, sorted by name."""
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise InputError(f"{task_dir}: no such task folder")
    found: dict[str, Path] = {}
    for path in sorted(task_dir.glob("*.yaml")):
        name = read_task_yaml(path)["task"]
        if name in found:
            raise InputError(f"{path}: task {name!r} is also defined in {found[name]}")
        found[name] = path
    if not found:
        raise InputError(f"{task_dir}: no *.yaml task files")
    return dict(sorted(found.items()))


def select_tasks(task_dir: str | Path, tasks: list[str]) -> dict[str, Path]:
    """The named tasks of ``task_dir`` (all of them when ``tasks`` is empty)."""
    available = task_files(task_dir)
    unknown = [t for t in tasks if t not in available]
    if unknown:
        raise InputError(f"{task_dir}: no task {unknown[0]!r} (tasks: "
                         f"{', '.join(available)})")
    return {t: available[t] for t in tasks} if tasks else available


def data_files(cfg: dict[str, Any], yaml_path: Path) -> Any:
    """``dataset_kwargs.data_files`` with relative paths made absolute against the YAML's
    folder (lm-eval hands them to ``datasets``, which would read them from the cwd); the
    same shape (a split dict, a list or a path), None when the task names none."""
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return None

    def resolve(p: Any) -> Any:
        if isinstance(p, list):
            return [resolve(x) for x in p]
        if not isinstance(p, str):
            raise InputError(f"{yaml_path}: data_files entry {p!r} is not a path")
        path = Path(p) if Path(p).is_absolute() else yaml_path.parent / p
        if not any(path.parent.glob(path.name)):
            raise InputError(f"{yaml_path}: data file {path} does not exist")
        return str(path.resolve())

    if isinstance(files, dict):
        return {split: resolve(p) for split, p in files.items()}
    return resolve(files)


def resolved_task_dir(tasks: dict[str, Path], out_dir: Path) -> None:
    """Copies of the task files in ``out_dir``, their data files as absolute paths."""
    for path in tasks.values():
        cfg = read_task_yaml(path)
        files = data_files(cfg, path)
        if files is not None:
            cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": files}
        (out_dir / path.name).write_text(yaml.safe_dump(cfg, allow_unicode=True,
                                                        sort_keys=False), encoding="utf-8")


def task_chance(path: Path, limit: int = 0) -> float | None:
    """Mean 1 / number of choices over the items a run scores (the first ``limit``, or
    all), for a task over JSON-lines records with a ``choices`` list; else None."""
    cfg = read_task_yaml(path)
    files = data_files(cfg, path)
    if not isinstance(files, dict):  # datasets calls a bare path's split "train"
        files = {"train": files}
    split = cfg.get("test_split") or "test"
    if cfg.get("dataset_path") != "json" or split not in files:
        return None
    inverse = []
    for file in (files[split] if isinstance(files[split], list) else [files[split]]):
        with open(file, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    choices = json.loads(line).get("choices")
                except (ValueError, AttributeError):
                    raise InputError(f"{file}:{n}: not a JSON object") from None
                if not isinstance(choices, list) or not choices:
                    return None
                inverse.append(1 / len(choices))
    inverse = inverse[:limit] if limit else inverse
    return sum(inverse) / len(inverse) if inverse else None


# --------------------------------------------------------------------------- export


def export_key(model_dir: Path) -> str:
    """A hash of the weights, the tokenizer and the exporting code's versions."""
    import transformers

    h = hashlib.sha256(f"lmforge {__version__} transformers {transformers.__version__}\n"
                       .encode())
    # The tokenizer's files, whichever backend (for sentencepiece: tokenizer.model alone).
    tokenizer = list(tokenizer_files(model_dir)) if find_tokenizer(model_dir) else [SP_FILE]
    for name in ("model.safetensors", *tokenizer, "config.json"):
        path = model_dir / name
        if not path.is_file():
            raise InputError(f"{path}: missing (not a trained lmforge model folder)")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                h.update(block)
    return h.hexdigest()


def cached_export(model_dir: str | Path, label: str, cache: Path = HF_CACHE) -> Path:
    """``model_dir`` exported to Hugging Face format under ``cache``; reused when the key
    matches. Older exports of the same label are removed (one per label is kept)."""
    model_dir = Path(model_dir)
    out = cache / f"{label}-{export_key(model_dir)[:12]}"
    if not (out / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        ignore = cache / ".gitignore"
        if not ignore.is_file():  # a cache, never committed (as pytest's .pytest_cache)
            ignore.write_text("# lmforge eval harness: exported models, a cache\n*\n",
                              encoding="utf-8")
        export_hf(model_dir, out)
    for old in cache.glob(f"{label}-*"):
        if old != out and old.is_dir() and (old / ".lmforge-export").is_file():
            shutil.rmtree(old, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- running


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Hugging Face libraries offline (and lm-eval's INFO lines and progress bars off)
    for the block."""
    saved = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; anything else as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def hflm_args(hf_dir: Path) -> dict[str, Any]:
    """HFLM's model_args for an exported model: fp32, no BOS added (each task names its
    first token), EOS as the prefix of a context-free item (as between documents)."""
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    eos = config.get("eos_token_id")
    eos = eos[-1] if isinstance(eos, list) else eos  # a chat export lists <|end|> first
    args: dict[str, Any] = {"pretrained": str(hf_dir), "dtype": "float32",
                            "add_bos_token": False, "trust_remote_code": False}
    if isinstance(eos, int):
        args["prefix_token_id"] = eos
    return args


def task_figures(results: dict[str, Any], task: str) -> dict[str, Any]:
    """acc, acc_norm, their standard errors and n of one task from lm-eval's results."""
    raw = results["results"].get(task)
    if raw is None:
        raise LmforgeError(f"lm-eval returned no results for task {task!r}")
    out: dict[str, Any] = {}
    for key in FIGURES:
        value = raw.get(f"{key},none")
        out[key] = float(value) if isinstance(value, (int, float)) else math.nan
    out["n"] = int(results["n-samples"][task]["effective"])
    return out


def run_harness(models: dict[str, Path], task_dir: Path, tasks: list[str], batch_size: int,
                limit: int, device: str = "auto", cache: Path = HF_CACHE) -> dict[str, Any]:
    """lm-eval on every model: ``{"models": {label: {...}}, "tasks": {task: {...}}}``.

    ``models[label]`` gets ``model_dir``, ``hf_dir``, ``seconds`` and ``tasks``:
    ``{task: {acc, acc_stderr, acc_norm, acc_norm_stderr, n}}``; ``tasks[task]`` has
    ``chance`` (None when unknown) and the YAML file. ``tasks`` empty = every task in
    ``task_dir``; ``limit`` 0 = every item.
    """
    for label, model_dir in models.items():
        if not (Path(model_dir) / "model.safetensors").is_file():
            raise InputError(f"{model_dir}/model.safetensors: no trained model for "
                             f"'{label}'")
    selected = select_tasks(task_dir, tasks)
    device = resolve_device(device)
    out: dict[str, Any] = {
        "tasks": {t: {"chance": task_chance(p, limit), "file": str(p)}
                  for t, p in selected.items()},
        "models": {}, "device": device, "limit": limit}
    with offline(), tempfile.TemporaryDirectory(prefix="lmforge-tasks-") as tmp:
        import lm_eval
        from lm_eval.tasks import TaskManager

        out["lm_eval_version"] = getattr(lm_eval, "__version__", "unknown")
        resolved_task_dir(selected, Path(tmp))
        manager = TaskManager(include_path=tmp, include_defaults=False)
        for label, model_dir in models.items():
            started = time.perf_counter()
            hf_dir = cached_export(model_dir, label, cache)
            results = lm_eval.simple_evaluate(
                model="hf", model_args=hflm_args(hf_dir), tasks=list(selected),
                task_manager=manager, batch_size=batch_size, device=device,
                limit=limit or None, log_samples=False)
            if results is None:  # a non-zero rank under torchrun
                continue
            out["models"][label] = {
                "model_dir": str(model_dir), "hf_dir": str(hf_dir),
                "seconds": round(time.perf_counter() - started, 2),
                "tasks": {t: task_figures(results, t) for t in selected}}
    return out


# --------------------------------------------------------------------------- reports


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """metrics/harness.json: numbers only, ``model -> task -> figure`` and chance per task
    (``dvc metrics diff`` shows e.g. ``sft.demo_instruct_mc.acc``)."""
    out: dict[str, Any] = {label: {t: {k: v for k, v in figs.items()
                                       if not (isinstance(v, float) and math.isnan(v))}
                                   for t, figs in m["tasks"].items()}
                           for label, m in result["models"].items()}
    out["chance"] = {t: round(info["chance"], 6) for t, info in result["tasks"].items()
                     if info["chance"] is not None}
    return out


def _cell(figs: dict[str, Any], key: str) -> str:
    value, se = figs.get(key, math.nan), figs.get(f"{key}_stderr", math.nan)
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.3f} ± {se:.3f}" if math.isfinite(se) else f"{value:.3f}"


def harness_markdown(result: dict[str, Any]) -> str:
    """Tasks as rows, models as columns (acc ± stderr), then chance and n; acc_norm after."""
    labels = list(result["models"])
    lines = []
    for key, title in (("acc", "accuracy"), ("acc_norm", "accuracy, log-likelihood per "
                                                         "character (acc_norm)")):
        lines += [f"### lm-eval {title}", "",
                  "| task | " + " | ".join(labels) + " | chance | n |",
                  "|---|" + "---:|" * len(labels) + "---:|---:|"]
        for task, info in result["tasks"].items():
            figs = [result["models"][lb]["tasks"][task] for lb in labels]
            chance = info["chance"]
            ns = sorted({f["n"] for f in figs})
            lines.append(f"| {task} | " + " | ".join(_cell(f, key) for f in figs)
                         + f" | {'n/a' if chance is None else f'{chance:.3f}'} | "
                         + "/".join(map(str, ns)) + " |")
        lines.append("")
    lines.append(f"lm-eval {result.get('lm_eval_version', '?')}, device "
                 f"{result.get('device', '?')}, "
                 + ("every item" if not result.get("limit") else f"limit {result['limit']}")
                 + "; ± is the standard error sqrt(p(1-p)/(n-1)).")
    return "\n".join(lines) + "\n"


def log_to_mlflow(result: dict[str, Any], markdown: str) -> None:
    """Each model's figures into its own MLflow run (named in its ``run.json``), else
    all of them into one standalone run tagged ``lmforge.stage=harness``.

    Metrics are ``harness/<task>/<figure>`` (``harness/<label>/<task>/<figure>`` in the
    standalone run); harness.json and harness.md go along as artifacts. A model whose run
    the store lacks (it was reset) falls back to the standalone run.
    """
    from lmforge.config import Params, load_params
    from lmforge.stage import repo_root
    from lmforge.tracking import (
        find_run,
        recorded_run_id,
        resume_run,
        start_run,
        tracking_off,
        ui_path,
    )

    if tracking_off("harness"):
        return
    root = repo_root()
    report = {"result": result, "markdown": markdown}
    orphans: dict[str, Any] = {}
    for label, figures in result["models"].items():
        run_id = recorded_run_id(figures["model_dir"])
        if not run_id or find_run(run_id, root) is None:
            orphans[label] = figures
            continue
        with resume_run(run_id, root) as run:
            run.log_metrics(_run_metrics(figures["tasks"]), step=0)
            run.log_dict(report["result"], "harness/harness.json")
            run.log_text(markdown, "harness/harness.md")
        print(f"harness: {label}: logged to MLflow run {run_id}")
    if not orphans:
        return
    name = os.environ.get("DVC_EXP_NAME") or f"harness-{time.strftime('%Y%m%d-%H%M%S')}"
    params = load_params("params.yaml") if Path("params.yaml").is_file() else Params()
    with start_run(params, run_name=name, root=root,
                   tags={"lmforge.stage": "harness"}) as run:
        metrics = {}
        for label, figures in orphans.items():
            metrics.update({f"harness/{label}/{k.removeprefix('harness/')}": v
                            for k, v in _run_metrics(figures["tasks"]).items()})
        run.log_metrics(metrics, step=0)
        run.log_dict(report["result"], "harness/harness.json")
        run.log_text(markdown, "harness/harness.md")
    print(f"harness: {', '.join(orphans)}: logged to MLflow run {run.run_id} (no training "
          f"run recorded); in `mlflow ui` open {ui_path(run.experiment_id())}")


def _run_metrics(tasks: dict[str, dict[str, Any]]) -> dict[str, float]:
    return {f"harness/{task}/{k}": float(v) for task, figs in tasks.items()
            for k, v in figs.items() if isinstance(v, (int, float)) and math.isfinite(v)}
