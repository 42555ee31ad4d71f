#!/usr/bin/env bash
# The project's test command (README): unit, integration (verl, dist) and end-to-end tests on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter scripts/setup.sh installed into: the active virtual environment, else ./.venv, else python3.
PY=python3
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python3 ]; then PY=.venv/bin/python3; fi
exec "$PY" -m pytest -q -ra --durations=15 tests "$@"
