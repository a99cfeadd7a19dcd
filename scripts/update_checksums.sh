#!/usr/bin/env bash
# Regenerate SHA256SUMS over the shipped configs (and, once present, the model manifest).
set -euo pipefail
cd "$(dirname "$0")/.."
{ find conf -name '*.yaml'; ls initialization/*.json 2>/dev/null || true; } | LC_ALL=C sort | xargs sha256sum > SHA256SUMS
echo "wrote SHA256SUMS ($(wc -l < SHA256SUMS) files)"
