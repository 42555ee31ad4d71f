"""Job control: ``sbatch`` submission, job and array-task states from ``scontrol``, waiting, cancelling, logs."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional


TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "REVOKED", "SPECIAL_EXIT", "UNKNOWN",
})


class SlurmError(RuntimeError):
    """sbatch/scontrol failed, or a job could not be followed; the message has the command's stderr."""


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
