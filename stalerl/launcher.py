"""Run a loaded config under its scheduler. ``local`` runs the controller in this process."""

from __future__ import annotations

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
        result = build_trainer(cfg).train()
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
    return build_trainer(cfg).train()
