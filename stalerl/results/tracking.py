"""Experiment trackers (stats_logger.wandb / stats_logger.mlflow) beside metrics.jsonl and TensorBoard.

:func:`open_metrics_logger` is the one place the trainer opens its metrics logger; trackers hang off it."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from stalerl.results.metrics_log import MetricsLogger, PathLike


def open_metrics_logger(run_dir: PathLike, cfg: Any, *, resume_step: Optional[int], resume_rows: Optional[Sequence],
                        log: Callable[[str], None]) -> MetricsLogger:
    """The run's metrics logger: metrics.jsonl, TensorBoard (stats_logger.tensorboard) and the enabled trackers."""
    return MetricsLogger(run_dir, tensorboard=cfg.stats_logger.tensorboard, resume_step=resume_step,
                         resume_rows=resume_rows, log=log)
