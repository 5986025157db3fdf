#!/usr/bin/env bash
# Create .venv and install lmforge with its dependencies.
#
# torch comes first and is chosen for the machine: with an NVIDIA GPU (nvidia-smi works)
# we take PyPI's default CUDA build; without one, torch==2.13.0 from PyTorch's CPU index
# (about 190 MB, not the multi-GB CUDA build that PyPI serves for Linux x86_64), or, with
# a warning, from the default index when the CPU index is unreachable. Setting TORCH_SPEC
# (and TORCH_INDEX for another index) skips that choice, e.g.
#   TORCH_SPEC="torch==2.6.0" TORCH_INDEX=https://download.pytorch.org/whl/cu124 scripts/setup.sh
# TORCH_CPU_INDEX replaces the CPU index's URL (a mirror of it). Sourcing this file only
# defines the functions (to test the choice of torch).
#
# The rest (about 200 packages) goes in with uv when it can be had (pip install uv), else
# with pip: uv installs them in parallel (a fresh set-up: 84-92 s against pip's 142 s on a
# 2-core VM). uv reads its own index settings (UV_INDEX_URL, uv.toml), not pip.conf; set
# INSTALLER=pip to use pip's. What they install is byte-compiled once, after them
# (compile_site): where PYTHONDONTWRITEBYTECODE is set, an uncompiled venv recompiles every
# module in every process (with pip --no-compile, a fresh `make test` was at 10 % after 12
# minutes).
set -euo pipefail

TORCH_PIN="torch==2.13.0"
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# Succeed when an NVIDIA GPU is visible.
have_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# Succeed when the index at $2 answers for torch within 10 s, probed with Python $1.
index_reachable() {
  # Headers only, no body; the thread caps DNS lookups too, which urllib's timeout does not.
  "$1" - "$2" >/dev/null 2>&1 <<'EOF'
import sys, threading, urllib.request

answered = []

def probe() -> None:
    with urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=8):
        answered.append(True)

thread = threading.Thread(target=probe, daemon=True)
thread.start()
thread.join(10)
sys.exit(0 if answered else 1)
EOF
}

# Set TORCH_SPEC and TORCH_INDEX (empty: pip's default index) for this machine.
choose_torch() {
  local python=$1
  TORCH_INDEX=${TORCH_INDEX:-}
  if [ -n "${TORCH_SPEC:-}" ]; then
    return 0  # the user's choice, from their index or the default one
  fi
  if have_nvidia_gpu; then
    TORCH_SPEC="torch"  # PyPI's default build is the CUDA one
    return 0
  fi
  TORCH_SPEC=$TORCH_PIN
  if [ -n "$TORCH_INDEX" ]; then
    return 0
  fi
  if index_reachable "$python" "$CPU_INDEX"; then
    TORCH_INDEX=$CPU_INDEX
  else
    echo "setup: PyTorch's CPU index ($CPU_INDEX) is unreachable; installing torch from the" \
         "default index (on Linux x86_64 that can be the multi-GB CUDA build; set TORCH_INDEX" \
         "to choose)" >&2
  fi
}

# Install torch into the venv of Python $1 (choose_torch picks the build). pip, because
# only pip reads pip.conf, where a machine may keep its torch wheel (find-links).
install_torch() {
  local python=$1
  choose_torch "$python"
  local from=()
  if [ -n "$TORCH_INDEX" ]; then
    from=(--index-url "$TORCH_INDEX")
    echo "setup: installing $TORCH_SPEC from $TORCH_INDEX"
  else
    echo "setup: installing $TORCH_SPEC"
  fi
  "$python" -m pip install --quiet --no-compile "$TORCH_SPEC" "${from[@]}"
}

# Install lmforge (editable, with the extras in $2, e.g. ".[dev]") into the venv of $1:
# with uv unless INSTALLER=pip or uv can't be installed or fails, then with pip.
install_lmforge() {
  local python=$1 target=$2
  if [ "${INSTALLER:-uv}" != pip ]; then
    if ! "$python" -m pip install --quiet uv >/dev/null 2>&1; then
      echo "setup: uv could not be installed; installing with pip" >&2
    elif "$python" -m uv pip install --quiet --python "$python" -e "$target"; then
      return 0
    else
      echo "setup: uv failed; installing with pip" >&2
    fi
  fi
  "$python" -m pip install --quiet --no-compile -e "$target"
}

# Byte-compile the site-packages of Python $1 when what is installed there changed (its
# list of *.dist-info, kept in $2): one process per core (pip's compiling is one thread;
# uv's and compileall's took the same ~57 s here). The packages' own test suites are left
# out (a seventh of the files, 13 of 59 s): nothing imports them. A file that fails to
# compile is ignored, as pip ignores it (a few of torch's test helpers are 3.12 syntax).
compile_site() {
  local python=$1 stamp=$2 site installed
  site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  installed=$(cd "$site" && ls -d -- *.dist-info 2>/dev/null || true)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$installed" ]; then
    return 0
  fi
  "$python" -m compileall -q -j 0 -x 'site-packages/(.+/)?tests?/' "$site" >/dev/null 2>&1 || true
  printf '%s\n' "$installed" > "$stamp"
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local python=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
  fi
  local pip=".venv/bin/python -m pip"
  $pip install --quiet --upgrade pip

  # Probe and install only when needed: make runs this before every demo and test.
  if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    install_torch .venv/bin/python
  fi

  echo "setup: installing lmforge${EXTRAS:-[dev]}"
  install_lmforge .venv/bin/python ".${EXTRAS:-[dev]}"
  compile_site .venv/bin/python .venv/.compiled
  .venv/bin/python -c "import torch, lmforge; print(f'setup: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main
fi
