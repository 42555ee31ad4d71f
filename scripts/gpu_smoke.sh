#!/usr/bin/env bash
# GPU smoke test of the real-scale config (examples/math/gsm8k_m2po.yaml): a few steps end to end on a from-scratch
# Qwen2 with the real vocabulary (151,936) and a locally built tokenizer (scripts/smoke_assets.py; nothing is
# downloaded), GSM8K-format data written locally. Runs:
#   1. the config as shipped (torch:d1, bf16, 64 prompts x 4 samples x 512 new tokens, fixed staleness 8), 1 GPU;
#   2. torch:d2 and 3. fsdp:d2 in the asynchronous runtime (2 train ranks + 1 rollout worker, one GPU each, so
#      they need 3 visible GPUs; skipped, and said so, with fewer).
# Each run passes when it exits 0, logs every step with a finite loss and grad norm, wrote a checkpoint and the
# final model. The summary at the end says what passed, failed or was skipped; the exit code is 1 if any failed.
#
#   bash scripts/gpu_smoke.sh                          # on a GPU machine
#   STALERL_SMOKE_DEVICE=cpu bash scripts/gpu_smoke.sh # CPU dry mode: tiny sizes, same code paths, d2 runs on CPU
# Env: STALERL_SMOKE_STEPS (default 3), STALERL_SMOKE_DIR (default: a new temp dir), PYTHON (default python3).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DEVICE="${STALERL_SMOKE_DEVICE:-cuda}"
STEPS="${STALERL_SMOKE_STEPS:-3}"
WORK="${STALERL_SMOKE_DIR:-$(mktemp -d -t stalerl-smoke-XXXXXX)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
cd "$REPO"

declare -a SUMMARY=()
FAILED=0
note() { SUMMARY+=("$1"); echo "smoke: $1"; }

if [ "$DEVICE" = "cpu" ]; then
  SIZE=cpu
  NGPU=0
  # Tiny sizes: the script and every code path it drives, in minutes on 2 cores.
  SIZE_OVERRIDES=(actor.device=cpu actor.dtype=bfloat16 torch_threads=1 train_dataset.batch_size=4
                  gconfig.max_new_tokens=8 eval_gconfig.max_new_tokens=8 valid_dataset.batch_size=8
                  evaluator.n_prompts=8 actor.mb_spec.max_tokens_per_mb=512 rollout.fixed_staleness=2
                  cluster.n_gpus_per_node=0)
else
  SIZE=gpu
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$NGPU" -lt 1 ]; then
    echo "smoke: FAIL no CUDA device visible (torch.cuda.device_count() = $NGPU); for the CPU dry mode set" \
         "STALERL_SMOKE_DEVICE=cpu" >&2
    exit 1
  fi
  SIZE_OVERRIDES=(evaluator.n_prompts=64 cluster.n_gpus_per_node="$NGPU")
fi

echo "smoke: device=$DEVICE GPUs=$NGPU steps=$STEPS work dir $WORK"
"$PY" scripts/smoke_assets.py "$WORK/assets" --size "$SIZE" || { echo "smoke: FAIL building the assets" >&2; exit 1; }
MODEL="$WORK/assets/model"
DATA="$WORK/assets/data"

# A from-scratch model never answers correctly, so GRPO advantages (group-normalised) would all be 0 and no step
# would train. Raw rewards shifted by -0.5 as advantages give every token a gradient: the step does the full work.
COMMON=(--config examples/math/gsm8k_m2po.yaml actor.adv_norm=null actor.reward_bias=-0.5 actor.path="$MODEL" train_dataset.path="$DATA"
        valid_dataset.path="$DATA" cluster.fileroot="$WORK/runs" total_train_steps="$STEPS"
        evaluator.freq_steps="$STEPS" recover.mode=auto recover.freq_steps=2 stats_logger.progress_bar=false
        stats_logger.log_every=1 "${SIZE_OVERRIDES[@]}")

check_run() {  # run dir, steps: every step logged with finite loss/grad norm, a checkpoint, the final model
  "$PY" - "$1" "$2" <<'PYEOF'
import json, math, sys
from pathlib import Path
run, steps = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
got = [r["step"] for r in rows if r["step"] > 0]
assert got == list(range(1, steps + 1)), f"logged steps {got}, expected 1..{steps}"
for r in rows[1:]:
    for k in ("actor/loss", "actor/grad_norm"):
        assert math.isfinite(r[k]), f"step {r['step']}: {k} = {r[k]}"
    assert r["actor/grad_norm"] > 0, f"step {r['step']}: zero gradient, nothing was trained"
assert (run / "checkpoints" / "latest").is_file(), "no committed checkpoint"
assert (run / "final_model" / "config.json").is_file(), "no final model"
last = rows[-1]
print(f"steps 1..{steps}, last loss {last['actor/loss']:.4g}, grad norm {last['actor/grad_norm']:.4g}, "
      f"reward {last.get('reward', float('nan')):.3g}, step time {last.get('timing/step_s', float('nan')):.1f}s")
PYEOF
}

run_case() {  # name, minimum GPUs, overrides...
  local name="$1" need="$2"; shift 2
  if [ "$DEVICE" != "cpu" ] && [ "$NGPU" -lt "$need" ]; then
    note "SKIP $name: needs $need GPUs (one per train rank and rollout worker), $NGPU visible"
    return
  fi
  local log="$WORK/$name.log" start=$SECONDS
  echo "smoke: running $name (log $log)"
  if "$PY" examples/math/gsm8k_rl.py "${COMMON[@]}" trial_name="$name" "$@" >"$log" 2>&1; then
    local detail
    if detail=$(check_run "$WORK/runs/gsm8k-m2po/$name" "$STEPS" 2>&1); then
      note "PASS $name in $((SECONDS - start))s: $detail"
      return
    fi
    note "FAIL $name: ran but its outputs are wrong: $(echo "$detail" | tail -1)"
  else
    note "FAIL $name (exit code $?): last lines of $log:"
    tail -15 "$log" | sed 's/^/    /'
  fi
  FAILED=1
}

# The async runtime for d2: a data-parallel train backend runs only there (fixed staleness -> max_head_offpolicyness).
ASYNC=(rollout.fixed_staleness=0 rollout.max_head_offpolicyness=2)
run_case single-gpu-torch-d1 1
run_case async-torch-d2 3 actor.backend=torch:d2 "${ASYNC[@]}"
run_case async-fsdp-d2 3 actor.backend=fsdp:d2 "${ASYNC[@]}"

echo
echo "==================== stalerl GPU smoke summary (device=$DEVICE, $NGPU GPUs, $STEPS steps) ===================="
for line in "${SUMMARY[@]}"; do echo "  $line"; done
[ "$DEVICE" = "cpu" ] && echo "  (CPU dry mode: tiny sizes; this checks the script and code paths, not GPU behaviour)"
exit $FAILED
