#!/usr/bin/env bash
# The GPU check for a short slot: one command with a total time budget (default 420 s) split over its parts, so it
# always ends inside the budget and says what it skipped or cut and why. Made for a bare CUDA image (Python 3.12,
# torch, transformers; no vLLM, Ray, omegaconf, gguf or accelerate; nothing downloadable): what it needs beyond the
# image comes from .whl/ (scripts/prepare_gpu_wheels.sh, carried with the repository) and ../shared/models (the
# SmolLM2-135M-Instruct GGUF). Parts, in order of what they are worth (docs/gpu.md, "The GPU check"):
#   environment  versions and the GPU; the wheels of .whl/ whose modules the image lacks, into a private folder;
#                the real model's conversion (stalerl-model fetch, GGUF -> HF dir in a temp dir) starts in the
#                background and overlaps the numerics;
#   numerics     scripts/gpu_check_numerics.py: m2po / fipo / vanilla losses and gradients on a fixed batch vs a
#                CPU float64 reference, chunked vs plain log-probs (and vs float64), one optimizer step fsdp:d1 vs
#                torch:d1; every comparison with its tolerance per dtype and pass/fail;
#   real_model   SmolLM2-135M-Instruct trained a few steps at a real batch (smollm2_add_m2po_cpu.yaml's task, 64
#                prompts x 8 samples, on the device) with the HF engine in bf16 and in fp32 (and vLLM when
#                importable): generation / training tokens/s, peak memory, the per-token engine-vs-trainer log-prob
#                mismatch (mismatch/*), the step split; beside the bf16 run the mismatch control
#                (scripts/gpu_check_mismatch.py: one batch re-scored in float32, by one-row micro-batches and through
#                the plain head; its per-token log-probs saved). Not run on CUDA (no GGUF): INCOMPLETE;
#   one_gpu_async  examples/math/one_gpu_async.yaml: async d1+d1 with the rollout and train processes on one device
#                (cluster.share_gpu), 4 steps; staleness within rollout.max_head_offpolicyness at every step, the
#                rollout's weight version advanced, the mismatch logged and within its bound (the real model when
#                real_model converted it, else tiny:qwen2);
#   real_scale   examples/math/gsm8k_m2po.yaml at its shipped batch and lengths (64 x 4 x 512 tokens, bf16, 8,192-token
#                micro-batches, no gradient checkpointing) on a from-scratch model of Qwen2.5-1.5B's shape, staleness 0;
#   long         scripts/gpu_check_long.py: one training step at 4k and 8k tokens per row on the 1.5B shape (chunked
#                log-probs, time and peak memory);
#   bench        scripts/gpu_check_bench.py: chunked vs plain log-prob time and memory at the 1.5B head shape over the
#                config's max_tokens_per_mb (the memory ratio asserted on CUDA); vLLM tokens/s with and without CUDA
#                graphs and weight-sync time (each says why when skipped);
#   m2po_selection  scripts/gpu_check_m2po.py: bench/m2po_selection.py on the device, ours <= 3x the elementwise floor;
#   smoke        scripts/gpu_smoke.sh (85M model, checkpoints, resume, d2 runs with 3 GPUs); optional: it runs only
#                with 200 s left on CUDA (e.g. --budget 600), otherwise it is listed as skipped for the budget.
# Each part gets min(its cap, the time left less the minimum of the parts after it); a part whose slice is below its
# minimum is skipped; a part that runs past its slice is cut (timeout) and reported as cut with what it finished; a
# part killed by a signal before its slice ran out is a failure ("killed (signal N; OOM?)").
# Sizing: a GPU under 100 GiB (an H100's 78 GiB) runs real_scale and long with PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True unless it is set (the caching allocator's reserve reached 139 GiB on an H200 for 55 GiB
# allocated); the report records it.
# Code identity: python scripts/gpu_check_identity.py here before the device call (carry .gpu_check); the report
# compares it with the tree the device ran and the runs' summary.json. The files to commit: $OUT/evidence/
# (scripts/gpu_check_evidence.py: the raw files, paths redacted by the script, with a SHA-256 manifest).
# Everything measured (gpu_check_report.json, every part's JSON and log, the runs' metrics) goes to $OUT when set,
# else to a new temp dir named at the start and the end; models, assets and checkpoints go to a scratch dir that is
# removed at the end (STALERL_CHECK_KEEP_WORK=1 keeps it).
#
#   bash scripts/gpu_check.sh [--budget SECONDS] [--out DIR] [--parts a,b]   # on the GPU machine (.whl/ prepared here)
#   --parts numerics,real_model,one_gpu_async,real_scale,long,bench,m2po_selection,smoke: run only these (the
#   environment always runs; the others are listed as "not selected"), e.g. one part again in a short slot; the
#   verdict is then PARTIAL.
#   STALERL_SMOKE_DEVICE=cpu bash scripts/gpu_check.sh             # CPU dry mode: the same parts at tiny sizes
# Exit code: 0 PASS (every part ran and passed), 1 FAIL (a part or a comparison failed, or a part was killed), 3
# INCOMPLETE (nothing failed, but a part was cut by its slice, a required part was skipped for the budget, or
# real_model did not run on CUDA), 4 PARTIAL (--parts: every selected part passed).
# Env: STALERL_CHECK_BUDGET_S (420), OUT (the report dir), STALERL_SMOKE_DIR (scratch dir), STALERL_CHECK_STEPS (2,
#      real_scale steps), STALERL_CHECK_MODEL_STEPS (4 on CUDA, 2 on CPU), STALERL_CHECK_VLLM=0 (no vLLM parts),
#      STALERL_MODEL_GGUF_DIR (the GGUF's folder; default ../shared/models), STALERL_CACHE (reuse a converted model
#      from $STALERL_CACHE/models), STALERL_REQUIRE_REAL_MODEL=1 (no GGUF is a failure, not a skip),
#      STALERL_CHECK_REPORT (also copy the report there), STALERL_CHECK_WHEELS (.whl), STALERL_CHECK_FORCE_WHEELS=1
#      (install every wheel even where the image has the module), STALERL_CHECK_NO_PIP=1 (unpack instead of pip),
#      STALERL_CHECK_KEEP_WORK=1, STALERL_CHECK_PARTS (= --parts), STALERL_CHECK_IDENTITY (the sent identity;
#      .gpu_check/identity.json), PYTHON (python3); PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF are passed through
#      and recorded in the report's environment.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DEVICE="${STALERL_SMOKE_DEVICE:-cuda}"
BUDGET="${STALERL_CHECK_BUDGET_S:-420}"
OUT_DIR="${OUT:-}"
SELECTED="${STALERL_CHECK_PARTS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET="$2"; shift 2 ;;
    --budget=*) BUDGET="${1#*=}"; shift ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --out=*) OUT_DIR="${1#*=}"; shift ;;
    --parts) SELECTED="$2"; shift 2 ;;
    --parts=*) SELECTED="${1#*=}"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (--budget SECONDS, --out DIR, --parts a,b)" >&2; exit 2 ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_check: the budget must be whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
