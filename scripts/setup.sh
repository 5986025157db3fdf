#!/usr/bin/env bash
# Create .venv and install lmforge with its dependencies.
#
# torch comes first and is chosen for the machine: without an NVIDIA GPU we pin the
# CPU build (a few hundred MB, not the multi-GB CUDA one); with one (nvidia-smi works)
# we take PyPI's default CUDA build. Override with TORCH_SPEC, e.g.
#   TORCH_SPEC="torch==2.6.0" TORCH_INDEX=https://download.pytorch.org/whl/cu124 scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip

if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch"
  else
    TORCH_SPEC="torch==2.13.0"
  fi
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC"
  if [ -n "${TORCH_INDEX:-}" ]; then
    $PIP install --quiet "$TORCH_SPEC" --index-url "$TORCH_INDEX"
  else
    $PIP install --quiet "$TORCH_SPEC"
  fi
fi

echo "setup: installing lmforge${EXTRAS:-[dev]}"
$PIP install --quiet -e ".${EXTRAS:-[dev]}"
.venv/bin/python -c "import torch, lmforge; print(f'setup: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
