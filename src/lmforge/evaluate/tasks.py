"""Held-out task scoring of a chat model: response loss, exact match, multiple choice.

The records are the instruction set's test files (``data/instructions/demo``:
``test.jsonl.gz`` and ``test_mc.jsonl.gz``, see its PROVENANCE.md): a conversation in
``messages`` whose last assistant turn is the reference reply, plus ``task``, ``lang``,
``answers`` (the accepted answers of an exact-match task, the reference otherwise) and,
for multiple choice, ``choices`` and ``answer``.

Everything is teacher-forced: one forward pass per token sequence, batched and
right-padded (causal attention keeps padding out of every scored position), with no
sampling loop. Three figures:

* **response loss** (``score_responses``): nats per reply token, the tokens the SFT loss
  mask covers (the last assistant turn's content and its ``<|end|>``), pooled over
  records, and bits per byte of the reply text;
* **exact match** (``score_responses``), for the tasks in ``EXACT_TASKS``: whether the
  greedy reply is one of ``answers``, read off the teacher-forced argmaxes;
* **multiple-choice accuracy** (``score_choices``): the choice with the highest
  log-likelihood as the reply.

Sequences are scored by lmforge.evaluate.sequences, standard errors come from
lmforge.evaluate.stats, and ``lmforge.evaluate.report.tasks_markdown`` puts a base and a
fine-tuned model's figures side by side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.data import readers
from lmforge.data.readers import Reject
from lmforge.errors import InputError
from lmforge.evaluate.sequences import SequenceSet, model_seq_len, score_sequences
from lmforge.evaluate.stats import by_task, proportion, ratio_stderr
from lmforge.finetune.records import Turn, iter_examples
from lmforge.tokenizer import Tokenizer

# Tasks whose ``answers`` are checked exactly (PROVENANCE.md, "check" column); the
# others (wn_define, wn_example, py_summary) are loose and get the response loss only.
EXACT_TASKS = frozenset({"wn_synonym", "wn_antonym", "poem_author", "poem_first_line",
                         "poem_next_line", "py_signature"})


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class TaskRecord:
    """One test conversation and its task fields; ``line`` is 1-based in ``file``."""

    file: str
    line: int
    turns: tuple[Turn, ...]
    task: str
    lang: str
    answers: list[str]
    choices: list[str] | None = None
    answer: int | None = None
    source_id: str | None = None

    @property
    def prompt(self) -> tuple[Turn, ...]:
        """All turns but the last (assistant) one: what the reply is conditioned on."""
        return self.turns[:-1]

    @property
    def reply(self) -> str:
        """The reference reply: the last assistant turn's content."""
        return self.turns[-1][1]

    @property
    def where(self) -> str:
        """``file:line``, for error messages."""
        return f"{self.file}:{self.line}"


def read_task_records(path: str | Path) -> list[TaskRecord]:
    """Every record of a task file, in file order; any bad line is an ``InputError``.

    The conversation is parsed by ``lmforge.finetune.records`` (so compression, a
    byte-order mark and CRLF line ends are handled as for training data); the task
    fields are then checked here. These are shipped evaluation files, not user data:
    a broken line means a broken file, so nothing is skipped.
    """
    examples = []
    for item in iter_examples(path):
        if isinstance(item, Reject):
            raise InputError(f"{path}:{item.pos}: {item.reason}: {item.detail}")
        examples.append(item)
    objects = _json_objects(path)  # the file reads cleanly: iter_examples said so
    records = [_task_record(str(path), line, turns, objects[line]) for line, turns in examples]
    if not records:
        raise InputError(f"{path}: no records")
    return records


def _json_objects(path: str | Path) -> dict[int, dict[str, Any]]:
    """``{line: object}`` of the lines ``iter_examples`` accepted (it reports the rest).

    A second, plain pass: ``iter_examples`` returns the turns only, not the object.
    """
    out = {}
    with readers.open_binary(path) as stream:
        for line, raw in enumerate(stream, start=1):  # lines split at b"\n", as its reader
            raw = raw.removeprefix(readers._BOM) if line == 1 else raw
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):
                continue  # blank or broken: iter_examples skips or rejects it
            if isinstance(obj, dict):
                out[line] = obj
    return out


