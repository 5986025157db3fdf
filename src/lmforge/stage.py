"""What every stage entry point shares: params, one-line errors, the repo root."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from lmforge.config import Params, load_params
from lmforge.errors import LmforgeError


def repo_root() -> Path:
    """The project root: ``DVC_ROOT`` when DVC runs us, else the working directory.

    Only for what is shared across experiments (the MLflow store): a queued experiment
    runs in a temp copy of the repo, while DVC_ROOT names the original. Stage inputs and
    outputs are relative to the working directory.
    """
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()


def run_stage(main: Callable[[Params], None], params_path: str = "params.yaml") -> None:
    """Load params and run ``main``; a user-facing error prints one line and exits 2."""
    try:
        main(load_params(params_path))
    except LmforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
