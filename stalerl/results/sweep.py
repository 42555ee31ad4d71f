"""YAML override sweeps: ``key=a,b,c`` overrides expand to the grid of runs, each with its own trial name.

    python3 examples/math/gsm8k_rl.py --config examples/math/gsm8k_m2po_cpu.yaml \\
        actor.loss=m2po,vanilla rollout.fixed_staleness=0,4,16 seed=1,2

runs 12 trials named ``<trial_name>-loss=m2po-fixed_staleness=0-seed=1`` etc. ``local`` runs them one after another
(each in its own process), ``ray`` runs them concurrently as the cluster's resources allow, ``slurm`` submits a job
array. At the end a summary table (one row per run) is written next to the runs.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from stalerl.core.io import atomic_write_text


def split_values(value: str) -> list[str]:
    """Split ``a,b,c`` on top-level commas (not inside [], {}, () or quotes)."""
    out, depth, quote, cur = [], 0, None, []
    for ch in value:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur))
    return out


def sweep_axes(overrides: Sequence[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(fixed overrides, [(key, values)] for every override with more than one value)."""
    fixed, axes = [], []
    for item in overrides:
        key, sep, value = item.partition("=")
        values = split_values(value) if sep else [value]
        if sep and len(values) > 1:
            if any(v == "" for v in values):
                raise ValueError(f"sweep override {item!r} has an empty value; write key=a,b,c")
            axes.append((key.lstrip("+"), values))
        else:
            fixed.append(item)
    keys = [k for k, _ in axes]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise ValueError(f"sweep key(s) given twice: {', '.join(sorted(dup))}")
    return fixed, axes


def is_sweep(overrides: Sequence[str]) -> bool:
    return bool(sweep_axes(overrides)[1])


def _short(key: str, keys: Sequence[str]) -> str:
    """The last component of a dotted key, or more of it when that is ambiguous among the swept keys."""
    parts = key.split(".")
    for n in range(1, len(parts) + 1):
        tail = ".".join(parts[-n:])
        if sum(1 for k in keys if k == tail or k.endswith("." + tail)) == 1:
            return tail
    return key


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)


def expand(overrides: Sequence[str], base_trial: str) -> list[tuple[str, list[str]]]:
    """The grid: [(trial_name, overrides)], in row-major order of the axes as given."""
    fixed, axes = sweep_axes(overrides)
    fixed = [o for o in fixed if not o.lstrip("+").startswith("trial_name=")]
    keys = [k for k, _ in axes]
    runs = []
    for combo in itertools.product(*[values for _, values in axes]):
        suffix = "-".join(f"{_short(k, keys)}={_safe(v)}" for k, v in zip(keys, combo))
        trial = f"{base_trial}-{suffix}"
        runs.append((trial, [*fixed, *(f"{k}={v}" for k, v in zip(keys, combo)), f"trial_name={trial}"]))
    return runs


# ---------------------------------------------------------------------------------------------- summary
# Held-out eval accuracy first; reward of the batches generated in the last steps vs of those trained on (under a
# FIFO of staleness S the consumed batch was generated S steps earlier, which biases a comparison across S).
SUMMARY_COLUMNS = ("trial", "status", "steps", "final_eval_accuracy", "final_reward_generated",
                   "final_reward_consumed", "staleness_avg",
                   "staleness_max", "masked_fraction", "clip_fraction", "seconds")


def summarize_run(run_dir: Path, status: str = "ok", tail_fraction: float = 0.1) -> dict[str, Any]:
    """One summary row: final rewards = means over the last ``tail_fraction`` of steps (at least one)."""
    from stalerl.results.metrics_log import loss_fraction_keys, read_metrics

    row: dict[str, Any] = {c: None for c in SUMMARY_COLUMNS}
    row["trial"] = run_dir.name
    row["status"] = status
    try:
        rows = [r for r in read_metrics(run_dir) if r.get("step", 0) > 0]
    except FileNotFoundError:
        return row
    if not rows:
        return row
    tail = rows[-max(1, int(len(rows) * tail_fraction)):]

    def mean(key: str) -> Optional[float]:
        vals = [r[key] for r in tail if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    tail_keys = {k for r in tail for k in r}
    row.update({
        "steps": rows[-1]["step"],
        "final_eval_accuracy": evals[-1] if evals else None,
        "final_reward_generated": mean("reward/generated"),
        "final_reward_consumed": mean("reward/consumed") if mean("reward/consumed") is not None else mean("reward"),
        "staleness_avg": sum(r.get("staleness/avg", 0.0) for r in rows) / len(rows),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        # the loss's own headline fractions, whichever loss logged them (the runtime names no loss)
        "masked_fraction": next((mean(k) for k in loss_fraction_keys(tail_keys, "masked_fraction")), None),
        "clip_fraction": next((mean(k) for k in loss_fraction_keys(tail_keys, "clip_fraction")), None),
        "seconds": sum(r.get("timing/step_s", 0.0) for r in rows),
    })
    return row


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_summary(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    """sweep_summary.md (a table) and sweep_summary.json next to the runs; returns the .md path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in SUMMARY_COLUMNS) + " |" for r in rows]
    md = out_dir / "sweep_summary.md"
    atomic_write_text(md, "\n".join(lines) + "\n")
    atomic_write_text(out_dir / "sweep_summary.json", json.dumps(rows, indent=2))
    return md
