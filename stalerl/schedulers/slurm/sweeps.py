"""Sweeps under Slurm: every run of a ``key=a,b,c`` grid as one task of a single job array."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from stalerl.config import ConfigError
from stalerl.config.slurm import _check_text, _raise_slurm_problems
from stalerl.schedulers.slurm.follow import _Follower, _startup_report
from stalerl.schedulers.slurm.jobs import _tail, cancel, job_log_path, submit, wait_for_jobs
from stalerl.schedulers.slurm.render import _inner_scheduler, _python, inner_command, render_sbatch
from stalerl.schedulers.slurm.submission import _atomic_write, _check_inner, _check_run_names, _job_name


# ---------------------------------------------------------------------------------------------------- sweeps
def _slurm_settings(cfg: Any) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg.scheduler.slurm)


def run_sweep_slurm(config_path: Optional[str], runs: Sequence[tuple[str, list[str]]], configs: Sequence[Any],
                    *, dry_run: bool = False) -> list[str]:
    """Run a sweep as one job array; returns one status per run: "ok" or "failed (STATE, code)".

    ``runs``/``configs``: as made by :func:`stalerl.results.sweep.expand` and validated by the CLI. Every run's resolved
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
    """Entry point for ``stalerl.launch.cli.run_sweep_on("slurm", ...)``: :func:`run_sweep_slurm`."""
    return run_sweep_slurm(config_path, runs, configs, dry_run=dry_run)
