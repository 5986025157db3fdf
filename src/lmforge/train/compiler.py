"""Whether to run the training step through ``torch.compile``.

``train.compile: auto`` compiles wherever Inductor can build its kernels: on a CUDA GPU
with Triton, on a CPU with a C++ compiler and the Python headers. On CPU that is worth
1.2-1.3x tokens/s at the demo size (bench/RESULTS.md): Inductor fuses RMSNorm, RoPE,
SwiGLU and the residual adds into a few C++ loops, leaving the GEMMs to MKL. The first
step pays the compilation (about 30 s on two cores; a few seconds once Inductor's cache
in the temp directory is warm).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import torch

from lmforge.errors import ConfigError


def compile_support(device: torch.device) -> str | None:
    """None when Inductor can compile for ``device`` here, else why not (one line)."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    if device.type != "cpu":
        return f"no Inductor backend set up for {device.type}"
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        return f"no C++ compiler on PATH ({', '.join(compilers)})"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"no Python headers ({headers}); install python3-dev"
    return None


def resolve_compile(requested: bool | str, device: torch.device) -> tuple[bool, str]:
    """``train.compile`` -> (compile?, what to say about it in the log)."""
    if requested is False:
        return False, "eager"
    missing = compile_support(device)
    if missing is None:
        return True, "compiled"
    if requested == "auto":
        return False, f"eager (torch.compile unavailable: {missing})"
    raise ConfigError(f"train.compile: true, but torch.compile cannot run here: {missing}; "
                      "set train.compile to auto or false")
