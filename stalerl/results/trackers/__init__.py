"""Experiment trackers beside metrics.jsonl: W&B (``stats_logger.wandb``) and MLflow (``stats_logger.mlflow``).

Each tracker module imports its package only inside its methods, so importing this package costs nothing; the
feeding rule (only durable rows, resume, failures) lives in :mod:`stalerl.results.tracking`. A missing package is
refused when the config is loaded (stalerl.config.trackers).
"""

from __future__ import annotations

from typing import Any, List

from stalerl.results.trackers.base import Tracker

__all__ = ["Tracker", "enabled_trackers"]


def wandb_enabled(cfg: Any) -> bool:
    return cfg.stats_logger.wandb.mode != "disabled"


def mlflow_enabled(cfg: Any) -> bool:
    return bool(cfg.stats_logger.mlflow.enabled)


def enabled_trackers(cfg: Any) -> List[Tracker]:
    """The trackers the config enables (not started yet)."""
    out: List[Tracker] = []
    if wandb_enabled(cfg):
        from stalerl.results.trackers.wandb_tracker import WandbTracker

        out.append(WandbTracker(cfg))
    if mlflow_enabled(cfg):
        from stalerl.results.trackers.mlflow_tracker import MLflowTracker

        out.append(MLflowTracker(cfg))
    return out
