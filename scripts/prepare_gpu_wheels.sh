#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a bare CUDA image (Python 3.12, torch, transformers; no network there):
# the project's dependencies that transformers does not bring, i.e. omegaconf and the antlr4 runtime it pins (the
# config), and gguf + accelerate + psutil (stalerl-model fetch: converting the SmolLM2 GGUF of ../shared/models into
# a Hugging Face directory on the GPU machine). Run it here (with network), then carry the folder along with the
# repository (it is git-ignored). The check installs only the wheels whose modules the image lacks.
#
#   bash scripts/prepare_gpu_wheels.sh [DIR]          # default DIR: .whl (about 2 MB)
#
# Versions: constraints/cpu.txt's (the ones the CPU results were made with). omegaconf, gguf and accelerate ship
# py3-none-any wheels; antlr4-python3-runtime 4.9.x (omegaconf 2.3 pins 4.9.*) exists on PyPI only as an sdist and is
# pure Python, so the wheel built from it here is the same for every Python 3 (py3-none-any); psutil is compiled: its
# abi3 wheel for CPython >= 3.6 on manylinux x86_64 (STALERL_GPU_PLATFORM) serves the GPU machine's Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
TARGET_PY=${STALERL_GPU_PYTHON_VERSION:-3.12}
PLATFORM=${STALERL_GPU_PLATFORM:-manylinux2014_x86_64}
pin() {  # the version constraints/cpu.txt pins, as a requirement
  local v
  v=$(grep -i "^$1==" constraints/cpu.txt | head -1 | cut -d= -f3)
  [ -n "$v" ] || { echo "prepare_gpu_wheels: no pin for $1 in constraints/cpu.txt" >&2; exit 1; }
  echo "$1==$v"
}
mkdir -p "$DIR"
rm -f "$DIR"/omegaconf-*.whl "$DIR"/antlr4_python3_runtime-*.whl "$DIR"/gguf-*.whl "$DIR"/accelerate-*.whl \
      "$DIR"/psutil-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" --dest "$DIR" \
  "$(pin omegaconf)" "$(pin gguf)" "$(pin accelerate)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" --platform "$PLATFORM" \
  --implementation cp --dest "$DIR" "$(pin psutil)"
"$PY" -m pip wheel -q --no-deps --no-binary=:all: --wheel-dir "$DIR" "$(pin antlr4-python3-runtime)"
for whl in "$DIR"/*.whl; do
  case "$whl" in
    *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
    psutil-*-abi3-*manylinux*x86_64*.whl|*/psutil-*-abi3-*manylinux*x86_64*.whl) ;;
    *) echo "prepare_gpu_wheels: $whl is neither pure Python nor psutil's abi3 manylinux wheel" >&2; exit 1 ;;
  esac
done
size=$(du -sk "$DIR" | cut -f1)
if [ "$size" -gt $((64 * 1024)) ]; then
  echo "prepare_gpu_wheels: $DIR holds ${size} KiB, over the 64 MiB a GPU slot carries" >&2
  exit 1
fi
echo "prepare_gpu_wheels: $(ls "$DIR" | tr '\n' ' ')(${size} KiB in $DIR)"
