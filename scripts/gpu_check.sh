#!/usr/bin/env bash
# One GPU session's checks, correctness first, then timings; every output under OUT_DIR.
#   scripts/gpu_check.sh OUT_DIR [tests|profile|kernel|offload ...]   (default: all four, in this order)
# tests: every `gpu`-marked test; profile: where the dsv2 draft step's time goes; kernel: the fused INT4
# kernel table at T=1 and 16 (eager and CUDA-graph replay); offload: dsv2 and qwen, mem=high, K=8 and 16,
# with the verification-plan-only variant. Each step prints a short table and keeps going if another fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR [tests|profile|kernel|offload ...]}"; shift
STEPS=("$@"); [ ${#STEPS[@]} -gt 0 ] || STEPS=(tests profile kernel offload)
mkdir -p "$OUT"
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: gpu_check.sh needs a CUDA GPU" >&2; exit 2
fi
status=0
for step in "${STEPS[@]}"; do
  start=$(date +%s)
  echo "== $step"
  case "$step" in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1; rc=$?
           grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3; grep -E "^FAILED" "$OUT/gpu_tests.log" ;;
    profile) python3 scripts/profile_draft.py --model dsv2 --out "$OUT" 2>&1 | grep -v -i warn; rc=${PIPESTATUS[0]} ;;
    kernel) python3 scripts/bench_kernel.py --out "$OUT" --tokens 1 16 2>&1 | grep -v -i warn | tail -9
            rc=${PIPESTATUS[0]} ;;
    offload) for model in dsv2 qwen; do
               python3 scripts/bench_offload.py --models "$model" --k 8 16 --plan-only --out "$OUT/$model" 2>&1 \
                 | grep -v -i -E "warn|max_cache_len" | tail -14; rc=${PIPESTATUS[0]}
             done ;;
    *) echo "error: unknown step $step" >&2; rc=2 ;;
  esac
  [ "$rc" = 0 ] || status=1
  echo "   ($step: $(( $(date +%s) - start )) s, exit $rc)"
done
exit $status
