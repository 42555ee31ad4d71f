"""The sbatch script: ``render_sbatch``, the controller command run inside the job, and ``#SBATCH`` quoting."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from stalerl.config import ConfigError
from stalerl.config.slurm import _CONTROL, _EXTRA_ARG, _check_text, _raise_slurm_problems


# The trainer measures its start-up overhead from this timestamp (= stalerl.training.trainer.LAUNCH_TIME_ENV; not imported
# from there because that module imports torch). sbatch exports the environment, so a run inside the job counts
# from the moment the user launched the command.
LAUNCH_TIME_ENV = "STALERL_LAUNCH_TIME"

_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_.,:/=+@%-]+")


def sbatch_quote(value: str) -> str:
    """``value`` as one argument for sbatch's ``#SBATCH`` line parser.

    That parser splits on unquoted whitespace, treats an unquoted ``#`` as the start of a comment, groups with
    single or double quotes and lets a backslash escape any character (also inside quotes). So: plain values stay as
    they are, everything else goes in double quotes with ``\\`` and ``"`` escaped. Control characters cannot be
    represented (a newline would end the line) and must be rejected before.
    """
    if _CONTROL.search(value):
        raise ValueError(f"cannot put {value!r} on an #SBATCH line: it contains a control character")
    if value and _SBATCH_PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _slurm_filename_dir(path: Path, key: str) -> str:
    """A directory for an sbatch filename pattern: ``%`` doubled (literal), backslash refused.

    sbatch disables every replacement symbol (``%j``, ``%A``...) in a filename that contains a backslash.
    """
    text = _check_text(key, str(path))
    if "\\" in text:
        raise ConfigError(f"invalid {key}: got {text!r}; Slurm log paths cannot contain a backslash (sbatch then "
                          "ignores %j/%A in the file name). Fix: choose a directory without '\\'.", [key])
    return text.replace("%", "%%")


# ------------------------------------------------------------------------------------------------------ rendering
# Helper programs run with the job's Python. No single quotes inside, so shlex.quote keeps them readable.
_FREE_PORTS_PY = (
    "import socket, sys\n"
    "socks = [socket.socket() for _ in range(int(sys.argv[1]))]\n"
    "for s in socks:\n"
    "    s.bind((\"\", 0))\n"
    "print(\" \".join(str(s.getsockname()[1]) for s in socks))\n"
)

_WAIT_NODES_PY = (
    "import sys, time\n"
    "import ray\n"
    "address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])\n"
    "ray.init(address=address, log_to_driver=False, logging_level=\"ERROR\")\n"
    "deadline = time.monotonic() + timeout\n"
    "while True:\n"
    "    alive = sum(1 for n in ray.nodes() if n.get(\"Alive\"))\n"
    "    if alive >= want:\n"
    "        print(f\"[stalerl-slurm] ray cluster: {alive}/{want} nodes up\", flush=True)\n"
    "        break\n"
    "    if time.monotonic() > deadline:\n"
    "        print(f\"[stalerl-slurm] only {alive}/{want} ray nodes joined in {timeout:.0f}s\", file=sys.stderr)\n"
    "        sys.exit(1)\n"
    "    time.sleep(0.5)\n"
    "ray.shutdown()\n"
)
assert "'" not in _FREE_PORTS_PY + _WAIT_NODES_PY


def _python(cfg: Any, python: Optional[str] = None) -> str:
    return python or cfg.scheduler.slurm.python or sys.executable


def _inner_scheduler(cfg: Any, array: bool) -> str:
    return cfg.scheduler.slurm.inner_scheduler or ("local" if array else "ray")


def inner_command(cfg: Any, config_path: Optional[Path], *, inner: Optional[str] = None, array: bool = False,
                  python: Optional[str] = None) -> list[str]:
    """The controller command run inside the allocation (``--config`` omitted for array tasks: per task)."""
    inner = inner or _inner_scheduler(cfg, array)
    argv = [_python(cfg, python), "-m", "stalerl.launch.cli"]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    return argv + [f"scheduler.type={inner}"]


def render_sbatch(cfg: Any, *, inner_argv: list[str], job_name: str, log_dir: Path,
                  array_size: Optional[int] = None, runs_file: Optional[Path] = None,
                  inner_scheduler: Optional[str] = None, python: Optional[str] = None,
                  workdir: Optional[Path] = None) -> str:
    """The sbatch script for ``cfg.scheduler.slurm``.

    ``inner_argv``: the command the job runs (see :func:`inner_command`); with ``inner_scheduler`` ray (default for
    a single job: ``scheduler.slurm.inner_scheduler`` or ray; for arrays: or local) a Ray cluster is started first
    and ``scheduler.ray_address=<head>`` is appended. ``array_size``: make it a job array of that many tasks; task
    ``i`` appends ``--config <line i+1 of runs_file>``. ``log_dir``: stdout+stderr go to ``log_dir/%j.log``
    (arrays: ``%A_%a.log``). ``python`` runs Ray's CLI and helpers (default ``inner_argv[0]``); ``workdir``: the
    job's working directory (default: the current one), so relative paths in the config mean the same as here.

    Raises :class:`~stalerl.config.ConfigError` naming the key for a value that cannot be written safely.
    """
    sc = cfg.scheduler.slurm
    # Checks first; their order decides which error a caller sees first. (runs_file and the #SBATCH values are
    # checked by the steps that write them.)
    _raise_slurm_problems(cfg)
    array = _check_array_args(array_size, runs_file)
    if not inner_argv:
        raise ValueError("inner_argv is empty")
    inner = _checked_inner_scheduler(cfg, inner_scheduler, array)
    job_name = _checked_job_name(job_name)
    argv = [_check_text(f"inner command argument {i} ({a!r})", a) for i, a in enumerate(inner_argv)]
    py = _check_text("scheduler.slurm.python", python or argv[0])
    log_dir = Path(os.path.abspath(log_dir))
    log_pattern = _slurm_filename_dir(log_dir, "log_dir") + ("/%A_%a.log" if array else "/%j.log")
    wd = _check_text("working directory", str(Path(os.path.abspath(workdir or os.getcwd()))))

    lines = ["#!/bin/bash"]
    lines += _sbatch_directives(sc, job_name, log_pattern, array_size)
    lines += _preamble(wd, py, log_dir, argv)
    if array:
        lines += _array_task_config(runs_file)
    if inner == "ray":
        lines += _ray_cluster(sc)
    lines += _run_and_forward_signals()
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- render_sbatch, in steps
def _check_array_args(array_size: Optional[int], runs_file: Optional[Path]) -> bool:
    """Whether this is a job array. An array's size becomes ``--array=0-<n-1>`` and task ``i`` reads line ``i+1`` of
    ``runs_file``, so a size below 1 or a missing runs file would give a job that cannot run: refused here."""
    array = array_size is not None
    if array and (not isinstance(array_size, int) or array_size < 1):
        raise ValueError(f"array_size must be a positive int, got {array_size!r}")
    if array and runs_file is None:
        raise ValueError("an array job needs runs_file (line i+1 = the config of array task i)")
    return array


def _checked_inner_scheduler(cfg: Any, inner_scheduler: Optional[str], array: bool) -> str:
    """The scheduler the controller uses inside the allocation (local or ray). Refused: anything else, and local on
    more than one node, which would leave every node but the first idle."""
    sc = cfg.scheduler.slurm
    inner = inner_scheduler or _inner_scheduler(cfg, array)
    if inner not in ("local", "ray"):
        raise ConfigError(f"invalid scheduler.slurm.inner_scheduler: got {inner!r}; expected local or ray.",
                          ["scheduler.slurm.inner_scheduler"])
    if inner == "local" and sc.nodes > 1:
        raise ConfigError(f"invalid scheduler.slurm.nodes: got {sc.nodes} with inner scheduler local; a run spans "
                          "several nodes only through Ray. Fix: set scheduler.slurm.inner_scheduler=ray (or "
                          "nodes=1).", ["scheduler.slurm.nodes", "scheduler.slurm.inner_scheduler"])
    return inner


def _checked_job_name(job_name: str) -> str:
    """``job_name`` as a single non-blank line: it goes on an ``#SBATCH`` line, where a newline would start a new
    directive and an empty name would make sbatch fall back to the script's file name."""
    job_name = _check_text("job_name", job_name)
    if not job_name.strip():
        raise ConfigError("invalid job_name: got ''; expected a name.", ["job_name"])
    return job_name


