#!/usr/bin/env bash
# Reproduce every experiment of the paper in order, then render the figures.
#   scripts/run_all.sh [--tiny] [--dry-run] [--results DIR] [--models "M1 M2"] [--launcher NAME] [-- OVERRIDE ...]
#   (default DIR: results/paper, its own root, so other runs under results/ are neither skipped as done nor drawn)
# --tiny: the tiny synthetic models on CPU, few short prompts (minutes; what CI runs).
# --dry-run: print the plan with an estimated time (and with --launcher the commands) and exit.
# --models: a subset of the plan's models (default: dsv2 qwen phi; with --tiny: tiny-dsv2 tiny-qwen).
# --launcher slurm|local: each step as a Hydra multirun through conf/hydra/launcher/NAME.yaml (pip install -e
#   '.[sweeps]'), every job waited for; the main experiment is one job per (model, mem, dataset) into
#   DIR/main/<model>-<mem>-<dataset>. Queue settings after --, e.g. -- hydra.launcher.partition=gpu (docs/cluster.md).
# -- OVERRIDE ...: more Hydra overrides for every step, after the plan's own (e.g. -- device=cuda:1 max_new_tokens=64).
# Resumable: a finished step or job (run.json "complete": true) is skipped; an unfinished one is resumed.
set -euo pipefail
cd "$(dirname "$0")/.."

TINY=0; DRY=0; RESULTS=results/paper; ONLY=""; LAUNCHER=""; EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) TINY=1 ;;
    --dry-run) DRY=1 ;;
    --results) RESULTS="$2"; shift ;;
    --models) ONLY="$2"; shift ;;
    --launcher) [ $# -ge 2 ] || { echo "error: --launcher needs a name: local or slurm" >&2; exit 2; }
      LAUNCHER="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$LAUNCHER" ] && [ ! -f "conf/hydra/launcher/$LAUNCHER.yaml" ]; then
  known=$(cd conf/hydra/launcher && ls -- *.yaml | sed 's/\.yaml$//' | paste -sd, -)
  echo "error: unknown launcher '$LAUNCHER'; known: $known (conf/hydra/launcher/)" >&2; exit 2
fi

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
  if [ -n "$LAUNCHER" ] && ! python3 -c "import hydra_plugins.hydra_submitit_launcher" 2>/dev/null; then
    echo "error: --launcher needs hydra-submitit-launcher: pip install -e '.[sweeps]'" >&2; exit 2
  fi
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
MAIN_SYSTEMS="systems=[specter,specter_paper,target_only,transformers,mo_sc,mo_sm,specmoeoff_sc,specmoeoff_sm,vllm,llama_cpp]"
for m in "${MODELS[@]}"; do for mem in high low; do plan main "$m" "$mem" k=auto "$MAIN_SYSTEMS" "${MAIN_EXTRA[@]}"; done; done
for m in "${MODELS[@]}"; do plan prefix "$m" high k=auto; done
for m in "${MODELS[@]}"; do plan routing "$m" high k=auto; done
# Figures 15-16 / Table 3: batched decoding on the first two models (the paper's DeepSeek-V2-Lite and Qwen1.5-MoE)
BATCH_EXTRA=("k=auto")
[ "$TINY" = 1 ] && BATCH_EXTRA+=("experiment.batch_sizes=[1,2,4]" "num_prompts=4")  # distinct requests per batch (Figure 16)
for m in "${MODELS[@]:0:2}"; do plan batch "$m" high "${BATCH_EXTRA[@]}"; done
plan kernel "${MODELS[0]}" high

complete() { python3 -c "import json,sys; sys.exit(0 if json.load(open('$1/run.json')).get('complete') else 1)" 2>/dev/null; }
state() { if [ -d "$1" ]; then complete "$1" && echo done || echo resume; else echo todo; fi; }

