"""The fused loss's Triton kernel (model/loss_kernel.py), its logic checked on a CPU by
Triton's interpreter: each row's loss and its logit gradient equal loss.py's aten path
(the reference the chunked loss is tested against), with label smoothing, z-loss and
ignored rows; and the whole chunked loss through it equals the plain loss, gradients
included. On CUDA the same kernel runs compiled (tests at the end, skipped here).

The interpreter rounds fp32 to bf16 by truncation where the GPU rounds to nearest, so
bf16 gradients are compared with the truncated reference here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

# The interpreter runs in a child process: TRITON_INTERPRET must be set before Triton is
# imported, and this test process may have imported it already (torch does, lazily).
CHILD = textwrap.dedent("""
    import builtins, json, sys
    import numpy as np
    import triton.runtime.interpreter as interpreter
    import torch
    from lmforge.model import loss, loss_kernel

    class _Int(int):  # numpy >= 2.4 refuses int() of a one-element array; the
        def __new__(cls, v=0, *a):  # interpreter (Triton 3.6) still relies on it
            if isinstance(v, np.ndarray):
                return builtins.int(v.reshape(-1)[0])
            return builtins.int(v, *a)

    interpreter.int = _Int
    case = json.loads(sys.argv[1])
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    rows, vocab, width = case["rows"], case["vocab"], 16
    xc = torch.randn(rows, width).to(dtype)
    w = (torch.randn(vocab, width) * 0.5).to(dtype)
    targets = torch.randint(0, vocab, (rows, 1))
    keep = (torch.rand(rows) > 0.3).float()
    smooth, z = case["smooth"], case["z_loss"]
    assert loss_kernel.available(xc.device, dtype)
    t_ref, t_new = torch.zeros(()), torch.zeros(())
    ref = loss._chunk(xc, w, targets, keep, smooth, z, t_ref, True)
    new = loss._chunk_kernel(xc, w, targets, keep, smooth, z, t_new, True)
    assert new.dtype == dtype and new.shape == ref.shape
    if dtype == torch.bfloat16:  # the interpreter truncates
        ref = (ref.view(torch.int32) & ~0xFFFF).view(torch.float32)
    err = float((new.float() - ref).norm() / ref.norm())
    differ = int((new.float() != ref).sum())
    # Without gradients the logits are left as the matmul made them.
    t_nog = torch.zeros(())
    assert loss._chunk_kernel(xc, w, targets, keep, smooth, z, t_nog, False) is None
    print(json.dumps({"loss_ref": float(t_ref), "loss_new": float(t_new),
                      "loss_nog": float(t_nog), "grad_err": err, "differ": differ,
                      "elements": ref.numel(), "ignored_rows_zero":
                      bool((new[keep == 0] == 0).all())}))
""")


def run_child(case: dict) -> dict:
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1", "LMFORGE_LOSS_KERNEL_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("smooth,z_loss", [(0.0, 0.0), (0.1, 1e-3)])
def test_the_kernel_computes_each_rows_loss_and_gradient_as_the_aten_path(
        dtype, smooth, z_loss):
    pytest.importorskip("triton", reason="no Triton here: pip install -e '.[kernel-tests]'")
    # 5,000 columns: a last block of 904 after one full 4,096, so the mask is exercised.
    got = run_child({"seed": 0, "dtype": dtype, "rows": 7, "vocab": 5000,
                     "smooth": smooth, "z_loss": z_loss})
    assert got["loss_new"] == pytest.approx(got["loss_ref"], rel=1e-5)
    assert got["loss_nog"] == pytest.approx(got["loss_ref"], rel=1e-5)
    assert got["ignored_rows_zero"]
    if dtype == "float32":
        assert got["grad_err"] < 1e-6
    else:  # the same rounding of the same fp32 values, but for a few near a tie
        assert got["differ"] <= got["elements"] // 1000


def test_the_kernel_is_used_only_for_cuda_bf16_or_fp32(monkeypatch):
    from lmforge.model import loss_kernel

    monkeypatch.delenv("LMFORGE_LOSS_KERNEL_INTERPRET", raising=False)
    monkeypatch.setattr(loss_kernel.importlib.util, "find_spec", lambda name: object())
    cuda = torch.device("cuda")
    assert loss_kernel.available(cuda, torch.bfloat16)
    assert loss_kernel.available(cuda, torch.float32)
    assert not loss_kernel.available(cuda, torch.float16)  # its gradient stays fp32
    assert not loss_kernel.available(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(loss_kernel.importlib.util, "find_spec", lambda name: None)
    assert not loss_kernel.available(cuda, torch.bfloat16)  # no Triton: the aten path


def test_the_kernel_takes_four_times_the_logits_per_chunk():
    from lmforge.model.loss import balanced_chunk, default_chunk_tokens

    most = default_chunk_tokens(50304, "cuda", kernel=True)
    assert most == (1 << 28) // 50304 and balanced_chunk(16 * 1024, most) == 4096
    assert default_chunk_tokens(50304, "cuda") == (1 << 26) // 50304


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_chunked_loss_through_the_kernel_equals_the_plain_loss(dtype):
    from lmforge.model.loss import cross_entropy, linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(3000, 256, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(50304, 256, device="cuda", dtype=dtype) * 0.05).requires_grad_()
    t = torch.randint(0, 50304, (3000,), device="cuda")
    t[::7] = -100
    grads = []
    for fn in (lambda: linear_cross_entropy(x, w, t, 0.1, 1e-4, chunk_tokens=1024),
               lambda: cross_entropy(x @ w.t(), t, 0.1, 1e-4)):
        loss = fn()
        gx, gw = torch.autograd.grad(loss, (x, w))
        grads.append((loss.float(), gx.float(), gw.float()))
    (l1, x1, w1), (l2, x2, w2) = grads
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(l1, l2, rtol=tol)
    for a, b in ((x1, x2), (w1, w2)):
        assert float((a - b).norm() / b.norm()) < tol


