"""Following a submitted job: state changes, the streamed log, and the start-up and failure reports."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Optional

from stalerl.schedulers.slurm.jobs import JobInfo, _tail, cancel, wait_for_jobs


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


def _interruption(run_dir: Path, since: float) -> Optional[dict]:
    """This job's run's summary.json when it records a SIGTERM/SIGINT interruption (stalerl.core.interrupt)."""
    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if summary.get("status") != "interrupted" or not isinstance(summary.get("interrupted"), dict):
        return None
    return summary


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
    stopped = _interruption(Path(run_dir_), submitted)
    if stopped is not None:  # scancel / the time limit: the run stopped cleanly (not a failure), and resumes
        print(f"[slurm] job {job_id} {info.state} after {elapsed:.1f}s: the run was {stopped['error']}; log: "
              f"{log_path}", file=sys.stderr, flush=True)
        return 128 + int(stopped["interrupted"]["signum"])
    print(f"[slurm] job {job_id} failed: {info.describe()} after {elapsed:.1f}s; log: {log_path}", file=sys.stderr)
    if tail_lines:
        print(f"[slurm] last {tail_lines} lines of {log_path}:\n{_tail(Path(log_path), tail_lines)}",
              file=sys.stderr, flush=True)
    return info.exit_code if info.exit_code else 1