def _task_record(file: str, line: int, turns: tuple[Turn, ...],
                 obj: dict[str, Any]) -> TaskRecord:
    """The record's task fields, each checked for type."""
    where = f"{file}:{line}"
    task = _field_str(obj, "task", where)
    if not task:
        raise InputError(f"{where}: task is empty")
    answers = _str_list(obj.get("answers"), "answers", where)
    if not answers:
        raise InputError(f"{where}: answers is empty")
    source_id = obj.get("source_id")
    if source_id is not None and not isinstance(source_id, str):
        raise InputError(f"{where}: source_id is {_type_name(source_id)}, not a string")
    choices, answer = _choices(obj, where)
    return TaskRecord(file, line, turns, task, _field_str(obj, "lang", where), answers,
                      choices, answer, source_id)


def _choices(obj: dict[str, Any], where: str) -> tuple[list[str] | None, int | None]:
    """``choices`` and ``answer``: both or neither, the index within range."""
    if "choices" not in obj and "answer" not in obj:
        return None, None
    if "choices" not in obj or "answer" not in obj:
        raise InputError(f"{where}: 'choices' and 'answer' go together")
    choices = _str_list(obj["choices"], "choices", where)
    if len(choices) < 2 or not all(choices):
        raise InputError(f"{where}: choices needs at least 2 non-empty strings")
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise InputError(f"{where}: answer is {_type_name(answer)}, not an integer")
    if not 0 <= answer < len(choices):
        raise InputError(f"{where}: answer {answer} is not an index of {len(choices)} choices")
    return choices, answer


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _field_str(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise InputError(f"{where}: {key} is {_type_name(value)}, not a string")
    return value


def _str_list(value: Any, key: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(f"{where}: {key} is not a list of strings")
    return list(value)


# --------------------------------------------------------------------------- scoring


def _loss_figures(nats: np.ndarray, tokens: np.ndarray, nbytes: np.ndarray,
                  right: np.ndarray) -> dict[str, Any]:
    """Pooled response loss, bits per byte and token accuracy (the share of reply tokens
    that are the teacher-forced argmax), with standard errors by record."""
    loss = nats.sum() / tokens.sum() if tokens.sum() else float("nan")
    return {
        "n": len(nats), "tokens": int(tokens.sum()), "bytes": int(nbytes.sum()),
        "loss": float(loss), "loss_stderr": ratio_stderr(nats, tokens),
        "bits_per_byte": (float(nats.sum() / math.log(2) / nbytes.sum())
                          if nbytes.sum() else float("nan")),
        "bits_per_byte_stderr": ratio_stderr(nats, nbytes) / math.log(2),
        "token_accuracy": float(right.sum() / tokens.sum()) if tokens.sum() else float("nan"),
        "token_accuracy_stderr": ratio_stderr(right.astype(np.float64), tokens),
    }


def _exact_figures(hits: np.ndarray) -> dict[str, Any]:
    p, se = proportion(hits)
    return {"n": len(hits), "correct": int(hits.sum()), "exact_match": p,
            "exact_match_stderr": se}




def score_responses(model: torch.nn.Module, tokenizer: Tokenizer,
                    records: Sequence[TaskRecord], batch_size: int,
                    device: str | torch.device = "cpu") -> dict[str, Any]:
    """Response loss of every record and exact match of the ``EXACT_TASKS`` records.

    Returns ``{"response": {"overall": F, "tasks": {task: F}}, "exact_match":
    {"overall": E, "tasks": {task: E}}}`` with F = ``n`` (records), ``tokens``,
    ``bytes`` (UTF-8 of the replies), ``loss`` (nats per reply token, pooled: total nats
    / total tokens), ``loss_stderr``, ``bits_per_byte``, ``bits_per_byte_stderr``; and
    E = ``n``, ``correct``, ``exact_match``, ``exact_match_stderr`` (sqrt(p(1-p)/n)).
    ``exact_match`` is empty of tasks when no record is of an exact task.

    The reply is the record's last assistant turn, scored on its content tokens and
    the closing ``<|end|>`` (whose nats count toward bits per byte: the reply's bytes
    must be said *and ended*). Standard errors treat records as independent: the
    delta-method error of the pooled ratio (``ratio_stderr``), not a bootstrap.

    Exact match, without a sampling loop: greedy decoding gives exactly answer A's
    tokens then ``<|end|>`` iff at every one of those positions the argmax of the
    teacher-forced logits is that token. A record is a hit when this holds for at
    least one of its ``answers`` (each is one sequence of the batch). Caveat: the
    answer is tokenized canonically (sentencepiece's encoding of its text); a greedy
    reply that spells an answer in other tokens counts as a miss. Greedy decoding that
    stops early (``<|end|>`` before the answer ends) or late (no ``<|end|>`` after it)
    is a miss, as it should be. Agreement with ``lmforge.model.generate`` holds up to
    float rounding between its KV-cache passes and this full-sequence pass.
    """
    seqs = SequenceSet(model_seq_len(model))
    reply_idx, answer_idx = [], []
    for rec in records:
        reply_idx.append(seqs.add(rec.prompt, rec.reply, tokenizer, rec.where))
        if rec.task in EXACT_TASKS:
            answer_idx.append([seqs.add(rec.prompt, a, tokenizer, rec.where)
                               for a in dict.fromkeys(rec.answers)])
    scores = score_sequences(model, seqs.ids, seqs.starts, batch_size, device)
    nats, tokens = scores.nats[reply_idx], scores.tokens[reply_idx]
    right = tokens - scores.misses[reply_idx]
    nbytes = np.array([len(rec.reply.encode("utf-8")) for rec in records], dtype=np.int64)
    response = by_task([rec.task for rec in records],
                        lambda m: _loss_figures(nats[m], tokens[m], nbytes[m], right[m]))
    hits = np.array([scores.greedy[idx].any() for idx in answer_idx], dtype=bool)
    exact_tasks = [rec.task for rec in records if rec.task in EXACT_TASKS]
    exact = by_task(exact_tasks, lambda m: _exact_figures(hits[m]))
    return {"response": response, "exact_match": exact}


def score_choices(model: torch.nn.Module, tokenizer: Tokenizer,
                  mc_records: Sequence[TaskRecord], batch_size: int,
                  device: str | torch.device = "cpu") -> dict[str, Any]:
    """Multiple-choice accuracy by log-likelihood.

    Each choice is scored as the assistant reply to the record's prompt: the summed
    log-probability of its tokens and the closing ``<|end|>`` (the end token makes a
    choice that is a prefix of another pay for stopping). The prediction is the
    highest (the first on ties, ``np.argmax``).

    Returns ``{"multiple_choice": {"overall": M, "tasks": {task: M}}}`` with M = ``n``,
    ``acc`` (the headline), ``acc_stderr``, ``acc_norm`` (the log-likelihood divided by
    the choice's UTF-8 bytes before the argmax, as lm-eval-harness's acc_norm, which
    divides by characters), ``acc_norm_stderr``, and ``chance`` (the mean of
    1 / number of choices). Standard errors are sqrt(p(1-p)/n).
    """
    seqs = SequenceSet(model_seq_len(model))
    index = []
    for rec in mc_records:
        if rec.choices is None or rec.answer is None:
            raise InputError(f"{rec.where}: not a multiple-choice record (no 'choices')")
        index.append([seqs.add(rec.prompt, c, tokenizer, rec.where) for c in rec.choices])
    scores = score_sequences(model, seqs.ids, seqs.starts, batch_size, device)
    right, right_norm, chance = [], [], []
    for rec, idx in zip(mc_records, index, strict=True):
        loglik = -scores.nats[idx]
        nbytes = np.array([len(c.encode("utf-8")) for c in rec.choices], dtype=np.float64)
        right.append(int(np.argmax(loglik)) == rec.answer)
        right_norm.append(int(np.argmax(loglik / nbytes)) == rec.answer)
        chance.append(1 / len(rec.choices))
    right_a, norm_a, chance_a = np.array(right), np.array(right_norm), np.array(chance)

    def figures(m: np.ndarray) -> dict[str, Any]:
        acc, acc_se = proportion(right_a[m])
        norm, norm_se = proportion(norm_a[m])
        return {"n": int(m.sum()), "acc": acc, "acc_stderr": acc_se, "acc_norm": norm,
                "acc_norm_stderr": norm_se, "chance": float(chance_a[m].mean())}

    return {"multiple_choice": by_task([rec.task for rec in mc_records], figures)}
