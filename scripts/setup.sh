#!/usr/bin/env bash
# Install stalerl for development on a CPU machine: CPU torch first, then the project with its test and verl extras,
# with torch pinned so that no dependency can swap in a multi-GB CUDA build. Run from anywhere; uses the current
# python (activate a virtual environment first if you want one).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${STALERL_TORCH_VERSION:-2.13.0}
EXTRAS=${STALERL_EXTRAS:-test,verl}
python -m pip install -q "torch==${TORCH_VERSION}"
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==${TORCH_VERSION}" > "$pin"
python -m pip install -q -e ".[${EXTRAS}]" -c "$pin"
python - <<PY
import sys, torch
print("stalerl installed; torch", torch.__version__)
sys.exit(0 if torch.__version__.startswith("${TORCH_VERSION}") else 1)
PY
