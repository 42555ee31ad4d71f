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
VENV=${1:-.venv-ci-swift}
TORCH_VERSION=${STALERL_TORCH_VERSION:-2.13.0}
SWIFT_VERSION=${STALERL_SWIFT_VERSION:-4.6.0}
start=$(date +%s)

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==${TORCH_VERSION}" > "$work/pin.txt"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==${TORCH_VERSION}"
# msgspec: imported by ms-swift's GRPO trainer module but not among ms-swift's requirements
"$PY" -m pip install -q "ms-swift==${SWIFT_VERSION}" msgspec -c "$work/pin.txt"
"$PY" -m pip freeze --exclude-editable | sort > "$work/before.txt"
"$PY" -m pip install -q -e ".[swift]" pytest -c "$work/pin.txt"
"$PY" -m pip freeze --exclude-editable | sort > "$work/after.txt"
changed=$(comm -23 "$work/before.txt" "$work/after.txt")
if [ -n "$changed" ]; then
  echo "installing stalerl[swift] changed packages ms-swift installed (must leave them as they were):" >&2
  echo "$changed" >&2
  exit 1
fi
"$PY" -m pip check
echo "ms-swift environment ready in ${VENV} after $(( $(date +%s) - start ))s"

set +e
STALERL_REQUIRE_SWIFT=1 OMP_NUM_THREADS=1 "$PY" -m pytest -q -ra --durations=10 -p no:cacheprovider -m swift \
  tests/integrations/swift --junitxml="$VENV/swift-tests.xml"
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
  "$PY" - "$VENV/swift-tests.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
tests, bad, skipped = int(s.get("tests")), int(s.get("failures")) + int(s.get("errors")), int(s.get("skipped"))
print(f"ms-swift tests: {tests} collected, {bad} failed, {skipped} skipped")
sys.exit(0 if tests > 0 and bad == 0 and skipped == 0 else 1)
PY
  rc=$?
fi
echo "scripts/ci_swift.sh: exit ${rc} after $(( $(date +%s) - start ))s"
exit "$rc"
