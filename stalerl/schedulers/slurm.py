"""``scheduler.type=slurm``: submit a run (or a sweep, as one job array) with ``sbatch`` and follow it.

    python3 examples/math/gsm8k_rl.py --config exp.yaml scheduler.type=slurm scheduler.slurm.partition=gpu \\
        scheduler.slurm.nodes=2 scheduler.slurm.gpus_per_node=8 [--dry-run]

What happens (:func:`launch_slurm`):

1. The resolved config is written to ``<run_dir>/slurm/config.yaml`` and an sbatch script to
   ``<run_dir>/slurm/job.sbatch`` (both atomically). ``--dry-run`` (or ``scheduler.slurm.dry_run=true``) prints the
   script and stops there.
2. ``sbatch --parsable`` submits it; the job id and the log path (``<run_dir>/slurm/logs/<jobid>.log``, stdout and
   stderr together) are printed. With ``scheduler.slurm.wait=false`` that is all.
3. Inside the allocation the script starts a Ray head on the first node (``ray start --head --block`` on free ports,
   a private ``--temp-dir``), joins the other nodes with ``srun ... ray start --address=... --block``, waits until
   every node is in the cluster, and runs the same controller as a local run:
   ``python -m stalerl.cli --config <run_dir>/slurm/config.yaml scheduler.type=ray scheduler.ray_address=<head>``.
   Its exit code is the job's. On exit only the Ray processes this job started are stopped (SIGTERM to its own
   ``ray start --block`` processes, which shut their node down); ``ray stop`` is *not* used because it kills every
   Ray process of the user on the node, including other jobs' clusters.
   With ``scheduler.slurm.inner_scheduler=local`` no Ray is started and the run uses local worker processes on the
   first node (one node only).
4. While waiting the job log is streamed, state changes are printed, and at the end the seconds from submission to
   the first training step (and the trainer's own ``timing/startup_overhead_s``, which excludes warm start and
   evaluation) are reported. A job that ends in any state but COMPLETED with exit code 0 is reported with its state,
   exit code and the last ``scheduler.slurm.log_tail_lines`` lines of its log, and the return code is non-zero.

Sweeps (:func:`run_sweep_slurm`): ``key=a,b,c`` overrides (expanded by :mod:`stalerl.sweep`) become one job array
``--array=0-(n-1)[%max_parallel]``; task ``i`` reads its resolved config path from line ``i+1`` of the runs file and
runs it. Inside array tasks the inner scheduler defaults to ``local``: each task is a self-contained run on its own
allocation, with no Ray cluster to start (seconds per task) and nothing shared between tasks; set
``scheduler.slurm.inner_scheduler=ray`` for runs that need several nodes per task.

Quoting: every user-provided value that reaches the script is either validated against a strict pattern
(partition, account, time, mem, the names of extra sbatch options) or quoted: ``shlex.quote`` in the bash body, and
for ``#SBATCH`` lines the quoting sbatch's own line parser understands (double quotes, backslash escapes).
Values with a newline, NUL or other control character are rejected with an error naming the key. No value is ever
``eval``-ed; per-task data is read from files into quoted variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from stalerl.config import ConfigError

__all__ = [
    "JobInfo",
    "SlurmError",
    "TERMINAL_STATES",
    "inner_command",
    "job_log_path",
    "job_state",
    "job_states",
    "launch",
    "launch_slurm",
    "render_sbatch",
    "run_sweep",
    "run_sweep_slurm",
    "sbatch_quote",
    "slurm_config_problems",
    "submit",
    "wait_for_job",
    "wait_for_jobs",
]

# The trainer measures its start-up overhead from this timestamp (= stalerl.trainer.LAUNCH_TIME_ENV; not imported
# from there because that module imports torch). sbatch exports the environment, so a run inside the job counts
# from the moment the user launched the command.
LAUNCH_TIME_ENV = "STALERL_LAUNCH_TIME"

TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "REVOKED", "SPECIAL_EXIT", "UNKNOWN",
})

# Options this scheduler sets itself; in extra_sbatch_args they would contradict the script or its bookkeeping.
_MANAGED_OPTIONS = {
    "job-name": "the job name is derived from experiment_name and trial_name",
    "output": "the log goes to <run_dir>/slurm/logs/",
    "error": "the log goes to <run_dir>/slurm/logs/",
    "array": "job arrays are made for sweeps (key=a,b,c overrides)",
    "nodes": "use scheduler.slurm.nodes",
    "ntasks": "one task per node is part of the script",
    "ntasks-per-node": "one task per node is part of the script",
    "cpus-per-task": "use scheduler.slurm.cpus_per_task",
    "mem": "use scheduler.slurm.mem",
    "time": "use scheduler.slurm.time",
    "gres": "use scheduler.slurm.gpus_per_node",
    "gpus": "use scheduler.slurm.gpus_per_node",
    "gpus-per-node": "use scheduler.slurm.gpus_per_node",
    "partition": "use scheduler.slurm.partition",
    "account": "use scheduler.slurm.account",
    "parsable": "the submission already uses it",
    "wrap": "the script is the job",
    "wait": "the submission polls the job itself (scheduler.slurm.wait)",
}

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAME_LIST = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_EXTRA_ARG = re.compile(r"--([A-Za-z][A-Za-z0-9-]*)(=(.*))?", re.DOTALL)
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+|UNLIMITED|INFINITE")
_MEM = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_.,:/=+@%-]+")


class SlurmError(RuntimeError):
    """sbatch/scontrol failed, or a job could not be followed; the message has the command's stderr."""


