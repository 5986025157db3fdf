"""The quick self-check: ten batches and two optimizer steps, before a long run.

``lmforge train --self-check`` (or ``train.self_check: true``) runs it on the real shards,
model and optimizer: batch shapes and token range, targets = inputs shifted by one,
ignore_index, the causal (and document) mask, the loss at initialisation against
ln(vocab), finite loss and gradients, and two optimizer steps that move the weights and
lower the loss on a repeated batch. It takes seconds and catches the shape, mask and
dtype mistakes that otherwise show up hours into a run as a bad loss curve.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmforge.config import Params
from lmforge.model.llama import Llama
from lmforge.model.loss import IGNORE_INDEX
from lmforge.train.distributed import DistEnv, resolve_device
from lmforge.train.objectives import TrainData
from lmforge.train.optim import build_optimizer
from lmforge.train.precision import resolve_precision
from lmforge.train.step import optimizer_step

NUM_BATCHES = 10
LOSS_TOLERANCE = 0.5  # |initial loss - ln(vocab)|, nats


@dataclass
class Check:
    """One check's outcome."""

    name: str
    ok: bool
    detail: str
    seconds: float
    warn: bool = False  # passed, but says something the user should act on


@dataclass
class SelfCheckReport:
    """Every check, in the order they ran (a failed check stops the rest)."""

    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> Check | None:
        """The first failed check, or None."""
        return next((c for c in self.checks if not c.ok), None)

    def table(self) -> str:
        """A short fixed-width table: check, result, time, detail."""
        width = max(len(c.name) for c in self.checks) if self.checks else 5
        lines = [f"{'check':<{width}}  result  {'time':>7}  detail"]
        for c in self.checks:
            result = "FAIL" if not c.ok else "warn" if c.warn else "ok"
            lines.append(f"{c.name:<{width}}  {result:<6}  {c.seconds:6.2f}s  {c.detail}")
        return "\n".join(lines)

    def warnings(self) -> list[str]:
        """One line per passed check that warns (e.g. an optimizer step dearer than the
        forward and backward it follows)."""
        return [f"train self-check: {c.name}: {c.detail}" for c in self.checks
                if c.ok and c.warn]

    def error_line(self) -> str:
        """One line naming the failed check (for the exit message)."""
        c = self.failed
        return "" if c is None else f"train self-check failed: {c.name}: {c.detail}"


class _Repeat:
    """A loader that hands out the same batch every time."""

    def __init__(self, batch: tuple[torch.Tensor, ...]) -> None:
        self.batch = batch

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        return self.batch


def self_check(params: Params, data: TrainData, device: torch.device | str | None = None
               ) -> SelfCheckReport:
    """Run every check on ``data`` (the train stage's shards, opened); a failed check
    stops the rest."""
    device = resolve_device(str(device) if device is not None else params.train.device)
    report = SelfCheckReport()
    for name, check in _Checks(params, data, device).steps():
        t0, warn = time.perf_counter(), False
        try:
            detail, ok = check(), True
        except _Warning as e:
            detail, ok, warn = str(e), True, True
        except _Failed as e:
            detail, ok = str(e), False
        except Exception as e:  # any crash is a failed check, named, in one line
            first = str(e).splitlines()[0] if str(e) else ""
            detail, ok = f"{type(e).__name__}: {first}", False
        report.checks.append(Check(name, ok, detail, time.perf_counter() - t0, warn))
        if not ok:
            break
    return report


