#!/usr/bin/env bash
# One GPU session's checks, correctness first, then timings; every output under OUT_DIR.
#   scripts/gpu_check.sh OUT_DIR [tests|profile|overlap|kernel|firstdecode|tiles|offload|spread|calibration|report|batch|llamacpp|hostcost ...]
#   (default: tests profile overlap kernel offload, in this order; the benchmarks it runs are in benchmarks/)
# tests: every `gpu`-marked test; profile: where the dsv2 draft step's time goes (PROFILE_ARGS=--compile
# adds the torch.compile'd step beside it: compile time, same tokens, replay ratio); overlap: when the copy
# stream idles during offloaded dsv2 decoding, and which kernels run then; kernel: the fused INT4
# kernel table at T=1 and 16 (eager and CUDA-graph replay); offload: dsv2 (mem=high, K=8) the paper's design,
# Specter and OFFLOAD_VARIANTS (bench_offload --variants, none by default, e.g. "pooled_slots=0 paper,prefetch=false"),
# each row printed as measured, with a host profile, then qwen K=8 in full (target-only on demand too).
# depth: experiment=depth (Specter's TPOT per K, best K to best_k.json for k=auto) on MODELS x MEMS, DEPTH_KS
# (default 4,8,12,16,24,32), DEPTH_PROMPTS (default 1) per dataset, into REPORT_DIR/depth/<model>-<mem>
# (RESUME=force continues runs whose config differs only by options added since, at their defaults).
# report: the harness with every system (or SYSTEMS, e.g. specter,specter_paper,target_only,mo_sm,specmoeoff_sm) on
# MODELS x MEMS (env, default "dsv2 qwen" x "high low"), NUM_PROMPTS (default 1) per dataset, REPEATS
# (default 1), TF_CAP (Transformers' tokens per case, default 8), REPORT_ARGS (more Hydra overrides, e.g.
# k=8 or k=auto, which reads the depth step's profile), REPORT_TIMEOUT_S (per run; 0 = none; set it below the device call's limit,
# or a run cut by the call loses its report.tgz; a run given less than REPORT_MIN_S, default 300 s, is skipped:
# a full-size model's setup and warm-ups take 240 s with the table's six systems on dsv2, of which 72 s build the
# systems and 88 s are the default Specter's first decode with its compile), resuming the result
# directories under REPORT_DIR (default .report/, carry it back and forth: runs that the call limit cuts
# continue next time; RESUME=force continues one whose config has changed since, e.g. a default), a summary
# per directory in OUT_DIR. table: the table of record (report's loop): calibrated weights, MODELS default
# "dsv2 qwen phi mixtral", SYSTEMS default specter,specter_paper,target_only,mo_sm,specmoeoff_sm,transformers,llama_cpp,
# REPEATS default 3, resuming TABLE_DIR (default .table-h200; carry it), then `python -m experiments.table`
# into OUT/table.md (copy the run directories to results/reference/table-<gpu>/, then `python -m experiments.table --readme README.md`);
# phi and mixtral build their experts straight into pinned host memory on an 80 GB card, and where the host cannot
# hold the raw experts and their residual blobs at once the systems run in two phases of one invocation. A point
# costs about 240 s of setup and warm-ups per call plus about 50 s per dataset and repeat (dsv2, H200): one point per
# call, REPORT_TIMEOUT_S=560. batch: experiment=batch on dsv2 (BATCH_SIZES,
# default 1,4,16,32; BATCH_TOKENS per request, default 64; BATCH_DATASET, default gsm8k; BATCH_ARGS, more
# Hydra overrides such as token_caps.specmoeoff_sm=32), resuming
# REPORT_DIR/batch-dsv2 the same way (B=16 and 32 take minutes each: one or two sizes per call).
# llamacpp: a CUDA (sm_90, no FlashAttention kernels) build of
# llama-cpp-python from the sdist staged by scripts/stage_llamacpp_cuda.sh (carry .llamacpp) into
# .llamacpp-site (once per machine: about 4.5 min; compressed it is 180 MB, more than a call can carry
# or send back, so a cold machine builds again; steps after it in the same call, e.g. report, run
# llama.cpp from it; llama.cpp runs in a worker process of its own), a probe (tiny-qwen
# on the GPU in a process alone and in one where torch used CUDA), then tiny-qwen against target-only
# on CUDA through the harness.
# firstdecode: what a prompt's first decode pays over its second, cuDNN SDPA off and on (FIRST_MODEL, FIRST_MEM;
# default qwen high; FIRST_ARGS more flags, e.g. "--prompts 1 --modes cudnn_sdp_on"), calibrated weights, one process,
# a fresh Triton cache, so that each decode's row counts the kernels it compiled.
# tiles: the residual decode kernel's tile sweep (rows per program, warps),
# bit-exact first, one process, each plan's time over the default's.
# residual: residual transfer on one expert per model (bit-exact decode, raw vs residual copy, decode time,
# the host's cost per load; BENCH_ARGS=--variants adds the kernel's variants), then dsv2 K=8 at MEMS (default
# "low high"), RESIDUAL_PROMPTS (default 1) prompts, with the paper's design, Specter and RESIDUAL_VARIANTS
# (default: Specter with raw copies, residual_transfer=false; the paper's design with residual transfer), each
# row printed from OUT/residual-<mem>.log as measured.
# hostcost: the GPU tests of the grouped residual paths and of the wave bench, then the host's microseconds per
# verify wave by wave size (bench_wave_host.py, dsv2 and qwen) and per residual load on every load path
# (bench_residual.py, dsv2; the grouped paths split into joining a group and its launch).
# spread: calibrated dsv2 mem=low, K=32 (SPREAD_MEM, SPREAD_K), the built-in prompts decoded 3 times each
# (SPREAD_REPEATS) by the paper's design and Specter, TPOT min-max per system, Specter's TPOT over the paper
# design's, and a host profile of one more decode of each (bench_offload.py --repeats).
# ahead: the GPU tests of draft-ahead and SideSteps, then calibrated dsv2 (AHEAD_MEM, default high; AHEAD_K,
# default 32; AHEAD_REPEATS decodes of the built-in prompts, default 2) with the paper's design, Specter and
# AHEAD_VARIANTS (default: Specter without draft-ahead, draft_ahead=false), each row as measured, with the host's
# time in draft-ahead's launch and the windows drafted ahead and from the prompt (OUT/ahead/offload.csv); AHEAD_ARGS
# adds bench_offload flags, e.g. --interleave (the systems take turns round by round; each variant's x Specter printed).
# calibration: each of CAL_MODELS (default "dsv2 qwen phi mixtral") calibrated at its real depth in CAL_DTYPE (default
# bfloat16, the default on CUDA), the registry's profile as committed: routing against the real row, Specter's
# acceptance and agreement with the greedy target with RTN and GPTQ drafts
# (fit_calibration.py --check-only --check-gptq, CAL_PROMPTS per dataset, default 1; phi about 250 s, mixtral 300 s:
# one model per device call).
# The log is written line by line, so a run cut by the call limit keeps what it printed; the benchmarks' CSVs
# likewise row by row, each row with its commit, host and workload (SPECTER_COMMIT=<commit> names the commit
# where the checkout has no .git, as on a device machine's copy).
# WEIGHTS (synthetic, the default, or calibrated) picks the full-size weights of offload, report and batch.
# Each step prints a short table and keeps going if another fails. The datasets are read from $SPECTER_DATA, default
# ../shared/data, else the repository's .data/ (a device machine gets only the repository: `cp -r ../shared/data
# .data` here, carry .data); the harness steps stop at once when none of their datasets is local.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR [tests|profile|kernel|offload ...]}"; shift
STEPS=("$@"); [ ${#STEPS[@]} -gt 0 ] || STEPS=(tests profile overlap kernel offload)
mkdir -p "$OUT"
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: gpu_check.sh needs a CUDA GPU" >&2; exit 2
fi
if [ -z "${SPECTER_DATA:-}" ] && [ ! -d ../shared/data ] && [ -d .data ]; then export SPECTER_DATA="$PWD/.data"; fi
LLAMA_SITE="$PWD/.llamacpp-site"  # the llamacpp step's CUDA build (git-ignored, kept while the machine is warm)
if [ -f "$LLAMA_SITE/llama_cpp/__init__.py" ]; then  # later steps and calls run llama.cpp from it
  export PYTHONPATH="$LLAMA_SITE:${PYTHONPATH:-}" SPECTER_LLAMACPP_SDIST=$(ls .llamacpp/llama_cpp_python-*-stripped.tar.gz | head -1)
fi
local_data() {  # exit status 0 when some dataset of the harness's defaults has its local file
  python3 -c "import sys; from experiments.datasets import local_datasets; sys.exit(0 if local_datasets() else 1)"
}
main_grid() {  # MODELS WEIGHTS REPEATS ROOT SYSTEMS: the main experiment per model and MEMS, each resumable under ROOT
  local rc=0 model mem dir resume
  if ! local_data; then
    echo "error: no dataset file under ${SPECTER_DATA:-../shared/data} (on a device machine: cp -r ../shared/data .data here, carry .data)"
    return 1
  fi
  for model in $1; do for mem in ${MEMS:-high low}; do
    dir="$4/main-$model-$mem"; resume=false; [ -d "$dir" ] && resume="${RESUME:-true}"
    if [ "${REPORT_TIMEOUT_S:-0}" -gt 0 ] && [ "${REPORT_TIMEOUT_S}" -lt "${REPORT_MIN_S:-300}" ]; then
      echo "skipped main-$model-$mem: REPORT_TIMEOUT_S=$REPORT_TIMEOUT_S is below REPORT_MIN_S=${REPORT_MIN_S:-300} (setup and warm-ups alone take about 240 s)"
      rc=1; continue
    fi
    timeout "${REPORT_TIMEOUT_S:-0}" python3 -m experiments.main model="$model" mem="$mem" model.weights="$2" dataset=all \
      "systems=[$5]" num_prompts="${NUM_PROMPTS:-1}" repeats="$3" token_caps.transformers="${TF_CAP:-8}" \
      results_root="$4" results_dir="$dir" resume=$resume ${REPORT_ARGS:-} > "$OUT/main-$model-$mem.log" 2>&1 || rc=1
    grep -E " AVG " "$OUT/main-$model-$mem.log" || tail -n 3 "$OUT/main-$model-$mem.log"
    local name; name=$(basename "$4"); tar czf "$OUT/${name#.}.tgz" "$4"  # after each run: unpack it in the repo to resume
  done; done
  return $rc
}

status=0
for step in "${STEPS[@]}"; do
  start=$(date +%s)
  echo "== $step"
  case "$step" in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1; rc=$?
           grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3; grep -E "^FAILED" "$OUT/gpu_tests.log" ;;
    profile) python3 benchmarks/profile_draft.py --model dsv2 --out "$OUT" ${PROFILE_ARGS:-} 2>&1 | grep -v -i -E "warn|^W[0-9]{4} "
             rc=${PIPESTATUS[0]} ;;
    overlap) python3 benchmarks/profile_offload.py --model dsv2 --k 8 --out "$OUT" 2>&1 | grep -v -i -E "warn|max_cache_len"
             rc=${PIPESTATUS[0]} ;;
    firstdecode) TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/bench_first_decode.py --model "${FIRST_MODEL:-qwen}" \
                   --mem "${FIRST_MEM:-high}" --out "$OUT" ${FIRST_ARGS:-} 2>&1 | grep -v -i -E "warn|max_cache_len"
                 rc=${PIPESTATUS[0]} ;;
    tiles) python3 benchmarks/bench_decode_tiles.py --models dsv2 qwen phi --out "$OUT" 2>&1 | grep -v -i warn
           rc=${PIPESTATUS[0]} ;;
    residual) python3 benchmarks/bench_residual.py --models dsv2 phi --out "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn
              rc=${PIPESTATUS[0]}
              for mem in ${MEMS:-low high}; do  # raw copies vs residual transfer, same model and process
                python3 benchmarks/bench_offload.py --models dsv2 --k 8 --mem "$mem" --quick --out "$OUT/residual-$mem" \
                  --prompts "${RESIDUAL_PROMPTS:-1}" --weights "${WEIGHTS:-synthetic}" \
                  --variants ${RESIDUAL_VARIANTS:-residual_transfer=false paper,residual_transfer=true} \
                  > "$OUT/residual-$mem.log" 2>&1 || rc=1
                grep -E "^== |^   [a-z_=,.0-9]+: [0-9]+ s;|Error" "$OUT/residual-$mem.log" | cut -c1-300  # the log keeps every row
              done ;;
    hostcost) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_bench_wave_host.py \
                -k "residual_transfer_on_cuda or wave_size" > "$OUT/hostcost_tests.log" 2>&1; rc=$?
              grep -E "passed|failed|error" "$OUT/hostcost_tests.log" | tail -2
              python3 benchmarks/bench_wave_host.py --models dsv2 qwen --out "$OUT" 2>&1 | grep -v -i warn
              [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
              python3 benchmarks/bench_residual.py --models dsv2 --repeats 5 --out "$OUT" 2>&1 | grep -v -i warn
              [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    spread) python3 benchmarks/bench_offload.py --models dsv2 --mem "${SPREAD_MEM:-low}" --k "${SPREAD_K:-32}" --quick \
              --weights calibrated --repeats "${SPREAD_REPEATS:-3}" --host-profile --out "$OUT/spread" 2>&1 \
              | grep -v -i -E "warn|max_cache_len"; rc=${PIPESTATUS[0]} ;;
    ahead) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k "draft_ahead or side_steps" \
             > "$OUT/ahead_tests.log" 2>&1; rc=$?
           grep -E "passed|failed|error" "$OUT/ahead_tests.log" | tail -2; grep -E "^FAILED" "$OUT/ahead_tests.log"
           python3 benchmarks/bench_offload.py --models dsv2 --mem "${AHEAD_MEM:-high}" --k "${AHEAD_K:-32}" --quick \
             --weights calibrated --repeats "${AHEAD_REPEATS:-2}" ${AHEAD_ARGS:-} --out "$OUT/ahead" \
             --variants ${AHEAD_VARIANTS:-draft_ahead=false} 2>&1 | grep --line-buffered -v -i -E "warn|max_cache_len" | tee "$OUT/ahead.log" \
             | grep -E "^   [a-z_=,0-9-]+: (interleaved, )?[0-9]+ s"; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    calibration) rc=0  # each model's committed profile at its real depth: routing, RTN and GPTQ acceptance
              for model in ${CAL_MODELS:-dsv2 qwen phi mixtral}; do
                python3 scripts/fit_calibration.py --models "$model" --layers 0 --device cuda --dtype "${CAL_DTYPE:-bfloat16}" \
                  --check-only --check-dtype "${CAL_DTYPE:-bfloat16}" --check-gptq --prompts "${CAL_PROMPTS:-1}" \
                  --out "$OUT/calibration-$model.json" 2>&1 | grep --line-buffered -v -E "^\[transformers\]" \
                  | tee "$OUT/calibration-$model.log" | tail -5; rc=$((rc | PIPESTATUS[0]))
              done ;;
    kernel) python3 benchmarks/bench_kernel.py --out "$OUT" --tokens 1 16 2>&1 | grep -v -i warn | tail -9
            rc=${PIPESTATUS[0]} ;;
    offload) python3 benchmarks/bench_offload.py --models dsv2 --k 8 --out "$OUT/dsv2" --quick --host-profile \
               --weights "${WEIGHTS:-synthetic}" --variants ${OFFLOAD_VARIANTS:-} 2>&1 \
               | grep -v -i -E "warn|max_cache_len"; rc=${PIPESTATUS[0]}
             python3 benchmarks/bench_offload.py --models qwen --k 8 --out "$OUT/qwen" --weights "${WEIGHTS:-synthetic}" 2>&1 \
               | grep -v -i -E "warn|max_cache_len" | tail -8; [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    depth) rc=0
           for model in ${MODELS:-dsv2 qwen}; do for mem in ${MEMS:-high low}; do
             resume=false; [ -d "${REPORT_DIR:-.report}/depth/$model-$mem" ] && resume="${RESUME:-true}"
             timeout "${REPORT_TIMEOUT_S:-0}" python3 -m experiments.main experiment=depth model="$model" mem="$mem" \
               model.weights="${WEIGHTS:-synthetic}" dataset=all num_prompts="${DEPTH_PROMPTS:-1}" repeats=1 \
               "experiment.k_values=[${DEPTH_KS:-4,8,12,16,24,32}]" warmup_tokens=32 \
               results_root="${REPORT_DIR:-.report}" resume=$resume > "$OUT/depth-$model-$mem.log" 2>&1 || rc=1
             grep -E " AVG |best K|error" "$OUT/depth-$model-$mem.log" || tail -n 3 "$OUT/depth-$model-$mem.log"
             tar czf "$OUT/report.tgz" "${REPORT_DIR:-.report}"  # after each run: unpack it in the repo to resume
           done; done ;;
    report) main_grid "${MODELS:-dsv2 qwen}" "${WEIGHTS:-synthetic}" "${REPEATS:-1}" "${REPORT_DIR:-.report}" \
              "${SYSTEMS:-specter,specter_paper,target_only,transformers,mo_sc,mo_sm,specmoeoff_sc,specmoeoff_sm,vllm,llama_cpp}"
            rc=$? ;;
    table) main_grid "${MODELS:-dsv2 qwen phi mixtral}" calibrated "${REPEATS:-3}" "${TABLE_DIR:-.table-h200}" \
             "${SYSTEMS:-specter,specter_paper,target_only,mo_sm,specmoeoff_sm,transformers,llama_cpp}"
           rc=$?
           python3 -m experiments.table "${TABLE_DIR:-.table-h200}" > "$OUT/table.md" && tail -n 40 "$OUT/table.md" ;;
    batch) dir="${REPORT_DIR:-.report}/batch-dsv2"; resume=false; [ -d "$dir" ] && resume=true
           python3 -m experiments.main experiment=batch model=dsv2 mem=high model.weights="${WEIGHTS:-synthetic}" \
             dataset="${BATCH_DATASET:-gsm8k}" num_prompts=32 repeats=1 max_new_tokens="${BATCH_TOKENS:-64}" \
             "experiment.batch_sizes=[${BATCH_SIZES:-1,4,16,32}]" token_caps.transformers=4 \
             'systems=[specter,mo_sm,specmoeoff_sm,transformers]' results_dir="$dir" resume=$resume ${BATCH_ARGS:-} \
             > "$OUT/batch-dsv2.log" 2>&1; rc=$?
           grep -E " AVG |error" "$OUT/batch-dsv2.log"
           tar czf "$OUT/report.tgz" "${REPORT_DIR:-.report}" ;;  # unpack it in the repo to resume next time
    llamacpp) sdist=$(ls .llamacpp/llama_cpp_python-*-stripped.tar.gz | head -1); rc=0
              if [ ! -f "$LLAMA_SITE/llama_cpp/__init__.py" ]; then  # built once per machine
                python3 -m pip install -q --no-index --no-deps --target "$LLAMA_SITE" .llamacpp/diskcache-*.whl \
                  && CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
                     CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "${LLAMA_BUILD_S:-420}" python3 -m pip install -q \
                     --no-index --no-deps --no-build-isolation --target "$LLAMA_SITE" "$sdist" > "$OUT/llamacpp_build.log" 2>&1
                rc=$?; tail -n 5 "$OUT/llamacpp_build.log"; du -sh "$LLAMA_SITE"
              fi
              if [ "$rc" = 0 ]; then
                export PYTHONPATH="$LLAMA_SITE:${PYTHONPATH:-}" SPECTER_LLAMACPP_SDIST="$sdist"
                python3 -c "import llama_cpp; print('llama.cpp', llama_cpp.__version__, 'gpu offload:', llama_cpp.llama_supports_gpu_offload())"
                python3 -m baselines.gguf_convert --fetch
                python3 scripts/llamacpp_cuda_probe.py --out "$OUT/llamacpp-probe" 2>&1 | grep -E "^(alone|after-torch):"
                python3 -X faulthandler -m experiments.main model=tiny-qwen device=cuda 'systems=[target_only,llama_cpp]' num_prompts=1 \
                  repeats=1 results_dir="$OUT/llamacpp-tiny" > "$OUT/llamacpp-tiny.log" 2>&1; rc=$?
                grep -E " AVG |error|unavailable" "$OUT/llamacpp-tiny.log"
                [ "$rc" = 0 ] || grep -A14 "Fatal Python error" "$OUT/llamacpp-tiny.log" | grep -v "^  File.*<frozen"
              fi ;;
    *) echo "error: unknown step $step" >&2; rc=2 ;;
  esac
  [ "$rc" = 0 ] || status=1
  echo "   ($step: $(( $(date +%s) - start )) s, exit $rc)"
done
exit $status
