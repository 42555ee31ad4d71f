"""Experiment trackers (stats_logger.wandb / stats_logger.mlflow) beside metrics.jsonl and TensorBoard.

:func:`open_metrics_logger` is the one place the trainer opens its metrics logger; trackers hang off it.

The rule that keeps a tracker's run equal to ``metrics.jsonl`` across resumes, SIGTERM and kills: a row goes to the
trackers only once it is **durable**, i.e. no resume can drop it. A resume from the checkpoint of step ``k`` drops
the lines of steps ``> k`` (MetricsLogger), and neither W&B's history nor MLflow's metrics can be rewound, so a row
of step ``s`` is sent when a checkpoint of a step ``>= s`` exists, when the trial has finished (``finished.json``),
or at once when nothing can resume (``recover.mode=disabled``). A resumed trial continues the same tracker runs
(their ids are kept in ``<run_dir>/trackers.json``), asks each tracker for the highest step it holds, and sends the
rows of ``metrics.jsonl`` after it (rows a kill cut off before they reached the tracker). So the tracker lags the
file by at most one checkpoint interval (recover.freq_steps / recover.freq_minutes) while a run is live, and ends
with exactly its rows. A tracker that fails (server gone, disk full) is one warning line; the run goes on.

The trackers' runs end when the launcher has written ``summary.json`` (:func:`finish_trackers`: the summary and the
artifacts go in, then the closing line, e.g. the ``wandb sync`` command), or at interpreter exit for a trainer run
without the launcher.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from stalerl.core.io import atomic_write_text
from stalerl.results.metrics_log import MetricsLogger, PathLike, read_metrics
from stalerl.results.trackers.base import Tracker, merge_rows

STATE_FILE = "trackers.json"
FINISHED_FILE = "finished.json"  # stalerl.training.trial_dir writes it when a trial has trained all its steps
_CHECKPOINT_RE = re.compile(r"^step_(\d+)(?:\.old-\d+)?$")  # committed checkpoints (stalerl.training.checkpoint)

# Loggers whose trackers are still open, by resolved run directory: finish_trackers (the launcher, once the summary
# is written) or the interpreter's exit ends them.
_OPEN: Dict[Path, "TrackedMetricsLogger"] = {}


def open_metrics_logger(run_dir: PathLike, cfg: Any, *, resume_step: Optional[int], resume_rows: Optional[Sequence],
                        log: Callable[[str], None]) -> MetricsLogger:
    """The run's metrics logger: metrics.jsonl, TensorBoard (stats_logger.tensorboard) and the enabled trackers."""
    from stalerl.results.trackers import enabled_trackers

    trackers = enabled_trackers(cfg) if _logs_here() else []
    if not trackers:
        return MetricsLogger(run_dir, tensorboard=cfg.stats_logger.tensorboard, resume_step=resume_step,
                             resume_rows=resume_rows, log=log)
    return TrackedMetricsLogger(run_dir, cfg, trackers, resume_step=resume_step, resume_rows=resume_rows, log=log)


def _logs_here() -> bool:
    """Only rank 0 (the controller) talks to trackers; rollout workers' metrics reach it as rows."""
    return os.environ.get("RANK", "0") in ("", "0")


def latest_checkpoint_step(run_dir: Path) -> Optional[int]:
    root = Path(run_dir) / "checkpoints"
    try:
        steps = [int(m.group(1)) for m in map(_CHECKPOINT_RE.match, os.listdir(root)) if m]
    except OSError:
        return None
    return max(steps) if steps else None


def durable_step(run_dir: Path, cfg: Any) -> float:
    """Rows with ``step <=`` this can no longer be dropped by a resume (see the module doc)."""
    if cfg.recover.mode == "disabled" or (Path(run_dir) / FINISHED_FILE).is_file():
        return math.inf
    latest = latest_checkpoint_step(run_dir)
    return -1 if latest is None else latest


def read_state(run_dir: Path) -> Dict[str, Any]:
    try:
        state = json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


