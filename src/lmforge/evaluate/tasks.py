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

``tasks_markdown`` puts a base and a fine-tuned model's figures side by side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lmforge.data import readers
from lmforge.data.readers import Reject
from lmforge.errors import InputError
from lmforge.finetune.records import ASSISTANT, Turn, iter_examples
from lmforge.finetune.template import chat_format
from lmforge.model.llama import Llama
from lmforge.model.loss import IGNORE_INDEX
from lmforge.tokenizer import Tokenizer

# Tasks whose ``answers`` are checked exactly (PROVENANCE.md, "check" column); the
# others (wn_define, wn_example, py_summary) are loose and get the response loss only.
EXACT_TASKS = frozenset({"wn_synonym", "wn_antonym", "poem_author", "poem_first_line",
                         "poem_next_line", "py_signature"})

# A change beyond this many standard errors of the difference is reported as real
# (as lmforge.evaluate.forgetting.SIGNIFICANT_Z).
SIGNIFICANT_Z = 2.0

# The right-padding id: any valid id does, causal attention never lets a scored
# position see it.
PAD_ID = 0

OVERALL = "all"  # the overall row's name in tasks_markdown


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


# --------------------------------------------------------------------------- sequences


@dataclass
class SequenceScores:
    """Per sequence: summed nats of the scored tokens, their count, ``misses``: how many
    are not the argmax of the logits before them, and ``greedy``: whether none is."""

    nats: np.ndarray
    tokens: np.ndarray
    misses: np.ndarray
    greedy: np.ndarray


@dataclass
class _SequenceSet:
    """Token sequences to score, deduplicated (an accepted answer is often the reference
    reply), each with the index of its first scored token."""

    max_len: int | None
    ids: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)

    def add(self, prompt: Sequence[Turn], reply: str, tokenizer: Tokenizer,
            where: str) -> int:
        """The index of ``prompt`` + ``reply`` as the assistant turn (added if new)."""
        ids, start = reply_sequence(prompt, reply, tokenizer)
        # The last token is only a target, never an input.
        if self.max_len is not None and len(ids) - 1 > self.max_len:
            raise InputError(f"{where}: {len(ids)} tokens with the reply, more than the "
                             f"model's seq_len {self.max_len} + 1")
        key = tuple(ids)
        if key not in self.index:
            self.index[key] = len(self.ids)
            self.ids.append(ids)
            self.starts.append(start)
        return self.index[key]


def reply_sequence(prompt: Sequence[Turn], reply: str, tokenizer: Tokenizer
                   ) -> tuple[list[int], int]:
    """(ids, start): ``prompt`` + ``reply`` rendered, and where the reply's tokens start.

    ``ids[start:]`` are the reply's content ids and its end-of-turn token (``<|end|>``,
    ``<|im_end|>``): the SFT loss mask of the last turn, in the model's chat format;
    what a template writes after it (a newline) is left off. The generation prompt must
    be an exact prefix; it is checked rather than assumed.
    """
    fmt = chat_format(tokenizer)
    head = fmt.generation_prompt(prompt)
    ids, mask = fmt.render((*prompt, (ASSISTANT, reply)))
    end = len(mask) - mask[::-1].index(1) if any(mask) else len(mask)
    ids, mask = ids[:end], mask[:end]
    if ids[:len(head)] != head or not all(mask[len(head):]):
        raise InputError(f"{fmt.where}: the generation prompt is not a prefix of the "
                         "conversation, so a reply's tokens cannot be told apart")
    return ids, len(head)


def _model_seq_len(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "seq_len", None)


@torch.no_grad()
def score_sequences(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                    starts: Sequence[int], batch_size: int,
                    device: str | torch.device = "cpu") -> SequenceScores:
    """Teacher-forced scores of ``sequences[i][starts[i]:]`` given what precedes it.

    One forward pass per batch of ``batch_size`` sequences, right-padded to the batch's
    longest; the sequences are batched by length (longest first) so little is padding.
    ``greedy`` uses ``torch.argmax`` (the first maximum on ties), as
    ``lmforge.model.generate.sample_next`` at temperature 0 does.
    """
    n = len(sequences)
    nats, tokens = np.zeros(n), np.zeros(n, dtype=np.int64)
    misses = np.zeros(n, dtype=np.int64)
    if any(not 0 < s < len(seq) for s, seq in zip(starts, sequences, strict=True)):
        raise ValueError("each start must be past the first token and within its sequence")
    device = torch.device(device)
    order = sorted(range(n), key=lambda i: -len(sequences[i]))
    was_training = model.training
    model.eval()
    try:
        for first in range(0, n, batch_size):
            rows = order[first:first + batch_size]
            x, y = _batch([sequences[i] for i in rows], [starts[i] for i in rows])
            b_nats, b_tokens, b_misses = _score_batch(model, x.to(device), y.to(device))
            nats[rows], tokens[rows], misses[rows] = b_nats, b_tokens, b_misses
    finally:
        model.train(was_training)
    return SequenceScores(nats, tokens, misses, misses == 0)


