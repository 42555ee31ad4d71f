#!/usr/bin/env bash
# The AReaL adapter's tests against the real areal 1.0.4, on CPU, in AReaL's own virtual environment.
#
#   bash scripts/ci_areal.sh [VENV]        (default VENV: .venv-ci-areal)
#
# AReaL pins torch<2.11 (no CPU build of that range on the package index: installing it with its dependencies pulls
# a CUDA torch) and ~80 runtime dependencies. So: CPU torch 2.13.0 first, AReaL with --no-deps, then only what its
# actor, engine and RPC modules import, torch pinned. Then this project, with its dependencies, which must leave that
# environment exactly as it was (checked: pip freeze before == after, except stalerl itself). Then the areal-marked
# tests with STALERL_REQUIRE_AREAL=1 (a missing AReaL is an error, not a skip); exit 0 only if tests ran, none failed
# and none was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci_lib.sh
AREAL_VERSION=$(python3 -m recipe.versions version areal)  # the tested range and the CI pin: recipe/versions.py
start=$(date +%s)

ci_venv "${1:-.venv-ci-areal}"
pin="$VENV/torch-constraint.txt"
ci_torch_pin "$pin"
"$PY" -m pip install -q --no-deps "areal==${AREAL_VERSION}"
# AReaL's own version pins (its Requires-Dist without extras and without torch*), as constraints for what follows.
"$PY" - > "$VENV/areal-pins.txt" <<'PY'
import importlib.metadata as md
import re
for req in md.requires("areal"):
    name = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower()
    if "extra ==" in req or name in ("torch", "torchaudio", "torchvision"):
        continue
    print(re.sub(r"\[[^\]]*\]", "", req))  # constraints take no extras
PY
# What `import areal`, areal.trainer.ppo.actor, areal.engine.fsdp_engine and the RPC engine endpoint import, at
# AReaL's pins (transformers<=5.3.0, peft<=0.18.1, the hydra-core/omegaconf pre-releases, ...), plus pytest.
"$PY" -m pip install -q -c "$pin" -c "$VENV/areal-pins.txt" \
  aiohttp httpx colorlog tenacity flask torchdata numpy lark uvloop pyyaml hydra-core omegaconf transformers peft \
  ray numba pillow orjson einops aiofiles openai datasets swanlab trackio wandb tensorboardX tabulate pybase64 pytest
ci_freeze "$VENV/freeze-before.txt"

# This project beside AReaL, with its core dependencies: every one must already be satisfied by AReaL's environment.
"$PY" -m pip install -q -e . -c "$pin"
ci_freeze "$VENV/freeze-after.txt"
ci_require_unchanged "$VENV/freeze-before.txt" "$VENV/freeze-after.txt" "AReaL ${AREAL_VERSION}"
setup_s=$(( $(date +%s) - start ))

rc=0
ci_marked_tests AReaL areal STALERL_REQUIRE_AREAL || rc=$?
echo "AReaL environment: ${setup_s}s; total $(( $(date +%s) - start ))s (exit $rc)"
exit "$rc"
