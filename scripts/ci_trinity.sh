#!/usr/bin/env bash
# CI for the Trinity-RFT adapter (recipe/trinity): the trinity-marked tests against the real trinity-rft and verl
# packages, on CPU, in their own virtual environment (Trinity pins transformers>=5.12.1; this project's verl extra
# pins verl 0.9.x, which wants transformers<5.11, so they cannot share one).
#
#   bash scripts/ci_trinity.sh [VENV]          # default VENV: .venv-ci-trinity
#
# What is installed: CPU torch first; trinity-rft 0.6.0 and verl 0.8.0 (the verl that pip resolves for trinity-rft
# 0.6.0: verl 0.9.x pins transformers<5.11) without their dependency trees (GPU stacks: vLLM, flash-attn, ...); then,
# with torch pinned, the modules that Trinity's loss registry, its config validator and verl's engine batch loop
# import. Then this project *with* its own requirements, constrained to what is already installed, and the script
# fails if that changed any installed package: installing stalerl beside Trinity leaves Trinity's environment as it
# was. Exits non-zero unless tests ran and none failed or was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci_lib.sh
TRINITY_VERSION=$(python3 -m recipe.versions version trinity-rft)  # the tested range and the CI pin: recipe/versions.py
VERL_VERSION=0.8.0  # the verl pip resolves for trinity-rft 0.6.0 (not the verl lane's pin, recipe/versions.py: 0.9.x needs transformers<5.11)
start=$(date +%s)

ci_venv "${1:-.venv-ci-trinity}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ci_torch_pin "$work/torch-pin.txt"
"$PY" -m pip install -q --no-deps "trinity-rft==${TRINITY_VERSION}" "verl==${VERL_VERSION}"
# trinity.utils.log imports ray; trinity.trainer imports pandas; verl's engine imports transformers, peft, datasets,
# codetiming, tensorboard; verl's torch unpadding uses einops; verl 0.8.0 wants tensordict<=0.10. numpy>=2: the
# pyarrow that datasets pulls (26) fails to import with numpy 1.x without declaring it (verl 0.8.0's metadata says
# numpy<2, but the code run here works with numpy 2).
"$PY" -m pip install -q -c "$work/torch-pin.txt" ray omegaconf "numpy>=2" safetensors \
    "tensordict>=0.8,<=0.10.0,!=0.9.0" pandas tensorboard "transformers>=5.12.1" peft datasets codetiming einops \
    pytest

ci_freeze "$work/before.txt"
"$PY" -m pip install -q -e . -c "$work/before.txt"
ci_freeze "$work/after.txt"
ci_require_unchanged "$work/before.txt" "$work/after.txt" "trinity-rft ${TRINITY_VERSION} / verl ${VERL_VERSION}"
echo "environment ready: $(( $(date +%s) - start ))s"

rc=0
ci_marked_tests Trinity-RFT trinity STALERL_REQUIRE_TRINITY --durations=10 || rc=$?
echo "Trinity-RFT environment + tests: $(( $(date +%s) - start ))s (exit $rc)"
exit "$rc"