# ---------------------------------------------------------------------------------------------------- validation
def _control_problem(value: str) -> Optional[str]:
    m = _CONTROL.search(value)
    if not m:
        return None
    ch = m.group()
    what = {"\n": "a newline", "\r": "a carriage return", "\x00": "a NUL byte", "\t": "a tab"}.get(
        ch, f"the control character {ch!r}")
    return f"got {value!r}, which contains {what}; values written into the sbatch script must be a single line"


def _check_text(key: str, value: Any) -> str:
    """``value`` as str, or ConfigError naming ``key`` when it contains a newline, NUL or other control char."""
    value = str(value)
    problem = _control_problem(value)
    if problem:
        raise ConfigError(f"invalid {key}: {problem}. Fix: remove it.", [key])
    return value


def slurm_config_problems(sc: Any) -> list[tuple[str, str]]:
    """Problems of a :class:`~stalerl.config.SlurmConfig` as (key relative to the section, message) pairs."""
    out: list[tuple[str, str]] = []

    def control(key: str, value: Optional[str]) -> bool:
        problem = _control_problem(value) if isinstance(value, str) else None
        if problem:
            out.append((key, f"{problem}. Fix: remove it."))
        return bool(problem)

    for key in ("time", "mem"):
        control(key, getattr(sc, key))
    if sc.partition is not None and not control("partition", sc.partition) and not _NAME_LIST.fullmatch(sc.partition):
        out.append(("partition", f"got {sc.partition!r}; a partition name (or comma-separated list) has only "
                                 "letters, digits and _ . + -. Fix: set scheduler.slurm.partition=<name> or null."))
    if sc.account is not None and not control("account", sc.account) and not _NAME.fullmatch(sc.account):
        out.append(("account", f"got {sc.account!r}; an account name has only letters, digits and _ . + -. "
                               "Fix: set scheduler.slurm.account=<name> or null."))
    if sc.python is not None and not control("python", sc.python) and not sc.python.strip():
        out.append(("python", "got ''; expected a Python executable or null (= the submitting Python)."))
    for i, arg in enumerate(sc.extra_sbatch_args or []):
        key = f"extra_sbatch_args[{i}]"
        if control(key, arg):
            continue
        m = _EXTRA_ARG.fullmatch(arg)
        if not m:
            out.append((key, f"got {arg!r}; expected a long option '--name' or '--name=value' (e.g. --qos=high). "
                             "Short options and separate values are not accepted: write --qos=high, not -q high."))
            continue
        name = m.group(1).lower()
        if name in _MANAGED_OPTIONS:
            out.append((key, f"got {arg!r}: --{name} is set by the slurm scheduler itself ({_MANAGED_OPTIONS[name]})."
                             " Fix: remove it from scheduler.slurm.extra_sbatch_args."))
    return out