class _Checks:
    """The checks, in order, on one setup; each returns its detail or raises ``_Failed``."""

    def __init__(self, params: Params, data: TrainData, device: torch.device) -> None:
        self.mcfg, self.cfg, self.data, self.device = params.model, params.train, data, device
        self.env = DistEnv(0, 1, 0, device)
        self.precision = resolve_precision(self.cfg.precision, device)
        self.vocab = int(data.train.vocab_size)
        self.batches: list[tuple[torch.Tensor, ...]] = []
        self.model: Llama | None = None
        self.optimizer: Any = None  # two_steps' optimizer, timed again by step_cost

    def steps(self) -> list[tuple[str, Callable[[], str]]]:
        """(name, check) in the order they run."""
        steps: list[tuple[str, Callable[[], str]]] = [
            ("batch shapes", self.check_batches), ("targets shifted", self.shifted),
            ("model", self.check_model), ("initial loss", self.initial_loss),
            ("ignore_index", self.check_ignore_index), ("causal mask", self.causal)]
        if self.mcfg.doc_mask:
            steps.append(("document mask", self.document_mask))
        return steps + [("finite loss/grads", self.finite_grads),
                        ("two optimizer steps", self.two_steps),
                        ("optimizer step cost", self.step_cost)]

    def check_batches(self) -> str:
        doc_info = {"return_doc_info": True} if self.mcfg.doc_mask else {}
        loader = self.data.make_loader(self.data.train, self.mcfg.seq_len,
                                       self.cfg.micro_batch_size, self.cfg.seed, **doc_info)
        got = [tuple(torch.as_tensor(t) for t in loader.next_batch())
               for _ in range(NUM_BATCHES)]
        want = (self.cfg.micro_batch_size, self.mcfg.seq_len)
        for i, b in enumerate(got):
            for t in b:
                _expect(tuple(t.shape) == want, f"batch {i}: shape {tuple(t.shape)}, "
                        f"expected {want}")
                _expect(t.dtype == torch.int64, f"batch {i}: dtype {t.dtype}, expected int64")
            lo, hi = int(b[0].min()), int(b[0].max())
            _expect(lo >= 0 and hi < self.vocab, f"batch {i}: token ids {lo}..{hi} outside "
                    f"[0, {self.vocab})")
        self.batches = [tuple(t.to(self.device) for t in b) for b in got]
        return f"{NUM_BATCHES} x {want}, ids < {self.vocab}"

    def shifted(self) -> str:
        for i, (x, y, *_) in enumerate(self.batches):
            _expect(torch.equal(x[:, 1:], y[:, :-1]),
                    f"batch {i}: targets are not the inputs shifted by one token")
        return "targets[t] == inputs[t + 1]"

    def check_model(self) -> str:
        torch.manual_seed(self.cfg.seed)
        model = Llama(self.mcfg, self.vocab).to(self.device)
        model.label_smoothing, model.z_loss = self.cfg.label_smoothing, self.cfg.z_loss
        model.fused_loss = self.cfg.fused_loss is not False  # auto: the chunked loss
        self.model = model
        return f"{model.num_params():,} parameters, {self.precision.name} on {self.device}"

    def initial_loss(self) -> str:
        model = self.model.eval()
        with torch.no_grad(), self.precision.autocast():
            losses = [float(model(b[0], b[1], positions=_positions(b))[1])
                      for b in self.batches]
        loss, expected = sum(losses) / len(losses), math.log(self.vocab)
        _expect(math.isfinite(loss), f"loss {loss} is not finite")
        _expect(abs(loss - expected) < LOSS_TOLERANCE,
                f"mean loss {loss:.3f} is not within {LOSS_TOLERANCE} of ln(vocab) = "
                f"{expected:.3f}: check the initialisation and the loss")
        return f"{loss:.3f} vs ln({self.vocab}) = {expected:.3f}"

    def check_ignore_index(self) -> str:
        model = self.model
        x, y, *_ = self.batches[0]
        half = y.size(1) // 2
        masked = y.clone()
        masked[:, :half] = IGNORE_INDEX
        positions = _positions(self.batches[0])
        with torch.no_grad(), self.precision.autocast():
            logits = model(x, positions=positions)
            # The training loss (fused or not) against the plain loss of the logits.
            got = float(model(x, masked, positions=positions)[1])
        ref = float(model.loss(logits[:, half:].contiguous(), y[:, half:]))
        _expect(math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-5),
                f"loss with half the targets = {IGNORE_INDEX} is {got:.5f}, the loss on the "
                f"other half alone {ref:.5f}: ignored targets still count")
        return f"targets = {IGNORE_INDEX} do not count"

    def causal(self) -> str:
        model = self.model
        b = self.batches[0]
        x, cut = b[0][:1], b[0].size(1) // 2
        changed = x.clone()
        changed[:, cut:] = (changed[:, cut:] + 1) % self.vocab
        pos = _positions(b)
        pos = None if pos is None else pos[:1]
        with torch.no_grad(), self.precision.autocast():
            a, c = model(x, positions=pos).float(), model(changed, positions=pos).float()
        drift = float((a[:, :cut] - c[:, :cut]).abs().max())
        _expect(drift < 1e-3 * max(1.0, float(a.abs().max())),
                f"changing tokens from position {cut} on moved earlier logits by {drift:.2e}: "
                "attention sees the future")
        _expect(not torch.allclose(a[:, cut:], c[:, cut:]),
                "changing tokens did not change their own logits")
        return f"logits before position {cut} unchanged by later tokens"

    def document_mask(self) -> str:
        model = self.model
        for b in self.batches:
            rows, cols = torch.nonzero(b[2][:, 1:] == 0, as_tuple=True)
            if len(rows):
                break
        else:
            return "skipped: no document boundary in the ten batches"
        row, start = int(rows[0]), int(cols[0]) + 1
        x, pos = b[0][row:row + 1], b[2][row:row + 1]
        changed = x.clone()
        changed[:, :start] = (changed[:, :start] + 1) % self.vocab
        with torch.no_grad(), self.precision.autocast():
            a, c = model(x, positions=pos).float(), model(changed, positions=pos).float()
        drift = float((a[:, start:] - c[:, start:]).abs().max())
        _expect(drift < 1e-3 * max(1.0, float(a.abs().max())),
                f"changing the previous document moved a document's logits by {drift:.2e}: "
                "attention crosses document boundaries")
        return f"a document starting at {start} ignores the one before"

    def finite_grads(self) -> str:
        model = self.model.train()
        b = self.batches[0]
        with self.precision.autocast():
            _, loss = model(b[0], b[1], positions=_positions(b))
        loss.backward()
        value = float(loss.detach())
        _expect(math.isfinite(value), f"training loss {value} is not finite")
        for name, p in model.named_parameters():
            _expect(p.grad is not None, f"{name} gets no gradient")
            _expect(bool(torch.isfinite(p.grad).all()), f"{name} has a non-finite gradient")
        model.zero_grad(set_to_none=True)
        return "loss and every parameter's gradient finite"

    def two_steps(self) -> str:
        model = self.model.train()
        # A small lr: Adam's first steps move every weight by about lr whatever its
        # gradient's size, so at a large max_lr two steps can overshoot and raise the loss
        # of a healthy model; at 1e-4 they must lower it unless the gradients are wrong.
        probe_lr = min(self.cfg.max_lr, 1e-4)
        optimizer = build_optimizer(model, dataclasses.replace(self.cfg, max_lr=probe_lr),
                                    self.device)
        self.optimizer = optimizer
        scaler = self.precision.grad_scaler()
        before = [p.detach().clone() for p in model.parameters()]
        loader = _Repeat(self.batches[0])
        losses = []
        for _ in range(2):
            loss, norm, _ = optimizer_step(model, None, model, optimizer, scaler,
                                           self.precision, loader, 1, self.cfg.grad_clip,
                                           self.env)
            _expect(math.isfinite(loss) and math.isfinite(norm),
                    f"step loss {loss} / grad_norm {norm} not finite")
            losses.append(loss)
        moved = max(float((p.detach() - b).abs().max())
                    for p, b in zip(model.parameters(), before, strict=True))
        _expect(moved > 0, "two optimizer steps left every weight unchanged")
        b = self.batches[0]
        with torch.no_grad(), self.precision.autocast():
            after = float(model.eval()(b[0], b[1], positions=_positions(b))[1])
        _expect(after < losses[0], f"loss on the repeated batch went {losses[0]:.4f} -> "
                f"{after:.4f} after two steps at lr {probe_lr:g}")
        return f"loss on a repeated batch {losses[0]:.4f} -> {after:.4f}"


    def step_cost(self) -> str:
        """One forward + backward of a micro-batch, then one ``optimizer.step()`` (the
        third, so lazily built state is not counted), timed apart: a step that costs
        more than the forward and backward it follows is worth a line (issue 43: Muon's
        bf16 Newton-Schulz on a CPU without bf16 units took 9x the forward+backward)."""
        model, b = self.model.train(), self.batches[0]
        t0 = time.perf_counter()
        with self.precision.autocast():
            _, loss = model(b[0], b[1], positions=_positions(b))
        loss.backward()
        forward_backward = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.optimizer.step()
        step = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        detail = (f"optimizer step {step:.3f} s, forward+backward of a micro-batch "
                  f"{forward_backward:.3f} s ({step / forward_backward:.2f}x)")
        if step > forward_backward:
            raise _Warning(f"{detail}: the optimizer costs more than the model; "
                           f"{_slow_step_hint(self.cfg.optimizer, self.device)}")
        return detail


def _slow_step_hint(optimizer: str, device: torch.device) -> str:
    """What to try when the optimizer step outweighs the forward and backward."""
    if optimizer == "muon":
        return ("Muon's Newton-Schulz is slow on this device (docs/training.md, 'Muon on "
                "a CPU without bf16 units'); train.optimizer: adamw avoids it")
    return f"check train.optimizer and the threads on {device}"


class _Warning(Exception):
    """A check passed but has something to say (the report's detail, marked warn)."""


class _Failed(Exception):
    """A check's expectation did not hold (its message is the report's detail)."""


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise _Failed(message)


def _positions(batch: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    return batch[2] if len(batch) > 2 else None