def _sbatch_directives(sc: Any, job_name: str, log_pattern: str, array_size: Optional[int]) -> list[str]:
    """The ``#SBATCH`` header: the allocation (one task per node, each with all the node's CPUs and GPUs, because the
    controller or Ray spreads the work itself), the log files, the array, then the user's extra arguments last.
    Every value goes through :func:`sbatch_quote`, as sbatch's own parser reads these lines, not bash."""
    sb = [("job-name", job_name), ("output", log_pattern), ("error", log_pattern), ("nodes", str(sc.nodes)),
          ("ntasks-per-node", "1"), ("cpus-per-task", str(sc.cpus_per_task)), ("mem", sc.mem.strip()),
          ("time", sc.time.strip())]
    if sc.gpus_per_node > 0:
        sb.append(("gres", f"gpu:{sc.gpus_per_node}"))
    if sc.partition:
        sb.append(("partition", sc.partition))
    if sc.account:
        sb.append(("account", sc.account))
    if array_size is not None:
        sb.append(("array", f"0-{array_size - 1}" + (f"%{sc.max_parallel}" if sc.max_parallel else "")))
    lines = [f"#SBATCH --{opt}={sbatch_quote(val)}" for opt, val in sb]
    for arg in sc.extra_sbatch_args:
        name, _, value = _EXTRA_ARG.fullmatch(arg).groups()
        lines.append(f"#SBATCH --{name}" + (f"={sbatch_quote(value)}" if value is not None else ""))
    return lines