def _raise_slurm_problems(cfg: Any) -> None:
    problems = slurm_config_problems(cfg.scheduler.slurm)
    sc = cfg.scheduler.slurm
    if not any(k == "time" for k, _ in problems) and not _TIME.fullmatch(sc.time.strip()):
        problems.append(("time", f"got {sc.time!r}; expected a Slurm time limit such as 01:00:00."))
    if not any(k == "mem" for k, _ in problems) and not _MEM.fullmatch(sc.mem.strip()):
        problems.append(("mem", f"got {sc.mem!r}; expected a Slurm memory size such as 16G."))
    if problems:
        keys = [f"scheduler.slurm.{k}" for k, _ in problems]
        lines = [f"invalid scheduler.slurm.{k}: {msg}" for k, msg in problems]
        raise ConfigError("\n".join(lines), keys)


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
    argv = [_python(cfg, python), "-m", "stalerl.cli"]
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
    _raise_slurm_problems(cfg)
    array = array_size is not None
    if array and (not isinstance(array_size, int) or array_size < 1):
        raise ValueError(f"array_size must be a positive int, got {array_size!r}")
    if array and runs_file is None:
        raise ValueError("an array job needs runs_file (line i+1 = the config of array task i)")
    if not inner_argv:
        raise ValueError("inner_argv is empty")
    inner = inner_scheduler or _inner_scheduler(cfg, array)
    if inner not in ("local", "ray"):
        raise ConfigError(f"invalid scheduler.slurm.inner_scheduler: got {inner!r}; expected local or ray.",
                          ["scheduler.slurm.inner_scheduler"])
    if inner == "local" and sc.nodes > 1:
        raise ConfigError(f"invalid scheduler.slurm.nodes: got {sc.nodes} with inner scheduler local; a run spans "
                          "several nodes only through Ray. Fix: set scheduler.slurm.inner_scheduler=ray (or "
                          "nodes=1).", ["scheduler.slurm.nodes", "scheduler.slurm.inner_scheduler"])
    job_name = _check_text("job_name", job_name)
    if not job_name.strip():
        raise ConfigError("invalid job_name: got ''; expected a name.", ["job_name"])
    argv = [_check_text(f"inner command argument {i} ({a!r})", a) for i, a in enumerate(inner_argv)]
    py = _check_text("scheduler.slurm.python", python or argv[0])
    log_dir = Path(os.path.abspath(log_dir))
    log_pattern = _slurm_filename_dir(log_dir, "log_dir") + ("/%A_%a.log" if array else "/%j.log")
    workdir = Path(os.path.abspath(workdir or os.getcwd()))
    wd = _check_text("working directory", str(workdir))
    q = shlex.quote

    sb = [("job-name", job_name), ("output", log_pattern), ("error", log_pattern), ("nodes", str(sc.nodes)),
          ("ntasks-per-node", "1"), ("cpus-per-task", str(sc.cpus_per_task)), ("mem", sc.mem.strip()),
          ("time", sc.time.strip())]
    if sc.gpus_per_node > 0:
        sb.append(("gres", f"gpu:{sc.gpus_per_node}"))
    if sc.partition:
        sb.append(("partition", sc.partition))
    if sc.account:
        sb.append(("account", sc.account))
    if array:
        sb.append(("array", f"0-{array_size - 1}" + (f"%{sc.max_parallel}" if sc.max_parallel else "")))
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH --{opt}={sbatch_quote(val)}" for opt, val in sb]
    for arg in sc.extra_sbatch_args:
        name, _, value = _EXTRA_ARG.fullmatch(arg).groups()
        lines.append(f"#SBATCH --{name}" + (f"={sbatch_quote(value)}" if value is not None else ""))
    lines += [
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
    if array:
        lines += [
            f"runs_file={q(_check_text('runs_file', str(Path(os.path.abspath(runs_file)))))}",
            'task=${SLURM_ARRAY_TASK_ID:?not running as a job array task}',
            'run_config=$(sed -n "$((task + 1))p" "$runs_file")',
            'if [ -z "$run_config" ]; then log "no run for array task $task in $runs_file" >&2; exit 2; fi',
            'cmd+=(--config "$run_config")',
            "# start-up overhead of each run counts from its task's start, not from the submission of the array",
            f'export {LAUNCH_TIME_ENV}="$(date +%s.%N)"',
        ]
    if inner == "ray":
        gpus = f" --num-gpus={sc.gpus_per_node}" if sc.gpus_per_node > 0 else ""
        step_gres = f" --gres=gpu:{sc.gpus_per_node}" if sc.gpus_per_node > 0 else ""
        timeout = int(max(1, round(sc.ray_start_timeout_s)))
        lines += [
            "",
            "# ---- Ray cluster over the allocation: head here (the first node), one worker per other node",
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
            "# Token auth: recent Ray turns it on for `ray start --head` when ~/.ray/auth_token exists, but not for a",
            "# driver that connects to it. A fresh per-job token exported to every process of the job (srun passes",
            "# the environment on) makes head, workers and driver agree. Only when RAY_AUTH_MODE is unset; older Ray",
            "# ignores both variables.",
            'if [ -z "${RAY_AUTH_MODE:-}" ]; then',
            "  export RAY_AUTH_MODE=token",
            '  RAY_AUTH_TOKEN=$("$py" -c "import secrets; print(secrets.token_hex(32))")',
            "  export RAY_AUTH_TOKEN",
            "fi",
            'mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname -s)}")',
            'if [ "${#nodes[@]}" -eq 0 ]; then nodes=("$(hostname -s)"); fi',
            'head_node=${nodes[0]}',
            'n_nodes=${#nodes[@]}',
            'head_ip=${STALERL_RAY_HEAD_IP:-}',
            'if [ -z "$head_ip" ]; then head_ip=$(hostname -I 2>/dev/null | awk \'{print $1}\' || true); fi',
            'if [ -z "$head_ip" ]; then head_ip=$(hostname -i | awk \'{print $1}\'); fi',
            f'read -r gcs_port client_port agent_port < <("$py" -c {q(_FREE_PORTS_PY)} 3)',
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
            'if [ "$n_nodes" -gt 1 ]; then',
            '  workers_log="$log_dir/ray-workers-${SLURM_JOB_ID:-0}.log"',
            '  log "starting ray on $((n_nodes - 1)) more node(s) (log: $workers_log)"',
            '  srun --nodes="$((n_nodes - 1))" --ntasks="$((n_nodes - 1))" --ntasks-per-node=1 \\',
            f'      --cpus-per-task="${{SLURM_CPUS_PER_TASK:-1}}"{step_gres} --exclude="$head_node" \\',
            '      --kill-on-bad-exit=1 \\',
            '      "$py" -m ray.scripts.scripts start --address="$ray_address" --block --disable-usage-stats \\',
            f'      --num-cpus="${{SLURM_CPUS_PER_TASK:-1}}"{gpus} >"$workers_log" 2>&1 &',
            "  workers_pid=$!",
            f'  "$py" -c {q(_WAIT_NODES_PY)} "$ray_address" "$n_nodes" {timeout}',
            "fi",
            'cmd+=("scheduler.ray_address=$ray_address")',
        ]
    lines += [
        "",
        "# ---- the run: the same controller as scheduler.type=local/ray; its exit code is the job's",
        'log "running: $(printf \'%q \' "${cmd[@]}")"',
        "set +e",
        '"${cmd[@]}"',
        "rc=$?",
        "set -e",
        'log "run finished with exit code $rc"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ job control
@dataclass
class JobInfo:
    """One job (or one array task) as Slurm reports it."""

    job_id: str  # "123", or "123_4" for array task 4
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, ... (first word: "CANCELLED by 0" -> CANCELLED)
    exit_code: Optional[int] = None  # the batch script's exit code, None when unknown
    signal: Optional[int] = None  # the signal that ended it, None/0 when none
    reason: str = ""
    array_task: Optional[str] = None  # "4", or a range like "0-3%2" for tasks still pending together

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and (self.exit_code or 0) == 0

    def describe(self) -> str:
        code = "?" if self.exit_code is None else str(self.exit_code)
        sig = f", signal {self.signal}" if self.signal else ""
        why = f", reason {self.reason}" if self.reason and self.reason not in ("None", "(null)") else ""
        return f"{self.state} (exit code {code}{sig}{why})"


def _run(argv: list[str], timeout: float = 60.0, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    exe = shutil.which(argv[0])
    if exe is None:
        raise SlurmError(f"{argv[0]} not found on PATH; is this a Slurm login node? (Debian/Ubuntu: apt-get install "
                         "slurm-client; CI: bash scripts/ci_system_deps.sh)")
    return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout, env=env)


def submit(script_path: Path, *, env: Optional[dict] = None) -> str:
    """``sbatch --parsable script_path``; returns the job id. :class:`SlurmError` with sbatch's stderr on failure."""
    try:
        res = _run(["sbatch", "--parsable", str(script_path)], timeout=120, env=env)
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"sbatch {script_path} did not answer within {exc.timeout:.0f}s (is slurmctld up?)") from None
    if res.returncode != 0:
        detail = (res.stderr or res.stdout).strip() or "(no output)"
        raise SlurmError(f"sbatch rejected {script_path} (exit {res.returncode}):\n{detail}")
    out = res.stdout.strip().splitlines()
    job_id = out[-1].split(";")[0].strip() if out else ""
    if not re.fullmatch(r"\d+", job_id):
        raise SlurmError(f"sbatch --parsable printed no job id for {script_path}: {res.stdout!r} {res.stderr!r}")
    return job_id


def _parse_scontrol(text: str) -> list[JobInfo]:
    """Records of ``scontrol show job -o``. The fields before ``UserId=`` (JobId, Array*, JobName) are read from the
    start of the line; state, reason and exit code from after it, so a job name cannot shadow them (the job names
    this module makes have no spaces; paths, which may, come after ExitCode)."""
    infos = []
    for line in text.splitlines():
        if not line.startswith("JobId="):
            continue
        m = re.search(r" UserId=\S+ GroupId=\S+ ", line)
        head, tail = (line[:m.start()], line[m.end():]) if m else (line, line)
        job = re.match(r"JobId=(\d+)", head).group(1)
        array_job = re.search(r"\bArrayJobId=(\d+)", head)
        array_task = re.search(r"\bArrayTaskId=(\S+)", head)
        state = re.search(r"\bJobState=(\S+)", tail)
        reason = re.search(r"\bReason=(\S+)", tail)
        code = re.search(r"\bExitCode=(\d+):(\d+)", tail)
        task = array_task.group(1) if array_task else None
        key = f"{array_job.group(1)}_{task}" if array_job and task else job
        infos.append(JobInfo(key, state.group(1) if state else "UNKNOWN",
                             int(code.group(1)) if code else None, int(code.group(2)) if code else None,
                             reason.group(1) if reason else "", task))
    return infos


def job_states(job_id: str) -> list[JobInfo]:
    """Every record of a job (one per array task; tasks still pending together share one record with a range).

    ``scontrol show job -o`` first; if slurmctld no longer knows the job, ``squeue -h -t all`` (no exit codes),
    then ``sacct`` where accounting is enabled. Empty when nothing knows the job.
    """
    res = _run(["scontrol", "show", "job", "-o", str(job_id)], timeout=60)
    if res.returncode == 0:
        infos = _parse_scontrol(res.stdout)
        if infos:
            return infos
    err = res.stderr.strip()
    res2 = _run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%i|%T|%r"], timeout=60)
    if res2.returncode == 0 and res2.stdout.strip():
        infos = []
        for line in res2.stdout.strip().splitlines():
            jid, state, reason = (line.split("|") + ["", ""])[:3]
            task = jid.split("_", 1)[1].strip("[]") if "_" in jid else None
            infos.append(JobInfo(jid, state.split()[0] if state else "UNKNOWN", None, None, reason, task))
        return infos
    if shutil.which("sacct"):
        res3 = _run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "JobID,State,ExitCode"], timeout=60)
        if res3.returncode == 0 and res3.stdout.strip():
            infos = []
            for line in res3.stdout.strip().splitlines():
                jid, state, code = (line.split("|") + ["", ""])[:3]
                c = re.fullmatch(r"(\d+):(\d+)", code.strip())
                task = jid.split("_", 1)[1] if "_" in jid else None
                infos.append(JobInfo(jid, state.split()[0] if state else "UNKNOWN",
                                     int(c.group(1)) if c else None, int(c.group(2)) if c else None, "", task))
            return infos
    if err and "Invalid job id" not in err:
        raise SlurmError(f"scontrol show job {job_id} failed: {err}")
    return []


