"""The block printed when a run ends: what it reached and where its outputs are (torch-free).

:func:`summary_row` turns a run's metrics into plain numbers (the same row :mod:`stalerl.results.sweep` tabulates, so a
machine-readable summary can share it); :func:`format_run_summary` renders the row, the wall time and the output
paths with the plot command.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional


def summary_row(run_dir: Path) -> dict[str, Any]:
    """Steps, final generated / consumed reward (means over the last 10% of steps), last eval accuracy, staleness and masked / clip
    fraction, from ``run_dir/metrics.jsonl``."""
    from stalerl.results.sweep import summarize_run

    return summarize_run(Path(run_dir))


def _num(v: Any) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def format_run_summary(row: dict[str, Any], run_dir: Path, *, wall_s: Optional[float] = None,
                       first_eval: Optional[float] = None) -> str:
    run_dir = Path(run_dir)
    eval_s = _num(row.get("final_eval_accuracy"))
    if first_eval is not None and row.get("final_eval_accuracy") is not None:
        eval_s = f"{first_eval:.4g} -> {eval_s}"
    trust = []
    if row.get("masked_fraction") is not None:
        trust.append(f"m2po masked fraction {_num(row['masked_fraction'])}")
    if row.get("clip_fraction") is not None:
        trust.append(f"clip fraction {_num(row['clip_fraction'])}")
    wall = f"{wall_s:.0f}s" if wall_s is not None else "-"
    generated = _num(row.get("final_reward_generated"))
    if row.get("final_reward_generated") is None and row.get("final_reward_consumed") is not None:
        # Asynchronous runs whose rollout workers finished the data early generate nothing in the last steps.
        generated = "- (no rollout finished in those steps)"
    lines = [
        f"== run finished: {run_dir}",
        f"   steps {_num(row.get('steps'))} | wall time {wall} | final reward generated "
        f"{generated}, consumed {_num(row.get('final_reward_consumed'))} "
        f"(means of the last 10% of steps) | eval accuracy {eval_s}",
        f"   staleness avg {_num(row.get('staleness_avg'))}, max {_num(row.get('staleness_max'))}"
        + (" | " + ", ".join(trust) if trust else ""),
        "   outputs:",
        f"     metrics      {run_dir / 'metrics.jsonl'}",
        f"     config       {run_dir / 'config.yaml'}",
    ]
    from stalerl.results.metrics_log import TENSORBOARD_DIR

    if (run_dir / TENSORBOARD_DIR).is_dir():
        lines.append(f"     tensorboard  tensorboard --logdir {shlex.quote(str(run_dir / TENSORBOARD_DIR))}")
    if (run_dir / "final_model").is_dir():
        lines.append(f"     final model  {run_dir / 'final_model'}")
    if (run_dir / "checkpoints").is_dir():  # resumable state (recover.mode auto / resume; trial_dir.CHECKPOINT_DIR)
        lines.append(f"     checkpoints  {run_dir / 'checkpoints'}")
    if (run_dir / "logs").is_dir():
        lines.append(f"     worker logs  {run_dir / 'logs'}")
    lines.append(f"   plot: stalerl-plot {shlex.quote(str(run_dir))} --metrics reward actor/grad_norm eval/accuracy "
                 f"--out {shlex.quote(str(run_dir / 'curves.png'))}")
    return "\n".join(lines)


def first_eval_accuracy(run_dir: Path) -> Optional[float]:
    """Eval accuracy at step 0 (after the warm start), for the before -> after figure."""
    from stalerl.results.metrics_log import read_metrics

    try:
        for r in read_metrics(Path(run_dir)):
            if r.get("step") == 0 and "eval/accuracy" in r:
                return float(r["eval/accuracy"])
    except (FileNotFoundError, ValueError):
        pass
    return None