def _batch(seqs: list[Sequence[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, T) right-padded with ``PAD_ID`` and targets (B, T): the next token where
    it is scored, ``IGNORE_INDEX`` elsewhere."""
    width = max(len(s) for s in seqs) - 1
    x = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for row, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        ids = torch.as_tensor(seq, dtype=torch.long)
        x[row, :len(seq) - 1] = ids[:-1]
        # The logits at position t predict token t + 1.
        y[row, start - 1:len(seq) - 1] = ids[start:]
    return x, y


def _score_batch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: summed nats, scored tokens, and tokens that are not the argmax."""
    keep = y != IGNORE_INDEX
    picked, target = scored_logits(model, x, keep), y[keep]
    token_nats = F.cross_entropy(picked.float(), target, reduction="none")
    misses = (torch.argmax(picked, dim=-1) != target).double()  # argmax in the model's dtype
    row = keep.nonzero()[:, 0]
    size = x.size(0)
    sums = torch.zeros(size, dtype=torch.float64, device=x.device).index_add_(
        0, row, token_nats.double())
    wrong = torch.zeros(size, dtype=torch.float64, device=x.device).index_add_(0, row, misses)
    return (sums.cpu().numpy(), keep.sum(1).cpu().numpy(), wrong.cpu().numpy())


def scored_logits(model: torch.nn.Module, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The logits (N, V) at the N positions where ``keep`` (B, T) is true.

    For a ``Llama`` the output layer runs on those positions only: it is ~40 % of the
    5M demo model's FLOPs and a quarter of the positions are scored (a reply after
    its prompt). A forward hook hands the final norm's output at those positions to
    ``lm_head``, so ``model(x)`` returns (N, V); the shape is checked, so a forward
    that no longer ends in ``norm -> lm_head`` fails loudly rather than scoring wrong
    rows. Any other model is called plainly and indexed.
    """
    norm = getattr(model, "norm", None)
    if not isinstance(model, Llama) or not isinstance(norm, torch.nn.Module):
        logits = model(x)
        return (logits[0] if isinstance(logits, tuple) else logits)[keep]
    handle = norm.register_forward_hook(lambda _module, _inputs, out: out[keep])
    try:
        logits = model(x)
    finally:
        handle.remove()
    if logits.dim() != 2 or logits.size(0) != int(keep.sum()):
        raise AssertionError(f"Llama.forward no longer ends in norm -> lm_head "
                             f"(logits {tuple(logits.shape)})")
    return logits


# --------------------------------------------------------------------------- statistics


def ratio_stderr(num: np.ndarray, den: np.ndarray) -> float:
    """Standard error of ``sum(num) / sum(den)`` over records (delta method).

    The linearised ratio estimator: ``sqrt(sum((num_i - R den_i)^2) / (n (n - 1))) /
    mean(den)``. Records, not tokens, are the independent units. NaN below 2 records.
    """
    n = len(num)
    if n < 2 or not den.sum():
        return float("nan")
    ratio = num.sum() / den.sum()
    resid = num - ratio * den
    return float(math.sqrt((resid ** 2).sum() / (n * (n - 1))) / den.mean())


def proportion(hits: np.ndarray) -> tuple[float, float]:
    """(p, sqrt(p (1 - p) / n)) of a boolean array."""
    n = len(hits)
    if not n:
        return float("nan"), float("nan")
    p = float(hits.mean())
    return p, math.sqrt(p * (1 - p) / n)


def _by_task(tasks: list[str], figures: Callable[[np.ndarray], dict[str, Any]]
             ) -> dict[str, Any]:
    """``{"overall": figures(all), "tasks": {task: figures(its records)}}``."""
    names = np.array(tasks)
    return {"overall": figures(np.ones(len(tasks), dtype=bool)),
            "tasks": {t: figures(names == t) for t in sorted(set(tasks))}}


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


# --------------------------------------------------------------------------- scoring


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
    seqs = _SequenceSet(_model_seq_len(model))
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
    response = _by_task([rec.task for rec in records],
                        lambda m: _loss_figures(nats[m], tokens[m], nbytes[m], right[m]))
    hits = np.array([scores.greedy[idx].any() for idx in answer_idx], dtype=bool)
    exact_tasks = [rec.task for rec in records if rec.task in EXACT_TASKS]
    exact = _by_task(exact_tasks, lambda m: _exact_figures(hits[m]))
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
    seqs = _SequenceSet(_model_seq_len(model))
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

    return {"multiple_choice": _by_task([rec.task for rec in mc_records], figures)}


# --------------------------------------------------------------------------- report


def _fig(value: float, stderr: float, digits: int = 3) -> str:
    if not math.isfinite(value):
        return "n/a"
    return (f"{value:.{digits}f} ± {stderr:.{digits}f}" if math.isfinite(stderr)
            else f"{value:.{digits}f}")


def _verdict(delta: float, se_base: float, se_tuned: float) -> str:
    """Whether ``delta`` exceeds ``SIGNIFICANT_Z`` standard errors of the difference.

    The errors combine as independent; both models answer the same records, so this
    overstates the noise (the test is conservative, as in forgetting.py). Two zero
    errors (0 or 100 % on both sides) leave any change as real.
    """
    se = math.hypot(se_base, se_tuned)
    if not (math.isfinite(se) and math.isfinite(delta)):
        return "n/a"
    if se == 0:
        return "yes" if delta else "no"
    return "yes" if abs(delta) > SIGNIFICANT_Z * se else "no"


def _rows(base: dict[str, Any], tuned: dict[str, Any]) -> Iterable[tuple[str, dict, dict]]:
    """(name, base figures, tuned figures): the tasks both have, then the overall row."""
    for task in sorted(set(base["tasks"]) & set(tuned["tasks"])):
        yield task, base["tasks"][task], tuned["tasks"][task]
    yield OVERALL, base["overall"], tuned["overall"]


def _compare_table(title: str, base: dict[str, Any] | None, tuned: dict[str, Any] | None,
                   key: str, digits: int, extra: tuple[str, ...] = (),
                   shared: tuple[str, ...] = ()) -> list[str]:
    """One markdown section: per task n, base and tuned ``key`` ± stderr, the change and
    whether it is beyond 2 standard errors; ``extra`` keys add base and tuned columns,
    ``shared`` keys (the same for both models, such as chance) one column."""
    if not base or not tuned or not base.get("tasks"):
        return []
    head = f"| task | n | base {key} | tuned {key} | change | beyond {SIGNIFICANT_Z:g} se |"
    head += "".join(f" base {e} | tuned {e} |" for e in extra)
    head += "".join(f" {s} |" for s in shared)
    lines = [f"### {title}", "", head,
             "|---|---:|---:|---:|---:|---|" + "---:|---:|" * len(extra) + "---:|" * len(shared)]
    for name, b, t in _rows(base, tuned):
        se_b, se_t = b.get(f"{key}_stderr", math.nan), t.get(f"{key}_stderr", math.nan)
        delta = t[key] - b[key]
        n = str(b["n"]) if b["n"] == t["n"] else f"{b['n']} / {t['n']}"
        row = (f"| {name} | {n} | {_fig(b[key], se_b, digits)} | {_fig(t[key], se_t, digits)} "
               f"| {delta:+.{digits}f} | {_verdict(delta, se_b, se_t)} |")
        for e in extra:
            row += (f" {_fig(b[e], b.get(f'{e}_stderr', math.nan), digits)} |"
                    f" {_fig(t[e], t.get(f'{e}_stderr', math.nan), digits)} |")
        row += "".join(f" {_fig(b[s], math.nan, digits)} |" for s in shared)
        lines.append(row)
    return [*lines, ""]


def tasks_markdown(base: dict[str, Any], tuned: dict[str, Any]) -> str:
    """Base vs fine-tuned, per task: exact match, response loss and multiple choice.

    ``base`` and ``tuned`` are ``score_responses(...)`` merged with ``score_choices(...)``
    (``{**responses, **choices}``); a section either lacks is left out. Multiple choice
    shows the headline ``acc`` with its significance test, then ``acc_norm`` and chance.
    """
    lines = []
    lines += _compare_table("Exact match (greedy reply is an accepted answer; higher is "
                            "better)", base.get("exact_match"), tuned.get("exact_match"),
                            "exact_match", 3)
    lines += _compare_table("Response loss (nats per reply token; lower is better)",
                            base.get("response"), tuned.get("response"), "loss", 4,
                            extra=("bits_per_byte",))
    lines += _compare_table("Token accuracy (share of reply tokens that are the greedy "
                            "choice given the reference so far; higher is better)",
                            base.get("response"), tuned.get("response"), "token_accuracy", 3)
    lines += _compare_table("Multiple choice (accuracy by log-likelihood; higher is better)",
                            base.get("multiple_choice"), tuned.get("multiple_choice"),
                            "acc", 3, extra=("acc_norm",), shared=("chance",))
    return "\n".join(lines)