def job_state(job_id: str) -> Optional[JobInfo]:
    """The state of a (non-array) job, or None when Slurm does not know it."""
    infos = job_states(job_id)
    return next((i for i in infos if i.job_id == str(job_id)), infos[0] if infos else None)


def _expand_tasks(spec: str) -> list[int]:
    """'0-3%2' / '1,3-4' / '5' -> task indices."""
    out = []
    for part in spec.split("%")[0].split(","):
        a, _, b = part.partition("-")
        if a.isdigit():
            out.extend(range(int(a), int(b) + 1) if b.isdigit() else [int(a)])
    return out


def wait_for_jobs(job_id: str, n_tasks: Optional[int] = None, *, poll_s: float = 1.0,
                  timeout_s: Optional[float] = None, on_poll: Optional[Callable[[dict], None]] = None,
                  unknown_grace_s: float = 60.0) -> dict[str, JobInfo]:
    """Poll until the job (or all ``n_tasks`` tasks of an array job) reached a terminal state.

    Returns {job id or "<array>_<task>": JobInfo}. ``on_poll(current)`` is called after every poll (state-change
    printing, log streaming). A job Slurm no longer knows for ``unknown_grace_s`` is reported as UNKNOWN; queries
    that keep failing for that long raise their :class:`SlurmError`. :class:`TimeoutError` after ``timeout_s``.
    """
    start = time.monotonic()
    unknown_since: Optional[float] = None
    failing_since: Optional[float] = None
    keys = [f"{job_id}_{i}" for i in range(n_tasks)] if n_tasks is not None else [str(job_id)]
    current: dict[str, JobInfo] = {}
    while True:
        try:
            infos = job_states(job_id)
            failing_since = None
        except (SlurmError, subprocess.TimeoutExpired) as exc:  # slurmctld busy: try again, for a while
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > unknown_grace_s:
                raise SlurmError(f"cannot query slurm job {job_id} for {unknown_grace_s:.0f}s: {exc}") from exc
            infos = None
        if infos == []:
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since > unknown_grace_s:
                for k in keys:
                    current.setdefault(k, JobInfo(k, "UNKNOWN", None))
                    if not current[k].done:
                        current[k] = JobInfo(k, "UNKNOWN", None, reason="no longer known to Slurm")
                return current
        elif infos:
            unknown_since = None
            for info in infos:
                if n_tasks is None:
                    if info.job_id == str(job_id) or info.array_task is None:
                        current[str(job_id)] = info
                    continue
                for t in _expand_tasks(info.array_task or ""):
                    k = f"{job_id}_{t}"
                    current[k] = JobInfo(k, info.state, info.exit_code, info.signal, info.reason, str(t)) \
                        if info.job_id != k else info
        if on_poll is not None:
            on_poll(current)
        if all(k in current and current[k].done for k in keys):
            return current
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            pending = {k: (current[k].state if k in current else "?") for k in keys
                       if not (k in current and current[k].done)}
            raise TimeoutError(f"slurm job {job_id} not finished after {timeout_s:.0f}s: {pending}")
        time.sleep(poll_s)


