#!/bin/bash
# Issue 44's GPU session in one call (device machine, one GPU): the prepared check
# (bench_gpu_mfu.py --all: plain, FSDP, upstream nanoGPT, profiles), then variants of
# the plain step while the budget lasts, their lines in variants.log. Run from the
# repository root with OUT set; .nanogpt/ (and optionally .whl/ with liger_kernel) carried.
#   bash bench/gpu_issue44.sh [SECONDS_FOR_VARIANTS]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src LMFORGE_TRACKING=off
budget=${1:-560}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used --format=csv
timeout 300 python3 bench/bench_gpu_mfu.py --all --out "$OUT" > "$OUT/run.log" 2>&1
echo "check exit $?"
grep -E '^\[|/ .* tokens/s|^total|fused_loss auto|FAILED|Error' "$OUT/run.log" | grep -v '^\[nanogpt\] iter'
variant() {  # name, then bench_gpu_mfu.py arguments; skipped when the budget is spent
  local name=$1; shift
  if (( SECONDS + 100 > budget )); then echo "[$name] skipped: ${SECONDS}s of ${budget}s spent"; return; fi
  echo "=== variant $name: $*"
  timeout 110 python3 bench/bench_gpu_mfu.py --strategy plain --steps 20 --warmup 6 "$@" 2>&1 \
    | grep -E '^\[plain\]|^inductor|fused_loss auto|FAILED|Error|^ +[0-9]+ +[0-9.]+ +[0-9.]+%|^top '
}
{
  echo "=== CUDA tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_model_loss_kernel.py \
    tests/test_train_step_device_skip.py tests/test_model_llama.py tests/test_loss_choice.py \
    -k "cuda or gpu" 2>&1 | tail -4
  variant cuda-graphs --compile-mode reduce-overhead
  variant no-cudnn-attention --no-cudnn-attention
  variant plain-loss --fused-loss false
  variant kernel-loss --fused-loss true
} > "$OUT/variants.log" 2>&1
cat "$OUT/variants.log"
echo "session ${SECONDS}s"
