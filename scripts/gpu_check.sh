#!/usr/bin/env bash
# The GPU check for a short slot: one command, under 8 minutes on one H200-class GPU, on a bare CUDA image (Python
# 3.12, torch, transformers; no vLLM, Ray or omegaconf; nothing downloadable; the repository plus .whl/ carried).
#   1. environment: versions and the GPU; omegaconf + antlr4 installed from .whl/ (scripts/prepare_gpu_wheels.sh)
#      into a private folder when the image lacks them;
#   2. real scale: examples/math/gsm8k_m2po.yaml at its shipped batch and lengths (64 prompts x 4 samples, 512 new
#      tokens, prompts up to 1024 tokens, bf16 compute on fp32 master weights, AdamW, gradient checkpointing,
#      16k-token micro-batches, M2PO) on a from-scratch model with Qwen2.5-1.5B's architecture and vocabulary (random
#      weights built there, scripts/smoke_assets.py) for STALERL_CHECK_STEPS steps; reports peak GPU memory, each
#      step's time split into generation / log-probs / training, and generated tokens per second;
#   3. measurements (scripts/gpu_check_bench.py, merged into the report): chunked vs plain training log-probs at
#      the 1.5B head shape; vLLM's generation tokens/s with and without CUDA graphs and its weight-sync path and
#      time per sync (colocated ipc; nccl to a second GPU); each vLLM part says why when skipped (no vLLM);
#   4. the smaller smoke runs: scripts/gpu_smoke.sh (85M model; d2 runs only with 3 GPUs).
# Overrides of the shipped config in step 2, and why:
#   rollout.fixed_staleness=1       shipped 8: filling the FIFO would generate 9 batches before the first step
#                                   (minutes); 1 keeps the FIFO path and gives step 2 a batch one version stale
#   actor.adv_norm=null actor.reward_bias=-0.5   a random model never answers right, so group-normalised
#                                   advantages would all be 0 and nothing would be trained (as in gpu_smoke.sh)
#   evaluator.freq_steps=null recover.mode=disabled saver.save_final=false   evaluation and checkpoints are covered
#                                   by step 3; here they would write ~25 GB (fp32 weights + AdamW) and cost minutes
#
#   bash scripts/gpu_check.sh                             # on the GPU machine (prepare .whl/ first, here)
#   STALERL_SMOKE_DEVICE=cpu bash scripts/gpu_check.sh    # CPU dry mode: tiny sizes, same script and code paths
# Env: STALERL_CHECK_STEPS (2), STALERL_SMOKE_STEPS (2 here),
#      STALERL_CHECK_TIMEOUT_S (300 s for the real-scale run; 3600 in CPU dry mode),
#      STALERL_CHECK_BENCH_TIMEOUT_S (300 s for the measurements; 900 in CPU dry mode), STALERL_CHECK_VLLM=0 (skip
#      the vLLM measurements),
#      STALERL_SMOKE_DIR (work dir; default a new temp dir), STALERL_CHECK_REPORT (also copy the JSON report there),
#      STALERL_CHECK_WHEELS (.whl), STALERL_CHECK_FORCE_WHEELS=1 (install the wheels even if omegaconf imports),
#      PYTHON (python3).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DEVICE="${STALERL_SMOKE_DEVICE:-cuda}"
STEPS="${STALERL_CHECK_STEPS:-2}"
WORK="${STALERL_SMOKE_DIR:-$(mktemp -d -t stalerl-gpucheck-XXXXXX)}"
WHEELS="${STALERL_CHECK_WHEELS:-$REPO/.whl}"
# The limit keeps a GPU slot's budget for step 3; the CPU dry mode has no such budget (a loaded CI runner is slow).
LIMIT="${STALERL_CHECK_TIMEOUT_S:-$([ "$DEVICE" = cpu ] && echo 3600 || echo 300)}"
# The measurements' limit: without vLLM in the image they take well under a minute; with it, two engine starts
BENCH_LIMIT="${STALERL_CHECK_BENCH_TIMEOUT_S:-$([ "$DEVICE" = cpu ] && echo 900 || echo 300)}"
export STALERL_SMOKE_DIR="$WORK" STALERL_SMOKE_STEPS="${STALERL_SMOKE_STEPS:-2}" TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$WORK"
cd "$REPO"
START=$SECONDS
fail() { echo "gpu_check: FAIL $*" >&2; exit 1; }
# First line: whether the carried wheels are here (.whl/ is git-ignored, so a copy of the tracked files lacks it)
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "gpu_check: wheels: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')in $WHEELS"
else
  echo "gpu_check: wheels: $WHEELS is MISSING (git-ignored): run bash scripts/prepare_gpu_wheels.sh where pip reaches" \
       "PyPI and carry .whl/ with the repository (needed when the image lacks omegaconf)"