def wait_for_job(job_id: str, poll_s: float = 1.0, timeout_s: Optional[float] = None) -> tuple[str, Optional[int]]:
    """Block until the job ends; returns (state, exit code). :class:`TimeoutError` after ``timeout_s``."""
    info = wait_for_jobs(job_id, poll_s=poll_s, timeout_s=timeout_s)[str(job_id)]
    return info.state, info.exit_code


def cancel(job_id: str) -> None:
    with contextlib.suppress(Exception):
        _run(["scancel", str(job_id)], timeout=30)


def job_log_path(log_dir: Path, job_id: str, task: Optional[int] = None) -> Path:
    """The log file of a job (``log_dir/<id>.log``) or of an array task (``log_dir/<array id>_<task>.log``)."""
    return Path(log_dir) / (f"{job_id}_{task}.log" if task is not None else f"{job_id}.log")


def _tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(lines[-n:]) if n > 0 else ""


# ------------------------------------------------------------------------------------------------ launching
def _atomic_write(path: Path, text: str) -> Path:
    from stalerl.io import atomic_write_text

    return atomic_write_text(path, text)


def _job_name(*parts: str) -> str:
    """A readable job name without spaces or quotes (squeue/scontrol output stays parseable)."""
    return re.sub(r"[^A-Za-z0-9._+=-]", "_", "-".join(parts))[:120] or "stalerl"


