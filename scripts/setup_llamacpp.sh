#!/usr/bin/env bash
# Install the llama.cpp baseline: llama-cpp-python (the `llamacpp` extra) and llama.cpp's HF->GGUF converter.
#   scripts/setup_llamacpp.sh      -> llama-cpp-python 0.3.36 in this python; the converter (from the same
#                                     release's sdist) under ${SPECTER_LLAMACPP_SRC:-$HOME/.cache/specter/llama-cpp-src}
# A quick no-op when both are present. The package is a source build: about 9-11 minutes on 2 cores,
# portable (CMAKE_ARGS=-DGGML_NATIVE=off) unless CMAKE_ARGS is set; for an NVIDIA GPU (needs nvcc):
#   CMAKE_ARGS=-DGGML_CUDA=on scripts/setup_llamacpp.sh
# sentencepiece is installed too: the converter needs it for real checkpoints with a tokenizer.model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VERSION=$(sed -n 's/^LLAMACPP_VERSION = "\([0-9.]*\)".*/\1/p' baselines/gguf_convert.py)

if "$PYTHON" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  echo "llama-cpp-python $VERSION: installed"
else
  echo "llama-cpp-python $VERSION: building from source (about 9-11 minutes on 2 cores)"
  start=$(date +%s)
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=off}" "$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    -e ".[llamacpp]"
  echo "llama-cpp-python $VERSION: built in $(( $(date +%s) - start )) s"
fi
"$PYTHON" -c "import sentencepiece" 2>/dev/null \
  || "$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore sentencepiece
echo "converter: $("$PYTHON" -m baselines.gguf_convert --fetch)"
