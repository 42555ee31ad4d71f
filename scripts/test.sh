#!/usr/bin/env bash
# The project's test command (README): unit, integration (verl, dist) and end-to-end tests on CPU.
# Two pytest-xdist workers where there are two CPUs or more (--dist loadgroup: the Slurm and Ray tests share one
# worker, tests/conftest.py); STALERL_TEST_WORKERS=N sets the number, 0 runs in one process (for --pdb, say).
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter scripts/setup.sh installed into: the active virtual environment, else ./.venv, else python3.
PY=python3
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python3 ]; then PY=.venv/bin/python3; fi
WORKERS="${STALERL_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}"
case "$WORKERS" in
  ''|*[!0-9]*) echo "STALERL_TEST_WORKERS=$WORKERS: expected a whole number of workers (0: one process); e.g. STALERL_TEST_WORKERS=2" >&2; exit 2 ;;
esac
XDIST=()
if [ "$WORKERS" -gt 1 ]; then
  # With several workers (and CI's second lane) there are more compute threads than cores: OpenMP threads waiting at a
  # barrier sleep instead of spinning on a core a sibling needs (a wait policy: no result changes). One SmolLM2 run, 2
  # threads, the other core busy: 234 s with libgomp's default, 36 s PASSIVE, 34 s at torch_threads=1, same metrics.
  # Not for one process on an idle machine, where sleeping costs wake-ups (tiny sync run: 27-31 s default, 36 s).
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
  if "$PY" -c 'import xdist' 2>/dev/null; then
    XDIST=(-n "$WORKERS" --dist loadgroup)
  else
    echo "scripts/test.sh: pytest-xdist is not installed (it comes with the test extra: pip install -e '.[test]'); running in one process" >&2
  fi
fi
exec "$PY" -m pytest -q -ra --durations=15 "${XDIST[@]}" tests "$@"
