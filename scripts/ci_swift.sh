#!/usr/bin/env bash
# ms-swift's GRPO with the recipe losses (recipe/swift/), tested against the real ms-swift in its own virtual
# environment: ms-swift 4.6 pins trl<1.0 and transformers<5.20, which the main environment cannot share.
#
#   bash scripts/ci_swift.sh [VENV]            # default VENV: .venv-ci-swift
#
# CPU torch first, then ms-swift at its tested version with torch pinned, then this project with its `swift` extra
# (which ms-swift's install already satisfies) and pytest; the step checks that no package ms-swift installed changed
# version. Then the swift-marked tests with STALERL_REQUIRE_SWIFT=1 (a missing ms-swift is an error, never a skip);
# exit 0 only if the junit report shows tests that ran, none failed or skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci_lib.sh
# the version CI installs comes from recipe/versions.py (FRAMEWORKS["ms-swift"].ci), the adapter's tested range
SWIFT_VERSION=${STALERL_SWIFT_VERSION:-$(python3 -m recipe.versions version ms-swift)}
start=$(date +%s)

ci_venv "${1:-.venv-ci-swift}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ci_torch_pin "$work/pin.txt"
# msgspec: imported by ms-swift's GRPO trainer module but not among ms-swift's requirements
"$PY" -m pip install -q "ms-swift==${SWIFT_VERSION}" msgspec -c "$work/pin.txt"
ci_freeze "$work/before.txt"
"$PY" -m pip install -q -e ".[swift]" pytest -c "$work/pin.txt"
ci_freeze "$work/after.txt"
ci_require_unchanged "$work/before.txt" "$work/after.txt" "ms-swift ${SWIFT_VERSION}" additions-ok
"$PY" -m pip check
echo "ms-swift environment ready in ${VENV} after $(( $(date +%s) - start ))s"

rc=0
OMP_NUM_THREADS=1 ci_marked_tests ms-swift swift STALERL_REQUIRE_SWIFT --durations=10 || rc=$?
echo "scripts/ci_swift.sh: exit ${rc} after $(( $(date +%s) - start ))s"
exit "$rc"