fi

# ---------------------------------------------------------------------------------------------- 1. environment
if [ "${STALERL_CHECK_FORCE_WHEELS:-0}" = 1 ] || ! "$PY" -c "import omegaconf" 2>/dev/null; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 \
    || fail "omegaconf is not importable and $WHEELS holds no wheels: run bash scripts/prepare_gpu_wheels.sh" \
            "where pip reaches PyPI, and carry .whl/ along"
  # The wheels are pure Python (py3-none-any): without pip (or with STALERL_CHECK_NO_PIP=1) they are unpacked,
  # which is all such an install does.
  if [ "${STALERL_CHECK_NO_PIP:-0}" != 1 ] && "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/pydeps" "$WHEELS"/*.whl \
      || fail "installing $WHEELS/*.whl into $WORK/pydeps"
    HOW=installed
  else
    "$PY" - "$WORK/pydeps" "$WHEELS"/*.whl <<'PYEOF' || fail "unpacking $WHEELS/*.whl into $WORK/pydeps"
import sys, zipfile
for whl in sys.argv[2:]:
    if not whl.endswith(("-py3-none-any.whl", "-py2.py3-none-any.whl")):
        sys.exit(f"gpu_check: {whl} is not a pure-Python wheel; unpacking it is not an install")
    zipfile.ZipFile(whl).extractall(sys.argv[1])
PYEOF
    HOW="unpacked (no pip)"
  fi
  export PYTHONPATH="$WORK/pydeps:$PYTHONPATH"
  echo "gpu_check: $HOW $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')into $WORK/pydeps"
fi
"$PY" - "$DEVICE" <<'PYEOF' || fail "environment (above)"
import importlib, platform, sys
missing = [m for m in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "yaml", "tqdm", "omegaconf")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python modules {missing} (omegaconf: scripts/prepare_gpu_wheels.sh; the others "
             "come with transformers)")
import omegaconf, torch, transformers
print(f"gpu_check: Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, omegaconf {omegaconf.__version__} ({omegaconf.__file__})")
if sys.argv[1] != "cpu":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; for the CPU dry mode set STALERL_SMOKE_DEVICE=cpu")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu_check: GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
PYEOF

# ---------------------------------------------------------------------------------------------- 2. real scale
if [ "$DEVICE" = "cpu" ]; then
  ASSETS=(--size cpu)
  SIZE_OVERRIDES=(actor.device=cpu torch_threads=1 train_dataset.batch_size=4 gconfig.max_new_tokens=8
                  eval_gconfig.max_new_tokens=8 actor.mb_spec.max_tokens_per_mb=512 cluster.n_gpus_per_node=0)
else
  ASSETS=(--size qwen2.5-1.5b --device cuda --save-dtype bfloat16)
  SIZE_OVERRIDES=()
fi
echo "gpu_check: building the real-scale assets in $WORK/real ($(date -u +%H:%M:%S))"
"$PY" scripts/smoke_assets.py "$WORK/real" "${ASSETS[@]}" || fail "building the assets"
RUN="$WORK/runs/gsm8k-m2po/real-scale"
LOG="$WORK/real-scale.log"
# nvidia-smi's view (CUDA context and allocator cache included), sampled while the run lasts, when the image has it
SMI_PID=""
if [ "$DEVICE" != "cpu" ] && command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$WORK/nvidia-smi.csv" 2>/dev/null &
  SMI_PID=$!
fi
echo "gpu_check: running gsm8k_m2po.yaml for $STEPS steps (log $LOG, limit ${LIMIT}s)"
timeout "$LIMIT" "$PY" examples/math/gsm8k_rl.py --config examples/math/gsm8k_m2po.yaml trial_name=real-scale \
  actor.path="$WORK/real/model" train_dataset.path="$WORK/real/data" valid_dataset.path="$WORK/real/data" \
  cluster.fileroot="$WORK/runs" total_train_steps="$STEPS" rollout.fixed_staleness=1 actor.adv_norm=null \
  actor.reward_bias=-0.5 evaluator.freq_steps=null recover.mode=disabled saver.save_final=false \
  stats_logger.tensorboard=false stats_logger.progress_bar=false stats_logger.log_every=1 \
  "${SIZE_OVERRIDES[@]}" >"$LOG" 2>&1
RC=$?
[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null
REAL_OK=1
if [ "$RC" -ne 0 ]; then
  REAL_OK=0
  [ "$RC" -eq 124 ] && echo "gpu_check: the real-scale run passed its ${LIMIT}s limit" >&2
  echo "gpu_check: real-scale run exit code $RC; last lines of $LOG:" >&2
  tail -20 "$LOG" | sed 's/^/    /' >&2
fi
# ---------------------------------------------------------------------------------------------- 3. measurements
# chunked vs plain log-probs at the 1.5B head shape; vLLM tokens/s with and without CUDA graphs and its weight-sync
# path and time per sync (colocated; nccl with 2 GPUs); the vLLM parts say why when skipped (no vLLM in the image)
echo "gpu_check: measurements (log-probs, vLLM with / without CUDA graphs, weight sync; limit ${BENCH_LIMIT}s)"
rm -f "$WORK/gpu_check_bench.json"
timeout "$BENCH_LIMIT" "$PY" scripts/gpu_check_bench.py --device "$DEVICE" --model "$WORK/real/model" \
  --out "$WORK/gpu_check_bench.json" >"$WORK/bench.log" 2>&1 \
  || { echo "gpu_check: measurements failed (exit $?); last lines of $WORK/bench.log:" >&2
       tail -15 "$WORK/bench.log" | sed 's/^/    /' >&2; }
"$PY" scripts/gpu_check_report.py "$RUN" --steps "$STEPS" --exit-code "$RC" --device "$DEVICE" \
  --nvidia-smi "$WORK/nvidia-smi.csv" --log "$LOG" --bench "$WORK/gpu_check_bench.json" \
  --out "$WORK/gpu_check_report.json" || REAL_OK=0
if [ -n "${STALERL_CHECK_REPORT:-}" ] && [ -f "$WORK/gpu_check_report.json" ]; then
  cp "$WORK/gpu_check_report.json" "$STALERL_CHECK_REPORT"
fi
echo "gpu_check: real-scale part done after $((SECONDS - START))s"

# ---------------------------------------------------------------------------------------------- 4. smoke runs
bash scripts/gpu_smoke.sh
SMOKE_RC=$?
echo
verdict() { [ "$1" = "$2" ] && echo PASS || echo FAIL; }
echo "gpu_check: real scale $(verdict $REAL_OK 1), smoke runs $(verdict $SMOKE_RC 0);" \
     "$((SECONDS - START))s in all (report $WORK/gpu_check_report.json)"
[ $REAL_OK = 1 ] && [ $SMOKE_RC = 0 ]
