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
    if kind != "local":
        raise NotImplementedError(
            f"scheduler.type={kind!r} is not available in this version; use scheduler.type=local")
    result = build_trainer(cfg).train()
    if plot:
        from stalerl.plot import plot_runs

        out = plot_runs([run_dir(cfg)], ["reward", "actor/grad_norm"], run_dir(cfg) / "curves.png")
        print(f"curves written to {out}")
    return result


def run_sweep_on(kind: str, config_path, runs, configs) -> list[str]:
    """Run the sweep's runs under a cluster scheduler; returns one status per run."""
    raise NotImplementedError(f"sweeps under scheduler.type={kind!r} are not available in this version; "
                              "use scheduler.type=local")