def _check_run_names(cfg: Any) -> None:
    for key, value in (("experiment_name", cfg.experiment_name), ("trial_name", cfg.trial_name),
                       ("cluster.fileroot", cfg.cluster.fileroot)):
        _check_text(key, value)


def _check_inner(cfg: Any, inner: str, python: str) -> None:
    if inner == "ray" and python == sys.executable:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("scheduler.slurm.inner_scheduler=ray (the default for a single job) needs Ray in the "
                              f"job's Python ({python}). Fix: pip install \"stalerl[ray]\", or set "
                              "scheduler.slurm.inner_scheduler=local.", ["scheduler.slurm.inner_scheduler"])


def _first_step_record(run_dir: Path, since: float) -> Optional[dict]:
    """The first metrics record with step >= 1 of a metrics.jsonl written after ``since`` (epoch seconds)."""
    path = run_dir / "metrics.jsonl"
    try:
        if path.stat().st_mtime < since:
            return None
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] >= 1:
                        return rec
    except OSError:
        return None
    return None


class _Follower:
    """Called on every poll: prints state changes, streams the log, notes when the first training step appears."""

    def __init__(self, submitted: float, logs: dict[str, Path], run_dirs: dict[str, Path], stream: bool):
        self.submitted = submitted  # time.time() at submission
        self.logs = logs
        self.run_dirs = run_dirs
        self.stream = stream
        self.states: dict[str, str] = {}
        self.offsets: dict[str, int] = {}
        self.first_step: dict[str, float] = {}  # key -> seconds after submission (observed)

    def __call__(self, current: dict[str, JobInfo]) -> None:
        now = time.time()
        for key, info in sorted(current.items()):
            if self.stream and key in self.logs:
                self._stream(key)
            if self.states.get(key) != info.state:
                self.states[key] = info.state
                what = info.describe() if info.done else info.state
                print(f"[slurm] {now - self.submitted:6.1f}s  job {key}: {what}", flush=True)
            if key in self.run_dirs and key not in self.first_step:
                if _first_step_record(self.run_dirs[key], self.submitted) is not None:
                    self.first_step[key] = now - self.submitted
                    print(f"[slurm] {now - self.submitted:6.1f}s  job {key}: first training step logged", flush=True)

    def _stream(self, key: str) -> None:
        path = self.logs[key]
        try:
            with open(path, "rb") as fh:
                fh.seek(self.offsets.get(key, 0))
                data = fh.read()
        except OSError:
            return
        if data:
            end = data.rfind(b"\n") + 1  # whole lines only
            if end:
                self.offsets[key] = self.offsets.get(key, 0) + end
                sys.stdout.write(data[:end].decode(errors="replace"))
                sys.stdout.flush()

    def flush(self) -> None:
        if self.stream:
            for key in self.logs:
                self._stream(key)


def _startup_report(run_dir: Path, observed: Optional[float], submitted: float) -> str:
    rec = _first_step_record(run_dir, submitted)
    overhead = rec.get("timing/startup_overhead_s") if rec else None
    parts = []
    if observed is not None:
        parts.append(f"first training step logged {observed:.1f}s after submission")
    if isinstance(overhead, (int, float)):
        parts.append(f"start-up overhead before the first step {overhead:.1f}s (trainer's timing/startup_overhead_s:"
                     " from launch, warm start and evaluation excluded)")
    return "; ".join(parts) if parts else "no training step was logged"