def _preamble(wd: str, py: str, log_dir: Path, argv: list[str]) -> list[str]:
    """Strict bash, the working directory, and the job's values as shell-quoted literals in variables (the command in
    the array ``cmd``, which later steps extend): no value is ever eval-ed or word-split. The first log line says
    where the job landed, which is what one looks for first when a job misbehaves."""
    q = shlex.quote
    return [
        "# Generated by stalerl (scheduler.type=slurm). Every value below is a quoted literal; nothing is eval-ed.",
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
        f"cd -- {q(wd)}",
        f"py={q(py)}",
        f"log_dir={q(str(log_dir))}",
        'log() { echo "[stalerl-slurm $(date +%H:%M:%S)] $*"; }',
        'log "job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)} on $(hostname -s):'
        ' nodes=${SLURM_JOB_NODELIST:-?} cpus-per-task=${SLURM_CPUS_PER_TASK:-?}"',
        "cmd=(" + " ".join(q(a) for a in argv) + ")",
    ]


def _array_task_config(runs_file: Path) -> list[str]:
    """Array task ``i`` runs the config on line ``i+1`` of ``runs_file``: one script serves every run of a sweep, so
    the per-run part is looked up at run time. A task without a line fails loudly instead of running the base
    config. The launch clock restarts, since tasks may wait in the queue long after the submission."""
    runs = _check_text("runs_file", str(Path(os.path.abspath(runs_file))))
    return [
        f"runs_file={shlex.quote(runs)}",
        'task=${SLURM_ARRAY_TASK_ID:?not running as a job array task}',
        'run_config=$(sed -n "$((task + 1))p" "$runs_file")',
        'if [ -z "$run_config" ]; then log "no run for array task $task in $runs_file" >&2; exit 2; fi',
        'cmd+=(--config "$run_config")',
        "# start-up overhead of each run counts from its task's start, not from the submission of the array",
        f'export {LAUNCH_TIME_ENV}="$(date +%s.%N)"',
    ]


def _ray_cluster(sc: Any) -> list[str]:
    """A Ray cluster private to this job (inner scheduler ray), its address appended to ``cmd``. Private because a
    shared node may run other jobs' Ray clusters: fresh ports, its own temp dir and auth token, and on exit only this
    job's Ray processes are stopped."""
    timeout = int(max(1, round(sc.ray_start_timeout_s)))
    return [
        "",
        "# ---- Ray cluster over the allocation: head here (the first node), one worker per other node",
        *_ray_teardown(),
        *_ray_auth_token(),
        *_ray_head(sc, timeout),
        *_ray_workers(sc, timeout),
        'cmd+=("scheduler.ray_address=$ray_address")',
    ]