# the parts after the environment, in the order they run
ORDER=(numerics real_model one_gpu_async real_scale long bench m2po_selection smoke)
for p in ${SELECTED//,/ }; do  # before anything is made: a typo must not spend a GPU slot
  case " ${ORDER[*]} " in *" $p "*) ;; *) echo "gpu_check: --parts: unknown part '$p'; expected a comma-separated \
subset of $(IFS=,; echo "${ORDER[*]}") (the environment always runs)" >&2; exit 2 ;; esac
done
START=$SECONDS
OUT_NOTE=""
if [ -z "$OUT_DIR" ]; then
  OUT_DIR="$(mktemp -d -t stalerl-gpucheck-out-XXXXXX)"
  OUT_NOTE=" (no \$OUT: a new temp dir)"
fi
rm -rf "$OUT_DIR/parts" "$OUT_DIR/logs" "$OUT_DIR/runs" "$OUT_DIR/evidence"  # a reused --out starts clean
mkdir -p "$OUT_DIR/parts" "$OUT_DIR/logs" "$OUT_DIR/runs"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
exec > >(tee "$OUT_DIR/console.log") 2>&1  # the console, as the evidence's console.log (stderr merged)
MADE_WORK=0
if [ -n "${STALERL_SMOKE_DIR:-}" ]; then WORK="$STALERL_SMOKE_DIR"; else WORK="$(mktemp -d -t stalerl-gpucheck-XXXXXX)"; MADE_WORK=1; fi
mkdir -p "$WORK"
WHEELS="${STALERL_CHECK_WHEELS:-$REPO/.whl}"
STEPS="${STALERL_CHECK_STEPS:-2}"
MODEL_STEPS="${STALERL_CHECK_MODEL_STEPS:-$([ "$DEVICE" = cpu ] && echo 2 || echo 4)}"
RESERVE=15  # kept for the report at the end
PARTS="$OUT_DIR/parts.tsv"
: > "$PARTS"
# nothing is downloaded: offline hub lookups fail at once instead of waiting for a network the GPU machine lacks
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"

# Part slices: minimum and cap in seconds, per device; optional parts reserve nothing for themselves. CPU dry mode:
# real_model's cap leaves its emulated-bf16 run room on a loaded runner (175 s of a 279 s share beside a second test
# worker on an idle AVX2 EPYC; CI adds the frameworks lane).
if [ "$DEVICE" = cpu ]; then
  declare -A PMIN=([numerics]=15 [real_model]=40 [one_gpu_async]=30 [real_scale]=20 [long]=15 [bench]=10
                   [m2po_selection]=10 [smoke]=60)
  declare -A PCAP=([numerics]=240 [real_model]=900 [one_gpu_async]=300 [real_scale]=300 [long]=120 [bench]=200
                   [m2po_selection]=120 [smoke]=600)
else
  declare -A PMIN=([numerics]=20 [real_model]=45 [one_gpu_async]=40 [real_scale]=60 [long]=40 [bench]=15
                   [m2po_selection]=10 [smoke]=200)
  declare -A PCAP=([numerics]=90 [real_model]=160 [one_gpu_async]=120 [real_scale]=180 [long]=120 [bench]=60
                   [m2po_selection]=60 [smoke]=300)
fi
declare -A OPTIONAL=([smoke]=1)
selected() { [ -z "$SELECTED" ] || [[ ",$SELECTED," == *",$1,"* ]]; }
NOT_SELECTED="not selected (--parts $SELECTED)"