# --launcher: the main experiment's datasets are its jobs (the last dataset= after --, else DATASET; all: its members)
MAIN_DATASET=$DATASET
for arg in "${EXTRA[@]}"; do case "$arg" in dataset=*) MAIN_DATASET=${arg#dataset=} ;; esac; done
MEMBERS=$(sed -n 's/^members: *\[\(.*\)\].*/\1/p' "conf/dataset/$MAIN_DATASET.yaml" 2>/dev/null | tr ', ' '  ')
cases() {  # experiment -> its jobs' datasets ("-": the whole step is one job)
  if [ -n "$LAUNCHER" ] && [ "$1" = main ]; then echo "${MEMBERS:-$MAIN_DATASET}"; else echo -; fi
}
case_dir() {  # experiment model mem case
  if [ "$4" = - ]; then echo "$RESULTS/$1/$2-$3"; else echo "$RESULTS/$1/$2-$3-$4"; fi
}
launch_args() {  # experiment model mem "cases" [extra ...] -> ARGS: one multirun, a job per case, each resumed
  local exp=$1 model=$2 mem=$3 jobs=$4 list; shift 4
  ARGS=(-m "hydra/launcher=$LAUNCHER" experiment="$exp" model="$model" mem="$mem" results_root="$RESULTS" resume=true)
  if [ "$jobs" = - ]; then
    ARGS+=(results_dir="$RESULTS/$exp/$model-$mem" dataset="$DATASET")
  elif [ -n "$MEMBERS" ]; then  # dataset=all cut to one member per job: dataset.members=[a],[b],...
    list=$(printf '[%s],' $jobs)
    ARGS+=(dataset="$MAIN_DATASET" "dataset.members=${list%,}"
      "results_dir=$RESULTS/$exp/$model-$mem-\${dataset.members.0}")
  else
    ARGS+=(dataset="$MAIN_DATASET" results_dir="$RESULTS/$exp/$model-$mem-$MAIN_DATASET")
  fi
  ARGS+=("${COMMON[@]}" "$@" "${EXTRA[@]}")
}
shell_words() {  # the arguments as one command line to paste
  local out=() a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}

JOBS=0
for s in "${STEPS[@]}"; do set -- $s; for c in $(cases "$1"); do JOBS=$((JOBS + 1)); done; done
via=""; [ -z "$LAUNCHER" ] || via=" ($JOBS jobs through hydra/launcher=$LAUNCHER)"
echo "plan: ${#STEPS[@]} steps$via into $RESULTS/, about $(python3 -c "print(round(${#STEPS[@]} * $STEP_MIN, 1))") minutes"
if [ "$DRY" = 1 ]; then
  COMMANDS=()
  for s in "${STEPS[@]}"; do
    set -- $s
    pending=""; dirs=()
    for c in $(cases "$1"); do
      dir=$(case_dir "$1" "$2" "$3" "$c"); now=$(state "$dir"); label=""
      [ "$now" = done ] || { pending+="$c "; dirs+=("$dir"); }
      [ "$c" = - ] || label="dataset=$c "
      echo "  [$now] experiment=$1 model=$2 mem=$3 $label${*:4} ${EXTRA[*]} -> $dir"
    done
    if [ -n "$LAUNCHER" ] && [ -n "$pending" ]; then
      launch_args "$1" "$2" "$3" "${pending% }" "${@:4}"
      COMMANDS+=("mkdir -p $(shell_words "${dirs[@]}") && python3 -m experiments.main $(shell_words "${ARGS[@]}")")
    fi
  done
  echo "  then: python3 -m experiments.figures $RESULTS"
  if [ -n "$LAUNCHER" ]; then
    echo "launcher commands (one per step, each submits its jobs and waits; every job resumes its directory):"
    printf '  %s\n' "${COMMANDS[@]}"
  fi
  exit 0
fi

launch_step() {  # experiment model mem [extra ...]: its unfinished jobs as one multirun, waited for
  local pending="" c dir
  for c in $(cases "$1"); do
    dir=$(case_dir "$1" "$2" "$3" "$c")
    if [ -d "$dir" ] && complete "$dir"; then echo "skip (done): $dir"; continue; fi
    mkdir -p "$dir"; pending+="$c "  # every job resumes: an empty directory has no config to differ
  done
  [ -n "$pending" ] || return 0
  launch_args "$1" "$2" "$3" "${pending% }" "${@:4}"
  echo "== experiment=$1 model=$2 mem=$3 ${*:4}: $(wc -w <<< "$pending") job(s) through hydra/launcher=$LAUNCHER" \
    "(logs under $RESULTS/.submitit/)"
  python3 -m experiments.main "${ARGS[@]}"
  for c in $pending; do dir=$(case_dir "$1" "$2" "$3" "$c"); echo "  [$(state "$dir")] $dir"; done
}

check_environment
for s in "${STEPS[@]}"; do
  set -- $s
  if [ -n "$LAUNCHER" ]; then launch_step "$@"; continue; fi
  exp=$1 model=$2 mem=$3; shift 3
  dir="$RESULTS/$exp/$model-$mem"
  if [ -d "$dir" ] && complete "$dir"; then echo "skip (done): $dir"; continue; fi
  echo "== experiment=$exp model=$model mem=$mem $*"
  resume=false; [ -d "$dir" ] && resume=true  # continue a step cut short; resume=true needs the directory
  python3 -m experiments.main experiment="$exp" model="$model" mem="$mem" results_root="$RESULTS" \
    results_dir="$dir" resume=$resume dataset="$DATASET" "${COMMON[@]}" "$@" "${EXTRA[@]}"
done
python3 -m experiments.figures "$RESULTS"
