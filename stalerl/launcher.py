"""Run a loaded config under its scheduler. ``local`` runs the controller in this process."""

from __future__ import annotations

import time
from typing import Any

from stalerl.config import ExperimentConfig, config_to_yaml, is_async, run_dir


def build_trainer(cfg: ExperimentConfig):
    """The synchronous loop (optionally with a fixed-staleness FIFO) or the asynchronous dX+dY runtime."""
    if is_async(cfg):
        from stalerl.async_trainer import AsyncTrainer

        return AsyncTrainer(cfg)
    from stalerl.trainer import Trainer

    return Trainer(cfg)


def launch(cfg: ExperimentConfig, *, dry_run: bool = False, plot: bool = False) -> dict[str, Any]:
    if dry_run:
        print(config_to_yaml(cfg))
        return {}
    kind = cfg.scheduler.type
    if kind == "slurm":
        raise NotImplementedError("scheduler.type='slurm' is wired in stalerl.cli")
    if kind == "ray" and not is_async(cfg):
        result = _run_sync_on_ray(cfg)
    else:
        result = train_with_summary(cfg)
    if plot:
        from stalerl.plot import plot_runs

        out = plot_runs([run_dir(cfg)], ["reward", "actor/grad_norm"], run_dir(cfg) / "curves.png")
        print(f"curves written to {out}")
    return result


def _run_sync_on_ray(cfg: ExperimentConfig) -> dict[str, Any]:
    """The single-process loop (fixed staleness) as one Ray task, with the resources of one worker."""
    from stalerl.workers.hosting import import_ray, init_ray, worker_resources

    ray = import_ray()
    started = init_ray(cfg.scheduler.ray_address)
    try:
        res = worker_resources(cfg)
        task = ray.remote(_train_in_task).options(num_cpus=res.cpus, num_gpus=res.gpus, max_retries=0)
        return ray.get(task.remote(cfg))
    finally:
        if started:
            ray.shutdown()


def _train_in_task(cfg: ExperimentConfig) -> dict[str, Any]:
    return train_with_summary(cfg)


def train_with_summary(cfg: ExperimentConfig) -> dict[str, Any]:
    """Train, then write ``<run_dir>/summary.json`` (see :mod:`stalerl.run_summary`), also when the run fails."""
    from stalerl.run_summary import write_run_summary

    start = time.time()
    try:
        result = build_trainer(cfg).train()
    except BaseException as exc:
        write_run_summary(cfg, status="failed", wall_s=time.time() - start,
                          error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    write_run_summary(cfg, status="finished", wall_s=time.time() - start)
    return result


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
    from stalerl.cli import main

    return main(argv)
