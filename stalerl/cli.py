"""The command line of the main job (``examples/math/gsm8k_rl.py`` and ``python -m stalerl.cli``).

    python3 examples/math/gsm8k_rl.py --config FILE.yaml [key=value ...] [key=a,b,c ...] [--dry-run] [--plot]

A ``key=a,b,c`` override makes it a sweep over the grid of values (see :mod:`stalerl.sweep`). Every config of a
sweep is loaded and validated before the first run starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

from stalerl.config import ExperimentConfig, is_async, load_config, parse_args, run_dir
from stalerl.launcher import launch
from stalerl.trainer import LAUNCH_TIME_ENV
from stalerl.sweep import expand, is_sweep, summarize_run, sweep_axes, write_summary
from stalerl.workers.process import WorkerFailure, failure_exit_code


def main(argv: Optional[list[str]] = None) -> int:
    # When the job was launched, for the start-up overhead metric (inherited by workers, tasks and Slurm jobs).
    os.environ.setdefault(LAUNCH_TIME_ENV, repr(time.time()))
    argv = sys.argv[1:] if argv is None else list(argv)
    config_path, overrides, flags = parse_args(argv)
    if not flags.get("help") and is_sweep(overrides):
        return run_sweep(config_path, overrides, dry_run=bool(flags.get("dry_run")))
    cfg = load_config(argv)
    if cfg.scheduler.type == "slurm":  # sbatch; inside the job this CLI runs again with scheduler.type=ray/local
        from stalerl.schedulers.slurm import launch as launch_slurm

        return launch_slurm(cfg, config_path, overrides, bool(flags.get("dry_run")))
    try:
        launch(cfg, dry_run=bool(flags.get("dry_run")), plot=bool(flags.get("plot")))
    except WorkerFailure as failure:  # a rollout or train worker raised or died: its code and log tail
        print(f"stalerl: {failure}", file=sys.stderr)
        return failure_exit_code(failure)
    return 0


def _config_args(config_path: Optional[str]) -> list[str]:
    return ["--config", config_path] if config_path else []


def run_sweep(config_path: Optional[str], overrides: list[str], *, dry_run: bool = False) -> int:
    fixed, axes = sweep_axes(overrides)
    if any(k == "scheduler.type" for k, _ in axes):
        raise ValueError("scheduler.type cannot be swept: a sweep runs under one scheduler")
    base = load_config([*_config_args(config_path), *fixed])
    runs = expand(overrides, base.trial_name)
    configs = [load_config([*_config_args(config_path), *ovr]) for _, ovr in runs]  # all validated up front
    print(f"sweep: {len(runs)} runs over {', '.join(k for k, _ in axes)} (scheduler.type={base.scheduler.type})")
    for trial, ovr in runs:
        print(f"  {trial}")
    if dry_run:
        if base.scheduler.type == "slurm":  # also print the job array's sbatch script
            from stalerl.schedulers.slurm import run_sweep as slurm_sweep

            slurm_sweep(config_path, runs, configs, dry_run=True)
        return 0
    kind = base.scheduler.type
    if kind == "local":
        statuses = _run_local(config_path, runs)
    else:
        statuses = run_sweep_on(kind, config_path, runs, configs)
    rows = [summarize_run(run_dir(cfg), status) for cfg, status in zip(configs, statuses)]
    out = write_summary(rows, run_dir(base).parent)
    print(out.read_text())
    print(f"sweep summary written to {out}")
    return 0 if all(s == "ok" for s in statuses) else 1


def _run_local(config_path: Optional[str], runs: list[tuple[str, list[str]]]) -> list[str]:
    """One run after another, each in its own process (a failed run does not stop the sweep)."""
    statuses = []
    for i, (trial, ovr) in enumerate(runs, 1):
        start = time.perf_counter()
        print(f"[{i}/{len(runs)}] {trial}", flush=True)
        res = subprocess.run([sys.executable, "-m", "stalerl.cli", *_config_args(config_path), *ovr])
        status = "ok" if res.returncode == 0 else f"failed ({res.returncode})"
        print(f"[{i}/{len(runs)}] {trial}: {status} in {time.perf_counter() - start:.0f}s", flush=True)
        statuses.append(status)
    return statuses


# Sweeps under a cluster scheduler. They live here, not in stalerl.launcher, because a Ray sweep runs this
# CLI inside each task: the imports go one way only, cli -> launcher.
def run_sweep_on(kind: str, config_path, runs, configs) -> list[str]:
    """Run the sweep's runs under a cluster scheduler; returns one status per run."""
    if kind == "ray":
        return _run_sweep_on_ray(config_path, runs, configs)
    if kind == "slurm":
        from stalerl.schedulers.slurm import run_sweep

        return run_sweep(config_path, runs, configs)
    raise ValueError(f"unknown scheduler.type {kind!r}")


def run_cpus(cfg: ExperimentConfig) -> float:
    """CPUs one run occupies: torch_threads per process (the controller plus its worker processes)."""
    from stalerl.config import ROLLOUT_ENGINES, TRAIN_ENGINES, parse_backend

    processes = 1
    if is_async(cfg):
        processes = (parse_backend(cfg.rollout.backend, engines=ROLLOUT_ENGINES).dp
                     + parse_backend(cfg.actor.backend, engines=TRAIN_ENGINES).dp)
    return float(cfg.torch_threads * processes)


def _run_sweep_on_ray(config_path, runs, configs) -> list[str]:
    """Every run as one Ray task holding the CPUs (and GPUs) it needs, so Ray runs as many at once as fit. Inside
    its task a run uses the local scheduler for its own worker processes."""
    from stalerl.workers.hosting import import_ray, init_ray, worker_resources

    ray = import_ray()
    started = init_ray(configs[0].scheduler.ray_address)
    try:
        total = ray.cluster_resources().get("CPU", 0.0)
        refs = []
        for (trial, overrides), cfg in zip(runs, configs):
            cpus = run_cpus(cfg)
            if cpus > total:
                raise RuntimeError(f"sweep run {trial} needs {cpus:g} CPUs but the Ray cluster has {total:g}")
            argv = (["--config", str(config_path)] if config_path else []) + [*overrides, "scheduler.type=local"]
            task = ray.remote(_cli_in_task).options(num_cpus=cpus, num_gpus=worker_resources(cfg).gpus,
                                                    max_retries=0)
            refs.append(task.remote(argv))
        statuses = []
        for (trial, _), ref in zip(runs, refs):
            try:
                code = ray.get(ref)
                statuses.append("ok" if code == 0 else f"failed ({code})")
            except Exception as exc:  # noqa: BLE001 - one failed run does not stop the sweep
                statuses.append(f"failed ({type(exc).__name__})")
            print(f"{trial}: {statuses[-1]}", flush=True)
        return statuses
    finally:
        if started:
            ray.shutdown()


def _cli_in_task(argv: list[str]) -> int:
    # by name: under `python -m stalerl.cli` this module is __main__, whose functions Ray would pickle by value
    from stalerl.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