def _ray_teardown() -> list[str]:
    """The exit trap, set before anything starts, so a failure half-way still stops what was started. It stops the
    pids this script started, never ``ray stop``, which would kill other jobs' Ray on the same node."""
    return [
        'ray_pid=""; workers_pid=""; ray_tmp=""',
        "stop_pid() {  # SIGTERM, then SIGKILL after 20 s",
        '  kill -TERM "$1" 2>/dev/null || return 0',
        '  for _ in $(seq 1 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.2; done',
        '  kill -KILL "$1" 2>/dev/null || true',
        '  wait "$1" 2>/dev/null || true',
        "}",
        "cleanup() {  # only the Ray processes of this job (not `ray stop`: it kills every Ray on the node)",
        '  if [ -n "$workers_pid" ]; then stop_pid "$workers_pid"; fi',
        '  if [ -n "$ray_pid" ]; then stop_pid "$ray_pid"; log "ray stopped"; fi',
        '  if [ -n "$ray_tmp" ]; then rm -rf -- "$ray_tmp"; fi',
        "}",
        "trap cleanup EXIT",
    ]


def _ray_auth_token() -> list[str]:
    """A per-job Ray auth token (see the comment it writes): without it, recent Ray may enable auth for the head but
    not for the driver, and the run cannot connect."""
    return [
        "# Token auth: recent Ray turns it on for `ray start --head` when ~/.ray/auth_token exists, but not for a",
        "# driver that connects to it. A fresh per-job token exported to every process of the job (srun passes",
        "# the environment on) makes head, workers and driver agree. Only when RAY_AUTH_MODE is unset; older Ray",
        "# ignores both variables.",
        'if [ -z "${RAY_AUTH_MODE:-}" ]; then',
        "  export RAY_AUTH_MODE=token",
        '  RAY_AUTH_TOKEN=$("$py" -c "import secrets; print(secrets.token_hex(32))")',
        "  export RAY_AUTH_TOKEN",
        "fi",
    ]


def _ray_head(sc: Any, timeout: int) -> list[str]:
    """The Ray head on this (the first) node, in the background, and a wait of at most ``timeout`` seconds for it to
    write its address. A head that dies or hangs ends the job with the tail of its log, rather than leaving the run
    to fail later with a connection error."""
    gpus = f" --num-gpus={sc.gpus_per_node}" if sc.gpus_per_node > 0 else ""
    return [
        'mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname -s)}")',
        'if [ "${#nodes[@]}" -eq 0 ]; then nodes=("$(hostname -s)"); fi',
        'head_node=${nodes[0]}',
        'n_nodes=${#nodes[@]}',
        'head_ip=${STALERL_RAY_HEAD_IP:-}',
        'if [ -z "$head_ip" ]; then head_ip=$(hostname -I 2>/dev/null | awk \'{print $1}\' || true); fi',
        'if [ -z "$head_ip" ]; then head_ip=$(hostname -i | awk \'{print $1}\'); fi',
        f'read -r gcs_port client_port agent_port < <("$py" -c {shlex.quote(_FREE_PORTS_PY)} 3)',
        'ray_tmp=$(mktemp -d /tmp/stalerl-ray-XXXXXX)  # short: Ray socket paths must fit in 107 bytes',
        'ray_log="$log_dir/ray-head-${SLURM_JOB_ID:-0}.log"',
        'log "starting ray head on $head_node ($head_ip:$gcs_port), $n_nodes node(s); ray log: $ray_log"',
        '"$py" -m ray.scripts.scripts start --head --block --node-ip-address="$head_ip" --port="$gcs_port" \\',
        '    --ray-client-server-port="$client_port" --dashboard-agent-listen-port="$agent_port" \\',
        f'    --num-cpus="${{SLURM_CPUS_PER_TASK:-1}}"{gpus} --disable-usage-stats --include-dashboard=false \\',
        '    --temp-dir="$ray_tmp" >"$ray_log" 2>&1 &',
        "ray_pid=$!",
        f"deadline=$((SECONDS + {timeout}))",
        'until [ -s "$ray_tmp/ray_current_cluster" ]; do',
        '  if ! kill -0 "$ray_pid" 2>/dev/null; then',
        '    ray_pid=""; log "ray head failed to start; last lines of $ray_log:" >&2',
        '    tail -n 30 "$ray_log" >&2 || true; exit 1',
        "  fi",
        '  if [ "$SECONDS" -ge "$deadline" ]; then',
        f'    log "ray head not up after {timeout}s; last lines of $ray_log:" >&2',
        '    tail -n 30 "$ray_log" >&2 || true; exit 1',
        "  fi",
        "  sleep 0.2",
        "done",
        'ray_address=$(cat "$ray_tmp/ray_current_cluster")',
        'export RAY_ADDRESS="$ray_address"',
        'log "ray head up at $ray_address"',
    ]


