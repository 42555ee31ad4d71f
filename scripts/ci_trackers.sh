#!/usr/bin/env bash
# The experiment trackers' CI step (stats_logger.wandb / stats_logger.mlflow, docs/tracking.md): its own virtual
# environment with the real wandb and MLflow at the versions of constraints/trackers.txt (MLflow requires pyarrow<26,
# which the main environment's pins cannot share), this project installed with its wandb and mlflow extras and torch
# pinned, then the trackers-marked tests with STALERL_REQUIRE_TRACKERS=1: a missing wandb or mlflow (or a missing
# `mlflow server`) is a failure, never a skip. Exits non-zero unless tests ran and none failed or was skipped.
#
#   bash scripts/ci_trackers.sh [VENV]          # default VENV: .venv-ci-trackers
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci_lib.sh
start=$(date +%s)

ci_venv "${1:-.venv-ci-trackers}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ci_torch_pin "$work/pin.txt"
"$PY" -m pip install -q -e ".[wandb,mlflow]" pytest -c "$work/pin.txt" -c constraints/trackers.txt
"$PY" -m pip check
echo "trackers environment ready in ${VENV} after $(( $(date +%s) - start ))s"

rc=0
OMP_NUM_THREADS=1 ci_marked_tests trackers trackers STALERL_REQUIRE_TRACKERS --durations=10 || rc=$?
echo "scripts/ci_trackers.sh: exit ${rc} after $(( $(date +%s) - start ))s"
exit "$rc"
