"""Submitting one run as one sbatch job (``launch_slurm``), and the preparation a sweep shares with it."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from stalerl.config import ConfigError
from stalerl.config.slurm import _check_text, _raise_slurm_problems
from stalerl.schedulers.slurm.follow import follow_job
from stalerl.schedulers.slurm.jobs import job_log_path, submit
from stalerl.schedulers.slurm.render import LAUNCH_TIME_ENV, _inner_scheduler, _python, inner_command, render_sbatch


# ------------------------------------------------------------------------------------------------ launching
def _atomic_write(path: Path, text: str) -> Path:
    from stalerl.core.io import atomic_write_text

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


def launch(cfg: Any, config_path: Optional[str], overrides: Sequence[str], dry_run: bool) -> int:
    """Entry point for ``stalerl.launch.launcher``/``stalerl.launch.cli``: :func:`launch_slurm`."""
    return launch_slurm(cfg, config_path, overrides, dry_run)
