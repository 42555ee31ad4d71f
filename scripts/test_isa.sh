#!/usr/bin/env bash
# The numerics claims that depend on the CPU's kernels, under every ATEN_CPU_CAPABILITY this CPU supports
# (scripts/cpu_capabilities.py: default, avx2, avx512 where /proc/cpuinfo has the flags), after the main suite ran
# them under the CPU's own choice: bf16 fsdp:d2 = torch:d2 = torch:d1 per update and on-policy log-ratios
# (tests/unit/test_fsdp.py), the zero on-policy log-ratio with dropout off, the bf16 chunked log-prob bound.
# The list comes from the CPU's flags, not from torch: ATen reports a requested capability as in use (here
# ATEN_CPU_CAPABILITY=avx512 reads back AVX512 on an AVX2-only EPYC), so asking it proves nothing.
# About 1 min per capability on 2 cores. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TESTS=(
  "tests/unit/test_fsdp.py::test_bf16_fsdp_d2_torch_d2_and_torch_d1_compute_the_same"
  "tests/unit/test_training_path.py::test_dropout_off_gives_zero_on_policy_log_ratio"
  "tests/unit/test_chunked_logprob.py::test_bf16_autocast_matches_the_plain_computation_within_the_stated_bound"
)
status=0
for cap in $(python3 scripts/cpu_capabilities.py); do
  start=$(date +%s)
  set +e
  ATEN_CPU_CAPABILITY=$cap python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
  rc=$?
  set -e
  echo "[isa] ATEN_CPU_CAPABILITY=${cap}: exit ${rc} after $(( $(date +%s) - start ))s"
  [ "$rc" -eq 0 ] || status=1
done
exit "$status"
