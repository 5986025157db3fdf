"""lm-eval harness: lm-eval's log-likelihoods equal ours, a run on a shipped task, and the
shipped task files themselves (data/tasks/demo)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.evaluate.harness import (
    cached_export,
    harness_markdown,
    headline,
    hflm_args,
    offline,
    run_harness,
    select_tasks,
)
from lmforge.evaluate.sequences import reply_sequence, score_sequences
from lmforge.finetune.template import render_text
from lmforge.model import Llama, load_model, save_model
from lmforge.tokenizer import Tokenizer

pytest.importorskip("lm_eval")
REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "data" / "tasks" / "demo"
# Items per shipped task (README.md in TASKS says how each was made).
SIZES = {"demo_minpairs_en": 240, "demo_minpairs_zh": 144, "demo_cloze_en": 113,
         "demo_instruct_mc": 144, "demo_pref_pairs": 216}
CHAT_TASKS = {"demo_instruct_mc", "demo_pref_pairs"}


@pytest.fixture(scope="module")
def model_dir(chat_tokenizer, tmp_path_factory) -> Path:
    """A tiny random model whose tokenizer carries the chat markers."""
    sp = chat_tokenizer
    tok = Tokenizer.load(sp)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, seq_len=256, ffn_multiple_of=16,
                      tie_embeddings=False)
    torch.manual_seed(0)
    model = Llama(cfg, tok.vocab_size)
    special = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "unk": tok.unk_id}
    out = tmp_path_factory.mktemp("model") / "tiny"
    save_model(model, out, sp, special_ids=special, tokenizer_sha256=tok.sha256)
    return out


@pytest.fixture(scope="module")
def hf_dir(model_dir, tmp_path_factory) -> Path:
    return cached_export(model_dir, "tiny", tmp_path_factory.mktemp("hf"))


def test_export_is_cached_by_content_and_ignored_by_git(model_dir, hf_dir):
    assert cached_export(model_dir, "tiny", hf_dir.parent) == hf_dir  # reused, same key
    assert (hf_dir.parent / ".gitignore").read_text().splitlines()[-1] == "*"
    assert json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]


# (context, continuation) as the shipped tasks pose them: plain text after "</s>", chat
# after "<s>" with the markers as text. Multi-token continuations, CJK (byte fallback on
# this tokenizer), an empty context, a reply closed by <|end|>.
PLAIN = [("The cat sat on the", " mat"), ("", "A whole sentence, scored alone."),
         ("Emma was sure he had not", " forgiven her entirely"),
         ("", "床前明月光，疑是地上霜。"), ("x = 1\nprint(", "x)\n")]
CHAT = [([("user", "Which token ends a turn?")], "好 🙂"),
        ([("system", "Answer in one word."), ("user", "Give a synonym of \"cold\".")],
         "chilly"),
        ([("user", "《靜夜思》的作者是谁？")], "李白")]


def ours(model_dir: Path) -> tuple[list[list[int]], list[int]]:
    """Our token sequences and scored starts for PLAIN and CHAT."""
    tok = Tokenizer.load(model_dir / "tokenizer.model")
    seqs, starts = [], []
    for context, cont in PLAIN:  # EOS first, as between pretraining documents
        head = [tok.eos_id] + tok.encode(context)
        seqs.append(head + tok.encode(cont))  # no merge across the split: checked below
        starts.append(len(head))
    for prompt, reply in CHAT:  # evaluate.tasks' own rendering (BOS, markers by id)
        ids, start = reply_sequence(prompt, reply, tok)
        seqs.append(ids)
        starts.append(start)
    return seqs, starts


def test_lm_eval_loglikelihoods_equal_ours(model_dir, hf_dir):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    requests = [("</s>" + c, x) for c, x in PLAIN]
    requests += [("<s>" + render_text(p, add_generation_prompt=True, bos=""), r + "<|end|>")
                 for p, r in CHAT]
    with offline():
        lm = HFLM(**hflm_args(hf_dir), device="cpu", batch_size=4)
        theirs = lm.loglikelihood([Instance("loglikelihood", {}, args, i)
                                   for i, args in enumerate(requests)], disable_tqdm=True)
        pairs = [lm._encode_pair(c, x) for c, x in requests]
    seqs, starts = ours(model_dir)
    model, _ = load_model(model_dir)
    scores = score_sequences(model, seqs, starts, batch_size=3)
    for (ctx, cont), seq, start in zip(pairs, seqs, starts, strict=True):
        assert ctx + cont == seq and len(ctx) == start  # the very same ids are scored
    ll = [t[0] for t in theirs]
    diff = max(abs(a + b) for a, b in zip(ll, scores.nats, strict=True))
    print(f"max |lm-eval - ours| = {diff:.2e} nats over {len(ll)} continuations")
    assert diff < 1e-3, (diff, ll, list(-scores.nats))
    assert scores.tokens.min() >= 2 and all(x < 0 for x in ll)


def test_simple_evaluate_on_shipped_tasks(model_dir, hf_dir):
    tasks = ["demo_minpairs_en", "demo_instruct_mc"]
    result = run_harness({"tiny": model_dir}, TASKS, tasks, batch_size=8, limit=6,
                         device="cpu", cache=hf_dir.parent)
    figs = result["models"]["tiny"]["tasks"]
    assert set(figs) == set(tasks)
    for task in tasks:
        assert figs[task]["n"] == 6
        for key in ("acc", "acc_norm"):
            assert 0 <= figs[task][key] <= 1 and math.isfinite(figs[task][f"{key}_stderr"])
    assert result["tasks"]["demo_minpairs_en"]["chance"] == 0.5
    assert result["tasks"]["demo_instruct_mc"]["chance"] == 0.25
    flat = headline(result)
    assert flat["tiny"]["demo_instruct_mc"]["acc"] == figs["demo_instruct_mc"]["acc"]
    assert flat["chance"] == {"demo_instruct_mc": 0.25, "demo_minpairs_en": 0.5}
    table = harness_markdown(result)
    assert "| demo_instruct_mc | " in table and "| 0.250 | 6 |" in table


def read_items(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("task", sorted(SIZES))
def test_shipped_task_files(task):
    path = select_tasks(TASKS, [task])[task]
    cfg = __import__("yaml").safe_load(path.read_text(encoding="utf-8"))
    assert cfg["output_type"] == "multiple_choice" and cfg["target_delimiter"] == ""
    chat = task in CHAT_TASKS
    assert cfg["doc_to_text"] == ("<s>" if chat else "</s>") + "{{context}}"
    items = read_items(path.parent / cfg["dataset_kwargs"]["data_files"]["test"])
    assert len(items) == SIZES[task]
    keys = set()
    for item in items:
        choices, answer = item["choices"], item["answer"]
        assert len(choices) >= 2 and all(isinstance(c, str) and c for c in choices), item
        assert len(set(choices)) == len(choices), item
        assert isinstance(answer, int) and 0 <= answer < len(choices), item
        if chat:
            assert item["context"].startswith("<|user|>") or \
                item["context"].startswith("<|system|>")
            assert item["context"].endswith("<|assistant|>")
            assert all(c.endswith("<|end|>") and c.count("<|end|>") == 1 for c in choices)
        keys.add((item["context"], tuple(choices)))
    assert len(keys) == len(items), "repeated items"
    if not chat:  # plain tasks carry no marker strings
        assert not any("<|" in json.dumps(i["choices"]) + i["context"] for i in items)
    if len(choices) == 2:  # gold on both sides: a tie-break cannot pass for skill
        assert 0.3 < sum(i["answer"] for i in items) / len(items) < 0.7


def test_every_shipped_task_loads_in_lm_eval(tmp_path):
    from lm_eval.tasks import TaskManager

    from lmforge.evaluate.harness import resolved_task_dir

    with offline():
        resolved_task_dir(select_tasks(TASKS, []), tmp_path)
        manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
        loaded = manager.load(list(SIZES))["tasks"]
    assert set(loaded) == set(SIZES)
    for name, task in loaded.items():
        docs = list(task.test_docs())
        assert len(docs) == SIZES[name]
        doc = docs[0]
        assert task.doc_to_choice(doc) == doc["choices"]
        assert task.doc_to_target(doc) == doc["answer"]


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml, no trained models: nothing from the repo
    named = tmp_path / "named"
    named.mkdir()
    (named / "model.safetensors").write_bytes(b"")  # only checked for, never read here
    for argv, message in [
        (["--model", str(named), "--tasks", "nope"], "no task 'nope'"),
        ([], "none of harness.models is trained yet"),
        (["--model", "a", "--model", "b", "--label", "x"], "1 --label for 2 --model"),
        (["--model", str(tmp_path)], "model.safetensors: no trained model"),
    ]:
        with pytest.raises(SystemExit):
            main(["eval", "harness", "--task-dir", str(TASKS), *argv])
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    bad = tmp_path / "tasks"
    bad.mkdir()
    (bad / "t.yaml").write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  "
                                "data_files: {test: missing.jsonl}\n", encoding="utf-8")
    from lmforge.errors import InputError
    from lmforge.evaluate.harness import task_chance

    with pytest.raises(InputError, match=r"t\.yaml: data file .*missing\.jsonl"):
        task_chance(bad / "t.yaml")
