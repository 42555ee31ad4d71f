"""Run a loaded config under its scheduler. ``local`` runs the trainer in this process."""

from __future__ import annotations

from typing import Any

from stalerl.config import ExperimentConfig, config_to_yaml, run_dir


def launch(cfg: ExperimentConfig, *, dry_run: bool = False, plot: bool = False) -> dict[str, Any]:
    if dry_run:
        print(config_to_yaml(cfg))
        return {}
    kind = cfg.scheduler.type
    if kind != "local":
        raise NotImplementedError(
            f"scheduler.type={kind!r} is not available in this version; use scheduler.type=local")
    from stalerl.trainer import run

    result = run(cfg)
    if plot:
        from stalerl.plot import plot_runs

        out = plot_runs([run_dir(cfg)], ["reward", "actor/grad_norm"], run_dir(cfg) / "curves.png")
        print(f"curves written to {out}")
    return result
