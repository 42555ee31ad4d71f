#!/usr/bin/env bash
# The pure-Python wheels scripts/gpu_check.sh installs on a bare CUDA image (Python 3.12, torch, transformers; no
# network there): the project's dependencies that transformers does not bring, i.e. omegaconf and the antlr4 runtime
# it pins. Run it here (with network), then carry the folder along with the repository (it is git-ignored).
#
#   bash scripts/prepare_gpu_wheels.sh [DIR]          # default DIR: .whl (about 0.3 MB)
#
# omegaconf ships a py3-none-any wheel. antlr4-python3-runtime 4.9.x (omegaconf 2.3 pins 4.9.*) exists on PyPI only
# as an sdist; it is pure Python, so the wheel built from it here is the same for every Python 3 (py3-none-any).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
TARGET_PY=${STALERL_GPU_PYTHON_VERSION:-3.12}
mkdir -p "$DIR"
rm -f "$DIR"/omegaconf-*.whl "$DIR"/antlr4_python3_runtime-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" --dest "$DIR" "omegaconf>=2.3,<2.4"
"$PY" -m pip wheel -q --no-deps --no-binary=:all: --wheel-dir "$DIR" "antlr4-python3-runtime==4.9.3"
for whl in "$DIR"/*.whl; do
  case "$whl" in
    *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
    *) echo "prepare_gpu_wheels: $whl is not a pure-Python wheel" >&2; exit 1 ;;
  esac
done
size=$(du -sk "$DIR" | cut -f1)
if [ "$size" -gt $((64 * 1024)) ]; then
  echo "prepare_gpu_wheels: $DIR holds ${size} KiB, over the 64 MiB a GPU slot carries" >&2
  exit 1
fi
echo "prepare_gpu_wheels: $(ls "$DIR" | tr '\n' ' ')(${size} KiB in $DIR)"
