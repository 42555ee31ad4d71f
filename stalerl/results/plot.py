"""``stalerl-plot``: compare runs by plotting metrics from their ``metrics.jsonl`` files.

    stalerl-plot runs/m2po runs/grpo --metrics reward grad_norm --smooth 10 --out compare.png

One subplot per metric, one line per run, x = step. A metric name matches its exact key, or else the single key that
ends in ``/<name>`` (so ``grad_norm`` finds ``actor/grad_norm``). Needs matplotlib: ``pip install "stalerl[plot]"``.
Only matplotlib's object-oriented Agg API is used (no pyplot), so calling :func:`plot_runs` from a notebook or
another program never changes its global backend.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from stalerl.core.io import PathLike, atomic_write_bytes
from stalerl.results.metrics_log import METRICS_FILE, read_metrics

__all__ = ["DEFAULT_METRICS", "PlotError", "main", "moving_average", "plot_runs", "resolve_metric_key"]

DEFAULT_METRICS = ("reward", "grad_norm")
_INSTALL_HINT = 'stalerl-plot needs matplotlib; install it with: pip install "stalerl[plot]"'


class PlotError(ValueError):
    """A user-facing problem with the inputs (missing run, metric, mismatched labels)."""


def _import_matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return Figure, FigureCanvasAgg, MaxNLocator


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average; the first ``window - 1`` points average over what is available (no lag padding)."""
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    out: list[float] = []
    acc = 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def resolve_metric_key(name: str, keys: set[str] | Sequence[str]) -> str | None:
    """``name`` if present, else the unique key ending in ``/name``; None if absent. Ambiguity is a PlotError."""
    if name in keys:
        return name
    matches = sorted(k for k in keys if k.endswith("/" + name))
    if len(matches) > 1:
        raise PlotError(f"metric {name!r} is ambiguous; use one of: {', '.join(matches)}")
    return matches[0] if matches else None


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) for ``key``: numbers only (lists/strings/NaN/inf skipped); a repeated step keeps the last."""
    by_step: dict[int, float] = {}
    for rec in records:
        v = rec.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):  # bool is an int: plotted as 0/1, which is fine
            by_step[rec["step"]] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _default_labels(run_dirs: list[Path]) -> list[str]:
    # The trial name is the run directory's name; if two runs share it (runs/a/seed0, runs/b/seed0), add the parent.
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{p.resolve().parent.name}/{p.resolve().name}" for p in run_dirs]


def _load_runs(run_dirs: list[Path]) -> list[list[dict]]:
    runs = []
    for d in run_dirs:
        if not d.exists():
            raise PlotError(f"run directory not found: {d}")
        path = d if d.is_file() else d / METRICS_FILE
        if not path.is_file():
            raise PlotError(f"no {METRICS_FILE} in {d}")
        runs.append(read_metrics(path))
    return runs


def plot_runs(
    run_dirs: Sequence[PathLike],
    metrics: Sequence[str] = DEFAULT_METRICS,
    out: PathLike = "plot.png",
    smooth: int = 1,
    labels: Sequence[str] | None = None,
    *,
    title: str | None = None,
    warn: Any = None,
) -> Path:
    """Draw one subplot per metric with one line per run and write the figure to ``out`` (PNG by default).

    A metric missing from some runs is reported through ``warn`` (default: a line on stderr) and drawn for the
    others; a metric missing from every run raises :class:`PlotError` naming the keys that do exist.
    Returns the written path.
    """
    if not run_dirs:
        raise PlotError("no run directories given")
    if not metrics:
        raise PlotError("no metrics given")
    if smooth < 1:
        raise PlotError(f"--smooth must be >= 1, got {smooth}")
    dirs = [Path(d) for d in run_dirs]
    if labels is not None and len(labels) != len(dirs):
        raise PlotError(f"got {len(labels)} labels for {len(dirs)} runs")
    names = list(labels) if labels is not None else _default_labels(dirs)
    say = warn if warn is not None else (lambda msg: print(f"stalerl-plot: warning: {msg}", file=sys.stderr))

    runs = _load_runs(dirs)
    run_keys = [set().union(*(r.keys() for r in records)) - {"step"} if records else set() for records in runs]

    # Resolve every (metric, run) pair first so that errors come before any drawing work.
    resolved: list[list[str | None]] = []
    for metric in metrics:
        row = [resolve_metric_key(metric, keys) for keys in run_keys]
        if all(k is None for k in row):
            available = ", ".join(sorted(set().union(*run_keys))) or "none"
            raise PlotError(f"metric {metric!r} not found in any run ({', '.join(names)}); available: {available}")
        for name, key in zip(names, row):
            if key is None:
                say(f"metric {metric!r} not found in run {name!r}; skipping it in that subplot")
        resolved.append(row)

    Figure, FigureCanvasAgg, MaxNLocator = _import_matplotlib()
    fig = Figure(figsize=(8.0, 2.8 * len(metrics)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    for ax, metric, row in zip(axes, metrics, resolved):
        smoothed = False
        for name, records, key in zip(names, runs, row):
            if key is None:
                continue
            steps, values = _series(records, key)
            if not steps:
                say(f"metric {metric!r} has no numeric values in run {name!r}")
                continue
            # A sparse metric (e.g. eval every N steps) is drawn as measured: averaging its few points over a
            # window of N *points* would smear it over N*freq steps.
            sparse = len(steps) < 0.5 * len(records)
            if sparse:
                ax.plot(steps, values, label=name, linewidth=1.4, marker="o", markersize=3)
            else:
                ax.plot(steps, moving_average(values, smooth), label=name, linewidth=1.4)
                smoothed = smoothed or smooth > 1
        keys_used = sorted({k for k in row if k is not None})
        ax.set_ylabel(metric)
        ax.set_title(", ".join(keys_used) + (f" (moving average {smooth})" if smoothed else ""), fontsize=9)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    if title:
        fig.suptitle(title)

    out_path = Path(out)
    fmt = out_path.suffix.lstrip(".").lower() or "png"
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=120)
    atomic_write_bytes(out_path, buf.getvalue())  # never leave a half-written image behind
    return out_path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stalerl-plot",
        description="Plot metrics.jsonl of one or more stalerl runs: one subplot per metric, one line per run.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each holding metrics.jsonl)")
    p.add_argument(
        "--metrics",
        nargs="+",
        default=list(DEFAULT_METRICS),
        metavar="KEY",
        help="metric keys; 'grad_norm' also matches a unique '.../grad_norm' key (default: %(default)s)",
    )
    p.add_argument("--smooth", type=int, default=1, metavar="N", help="trailing moving-average window (default: 1)")
    p.add_argument("--out", default="plot.png", help="output image (default: %(default)s)")
    p.add_argument("--labels", nargs="+", default=None, help="legend labels, one per run (default: directory names)")
    p.add_argument("--title", default=None, help="figure title")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input or missing matplotlib)."""
    args = _parser().parse_args(argv)
    try:
        out = plot_runs(args.run_dirs, args.metrics, args.out, smooth=args.smooth, labels=args.labels, title=args.title)
    except (PlotError, ImportError) as exc:
        print(f"stalerl-plot: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
