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
VENV=${1:-.venv-ci-areal}
TORCH_VERSION=${STALERL_TORCH_VERSION:-2.13.0}
AREAL_VERSION=1.0.4
start=$(date +%s)

python3 -m venv "$VENV"
PY="$VENV/bin/python"
pin="$VENV/torch-constraint.txt"
echo "torch==${TORCH_VERSION}" > "$pin"
"$PY" -m pip install -q "torch==${TORCH_VERSION}"
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
"$PY" -m pip freeze --exclude-editable | sort > "$VENV/freeze-before.txt"

# This project beside AReaL, with its core dependencies: every one must already be satisfied by AReaL's environment.
"$PY" -m pip install -q -e . -c "$pin"
"$PY" -m pip freeze --exclude-editable | sort > "$VENV/freeze-after.txt"
if ! diff -u "$VENV/freeze-before.txt" "$VENV/freeze-after.txt"; then
  echo "installing stalerl changed AReaL's environment (diff above): failing" >&2
  exit 1
fi
echo "installing stalerl left AReaL's environment as it was ($(wc -l < "$VENV/freeze-after.txt") packages)"
setup_s=$(( $(date +%s) - start ))

set +e
STALERL_REQUIRE_AREAL=1 "$PY" -m pytest -q -ra -m areal tests/integrations/areal \
  -p no:cacheprovider --junitxml="$VENV/areal-tests.xml"
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
  "$PY" scripts/junit_check.py "$VENV/areal-tests.xml" AReaL
  rc=$?
fi
echo "AReaL environment: ${setup_s}s; total $(( $(date +%s) - start ))s (exit $rc)"
exit "$rc"