def launch_slurm(cfg: Any, config_path: Optional[str] = None, overrides: Sequence[str] = (),
                 dry_run: bool = False) -> int:
    """Submit ``cfg`` as one sbatch job (see the module docstring). Returns 0 on success, else non-zero."""
    from stalerl.config import run_dir, save_resolved_config

    sc = cfg.scheduler.slurm
    _check_run_names(cfg)
    _raise_slurm_problems(cfg)
    inner = _inner_scheduler(cfg, array=False)
    python = _python(cfg)
    rd = run_dir(cfg)
    slurm_dir = rd / "slurm"
    log_dir = slurm_dir / "logs"
    config_file = slurm_dir / "config.yaml"
    script_path = slurm_dir / "job.sbatch"
    script = render_sbatch(cfg, inner_argv=inner_command(cfg, Path(os.path.abspath(config_file)), inner=inner),
                           job_name=_job_name(cfg.experiment_name, cfg.trial_name), log_dir=log_dir,
                           inner_scheduler=inner)
    log_dir.mkdir(parents=True, exist_ok=True)
    save_resolved_config(cfg, config_file)
    _atomic_write(script_path, script)
    if dry_run or sc.dry_run:
        print(script, end="")
        print(f"# dry run: wrote {script_path} and {config_file}; submit with: sbatch {shlex.quote(str(script_path))}")
        return 0
    _check_inner(cfg, inner, python)
    submitted = time.time()
    env = dict(os.environ)
    env.setdefault(LAUNCH_TIME_ENV, repr(submitted))  # cli.main sets it when the command starts; else now
    job_id = submit(script_path, env=env)
    log_path = job_log_path(log_dir, job_id)
    _atomic_write(slurm_dir / "job.json", json.dumps({
        "job_id": job_id, "submitted_at": submitted, "script": str(script_path), "config": str(config_file),
        "log": str(log_path), "inner_scheduler": inner, "source_config": config_path,
        "overrides": list(overrides)}, indent=2) + "\n")
    print(f"[slurm] submitted job {job_id} ({_job_name(cfg.experiment_name, cfg.trial_name)}, inner scheduler "
          f"{inner}); log: {log_path}", flush=True)
    if not sc.wait:
        print(f"[slurm] not waiting (scheduler.slurm.wait=false); follow with: squeue -j {job_id}; "
              f"tail -f {shlex.quote(str(log_path))}")
        return 0
    return follow_job(job_id, log_path, rd, submitted=submitted, poll_s=sc.poll_interval_s,
                      timeout_s=sc.wait_timeout_s, tail_lines=sc.log_tail_lines)


def follow_job(job_id: str, log_path: Path, run_dir_: Path, *, submitted: float, poll_s: float = 1.0,
               timeout_s: Optional[float] = None, tail_lines: int = 40, stream: bool = True) -> int:
    """Wait for a submitted job, streaming its log; report success (with start-up time) or failure (state, exit
    code, log tail). Returns 0, the job's exit code, 1 (failed without one) or 124 (stopped waiting). Ctrl-C cancels
    the job."""
    follower = _Follower(submitted, {str(job_id): Path(log_path)}, {str(job_id): Path(run_dir_)}, stream)
    try:
        info = wait_for_jobs(job_id, poll_s=poll_s, timeout_s=timeout_s, on_poll=follower)[str(job_id)]
    except TimeoutError as exc:
        print(f"[slurm] {exc}; stopped waiting (the job keeps running): squeue -j {job_id}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print(f"[slurm] interrupted: cancelling job {job_id}", file=sys.stderr)
        cancel(job_id)
        raise
    follower.flush()
    elapsed = time.time() - submitted
    if info.ok:
        print(f"[slurm] job {job_id} COMPLETED in {elapsed:.1f}s; "
              f"{_startup_report(Path(run_dir_), follower.first_step.get(str(job_id)), submitted)}", flush=True)
        print(f"[slurm] log: {log_path}")
        return 0
    print(f"[slurm] job {job_id} failed: {info.describe()} after {elapsed:.1f}s; log: {log_path}", file=sys.stderr)
    if tail_lines:
        print(f"[slurm] last {tail_lines} lines of {log_path}:\n{_tail(Path(log_path), tail_lines)}",
              file=sys.stderr, flush=True)
    return info.exit_code if info.exit_code else 1


def launch(cfg: Any, config_path: Optional[str], overrides: Sequence[str], dry_run: bool) -> int:
    """Entry point for ``stalerl.launcher``/``stalerl.cli``: :func:`launch_slurm`."""
    return launch_slurm(cfg, config_path, overrides, dry_run)


# ---------------------------------------------------------------------------------------------------- sweeps
def _slurm_settings(cfg: Any) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg.scheduler.slurm)


