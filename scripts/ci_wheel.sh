#!/usr/bin/env bash
# The wheel lane: install stalerl as a user does (no index has it), then run the verl plugin's tests and TRL's marked
# tests against the installed package, not the checkout:
#
#   1. build the wheel from a clean copy of the tracked files (`pip wheel --no-deps`, the README's second way);
#   2. a fresh virtual environment: CPU torch pinned first, then the wheel (NOT editable) with the verl and trl
#      extras at their CI pins (recipe/versions.py, via ci_pin);
#   3. from a directory outside the checkout (which therefore cannot be imported): the package data is there
#      (recipe/verl/config/*.yaml, the ms-swift plugin file), the entry points (verl.plugins, console scripts) are
#      registered and run, and `recipe`/`stalerl` import from site-packages;
#   4. tests/integration/test_verl_plugin.py, test_verl_fipo.py, test_add_a_loss_verl.py and test_new_losses_verl.py
#      (real verl), then `pytest -m trl` (real TRL), run
#      from a copy of tests/ and examples/ only; junit-gated: tests must run, none may fail or skip.
#
#   bash scripts/ci_wheel.sh [VENV]          # default VENV: .venv-ci-wheel
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci_lib.sh
start=$(date +%s)
repo=$PWD
VERL_REQ=$(ci_pin verl)
TRL_REQ=$(ci_pin trl)

ci_venv "${1:-.venv-ci-wheel}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. the wheel, built from the tracked files only (a stray local file cannot end up in it)
mkdir -p "$work/src" "$work/dist"
git ls-files -z | tar --null -cf - -T - | tar -xf - -C "$work/src"
"$PY" -m pip wheel -q --no-deps "$work/src" -w "$work/dist"
wheel=$(ls "$work"/dist/stalerl-*.whl)
echo "built $(basename "$wheel") in $(( $(date +%s) - start ))s"

# 2. installed as a user installs it: torch first, then the wheel with its extras (torch pinned)
ci_torch_pin "$work/pin.txt"
"$PY" -m pip install -q "${wheel}[verl,trl]" "$VERL_REQ" "$TRL_REQ" pytest -c "$work/pin.txt"
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"  # a reused venv must test this wheel, not an older stalerl
"$PY" -m pip check
if "$PY" -m pip show -f stalerl | grep -qi "editable"; then
  echo "stalerl is installed editable; the wheel lane needs the built wheel" >&2
  exit 1
fi
echo "installed the wheel with ${VERL_REQ} and ${TRL_REQ} after $(( $(date +%s) - start ))s"

# 3. outside the checkout: what the wheel must carry
mkdir -p "$work/outside"
(cd "$work/outside" && PATH="$VENV/bin:$PATH" "$PY" - <<'PY'
import importlib.metadata as md
import pathlib
import subprocess
import sys

import recipe
import stalerl
import stalerl_study

site = pathlib.Path(md.distribution("stalerl").locate_file("")).resolve()
for pkg in (recipe, stalerl, stalerl_study):
    where = pathlib.Path(pkg.__file__).resolve()
    assert site in where.parents, f"{pkg.__name__} imports from {where}, not from the installed wheel ({site})"

from recipe.swift.plugin import PLUGIN_FILE
from recipe.verl import config_dir

for path in (config_dir() / "m2po_trainer.yaml", config_dir() / "fipo_trainer.yaml", PLUGIN_FILE):
    assert path.is_file() and site in path.resolve().parents, f"package data missing from the wheel: {path}"

plugins = {e.name: e.value for e in md.entry_points(group="verl.plugins")}
assert plugins.get("stalerl") == "recipe.verl.plugin", plugins
scripts = {e.name: e.value for e in md.entry_points(group="console_scripts") if e.dist.name == "stalerl"}
expected = {"stalerl-plot", "stalerl-report", "stalerl-study", "stalerl-model", "stalerl-verl-config-path"}
assert set(scripts) == expected, scripts
out = subprocess.run(["stalerl-verl-config-path"], capture_output=True, text=True, check=True).stdout.strip()
assert pathlib.Path(out) == config_dir(), (out, config_dir())
for name in sorted(expected - {"stalerl-verl-config-path"}):
    subprocess.run([name, "--help"], capture_output=True, check=True)
# `import verl` alone loads the plugin from the installed entry point and registers the losses
code = ("import verl\nfrom verl.trainer.ppo.core_algos import get_policy_loss_fn\nimport recipe.verl\n"
        "assert all(get_policy_loss_fn(n) is recipe.verl.loss_function(n) for n in recipe.verl.VERL_LOSS_NAMES)\n")
subprocess.run([sys.executable, "-c", code], check=True)
print(f"package data, entry points and console scripts present in {site}")
PY
)

# 4. the tests, from a copy of tests/ and examples/ only
mkdir -p "$work/tree/scripts"
cp -r "$repo/tests" "$repo/examples" "$repo/pyproject.toml" "$work/tree/"
cp "$repo/scripts/junit_check.py" "$work/tree/scripts/"
find "$work/tree" -name __pycache__ -prune -exec rm -rf {} +
cat > "$work/tree/tests/integration/test_installed_wheel.py" <<'PY'
"""Written by scripts/ci_wheel.sh: the tests of this run import stalerl from the installed wheel."""
import importlib.metadata as md
import pathlib

import recipe
import recipe.verl


def test_recipe_imports_from_the_installed_wheel():
    site = pathlib.Path(md.distribution("stalerl").locate_file("")).resolve()
    assert site in pathlib.Path(recipe.__file__).resolve().parents
    assert site in pathlib.Path(recipe.verl.__file__).resolve().parents
PY
cd "$work/tree"
export PATH="$VENV/bin:$PATH"
rc=0
"$PY" -m pytest -q -ra -p no:cacheprovider tests/integration/test_installed_wheel.py \
  tests/integration/test_verl_plugin.py tests/integration/test_verl_fipo.py tests/integration/test_add_a_loss_verl.py \
  tests/integration/test_new_losses_verl.py --junitxml="$VENV/verl-tests.xml" || rc=$?
[ "$rc" -ne 0 ] || "$PY" scripts/junit_check.py "$VENV/verl-tests.xml" "verl plugin (wheel)" || rc=$?
trl_rc=0
ci_marked_tests "TRL (wheel)" trl STALERL_REQUIRE_TRL -W ignore::FutureWarning || trl_rc=$?
[ "$trl_rc" -eq 0 ] || rc=$trl_rc
echo "wheel lane (build, install, package data, verl + TRL tests): $(( $(date +%s) - start ))s (exit $rc)"
exit "$rc"
