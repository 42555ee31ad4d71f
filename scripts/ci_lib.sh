# Steps shared by the separate-environment CI lanes (scripts/ci_trl.sh, ci_swift.sh, ci_areal.sh, ci_trinity.sh).
# Source it from the repository root after `set -euo pipefail`; each lane keeps its own install order, because
# what may be installed with which pins is the part that differs between frameworks.
#
#   ci_venv VENV                      create VENV unless it has a python; sets PY (and VENV, made absolute)
#   ci_pin KEY                        print the pip requirement CI installs for framework KEY (trl==1.16.0), read
#                                     from recipe/versions.py: the tested range and the CI pin live there only
#   ci_torch_pin FILE                 write the CPU torch pin (torch==$TORCH_VERSION) and install CPU torch first
#   ci_freeze FILE                    pip freeze of PY's environment (editable installs left out), sorted
#   ci_require_unchanged BEFORE AFTER FRAMEWORK [identical|additions-ok]
#                                     fail unless installing stalerl left every package of BEFORE as it was; with
#                                     identical (the default) it may not add any package either
#   ci_marked_tests LABEL MARK REQUIRE_VAR [PYTEST ARGS...]
#                                     pytest -m MARK tests/integrations/MARK with REQUIRE_VAR=1 (a missing framework
#                                     fails, never skips); returns non-zero unless tests ran and none failed or skipped

TORCH_VERSION=${STALERL_TORCH_VERSION:-2.13.0}

ci_venv() {
  VENV=$1
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  VENV=$(cd "$VENV" && pwd)  # absolute: a lane may run its tests from another directory
  PY="$VENV/bin/python"
  "$PY" -m pip install -q --upgrade pip
}

ci_pin() {
  # recipe.versions is stdlib-only, so any python3 runs it from the repository root (no install needed)
  local pin
  pin=$(python3 -m recipe.versions ci "$1") || { echo "ci_pin: no CI pin for framework '$1' in recipe/versions.py" >&2; return 2; }
  echo "$pin"
}

ci_torch_pin() {
  echo "torch==${TORCH_VERSION}" > "$1"
  "$PY" -m pip install -q "torch==${TORCH_VERSION}"  # CPU torch first: nothing after it may pull a CUDA build
}

ci_freeze() {
  "$PY" -m pip freeze --exclude-editable | sort > "$1"
}

ci_require_unchanged() {
  local before=$1 after=$2 framework=$3 mode=${4:-identical}
  local changed added
  case "$mode" in identical|additions-ok) ;; *) echo "ci_require_unchanged: mode '$mode', expected identical or additions-ok" >&2; exit 2 ;; esac
  changed=$(comm -23 "$before" "$after")  # lines of the framework's freeze that are gone: changed or removed
  added=$(comm -13 "$before" "$after")
  if [ -n "$changed" ] || { [ "$mode" = identical ] && [ -n "$added" ]; }; then
    echo "installing stalerl changed ${framework}'s environment; it must leave the framework's pins as they were" \
         "(failing CI). Before -> after:" >&2
    diff -u "$before" "$after" >&2 || true
    exit 1
  fi
  echo "installing stalerl left ${framework}'s environment as it was ($(wc -l < "$before") packages" \
       "unchanged${added:+; added: $(echo $added)})"
}

ci_marked_tests() {
  local label=$1 mark=$2 require=$3 rc=0
  shift 3
  local report="$VENV/${mark}-tests.xml"
  env "${require}=1" "$PY" -m pytest -q -ra -p no:cacheprovider -m "$mark" "tests/integrations/${mark}" \
    --junitxml="$report" "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    "$PY" scripts/junit_check.py "$report" "$label" || rc=$?
  fi
  return "$rc"
}