def run_sweep_slurm(config_path: Optional[str], runs: Sequence[tuple[str, list[str]]], configs: Sequence[Any],
                    *, dry_run: bool = False) -> list[str]:
    """Run a sweep as one job array; returns one status per run: "ok" or "failed (STATE, code)".

    ``runs``/``configs``: as made by :func:`stalerl.sweep.expand` and validated by the CLI. Every run's resolved
    config is written to ``<experiment dir>/slurm-sweeps/<stamp>/configs/<i>.yaml`` and its path to line ``i+1`` of
    ``runs.txt``, which array task ``i`` reads. Resource settings (``scheduler.slurm.*``) must be the same for every
    run (one array, one request). Sweeps always wait for the array (the summary table needs the results).
    """
    from stalerl.config import run_dir, save_resolved_config

    if not configs:
        return []
    base = configs[0]
    settings = _slurm_settings(base)
    for cfg in configs:
        _check_run_names(cfg)
        differ = sorted(k for k, v in _slurm_settings(cfg).items() if settings.get(k) != v)
        if differ:
            keys = [f"scheduler.slurm.{k}" for k in differ]
            raise ConfigError(f"a sweep under scheduler.type=slurm is one job array with one resource request, so "
                              f"{', '.join(keys)} cannot differ between runs (run {cfg.trial_name} differs). Fix: "
                              "sweep other keys, or submit separate sweeps.", keys)
    _raise_slurm_problems(base)
    sc = base.scheduler.slurm
    inner = _inner_scheduler(base, array=True)
    exp_dir = run_dir(base).parent
    sweep_dir = exp_dir / "slurm-sweeps" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log_dir = sweep_dir / "logs"
    runs_file = sweep_dir / "runs.txt"
    script_path = sweep_dir / "job.sbatch"
    n = len(configs)
    script = render_sbatch(base, inner_argv=inner_command(base, None, inner=inner, array=True),
                           job_name=_job_name(base.experiment_name, "sweep"), log_dir=log_dir, array_size=n,
                           runs_file=runs_file, inner_scheduler=inner)
    log_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, cfg in enumerate(configs):
        p = Path(os.path.abspath(save_resolved_config(cfg, sweep_dir / "configs" / f"{i}.yaml")))
        paths.append(_check_text(f"config path of run {i}", str(p)))
    _atomic_write(runs_file, "".join(f"{p}\n" for p in paths))
    _atomic_write(script_path, script)
    trials = [trial for trial, _ in runs] if runs else [c.trial_name for c in configs]
    if dry_run or sc.dry_run:
        print(script, end="")
        print(f"# dry run: wrote {script_path}, {runs_file} and {n} configs; submit with: "
              f"sbatch {shlex.quote(str(script_path))}")
        return ["dry-run"] * n
    _check_inner(base, inner, _python(base))
    if not sc.wait:
        print("[slurm] scheduler.slurm.wait=false is ignored for sweeps: the summary table needs the results")
    submitted = time.time()
    job_id = submit(script_path)
    logs = {f"{job_id}_{i}": job_log_path(log_dir, job_id, i) for i in range(n)}
    rdirs = {f"{job_id}_{i}": run_dir(cfg) for i, cfg in enumerate(configs)}
    _atomic_write(sweep_dir / "sweep.json", json.dumps({
        "job_id": job_id, "submitted_at": submitted, "script": str(script_path), "runs_file": str(runs_file),
        "inner_scheduler": inner, "source_config": config_path,
        "tasks": [{"task": i, "trial": t, "config": p, "log": str(logs[f"{job_id}_{i}"])}
                  for i, (t, p) in enumerate(zip(trials, paths))]}, indent=2) + "\n")
    throttle = f", at most {sc.max_parallel} at once" if sc.max_parallel else ""
    print(f"[slurm] submitted job array {job_id} ({n} tasks{throttle}, inner scheduler {inner}); logs: "
          f"{log_dir}/{job_id}_<task>.log", flush=True)
    follower = _Follower(submitted, logs, rdirs, stream=False)
    try:
        infos = wait_for_jobs(job_id, n, poll_s=sc.poll_interval_s, timeout_s=sc.wait_timeout_s, on_poll=follower)
    except KeyboardInterrupt:
        print(f"[slurm] interrupted: cancelling job array {job_id}", file=sys.stderr)
        cancel(job_id)
        raise
    except TimeoutError as exc:
        print(f"[slurm] {exc}; stopped waiting (the array keeps running): squeue -j {job_id}", file=sys.stderr)
        return [f"failed (TIMEOUT_WAITING, {job_id}_{i})" for i in range(n)]
    statuses = []
    for i, trial in enumerate(trials):
        key = f"{job_id}_{i}"
        info = infos[key]
        if info.ok:
            statuses.append("ok")
            print(f"[slurm] {key} {trial}: ok; {_startup_report(rdirs[key], follower.first_step.get(key), submitted)}")
        else:
            code = "?" if info.exit_code is None else info.exit_code
            statuses.append(f"failed ({info.state}, {code})")
            print(f"[slurm] {key} {trial}: {info.describe()}; log {logs[key]}; last {sc.log_tail_lines} lines:\n"
                  f"{_tail(logs[key], sc.log_tail_lines)}", file=sys.stderr, flush=True)
    print(f"[slurm] job array {job_id} done in {time.time() - submitted:.1f}s: "
          f"{sum(s == 'ok' for s in statuses)}/{n} ok", flush=True)
    return statuses


def run_sweep(config_path: Optional[str], runs: Sequence[tuple[str, list[str]]], configs: Sequence[Any],
              dry_run: bool = False) -> list[str]:
    """Entry point for ``stalerl.launcher.run_sweep_on("slurm", ...)``: :func:`run_sweep_slurm`."""
    return run_sweep_slurm(config_path, runs, configs, dry_run=dry_run)
