#!/usr/bin/env bash
# Install stalerl for development on a CPU machine: CPU torch first, then the project with its test, verl and model
# extras, with torch pinned so that no dependency can swap in a multi-GB CUDA build and every other package pinned by
# constraints/cpu.txt (the versions the docs' results were made with: transformers 5.10.4, matplotlib 3.11.2, ...),
# then a check that what got installed is the CPU build (scripts/check_cpu_torch.py: torch.version.cuda is None, no
# nvidia-*/triton packages). STALERL_CONSTRAINTS=FILE uses another constraints file, STALERL_CONSTRAINTS=none none.
# Where: the active virtual environment if one is active (CI's), else ./.venv (made with python3 -m venv if absent),
# never a system interpreter. Torch comes from the PyTorch CPU wheel index when it answers (on Linux x86_64 the
# public index alone would resolve the CUDA build), else from pip's configured index (here a local CPU file);
# STALERL_TORCH_INDEX=URL forces an index, STALERL_TORCH_INDEX=none skips the probe.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${STALERL_TORCH_VERSION:-2.13.0}
EXTRAS=${STALERL_EXTRAS:-test,verl,model}
CONSTRAINTS=${STALERL_CONSTRAINTS:-constraints/cpu.txt}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python3"
else
  [ -x .venv/bin/python3 ] || python3 -m venv .venv
  PY=.venv/bin/python3
fi
echo "setup: installing into $("$PY" -c 'import sys; print(sys.prefix)')"
index=${STALERL_TORCH_INDEX:-}
if [ -z "$index" ] && "$PY" - "$CPU_INDEX" <<'PY' 2>/dev/null; then index=$CPU_INDEX; fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5)
PY
if [ -n "$index" ] && [ "$index" != none ]; then
  echo "setup: torch ${TORCH_VERSION} from the CPU wheel index ${index}"
  "$PY" -m pip install -q "torch==${TORCH_VERSION}" --index-url "$index"
else
  echo "setup: PyTorch's CPU wheel index not reachable; torch ${TORCH_VERSION} from pip's index, checked below"
  "$PY" -m pip install -q "torch==${TORCH_VERSION}"
fi
"$PY" scripts/check_cpu_torch.py
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==${TORCH_VERSION}" > "$pin"
constraints=(-c "$pin")
if [ "$CONSTRAINTS" != none ]; then
  echo "setup: versions pinned by $CONSTRAINTS"
  constraints+=(-c "$CONSTRAINTS")
fi
"$PY" -m pip install -q -e ".[${EXTRAS}]" "${constraints[@]}"
"$PY" scripts/check_cpu_torch.py
"$PY" - <<PY
import sys, torch
print("stalerl installed; torch", torch.__version__)
sys.exit(0 if torch.__version__.startswith("${TORCH_VERSION}") else 1)
PY
[ -n "${VIRTUAL_ENV:-}" ] || echo "setup: done; run with .venv/bin/python3 (or: . .venv/bin/activate)"