class TrackedMetricsLogger(MetricsLogger):
    """A :class:`MetricsLogger` that also feeds its durable rows to experiment trackers (see the module doc)."""

    def __init__(self, run_dir: PathLike, cfg: Any, trackers: Sequence[Tracker], *, resume_step: Optional[int],
                 resume_rows: Optional[Sequence], log: Callable[[str], None]) -> None:
        super().__init__(run_dir, tensorboard=cfg.stats_logger.tensorboard, resume_step=resume_step,
                         resume_rows=resume_rows, log=log)
        self.cfg = cfg
        self._say = log
        self._pending: List[dict] = []  # rows in metrics.jsonl not yet durable (or not yet sent)
        self.live: List[Tracker] = []
        self._have: Dict[str, Optional[int]] = {}  # per tracker: the highest step its run holds
        self._finished = False
        earlier = read_state(self.run_dir) if resume_step is not None else {}
        state: Dict[str, Any] = dict(earlier)  # a tracker that fails to start now keeps its run for the next resume
        for tracker in trackers:
            try:
                state[tracker.key] = tracker.start(self.run_dir, earlier.get(tracker.key), log)
                have = tracker.last_step()
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                self._fail(tracker, exc, "could not start")
                continue
            if have is not None and resume_step is not None and have > resume_step:
                log(f"stalerl: the {tracker.name} run holds steps up to {have} but the trial resumes from the "
                    f"checkpoint of step {resume_step}: a tracker cannot rewind, so steps {resume_step + 1}..{have} "
                    "keep the values logged before and the new rows start after them")
            self.live.append(tracker)
            self._have[tracker.key] = have
        if state:
            atomic_write_text(self.run_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")
        if resume_step is not None and self.path.is_file():
            self._pending = read_metrics(self.path)  # all <= resume_step: durable; a tracker gets those it lacks
        self._forward()
        _OPEN[self.run_dir.resolve()] = self
        _register_exit_hook()

    def _fail(self, tracker: Tracker, exc: BaseException, what: str) -> None:
        if tracker in self.live:
            self.live.remove(tracker)
        have = self._have.get(tracker.key)
        held = f"its run holds the steps up to {have}" if have is not None else "its run holds no steps"
        self._say(f"stalerl: {tracker.name} tracking stopped, {what} ({_one_line(exc)}); {held}. metrics.jsonl "
                  "and TensorBoard go on")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        super().log(step, metrics)
        self._pending.append(self._rows[-1])
        self._forward()

    def _forward(self) -> None:
        """Send the pending rows that are durable to every live tracker."""
        if not self.live or not self._pending:
            return
        durable = durable_step(self.run_dir, self.cfg)
        n = 0
        while n < len(self._pending) and self._pending[n]["step"] <= durable:  # rows are in step order
            n += 1
        if not n:
            return
        rows, self._pending = merge_rows(self._pending[:n]), self._pending[n:]
        for tracker in list(self.live):
            have = self._have.get(tracker.key)
            todo = [r for r in rows if have is None or r[0] > have]
            if not todo:
                continue
            try:
                tracker.log_rows(todo)
            except Exception as exc:  # noqa: BLE001
                self._fail(tracker, exc, f"logging step {todo[0][0]}")
                continue
            self._have[tracker.key] = todo[-1][0]

    def close(self) -> None:
        """Close metrics.jsonl/TensorBoard and send what is durable; the trackers' runs stay open for the summary."""
        super().close()
        self._forward()

    def finish(self, status: str, summary: Optional[Mapping[str, Any]] = None,
               files: Sequence[PathLike] = ()) -> None:
        """Send what is durable now, then each tracker's summary and artifacts; end its run. Idempotent."""
        _OPEN.pop(self.run_dir.resolve(), None)
        if self._finished:
            return
        self._finished = True
        self._forward()
        for tracker in list(self.live):
            try:
                tracker.finish(status, summary, list(files))
            except Exception as exc:  # noqa: BLE001
                self._fail(tracker, exc, "ending its run")
                continue
            for line in tracker.end_lines():
                self._say(line)
        self.live = []


def finish_trackers(run_dir: PathLike, status: str, summary_path: Optional[PathLike] = None) -> None:
    """End the trackers of the run in ``run_dir`` (if this process opened any): its remaining durable rows, then
    ``summary.json`` (flattened into the tracker's summary; with ``config.yaml`` as artifacts), then ``status``."""
    logger = _OPEN.get(Path(run_dir).resolve())
    if logger is None:
        return
    summary = None
    files: List[Path] = []
    if summary_path is not None and Path(summary_path).is_file():
        try:
            summary = json.loads(Path(summary_path).read_text())
            files.append(Path(summary_path))
        except ValueError:
            summary = None
    config = Path(run_dir) / "config.yaml"
    if config.is_file():
        files.append(config)
    logger.finish(status, summary, files)


_EXIT_HOOK: List[bool] = []


def _register_exit_hook() -> None:
    """Once, after the trackers' packages are imported: atexit runs hooks last-in first-out, so ours ends the runs
    before wandb's own exit hook tears its run down."""
    if not _EXIT_HOOK:
        atexit.register(_finish_at_exit)
        _EXIT_HOOK.append(True)


def _finish_at_exit() -> None:
    """A trainer run without the launcher (no summary): end its trackers as finished or failed."""
    for run_dir, logger in list(_OPEN.items()):
        logger.finish("finished" if (run_dir / FINISHED_FILE).is_file() else "failed")
