"""What every tracker provides to :mod:`stalerl.results.tracking`, and the value conversions they share."""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

# A metric row as the trackers receive it: (step, the union of that step's metrics.jsonl lines without "step").
Row = Tuple[int, Dict[str, Any]]


class Tracker:
    """One experiment tracker's run. Methods may raise anything: the caller turns a failure into one warning line
    and stops feeding this tracker (metrics.jsonl and TensorBoard go on)."""

    name = "tracker"  # shown in messages: "W&B", "MLflow"
    key = "tracker"  # its key in the trial directory's trackers.json

    def start(self, run_dir: Any, state: Optional[Mapping[str, Any]], log) -> Dict[str, Any]:
        """Start a new run (``state`` None) or continue the run ``state`` describes; return the state to keep in
        the trial directory (at least the run's id)."""
        raise NotImplementedError

    def last_step(self) -> Optional[int]:
        """The highest step the tracker's run holds (read from the tracker itself), or None when it holds none."""
        raise NotImplementedError

    def log_rows(self, rows: Sequence[Row]) -> None:
        """Log ``rows`` (ascending steps, each above :meth:`last_step`)."""
        raise NotImplementedError

    def finish(self, status: str, summary: Optional[Mapping[str, Any]], files: Sequence[Any]) -> None:
        """Record the run summary (flattened) and ``files`` (artifacts), then end the run with ``status``
        (finished / interrupted / failed / diverged)."""
        raise NotImplementedError

    def end_lines(self) -> List[str]:
        """What to tell the user when the run ends (e.g. the ``wandb sync`` command)."""
        return []


def scalar(value: Any) -> Optional[float]:
    """A float for a tracker's metric when ``value`` is a single number (bools as 0/1), else None: lists
    (histograms), strings and None stay in metrics.jsonl only."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def scalar_metrics(metrics: Mapping[str, Any]) -> Dict[str, float]:
    out = {}
    for key, value in metrics.items():
        x = scalar(value)
        if x is not None:
            out[str(key)] = x
    return out


def flatten(d: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """``{"a": {"b": 1}}`` -> ``("a.b", 1)``; lists and scalars are leaves."""
    for k, v in d.items():
        if isinstance(v, Mapping):
            yield from flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


# Summary fields left out of the trackers: compact curves (the metrics are there step by step already) and the
# histogram of staleness (a list).
SUMMARY_SKIP = ("curves", "diagnostic_curves")


def summary_items(summary: Mapping[str, Any]) -> Tuple[Dict[str, float], Dict[str, str]]:
    """The run summary as ``summary/<dotted key>`` numbers (finite) and strings (everything else but lists): final
    accuracy, wall time, status, provenance (code commit, versions, digests)."""
    numbers_: Dict[str, float] = {}
    texts: Dict[str, str] = {}
    for key, value in flatten({k: v for k, v in summary.items() if k not in SUMMARY_SKIP}):
        name = f"summary/{key}"
        x = scalar(value)
        if x is not None and math.isfinite(x) and not isinstance(value, bool):
            numbers_[name] = x
        elif value is None or isinstance(value, (str, bool)):
            texts[name] = "null" if value is None else str(value)
    return numbers_, texts


def merge_rows(records: Sequence[Mapping[str, Any]]) -> List[Row]:
    """metrics.jsonl records (in file order, steps non-decreasing) -> one row per step, the step's lines merged (a
    later line's key wins), as W&B's history keeps them."""
    rows: List[Row] = []
    for rec in records:
        step = int(rec["step"])
        values = {k: v for k, v in rec.items() if k != "step"}
        if rows and rows[-1][0] == step:
            rows[-1][1].update(values)
        else:
            rows.append((step, values))
    return rows
