"""The Slurm config section (``scheduler.slurm``) and the Slurm value checks the scheduler applies again at launch."""

import re
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from stalerl.config.errors import ConfigError
from stalerl.config.section import _f, _Section


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


@dataclass
class SlurmConfig(_Section):
    """sbatch settings, used only when scheduler.type=slurm (see stalerl/schedulers/slurm.py)."""

    partition: Optional[str] = _f(None, help="Slurm partition (--partition), or a comma-separated list; null = the "
                                             "cluster default. Letters, digits and _ . + - only.")
    account: Optional[str] = _f(None, help="Slurm account (--account); null = your default account. Letters, digits "
                                           "and _ . + - only.")
    time: str = _f("01:00:00", help="Wall-clock limit (--time), Slurm format [D-]HH:MM:SS, MM:SS or minutes. "
                                    "Quote it in YAML (time: \"1:00:00\"): YAML reads unquoted 1:00:00 as a "
                                    "base-60 integer.")
    mem: str = _f("16G", help="Memory per node (--mem), e.g. 16G, 64000M.")
    cpus_per_task: int = _f(2, ge=1, help="CPUs per task (--cpus-per-task); one task per node, so this is also the "
                                          "Ray CPUs of each node.")
    gpus_per_node: int = _f(0, ge=0, help="GPUs per node (--gres=gpu:N); 0 = no GPU request.")
    nodes: int = _f(1, ge=1, help="Nodes (--nodes). With more than one, a Ray cluster spans them (inner scheduler "
                                  "ray).")
    extra_sbatch_args: List[str] = _f(factory=list, help="Extra sbatch options, each '--name' or '--name=value' "
                                                          "(long form; the value is quoted), e.g. "
                                                          "[--qos=high,--constraint=a100]. Options this scheduler "
                                                          "sets itself (job-name, output, array, nodes, ...) are "
                                                          "refused: use their scheduler.slurm.* keys.")
    dry_run: bool = _f(False, help="Write the sbatch script and print it instead of submitting it (same as "
                                   "--dry-run).")
    wait: bool = _f(True, help="Wait for the job, report its state, log tail and start-up time; false = return "
                               "right after submission (the job id and log path are printed). Sweeps always wait: "
                               "their summary table needs the results.")
    inner_scheduler: Optional[str] = _f(None, choices=("local", "ray"),
                                        help="scheduler.type of the run inside the allocation. ray = a Ray cluster "
                                             "is started across the allocated nodes (needed for nodes > 1); local = "
                                             "worker processes on the first node, no Ray. null = ray for a single "
                                             "job, local for each task of a sweep's job array (self-contained "
                                             "tasks, no Ray start-up per task).")
    max_parallel: Optional[int] = _f(None, ge=1, help="Sweeps: at most this many array tasks run at once "
                                                      "(--array=0-N%max_parallel); null = as many as fit.")
    python: Optional[str] = _f(None, help="Python executable inside the job; null = the one running the "
                                          "submission (sys.executable). It must see the same stalerl install.")
    poll_interval_s: float = _f(1.0, gt=0.0, help="Seconds between job state polls while waiting.")
    wait_timeout_s: Optional[float] = _f(None, gt=0.0, help="Stop waiting after this many seconds (the job keeps "
                                                            "running; its id is printed); null = wait until it ends.")
    ray_start_timeout_s: float = _f(180.0, gt=0.0, help="Inside the job: seconds to wait for the Ray head and for "
                                                        "every node to join before failing.")
    log_tail_lines: int = _f(40, ge=0, help="Lines of the job log printed when a job fails.")

    def _check(self) -> List[Tuple[str, str]]:
        out: List[Tuple[str, str]] = slurm_config_problems(self)
        bad = {key for key, _ in out}
        if "time" not in bad and not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+|UNLIMITED|INFINITE",
                                                  self.time.strip()):
            out.append(("time", f"got {self.time!r}; expected a Slurm time limit such as 01:00:00, 2-00:00:00, "
                                "90:00 or 120 (minutes). Fix: set scheduler.slurm.time=01:00:00."))
        if "mem" not in bad and not re.fullmatch(r"\d+[KMGT]?B?", self.mem.strip(), flags=re.IGNORECASE):
            out.append(("mem", f"got {self.mem!r}; expected a Slurm memory size such as 16G or 64000M. "
                               "Fix: set scheduler.slurm.mem=16G."))
        return out
