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
# OpenMP threads waiting at a barrier sleep instead of spinning (a wait policy: no change to any result). Two test
# workers, their runs' own processes and CI's second lane put more compute threads than cores on the machine, and with
# libgomp's default spin-wait a waiting thread burns the core its sibling needs: one SmolLM2 run (2 threads, the other
# core busy) took 234 s with the default, 36 s with PASSIVE, 34 s at torch_threads=1, the same metrics in all three.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
XDIST=()
if [ "$WORKERS" -gt 1 ]; then
  if "$PY" -c 'import xdist' 2>/dev/null; then
    XDIST=(-n "$WORKERS" --dist loadgroup)
  else
    echo "scripts/test.sh: pytest-xdist is not installed (it comes with the test extra: pip install -e '.[test]'); running in one process" >&2
  fi
fi
exec "$PY" -m pytest -q -ra --durations=15 "${XDIST[@]}" tests "$@"
