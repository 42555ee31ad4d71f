#!/usr/bin/env bash
# The TRL integration's CI step: its own virtual environment with TRL at its tested version, this project installed
# into it without touching TRL's pins, then the trl-marked tests against the real GRPOTrainer (STALERL_REQUIRE_TRL=1:
# a missing TRL is a failure, never a skip). Exits non-zero unless tests ran and none failed or was skipped.
#
#   bash scripts/ci_trl.sh [VENV]          # default VENV: .venv-ci-trl
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-ci-trl}
TORCH_VERSION=${STALERL_TORCH_VERSION:-2.13.0}
TRL_VERSION=${STALERL_TRL_VERSION:-1.16.0}
start=$(date +%s)

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
pin=$(mktemp)
before=$(mktemp)
trap 'rm -f "$pin" "$before"' EXIT
echo "torch==${TORCH_VERSION}" > "$pin"
"$PY" -m pip install -q "torch==${TORCH_VERSION}"          # CPU torch first: nothing below may pull a CUDA build
"$PY" -m pip install -q "trl==${TRL_VERSION}" -c "$pin"
"$PY" -m pip freeze --exclude-editable > "$before"
# The adapter needs only torch + recipe + trl; the project's own requirements (omegaconf, tqdm, ...) are added
# with torch pinned, and nothing TRL installed may change version (checked below), so TRL's pins stay as they were.
"$PY" -m pip install -q -e ".[trl]" pytest -c "$pin"
"$PY" - "$before" <<'PY'
import subprocess, sys
def versions(lines):
    return dict(line.split("==", 1) for line in lines if "==" in line)
before = versions(open(sys.argv[1]).read().split())
after = versions(subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                                capture_output=True, text=True).stdout.split())
changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
if changed:
    sys.exit(f"installing stalerl next to TRL changed TRL's environment: {changed}")
print(f"TRL environment unchanged by the project install ({len(before)} packages; trl {before.get('trl')}, "
      f"transformers {before.get('transformers')}, torch {before.get('torch')})")
PY
"$PY" -m pip check

report="$VENV/trl-tests.xml"
set +e
STALERL_REQUIRE_TRL=1 "$PY" -m pytest -q -ra -p no:cacheprovider -W ignore::FutureWarning -m trl \
  tests/integrations/trl --junitxml="$report"
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
  "$PY" scripts/junit_check.py "$report" TRL
  rc=$?
fi
echo "TRL environment + tests: $(( $(date +%s) - start ))s (exit $rc)"
exit "$rc"