def _ray_workers(sc: Any, timeout: int) -> list[str]:
    """One Ray worker per other node, as a single srun step (``--kill-on-bad-exit``: one lost node fails the step),
    then a wait until every node has joined, so the run never starts on a partial cluster."""
    gpus = f" --num-gpus={sc.gpus_per_node}" if sc.gpus_per_node > 0 else ""
    step_gres = f" --gres=gpu:{sc.gpus_per_node}" if sc.gpus_per_node > 0 else ""
    return [
        'if [ "$n_nodes" -gt 1 ]; then',
        '  workers_log="$log_dir/ray-workers-${SLURM_JOB_ID:-0}.log"',
        '  log "starting ray on $((n_nodes - 1)) more node(s) (log: $workers_log)"',
        '  srun --nodes="$((n_nodes - 1))" --ntasks="$((n_nodes - 1))" --ntasks-per-node=1 \\',
        f'      --cpus-per-task="${{SLURM_CPUS_PER_TASK:-1}}"{step_gres} --exclude="$head_node" \\',
        '      --kill-on-bad-exit=1 \\',
        '      "$py" -m ray.scripts.scripts start --address="$ray_address" --block --disable-usage-stats \\',
        f'      --num-cpus="${{SLURM_CPUS_PER_TASK:-1}}"{gpus} >"$workers_log" 2>&1 &',
        "  workers_pid=$!",
        f'  "$py" -c {shlex.quote(_WAIT_NODES_PY)} "$ray_address" "$n_nodes" {timeout}',
        "fi",
    ]


def _run_and_forward_signals() -> list[str]:
    """The run itself, in the background so the shell can forward scancel's SIGTERM (and SIGINT) to it: the run then
    stops at the end of its step with a final checkpoint rather than being killed. The job exits with the run's
    exit code, so Slurm's job state says whether training succeeded."""
    return [
        "",
        "# ---- the run: the same controller as scheduler.type=local/ray; its exit code is the job's",
        'log "running: $(printf \'%q \' "${cmd[@]}")"',
        "# scancel (and a job's time limit) sends SIGTERM to the job's shell: pass it, and SIGINT, on to the run, which",
        "# stops at the end of its step with a final checkpoint (stalerl.core.interrupt), and wait for it to end.",
        'run_pid=""',
        'forward() { log "got SIG$1: passing it to the run"; if [ -n "$run_pid" ]; then kill -"$1" "$run_pid" 2>/dev/null || true; fi; }',
        "trap 'forward TERM' TERM",
        "trap 'forward INT' INT",
        "set +e",
        '"${cmd[@]}" &',
        "run_pid=$!",
        'while :; do wait "$run_pid"; rc=$?; kill -0 "$run_pid" 2>/dev/null || break; done  # wait returns early on a trap',
        'wait "$run_pid" 2>/dev/null; last=$?; if [ "$last" -ne 127 ]; then rc=$last; fi  # its own status, once known',
        "set -e",
        'log "run finished with exit code $rc"',
        'exit "$rc"',
        "",
    ]
