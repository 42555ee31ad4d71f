#!/usr/bin/env bash
# The TRL integration's CI step: its own virtual environment with TRL at its tested version, this project installed
# into it without touching TRL's pins, then the trl-marked tests against the real GRPOTrainer (STALERL_REQUIRE_TRL=1:
# a missing TRL is a failure, never a skip). Exits non-zero unless tests ran and none failed or was skipped.
#
#   bash scripts/ci_trl.sh [VENV]          # default VENV: .venv-ci-trl
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci_lib.sh
# the version CI installs comes from recipe/versions.py (FRAMEWORKS["trl"].ci), the adapter's tested range
TRL_VERSION=${STALERL_TRL_VERSION:-$(python3 -m recipe.versions version trl)}
start=$(date +%s)

ci_venv "${1:-.venv-ci-trl}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ci_torch_pin "$work/pin.txt"
"$PY" -m pip install -q "trl==${TRL_VERSION}" -c "$work/pin.txt"
ci_freeze "$work/before.txt"
# The adapter needs only torch + recipe + trl; the project's own requirements (omegaconf, tqdm, ...) are added
# with torch pinned, and nothing TRL installed may change version, so TRL's pins stay as they were.
"$PY" -m pip install -q -e ".[trl]" pytest -c "$work/pin.txt"
ci_freeze "$work/after.txt"
ci_require_unchanged "$work/before.txt" "$work/after.txt" "TRL ${TRL_VERSION}" additions-ok
"$PY" -m pip check

rc=0
ci_marked_tests TRL trl STALERL_REQUIRE_TRL -W ignore::FutureWarning || rc=$?
echo "TRL environment + tests: $(( $(date +%s) - start ))s (exit $rc)"
exit "$rc"
