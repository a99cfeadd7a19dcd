#!/usr/bin/env bash
# Stage what a CUDA build of llama-cpp-python needs on a machine without a package index (the H200):
# the release's sdist, stripped of llama.cpp's docs, vocab test files and git history (76 MB -> ~13 MB,
# under the device tool's 64 MiB), and the one runtime dependency the H200 image lacks (diskcache).
#   scripts/stage_llamacpp_cuda.sh [DIR]   (default .llamacpp/, git-ignored; carry it to the GPU machine)
# There: scripts/gpu_check.sh OUT llamacpp  builds it for sm_90 into /tmp/site-llama and runs a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.llamacpp}"
VERSION=$(sed -n 's/^LLAMACPP_VERSION = "\([0-9.]*\)".*/\1/p' baselines/gguf_convert.py)
STRIPPED="$DIR/llama_cpp_python-$VERSION-stripped.tar.gz"
grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
mkdir -p "$DIR"
if [ ! -f "$STRIPPED" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-$VERSION"
  rm -rf "$src/vendor/llama.cpp/docs" "$src/vendor/llama.cpp/benches"
  find "$src" -name .git -prune -exec rm -rf {} +
  find "$src/vendor/llama.cpp/models" -name '*.gguf' -delete
  tar czf "$STRIPPED" -C "$tmp" "llama_cpp_python-$VERSION"
fi
ls "$DIR"/diskcache-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary :all: -d "$DIR" diskcache
du -sh "$DIR"/*
