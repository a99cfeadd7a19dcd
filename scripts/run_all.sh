#!/usr/bin/env bash
# Reproduce every experiment of the paper in order, then render the figures.
#   scripts/run_all.sh [--tiny] [--dry-run] [--results DIR] [--models "M1 M2"] [-- OVERRIDE ...]
#   (default DIR: results/paper, its own root, so other runs under results/ are neither skipped as done nor drawn)
# --tiny: the tiny synthetic models on CPU, few short prompts (minutes; what CI runs).
# --dry-run: print the plan with an estimated time and exit.
# --models: a subset of the plan's models (default: dsv2 qwen phi; with --tiny: tiny-dsv2 tiny-qwen).
# -- OVERRIDE ...: more Hydra overrides for every step, after the plan's own (e.g. -- device=cuda:1 max_new_tokens=64).
# Resumable: a finished step (run.json "complete": true) is skipped; an unfinished one is resumed.
set -euo pipefail
cd "$(dirname "$0")/.."

TINY=0; DRY=0; RESULTS=results/paper; ONLY=""; EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) TINY=1 ;;
    --dry-run) DRY=1 ;;
    --results) RESULTS="$2"; shift ;;
    --models) ONLY="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$TINY" = 1 ]; then
  export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"  # local data only
  MODELS=(tiny-dsv2 tiny-qwen); COMMON=(model.weights=synthetic num_prompts=1 repeats=1 max_new_tokens=16
    "++experiment.k_values=[2,4,8]" device=cpu); STEP_MIN=0.3
else
  MODELS=(dsv2 qwen phi); COMMON=(); STEP_MIN=25
fi
if [ -n "$ONLY" ]; then
  for m in $ONLY; do
    case " ${MODELS[*]} " in *" $m "*) ;; *) echo "error: --models: $m is not one of: ${MODELS[*]}" >&2; exit 2 ;; esac
  done
  read -r -a MODELS <<< "$ONLY"
fi
MAIN_EXTRA=()
[ "$TINY" = 1 ] || MAIN_EXTRA=("token_caps.transformers=16")  # Accelerate-offloaded HF: seconds per token

check_environment() {
  python3 - <<'PY' || { echo "error: the Python environment is not set up (see README: pip install -e .)" >&2; exit 2; }
import shutil, torch, specter, hydra
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU only)"
free = shutil.disk_usage(".").free / 2**30
print(f"environment: torch {torch.__version__}, GPU {gpu}, {free:.0f} GiB free disk")
PY
  if [ "$TINY" = 0 ] && ! python3 -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "warning: no CUDA GPU: the full-size experiments will be very slow (use --tiny on a CPU machine)" >&2
  fi
}

STEPS=()
plan() {  # experiment model mem [extra overrides...]
  STEPS+=("$*")
}
DATASET=all
if [ "$TINY" = 1 ] && ! python3 -c "import sys; from experiments.datasets import data_dir; sys.exit(0 if data_dir().is_dir() else 1)" 2>/dev/null; then
  DATASET=builtin  # no local dataset files (and --tiny stays offline): the built-in prompts
  echo "note: no dataset files under \$SPECTER_DATA or ../shared/data; --tiny uses dataset=builtin"
fi
for m in "${MODELS[@]}"; do plan depth "$m" high; done
# Figure 14: Specter and every baseline (a system that cannot run here gives "unavailable: <reason>" rows)
MAIN_SYSTEMS="systems=[specter,target_only,transformers,mo_sc,mo_sm,specmoeoff_sc,specmoeoff_sm,vllm,llama_cpp]"
for m in "${MODELS[@]}"; do for mem in high low; do plan main "$m" "$mem" k=auto "$MAIN_SYSTEMS" "${MAIN_EXTRA[@]}"; done; done
for m in "${MODELS[@]}"; do plan prefix "$m" high k=auto; done
for m in "${MODELS[@]}"; do plan routing "$m" high k=auto; done
# Figures 15-16 / Table 3: batched decoding on the first two models (the paper's DeepSeek-V2-Lite and Qwen1.5-MoE)
BATCH_EXTRA=("k=auto")
[ "$TINY" = 1 ] && BATCH_EXTRA+=("experiment.batch_sizes=[1,2,4]" "num_prompts=4")  # distinct requests per batch (Figure 16)
for m in "${MODELS[@]:0:2}"; do plan batch "$m" high "${BATCH_EXTRA[@]}"; done
plan kernel "${MODELS[0]}" high

complete() { python3 -c "import json,sys; sys.exit(0 if json.load(open('$1/run.json')).get('complete') else 1)" 2>/dev/null; }

echo "plan: ${#STEPS[@]} steps into $RESULTS/, about $(python3 -c "print(round(${#STEPS[@]} * $STEP_MIN, 1))") minutes"
if [ "$DRY" = 1 ]; then
  for s in "${STEPS[@]}"; do
    set -- $s
    dir="$RESULTS/$1/$2-$3"
    state=$([ -d "$dir" ] && (complete "$dir" && echo done || echo resume) || echo todo)
    echo "  [$state] experiment=$1 model=$2 mem=$3 ${*:4} ${EXTRA[*]} -> $dir"
  done
  echo "  then: python3 -m experiments.figures $RESULTS"
  exit 0
fi

check_environment
for s in "${STEPS[@]}"; do
  set -- $s
  exp=$1 model=$2 mem=$3; shift 3
  dir="$RESULTS/$exp/$model-$mem"
  if [ -d "$dir" ] && complete "$dir"; then echo "skip (done): $dir"; continue; fi
  echo "== experiment=$exp model=$model mem=$mem $*"
  resume=false; [ -d "$dir" ] && resume=true  # continue a step cut short; resume=true needs the directory
  python3 -m experiments.main experiment="$exp" model="$model" mem="$mem" results_root="$RESULTS" \
    results_dir="$dir" resume=$resume dataset="$DATASET" "${COMMON[@]}" "$@" "${EXTRA[@]}"
done
python3 -m experiments.figures "$RESULTS"