now() { echo $((SECONDS - START)); }
atleast1() { if [ "$1" -lt 1 ]; then echo 1; else echo "$1"; fi; }  # timeout 0 would mean no limit
left() { echo $((BUDGET - RESERVE - (SECONDS - START))); }
reserved_after() {  # the minimum slices of the non-optional parts after $1
  local seen=0 sum=0 p
  for p in "${ORDER[@]}"; do
    if [ "$seen" = 1 ] && [ -z "${OPTIONAL[$p]:-}" ] && selected "$p"; then sum=$((sum + PMIN[$p])); fi
    [ "$p" = "$1" ] && seen=1
  done
  echo "$sum"
}
SLICE=0
MODEL_DIR=""  # the converted real model, once real_model has it
plan() {  # plan NAME: sets SLICE (0: skipped for the budget, recorded)
  local name="$1" avail
  if ! selected "$name"; then record "$name" skipped 0 0 "$NOT_SELECTED"; SLICE=0; return; fi
  avail=$(( $(left) - $(reserved_after "$name") ))
  [ "$avail" -lt 0 ] && avail=0
  SLICE=$(( avail < PCAP[$name] ? avail : PCAP[$name] ))
  if [ "$SLICE" -lt "${PMIN[$name]}" ]; then
    # "budget:" marks a part the check should have run (the verdict is then INCOMPLETE); an optional part says so
    local tag="budget"
    [ -n "${OPTIONAL[$name]:-}" ] && tag="budget (optional part)"
    record "$name" skipped 0 0 "$tag: ${avail}s left for it after reserving $(reserved_after "$name")s for the later \
parts and ${RESERVE}s for the report (budget ${BUDGET}s); it needs at least ${PMIN[$name]}s; raise \
STALERL_CHECK_BUDGET_S or --budget"
    echo "gpu_check: SKIP $name: not enough of the budget left (${avail}s < ${PMIN[$name]}s)"
    SLICE=0
  fi
}
record() {  # name status seconds limit why  (one line of parts.tsv; the report reads it)
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$(echo "$5" | tr '\t\n' '  ')" >> "$PARTS"
}
S="" WHY=""
classify() {  # classify RC ELAPSED LIMIT: sets S (pass / cut / fail) and WHY (gpu_check_report.py's exit_status:
  # "cut" only when the slice was reached; a signal before that is "killed (signal N; OOM?)", a failure)
  local line
  line="$("$PY" scripts/gpu_check_report.py status "$1" "$2" "$3")" || line="fail	exit code $1"
  S="${line%%	*}"
  WHY="${line#*	}"
}
SMI_PID=""
smi_start() {  # nvidia-smi's memory.used, sampled every 0.5 s while a part runs (when the image has nvidia-smi)
  SMI_PID=""
  if [ "$DEVICE" != cpu ] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT_DIR/parts/$1.smi.csv" 2>/dev/null &
    SMI_PID=$!
  fi
}
smi_stop() { [ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; SMI_PID=""; }
tail_log() { tail -"${2:-15}" "$1" 2>/dev/null | sed 's/^/    /' >&2; }

# The skeleton every part shares. run_unit runs one timed command of a part and records its row; run_part is a whole
# part: the environment's verdict, the budget's slice (plan), then run_unit over the slice. Set PART_ENV (variables
# for the command) and PART_REPORT (RUN_DIR NAME STEPS [ARGS...]: gpu_check_report.py on the run the command makes,
# into parts/NAME.json; a report naming problems fails a part that otherwise passed) before a call; both are cleared.
PART_ENV=() PART_REPORT=()
run_unit() {  # run_unit ROW LIMIT LOG SHOW CUT_WHY -- COMMAND...: sets RC, S and WHY
  local row="$1" limit="$2" log="$3" show="$4" cut_why="$5" start=$SECONDS prc=0 smi
  shift 6
  smi="$(basename "$log" .log)"
  smi_start "$smi"
  env "${PART_ENV[@]}" timeout -k 5 "$(atleast1 "$limit")" "$@" > "$log" 2>&1
  RC=$?
  smi_stop
  [ -n "$show" ] && grep -E "$show" "$log" | head -40 | sed 's/^/  /'
  if [ "$RC" -ne 0 ]; then echo "gpu_check: $row exit code $RC; last lines of $log:" >&2; tail_log "$log" 20; fi
  if [ ${#PART_REPORT[@]} -gt 0 ]; then
    "$PY" scripts/gpu_check_report.py "${PART_REPORT[0]}" --out "$OUT_DIR/parts/${PART_REPORT[1]}.json" \
      --steps "${PART_REPORT[2]}" --exit-code "$RC" --device "$DEVICE" --log "$log" \
      --nvidia-smi "$OUT_DIR/parts/$smi.smi.csv" "${PART_REPORT[@]:3}" | sed 's/^/  /'
    prc=${PIPESTATUS[0]}
  fi
  PART_ENV=() PART_REPORT=()
  # the verdict (gpu_check_report.py's exit_status): cut only when the slice was reached, a kill before it fails
  classify "$RC" $((SECONDS - start)) "$limit"
  [ "$S" = pass ] && [ "$prc" -ne 0 ] && S=fail WHY="the run's report names its problems"
  [ "$S" = cut ] && [ -n "$cut_why" ] && WHY="${cut_why//\{limit\}/$limit}"
  record "$row" "$S" $((SECONDS - start)) "$limit" "$WHY"
}
run_part() {  # run_part NAME WHAT SHOW CUT_WHY -- COMMAND...: the part NAME, its log logs/NAME.log
  local name="$1" what="$2" show="$3" cut_why="$4"
  shift 5
  if [ "$ENV_OK" != 1 ]; then record "$name" skipped 0 0 "the environment failed"; SLICE=0; else plan "$name"; fi
  if [ "$SLICE" -le 0 ]; then PART_ENV=() PART_REPORT=(); return 0; fi
  echo "gpu_check: $what (log $OUT_DIR/logs/$name.log, limit ${SLICE}s)"
  run_unit "$name" "$SLICE" "$OUT_DIR/logs/$name.log" "$show" "$cut_why" -- "$@"
}

# First line: whether the carried wheels are here (.whl/ is git-ignored, so a copy of the tracked files lacks it)
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "gpu_check: wheels: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')in $WHEELS"
else
  echo "gpu_check: wheels: $WHEELS is MISSING (git-ignored): run bash scripts/prepare_gpu_wheels.sh where pip reaches" \
       "PyPI and carry .whl/ with the repository (needed when the image lacks omegaconf, gguf or accelerate)"
fi
echo "gpu_check: device $DEVICE, budget ${BUDGET}s; report, logs and runs in $OUT_DIR$OUT_NOTE; scratch $WORK"

# ------------------------------------------------------------------------------------------ environment
PART_START=$SECONDS
ENV_LIMIT=$(( $(left) < 120 ? $(left) : 120 ))
ENV_OK=1
if [ "$ENV_LIMIT" -lt 5 ]; then
  ENV_OK=0
  record environment skipped 0 0 "budget: ${ENV_LIMIT}s left (budget ${BUDGET}s)"
else
  # The wheels whose modules the image lacks (all of them with STALERL_CHECK_FORCE_WHEELS=1), installed with pip
  # --target, or unpacked where there is no pip (STALERL_CHECK_NO_PIP=1): a wheel's install is its unpacking.
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    timeout -k 5 "$ENV_LIMIT" "$PY" - "$WORK/pydeps" "${STALERL_CHECK_FORCE_WHEELS:-0}" "${STALERL_CHECK_NO_PIP:-0}" \
        "$OUT_DIR/parts/wheels.json" "$WHEELS"/*.whl <<'PYEOF'
import importlib.util, json, os, subprocess, sys, sysconfig, zipfile
target, force, no_pip, out, wheels = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4], sys.argv[5:]


def top_levels(whl):
    names = set()
    for n in zipfile.ZipFile(whl).namelist():
        head = n.split("/", 1)[0]
        if head.endswith((".dist-info", ".data")):
            continue
        names.add(head[:-3] if head.endswith(".py") else head.split(".", 1)[0])
    return sorted(names)


def compatible(whl):  # what an unpacking may install: pure Python, or built for this interpreter
    tags = whl[:-4].split("-")[-3:]
    if tags[1] == "none" and tags[2] == "any":
        return True
    try:
        from packaging.tags import sys_tags
    except ImportError:
        return False
    mine = {str(t) for t in sys_tags()}
    return any(f"{py}-{abi}-{plat}" in mine for py in tags[0].split(".") for abi in tags[1].split(".")
               for plat in tags[2].split("."))


chosen, present = [], []
for whl in wheels:
    mods = [m for m in top_levels(whl) if not m.startswith("_")] or top_levels(whl)
    if not force and mods and all(importlib.util.find_spec(m) is not None for m in mods):
        present.append(os.path.basename(whl))
    else:
        chosen.append(whl)
how = "none needed"
if chosen:
    has_pip = not no_pip and subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip:
        res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                              target, *chosen], capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"gpu_check: pip install --target {target} failed: {res.stderr[-800:]}")
        how = "installed"
    else:
        for whl in chosen:
            if not compatible(whl):
                sys.exit(f"gpu_check: {os.path.basename(whl)} is not built for this interpreter; unpacking it is not "
                         "an install")
            zipfile.ZipFile(whl).extractall(target)
        how = "unpacked (no pip)"
names = " ".join(os.path.basename(w) for w in chosen)
print(f"gpu_check: {how} {names + ' ' if names else ''}into {target}"
      + (f"; the image has {', '.join(present)}" if present else ""))
json.dump({"how": how, "installed": [os.path.basename(w) for w in chosen], "image_has": present, "target": target},
          open(out, "w"), indent=2)
PYEOF
    [ $? -eq 0 ] || ENV_OK=0
  fi
  export PYTHONPATH="$WORK/pydeps:$PYTHONPATH"
  if [ "$ENV_OK" = 1 ]; then
    timeout -k 5 "$(atleast1 $(( $(left) < 60 ? $(left) : 60 )))" "$PY" - "$DEVICE" "$OUT_DIR/parts/environment.json" <<'PYEOF'
import importlib.util, json, os, platform, sys
missing = [m for m in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "yaml", "tqdm", "omegaconf")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python modules {missing} (omegaconf: scripts/prepare_gpu_wheels.sh; the others "
             "come with transformers)")
import omegaconf, torch, transformers
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       # torch reads PYTORCH_ALLOC_CONF first, then PYTORCH_CUDA_ALLOC_CONF
       "pytorch_alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF"),
       "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
       "transformers": transformers.__version__, "omegaconf": omegaconf.__version__,
       "model_converter": {m: importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate")},
       "vllm": importlib.util.find_spec("vllm") is not None, "gpus": []}
print(f"gpu_check: Python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), transformers "
      f"{env['transformers']}, omegaconf {env['omegaconf']} ({omegaconf.__file__})")
if sys.argv[1] != "cpu":
    if not torch.cuda.is_available():
        json.dump(env, open(sys.argv[2], "w"), indent=2)
        sys.exit("gpu_check: no CUDA device visible; for the CPU dry mode set STALERL_SMOKE_DEVICE=cpu")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        env["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
        print(f"gpu_check: GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
json.dump(env, open(sys.argv[2], "w"), indent=2)
PYEOF
    [ $? -eq 0 ] || ENV_OK=0
  fi
  if [ "$ENV_OK" = 1 ]; then
    # the code identity: the sent tree (scripts/gpu_check_identity.py, run before the call) against this copy
    "$PY" scripts/gpu_check_identity.py --verify "${STALERL_CHECK_IDENTITY:-$REPO/.gpu_check/identity.json}" \
      --out "$OUT_DIR/parts/identity.json" || echo "gpu_check: identity: could not be checked (see above)"
    record environment pass $((SECONDS - PART_START)) "$ENV_LIMIT" ""
  else
    record environment fail $((SECONDS - PART_START)) "$ENV_LIMIT" "the environment is not usable (see the lines above)"
  fi
fi

# Sizing by the GPU's memory: under 100 GiB (an H100's 78 GiB) the 1.5B parts run with expandable segments unless
# an allocator setting was given (the caching allocator reserved the H200's 139 GiB for 55 GiB allocated without it)
SIZING_ENV=()
GPU_GIB="$("$PY" -c 'import json, sys; g = (json.load(open(sys.argv[1])).get("gpus") or [{}])[0]
print(int(g.get("memory_gib", 0)))' "$OUT_DIR/parts/environment.json" 2>/dev/null || echo 0)"
if [ "$DEVICE" != cpu ] && [ "${GPU_GIB:-0}" -gt 0 ] && [ "$GPU_GIB" -lt 100 ] \
   && [ -z "${PYTORCH_CUDA_ALLOC_CONF:-}${PYTORCH_ALLOC_CONF:-}" ]; then
  SIZING_ENV=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
fi
printf '{"gpu_memory_gib": %s, "tier": "%s", "real_scale_and_long_env": "%s"}\n' "${GPU_GIB:-0}" \
  "$([ "$DEVICE" = cpu ] && echo cpu || { [ "${GPU_GIB:-0}" -lt 100 ] && echo "under 100 GiB (H100-class)" || echo "100 GiB or more (H200-class)"; })" \
  "${SIZING_ENV[*]:-}" > "$OUT_DIR/parts/sizing.json"
[ ${#SIZING_ENV[@]} -gt 0 ] && echo "gpu_check: sizing: a ${GPU_GIB} GiB GPU: real_scale and long run with ${SIZING_ENV[*]}"

# The real model's conversion, in the background from here (CPU work; the numerics use the device meanwhile)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_DIR="${STALERL_MODEL_GGUF_DIR:-$REPO/../shared/models}"
MODEL_CACHE="${STALERL_CACHE:+$STALERL_CACHE/models}"
MODEL_CACHE="${MODEL_CACHE:-$WORK/models}"
FETCH_PID=""
FETCH_SKIP=""
if [ "$ENV_OK" != 1 ]; then
  FETCH_SKIP="the environment failed"
elif ! selected real_model; then
  FETCH_SKIP="$NOT_SELECTED"
elif [ ! -f "$GGUF_DIR/$GGUF_NAME" ] && [ -z "$("$PY" -c 'import sys
from stalerl.core.model_store import cached_model_dir
print(cached_model_dir("smollm2-135m-instruct", cache_dir=sys.argv[1]) or "")' "$MODEL_CACHE" 2>/dev/null)" ]; then
  FETCH_SKIP="no $GGUF_NAME in $GGUF_DIR and no converted model in $MODEL_CACHE (carry ../shared/models, set \
STALERL_MODEL_GGUF_DIR, or STALERL_CACHE to where stalerl-model fetch put it)"
else
  FETCH_LIMIT=$(( $(left) - PMIN[real_scale] - PMIN[bench] ))
  GGUF_ARGS=()  # none: the converted model in the cache is taken as it is
  [ -f "$GGUF_DIR/$GGUF_NAME" ] && GGUF_ARGS=(--gguf "$GGUF_DIR/$GGUF_NAME")
  if [ "$FETCH_LIMIT" -gt 10 ]; then
    echo "gpu_check: converting $GGUF_NAME into $MODEL_CACHE in the background, or taking it from there ($(date -u +%H:%M:%S))"
    timeout -k 5 "$FETCH_LIMIT" "$PY" -m stalerl.launch.model_cli fetch smollm2-135m-instruct \
      "${GGUF_ARGS[@]}" --cache-dir "$MODEL_CACHE" > "$OUT_DIR/logs/model_fetch.log" 2>&1 &
    FETCH_PID=$!
  else
    FETCH_SKIP="budget: ${FETCH_LIMIT}s left for the conversion"
  fi
fi

# ------------------------------------------------------------------------------------------ numerics
run_part numerics "numerics (losses vs CPU float64, chunked vs plain log-probs, fsdp:d1 vs torch:d1)" \
  '^(gpu_check numerics|  FAIL)' "" -- \
  "$PY" scripts/gpu_check_numerics.py --device "$DEVICE" --out "$OUT_DIR/parts/numerics.json"

# ------------------------------------------------------------------------------------------ real model
# SmolLM2-135M-Instruct on smollm2_add_m2po_cpu.yaml's task (chat template, "What is a + b?"), at a real batch on the
# device; one run per engine dtype (and vLLM when importable). Staleness 0: every batch is trained at once.
BF16_CPU_OVERRIDES=()
if [ "$DEVICE" = cpu ]; then
  MODEL_OVERRIDES=(actor.device=cpu torch_threads=1 train_dataset.batch_size=2 gconfig.n_samples=4
                   gconfig.max_new_tokens=12 eval_gconfig.max_new_tokens=12 valid_dataset.batch_size=4
                   evaluator.n_prompts=4 cluster.n_gpus_per_node=0)
  # A CPU without AMX-BF16 / AVX512-BF16 emulates bf16 matmuls (about 10x float32's step on an AVX2 EPYC: 124 s vs 12 s):
  # there the bf16 run trains half the rows (2 samples a prompt) and gets 3 of the shares below instead of 2, so its
  # two steps fit the slice; the same code path, fewer tokens.
  BF16_NATIVE="$("$PY" -c 'from stalerl.core.hardware import BF16_CPU_FLAGS, cpu_flags
print(next((f for f in BF16_CPU_FLAGS if f in cpu_flags()), ""))' 2>/dev/null)"
  if [ -z "$BF16_NATIVE" ]; then
    BF16_CPU_OVERRIDES=(gconfig.n_samples=2)
    echo "gpu_check: this CPU has no bf16 units (bf16 matmuls emulated): the real model's bf16 run trains" \
      "2 samples a prompt (float32's: 4)"
  fi
else
  MODEL_OVERRIDES=(actor.device=cuda torch_threads=8 train_dataset.batch_size=64 gconfig.n_samples=8
                   evaluator.n_prompts=128 cluster.n_gpus_per_node=1)
fi
VARIANTS=(bfloat16 control float32)  # control: the mismatch control beside the bf16 run (gpu_check_mismatch.py)
VLLM_WHY="$("$PY" - "$DEVICE" <<'PYEOF' 2>/dev/null
import importlib.util, os, sys
if os.environ.get("STALERL_CHECK_VLLM", "1") == "0":
    print("STALERL_CHECK_VLLM=0")
elif sys.argv[1] == "cpu":
    print("CPU dry mode: the vLLM engine's mismatch is measured on CUDA only")
elif importlib.util.find_spec("vllm") is None:
    import torch
    print(f"vLLM is not importable here: this image has torch {torch.__version__} and no vLLM; vLLM 0.32-0.34 pin "
          "torch 2.13 / 2.14 (several GB of wheels) and the device has no package registry, so it cannot be "
          "installed here; the GPU vLLM path is tested on CPU only (docs/gpu.md, 'vLLM on the GPU')")
PYEOF
)"
if ! selected real_model; then :
elif [ -z "$VLLM_WHY" ]; then VARIANTS+=(vllm); else record real_model/vllm skipped 0 0 "$VLLM_WHY"; fi
if [ "$ENV_OK" != 1 ]; then
  record real_model skipped 0 0 "the environment failed"
elif [ -n "$FETCH_SKIP" ]; then  # also "not selected (--parts ...)", which plan records itself
  plan real_model  # the budget first: a part with no time for it is skipped for the budget, GGUF or not
  if [ "$SLICE" -gt 0 ]; then
    if [ "${STALERL_REQUIRE_REAL_MODEL:-0}" = 1 ] && [ "${FETCH_SKIP#no }" != "$FETCH_SKIP" ]; then
      record real_model fail 0 0 "STALERL_REQUIRE_REAL_MODEL=1 but $FETCH_SKIP"
    else  # on CUDA the report makes this INCOMPLETE: the real model's figures are what a GPU slot is for
      record real_model skipped 0 0 "$FETCH_SKIP"
    fi
  fi
else
  plan real_model
  if [ "$SLICE" -gt 0 ]; then
    PART_START=$SECONDS
    PART_END=$((SECONDS + SLICE))
    MODEL_DIR=""
    while kill -0 "$FETCH_PID" 2>/dev/null && [ $SECONDS -lt $PART_END ]; do sleep 1; done
    if kill -0 "$FETCH_PID" 2>/dev/null; then
      kill -- "$FETCH_PID" 2>/dev/null
      record real_model cut $((SECONDS - PART_START)) "$SLICE" \
        "the model conversion did not finish within the part's ${SLICE}s slice (log $OUT_DIR/logs/model_fetch.log)"
    else
      wait "$FETCH_PID"
      FRC=$?
      MODEL_DIR="$(tail -1 "$OUT_DIR/logs/model_fetch.log")"
      if [ "$FRC" -ne 0 ] || [ ! -f "$MODEL_DIR/config.json" ]; then
        echo "gpu_check: converting the real model failed (exit $FRC); last lines of $OUT_DIR/logs/model_fetch.log:" >&2
        tail_log "$OUT_DIR/logs/model_fetch.log"
        if [ "$FRC" -eq 124 ]; then  # its own limit, the time left for it when it started, ran out
          record real_model cut $((SECONDS - PART_START)) 0 "the model conversion ran out of the time it was given"
        else
          record real_model fail $((SECONDS - PART_START)) "$SLICE" \
            "converting the GGUF failed (exit $FRC): $(tail -1 "$OUT_DIR/logs/model_fetch.log")"
        fi
        MODEL_DIR=""
      else
        echo "gpu_check: real model at $MODEL_DIR (ready after $(now)s)"
      fi
    fi
    if [ -n "$MODEL_DIR" ]; then
      WORST=pass
      declare -A VWEIGHT=([bfloat16]=2 [float32]=2 [vllm]=2 [control]=1)  # shares of what is left of the slice
      [ ${#BF16_CPU_OVERRIDES[@]} -gt 0 ] && VWEIGHT[bfloat16]=3  # emulated bf16 (see MODEL_OVERRIDES)
      for i in "${!VARIANTS[@]}"; do
        V=${VARIANTS[$i]}
        WSUM=0
        for W in "${VARIANTS[@]:$i}"; do WSUM=$((WSUM + VWEIGHT[$W])); done
        RUN_LIMIT=$(( (PART_END - SECONDS) * VWEIGHT[$V] / WSUM ))
        if [ "$RUN_LIMIT" -lt 10 ]; then
          record "real_model/$V" skipped 0 0 "budget: ${RUN_LIMIT}s left of the part's slice"
          continue
        fi
        if [ "$V" = control ]; then  # the same batch scored as the probe does, and re-scored three ways
          LOGF="$OUT_DIR/logs/mismatch_control.log"
          echo "gpu_check: mismatch control beside the bf16 run (log $LOGF, limit ${RUN_LIMIT}s)"
          run_unit real_model/mismatch_control "$RUN_LIMIT" "$LOGF" '^(mismatch control|  (ok|FAIL|control|WARNING))' \
            "" -- "$PY" scripts/gpu_check_mismatch.py --config examples/math/smollm2_add_m2po_cpu.yaml \
            --out "$OUT_DIR/parts/mismatch_control.json" --tokens "$OUT_DIR/parts/mismatch_tokens_bfloat16.json" \
            actor.path="$MODEL_DIR" actor.dtype=bfloat16 "${MODEL_OVERRIDES[@]}"
        else
          EXTRA=(actor.dtype="$V" rollout.backend=hf:d1)  # the config's auto:d1 would take vLLM where importable
          [ "$V" = bfloat16 ] && EXTRA+=("${BF16_CPU_OVERRIDES[@]}")
          [ "$V" = vllm ] && EXTRA=(actor.dtype=bfloat16 rollout.backend=vllm:d1)
          LOGF="$OUT_DIR/logs/real_model_$V.log"
          echo "gpu_check: real model, $V engine: $MODEL_STEPS steps (log $LOGF, limit ${RUN_LIMIT}s)"
          PART_REPORT=("$OUT_DIR/runs/smollm2-add-m2po-cpu/real-model-$V" "real_model_$V" "$MODEL_STEPS"
                       --kind real_model --variant "$V")
          run_unit "real_model/$V" "$RUN_LIMIT" "$LOGF" "" "its {limit}s share of the part's slice ran out" -- \
            "$PY" examples/math/gsm8k_rl.py --config examples/math/smollm2_add_m2po_cpu.yaml \
            trial_name="real-model-$V" actor.path="$MODEL_DIR" cluster.fileroot="$OUT_DIR/runs" \
            total_train_steps="$MODEL_STEPS" rollout.fixed_staleness=0 evaluator.freq_steps="$MODEL_STEPS" \
            recover.mode=disabled saver.save_final=false stats_logger.mismatch_freq_steps=1 \
            stats_logger.mismatch_max_rows=null stats_logger.tensorboard=false stats_logger.progress_bar=false \
            "${MODEL_OVERRIDES[@]}" "${EXTRA[@]}"
        fi
        [ "$S" = fail ] && WORST=fail
        [ "$S" = cut ] && [ "$WORST" = pass ] && WORST=cut
      done
      if [ "$WORST" = cut ]; then  # a run's share ran out (its row says so): no slice of the part's own to check
        record real_model cut $((SECONDS - PART_START)) 0 "a run was cut by its share of the part's ${SLICE}s slice"
      else
        record real_model "$WORST" $((SECONDS - PART_START)) "$SLICE" ""
      fi
    fi
  fi
fi

# ------------------------------------------------------------------------------------------ one GPU, async
# examples/math/one_gpu_async.yaml: d1+d1 with the rollout and train processes sharing the device
# (cluster.share_gpu), 4 steps; its report checks every step's staleness against rollout.max_head_offpolicyness,
# that the rollout's weight version advanced (the trainer's weights reached it) and the mismatch figures. The real
# model when real_model converted it, else the tiny one. CPU dry mode: float32, and real_model's tiny sizes (the
# shipped 8 prompts x 8 samples take minutes a step on 2 shared cores); the plan, fit check and sync path are the same.
ASYNC_MODEL="${MODEL_DIR:-tiny:qwen2}"
ASYNC_OVERRIDES=()
[ "$DEVICE" = cpu ] && ASYNC_OVERRIDES=(actor.device=cpu actor.dtype=float32 torch_threads=1 train_dataset.batch_size=2
                                        gconfig.n_samples=4 gconfig.max_new_tokens=8 eval_gconfig.max_new_tokens=8
                                        valid_dataset.batch_size=4 evaluator.n_prompts=4)
PART_REPORT=("$OUT_DIR/runs/one-gpu-async/one-gpu-async" one_gpu_async 4 --kind one_gpu_async)
run_part one_gpu_async "one GPU, async d1+d1 (cluster.share_gpu; $ASYNC_MODEL): 4 steps" "" "" -- \
  "$PY" examples/math/gsm8k_rl.py --config examples/math/one_gpu_async.yaml trial_name=one-gpu-async \
  actor.path="$ASYNC_MODEL" cluster.fileroot="$OUT_DIR/runs" total_train_steps=4 recover.mode=disabled \
  saver.save_final=false stats_logger.tensorboard=false stats_logger.progress_bar=false "${ASYNC_OVERRIDES[@]}"

# ------------------------------------------------------------------------------------------ real scale
# Overrides of the shipped config, and why:
#   rollout.fixed_staleness=0       shipped 8: filling the FIFO would generate 9 batches of 64 x 4 x 512 tokens before
#                                   the first step; 0 generates one per step (the step's cost is the same)
#   actor.adv_norm=null actor.reward_bias=-0.5   a random model never answers right, so group-normalised
#                                   advantages would all be 0 and nothing would be trained (as in gpu_smoke.sh)
#   evaluator.freq_steps=null recover.mode=disabled saver.save_final=false   no evaluation or checkpoints (the smoke
#                                   part covers them; here they would write ~25 GB of fp32 weights + AdamW)
if [ "$DEVICE" = cpu ]; then
  ASSETS=(--size cpu)
  SIZE_OVERRIDES=(actor.device=cpu torch_threads=1 train_dataset.batch_size=4 gconfig.max_new_tokens=8
                  eval_gconfig.max_new_tokens=8 actor.mb_spec.max_tokens_per_mb=512 cluster.n_gpus_per_node=0)
else
  ASSETS=(--size qwen2.5-1.5b --device cuda --save-dtype bfloat16)
  SIZE_OVERRIDES=()
fi
PART_ENV=("${SIZING_ENV[@]}")
PART_REPORT=("$OUT_DIR/runs/gsm8k-m2po/real-scale" real_scale "$STEPS")
# the assets, then the run, under the part's one slice (n: how many of the arguments are smoke_assets.py's)
run_part real_scale "real scale: building the assets in $WORK/real, then gsm8k_m2po.yaml for $STEPS steps" "" \
  "its {limit}s slice ran out (the report lists the steps it finished)" -- \
  bash -c 'n=$1; shift; "$0" scripts/smoke_assets.py "${@:1:n}" && exec "$0" examples/math/gsm8k_rl.py "${@:n+1}"' \
  "$PY" $((1 + ${#ASSETS[@]})) "$WORK/real" "${ASSETS[@]}" \
  --config examples/math/gsm8k_m2po.yaml trial_name=real-scale \
  actor.path="$WORK/real/model" train_dataset.path="$WORK/real/data" valid_dataset.path="$WORK/real/data" \
  cluster.fileroot="$OUT_DIR/runs" total_train_steps="$STEPS" rollout.fixed_staleness=0 actor.adv_norm=null \
  actor.reward_bias=-0.5 evaluator.freq_steps=null recover.mode=disabled saver.save_final=false \
  stats_logger.tensorboard=false stats_logger.progress_bar=false stats_logger.log_every=1 "${SIZE_OVERRIDES[@]}"

# ------------------------------------------------------------------------------------------ long rows
PART_ENV=("${SIZING_ENV[@]}")
run_part long "long rows (one step at 4k and 8k tokens per row, 1.5B shape; CPU: 256 and 512)" \
  '^(gpu_check long|  [0-9]+ x )' "" -- \
  "$PY" scripts/gpu_check_long.py --device "$DEVICE" --out "$OUT_DIR/parts/long.json"

# ------------------------------------------------------------------------------------------ bench
# without the real-scale model (part skipped or cut) its vLLM parts say so; the log-prob part runs
run_part bench "measurements (log-prob time, vLLM with / without CUDA graphs, weight sync)" "" "" -- \
  "$PY" scripts/gpu_check_bench.py --device "$DEVICE" --model "$WORK/real/model" --out "$OUT_DIR/parts/bench.json"

# ------------------------------------------------------------------------------------------ m2po selection
run_part m2po_selection "M2PO selection vs the elementwise floor (bench/m2po_selection.py)" \
  '^(gpu_check m2po|  (ok|FAIL))' "" -- \
  "$PY" scripts/gpu_check_m2po.py --device "$DEVICE" --out "$OUT_DIR/parts/m2po_selection.json"

# ------------------------------------------------------------------------------------------ smoke
PART_ENV=(STALERL_SMOKE_DIR="$WORK/smoke" STALERL_SMOKE_STEPS="${STALERL_SMOKE_STEPS:-2}")
run_part smoke "smoke runs (scripts/gpu_smoke.sh)" '^smoke: (PASS|FAIL|SKIP)' "" -- bash scripts/gpu_smoke.sh

# ------------------------------------------------------------------------------------------ report
if [ -n "$FETCH_PID" ] && kill -0 "$FETCH_PID" 2>/dev/null; then kill -- "$FETCH_PID" 2>/dev/null; fi
echo
timeout -k 2 "$((RESERVE - 5))" "$PY" scripts/gpu_check_report.py assemble "$OUT_DIR" --device "$DEVICE" \
  --budget "$BUDGET" --elapsed "$(now)" --selected "$SELECTED"
RC=$?
if [ "$RC" -ne 0 ] && [ "$RC" -ne 1 ] && [ "$RC" -ne 3 ] && [ "$RC" -ne 4 ]; then
  echo "gpu_check: FAIL writing the report (exit $RC); the parts' files are in $OUT_DIR" >&2
  RC=1
fi
if [ -n "${STALERL_CHECK_REPORT:-}" ] && [ -f "$OUT_DIR/gpu_check_report.json" ]; then
  cp "$OUT_DIR/gpu_check_report.json" "$STALERL_CHECK_REPORT"
fi
if [ "$MADE_WORK" = 1 ] && [ "${STALERL_CHECK_KEEP_WORK:-0}" != 1 ]; then rm -rf "$WORK"; fi
echo "gpu_check: $(now)s of ${BUDGET}s; report $OUT_DIR/gpu_check_report.json"
# the files to commit, raw and path-redacted by the script (console.log up to the line above)
sleep 0.2
EV_LIMIT=$(( BUDGET - $(now) )); [ "$EV_LIMIT" -gt 10 ] && EV_LIMIT=10; [ "$EV_LIMIT" -lt 2 ] && EV_LIMIT=2
timeout -k 1 "$EV_LIMIT" "$PY" scripts/gpu_check_evidence.py "$OUT_DIR" --repo "$REPO" --work "$WORK" \
  --also "wheels=$WHEELS" --also "gguf=$GGUF_DIR" --also "models=$MODEL_CACHE" \
  || echo "gpu_check: writing $OUT_DIR/evidence failed (the report and the raw files are in $OUT_DIR)" >&2
exit "$RC"
