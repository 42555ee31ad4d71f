#!/usr/bin/env bash
# The project's test command (README): unit, integration (verl, dist) and end-to-end tests on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -ra --durations=15 tests "$@"
