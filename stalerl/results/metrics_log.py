"""Per-step metrics: a durable JSON-lines log (+ optional TensorBoard), progress output and one-line summaries.

``<run_dir>/metrics.jsonl`` holds one ``{"step": N, ...}`` object per :meth:`MetricsLogger.log` call. It is the
source of truth (``stalerl-plot`` reads it); TensorBoard is a convenience mirror of the scalar values.

Resuming: a run killed after logging step ``k + 3`` but whose newest checkpoint is step ``k`` will recompute steps
``k+1 .. k+3``. ``MetricsLogger(run_dir, resume_step=k)`` therefore first drops every line with ``step > k`` (and any
torn last line), atomically, so the finished file has exactly the lines an uninterrupted run would have written.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterable, Mapping, Optional, Sequence

from stalerl.core.io import PathLike, append_jsonl, atomic_write_text, to_jsonable

__all__ = [
    "METRICS_FILE",
    "DEFAULT_PROGRESS_KEYS",
    "MetricsLogger",
    "Progress",
    "format_summary",
    "is_interactive",
    "lookup_metric",
    "read_metrics",
]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _metrics_path(path_or_run_dir: PathLike) -> Path:
    p = Path(path_or_run_dir)
    return p / METRICS_FILE if p.is_dir() else p


def _parse_lines(text: str, source: Path, *, quiet: bool = False) -> list[dict]:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            # Typically the torn last line of a killed writer; everything else in the file is still usable.
            if not quiet:
                logger.warning("%s:%d: skipping malformed line %.80r", source, lineno, line)
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            if not quiet:
                logger.warning("%s:%d: skipping line without an integer 'step'", source, lineno)
            continue
        records.append(rec)
    return records


def read_metrics(path_or_run_dir: PathLike) -> list[dict]:
    """All records of a ``metrics.jsonl`` (given the file or its run directory), in file order.

    Malformed lines (e.g. a line torn by a crash) are skipped with a warning. Raises ``FileNotFoundError`` with the
    path if there is no metrics file.
    """
    path = _metrics_path(path_or_run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return _parse_lines(path.read_text(encoding="utf-8"), path)


def _truncate_after(path: Path, step: int) -> tuple[int, int]:
    """Atomically keep only well-formed lines with ``step <= step``; returns (lines dropped, of which malformed)."""
    if not path.is_file():
        return 0, 0
    text = path.read_text(encoding="utf-8")
    kept: list[str] = []
    dropped = torn = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            keep = isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step
        except json.JSONDecodeError:
            keep = False
            torn += 1
        if keep:
            kept.append(line)  # the original bytes, so kept lines are byte-identical to an uninterrupted run
        else:
            dropped += 1
    if dropped or (text and not text.endswith("\n")):  # nothing to drop: don't rewrite a possibly large file
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped, torn


def _scalar(value: Any) -> float | None:
    """A float for TensorBoard if ``value`` is a single number, else None (lists, strings, None are skipped)."""
    value = to_jsonable(value)  # tensors / numpy scalars -> Python numbers (or lists, which we skip)
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


class MetricsLogger:
    """Append one JSON line per :meth:`log` call to ``<run_dir>/metrics.jsonl``; mirror scalars to TensorBoard.

    Args:
        run_dir: the run directory (created if missing).
        tensorboard: also write scalars to ``<run_dir>/tensorboard`` with ``torch.utils.tensorboard`` when the
            ``tensorboard`` package is importable (a warning is logged once if it is not).
        resume_step: the step of the checkpoint being resumed. Lines with ``step > resume_step`` are dropped from an
            existing file, and TensorBoard events after it are purged. ``None`` (fresh start) appends to whatever is
            there -- deliberately not destructive; start fresh runs in fresh directories.
    """

    def __init__(self, run_dir: PathLike, *, tensorboard: bool = True, resume_step: int | None = None,
                 resume_rows: Sequence[Mapping[str, Any]] | None = None, log=print) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.resume_step = None if resume_step is None else int(resume_step)
        self._rows: list[dict] = []  # the records of the latest step logged (a checkpoint of that step keeps them)
        if self.resume_step is not None:
            dropped, torn = _truncate_after(self.path, self.resume_step)
            if dropped:
                logger.info(
                    "resuming at step %d: dropped %d metric lines from %s", self.resume_step, dropped, self.path
                )
            if torn:
                log(f"stalerl: {self.path}: dropped {torn} malformed (torn) line(s) on resume")
            self._restore_checkpoint_rows(resume_rows, log)
        self._tb_enabled = tensorboard
        self._tb_writer: Any = None
        self._closed = False

    def _restore_checkpoint_rows(self, rows: Sequence[Mapping[str, Any]] | None, log) -> None:
        """The resumed checkpoint's own step must have its line(s): a torn last line (a crash or a full disk while
        writing it) is restored from the rows the checkpoint recorded, and said so."""
        step = self.resume_step
        have = self.path.is_file() and any(r["step"] == step for r in _parse_lines(
            self.path.read_text(encoding="utf-8"), self.path, quiet=True))
        if have or step == 0:
            return
        if rows:
            for row in rows:
                append_jsonl(self.path, row)
            log(f"stalerl: {self.path} had no intact line for step {step} (torn); restored it from the checkpoint "
                f"of step {step}")
        else:
            log(f"stalerl: {self.path} has no line for step {step} and its checkpoint does not record one; that "
                "step's metrics are missing from the file")

    def rows_of(self, step: int) -> list[dict]:
        """The records logged for ``step`` if it is the latest step logged (what a checkpoint of it records)."""
        return [dict(r) for r in self._rows if r["step"] == int(step)]

    def _writer(self) -> Any:
        # Created lazily: importing tensorboard costs seconds and most short runs/tests never need it.
        if self._tb_writer is None and self._tb_enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                logger.warning(
                    'TensorBoard logging disabled (%s); install it with: pip install "stalerl[tensorboard]"', exc
                )
                self._tb_enabled = False
                return None
            # purge_step discards events at steps > resume_step written by the killed run, matching the JSONL file.
            purge = None if self.resume_step is None else self.resume_step + 1
            _quiet_tensorboard_thread_errors()
            self._tb_writer = self._tensorboard(SummaryWriter, log_dir=str(self.run_dir / TENSORBOARD_DIR),
                                                purge_step=purge)
        return self._tb_writer

    def _tensorboard(self, call, *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)`` on TensorBoard's writer. Its events are written by a background thread, whose
        error (a full disk, a read-only file system) comes back on a later call: the same one-line ResourceError as
        for metrics.jsonl (whose lines are all whole), and the writer is dropped so closing does not raise it again."""
        from stalerl.core.errors import resource_error

        try:
            return call(*args, **kwargs)
        except OSError as exc:
            resource = resource_error(exc, "TensorBoard events", self.run_dir / TENSORBOARD_DIR)
            if resource is None:
                raise
            self._tb_writer, self._tb_enabled = None, False
            raise resource from exc

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append ``{"step": step, **metrics}`` as one durable line; scalar values also go to TensorBoard.

        Values may be numbers, tensors, numpy values, strings or nested lists (e.g. a staleness histogram). Each call
        writes its own line, so eval metrics may be logged separately for the same step.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step'; pass it as the step argument")
        step = int(step)
        record = {"step": step, **{str(k): to_jsonable(v) for k, v in metrics.items()}}
        append_jsonl(self.path, record)
        if self._rows and self._rows[-1]["step"] != step:
            self._rows = []
        self._rows.append(record)
        writer = self._writer()
        if writer is not None:
            for key, value in record.items():
                if key == "step":
                    continue
                scalar = _scalar(value)
                if scalar is not None:
                    self._tensorboard(writer.add_scalar, key, scalar, global_step=step)

    def flush(self) -> None:
        """Flush TensorBoard (the JSONL file is already durable after every :meth:`log`)."""
        if self._tb_writer is not None:
            self._tensorboard(self._tb_writer.flush)

    def close(self) -> None:
        """Flush and close TensorBoard. Idempotent."""
        self._closed = True
        if self._tb_writer is not None:
            writer, self._tb_writer = self._tb_writer, None
            self._tensorboard(writer.close)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quiet_tensorboard_thread_errors() -> None:
    """TensorBoard's writer thread re-raises its write error, which Python prints as a thread traceback; a full disk
    or read-only file system comes back in the main thread as one line (MetricsLogger._tensorboard), so only that
    case is kept off the console (any other error of any thread is printed as before). Installed once."""
    import threading

    from stalerl.core.errors import resource_error

    previous = threading.excepthook
    if getattr(previous, "_stalerl_quiet_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and resource_error(args.exc_value, "", "") is not None:
            return
        previous(args)

    hook._stalerl_quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


# ------------------------------------------------------------------------------------------- console reporting

# Short label -> keys to look for, in order. Trainers name things differently ("reward" vs "critic/rewards/mean"),
# so besides these exact keys, lookup_metric also accepts a unique key ending in "/<candidate>".
DEFAULT_PROGRESS_KEYS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "reward/mean", "critic/rewards/mean", "critic/score/mean"),
    # held-out greedy accuracy only: the trainer's batch "accuracy" (samples with reward 1) is the batch reward
    # again for 0/1 rewards, and an "acc=" fed by it read as accuracy (issue 28)
    "eval_acc": ("eval/acc", "eval/accuracy"),
    "loss": ("loss", "actor/pg_loss", "actor/loss", "pg_loss"),
    "gnorm": ("grad_norm", "actor/grad_norm"),
    "stale": ("staleness", "staleness/mean", "staleness_mean"),
    "masked": ("masked_fraction", "mask_fraction", "masked_frac", "actor/masked_fraction", "m2po/masked_fraction"),
}


def lookup_metric(metrics: Mapping[str, Any], candidates: Sequence[str]) -> Any | None:
    """First value among ``candidates`` (exact keys), else the value of the unique key ending in ``/candidate``."""
    for key in candidates:
        if key in metrics:
            return metrics[key]
    for key in candidates:
        matches = [k for k in metrics if k.endswith("/" + key)]
        if len(matches) == 1:
            return metrics[matches[0]]
    return None


def _fmt(value: Any) -> str | None:
    value = to_jsonable(value)
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    return None  # lists/dicts do not fit on one line


#: The last segment of a loss's own headline fractions, ``actor/<loss>/<fraction>``: M2PO's masked share, a clip's
#: clipped share, whatever loss logs one (the runtime names no loss).
LOSS_FRACTIONS = ("masked_fraction", "clip_fraction")


def loss_fraction_keys(keys: Iterable[str], fraction: Optional[str] = None) -> list[str]:
    """The ``actor/<loss>/<fraction>`` keys among ``keys`` (``fraction`` one of :data:`LOSS_FRACTIONS`, None: both),
    sorted; ``actor/m2po/would_clip_fraction`` and per-quadrant keys are not headline fractions."""
    wanted = LOSS_FRACTIONS if fraction is None else (fraction,)
    return sorted(k for k in keys if k.startswith("actor/") and k.count("/") == 2 and k.rsplit("/", 1)[1] in wanted)


def format_summary(step: int, metrics: Mapping[str, Any], keys: Sequence[str], *, total: int | None = None) -> str:
    """One line such as ``step 120/500 | reward=0.4375 | actor/grad_norm=1.23``.

    ``keys`` are looked up with :func:`lookup_metric` (exact key, else a unique ``.../key`` suffix); keys absent from
    ``metrics`` or holding lists are left out rather than shown as noise.
    """
    parts = [f"step {step}" if total is None else f"step {step}/{total}"]
    for key in keys:
        text = _fmt(lookup_metric(metrics, (key,)))
        if text is not None:
            parts.append(f"{key}={text}")
    return " | ".join(parts)


def is_interactive(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal a person watches (live bar), not a file, a pipe or a CI log (plain lines).

    A CI job (``CI`` set, as GitHub Actions, GitLab CI and most others do) counts as non-interactive even when it
    allocates a pseudo-terminal, because its log is read afterwards, line by line; so does ``TERM=dumb``.
    """
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class Progress:
    """Step progress whose form suits where it goes; both show the key numbers of the latest step.

    On an interactive terminal (:func:`is_interactive`) it is a live bar (tqdm when installed). Anywhere else -- a
    file, a pipe, a CI log -- a bar would write hundreds of carriage-return frames that bury the step lines, so it
    prints a plain line every ~10% of the steps (``PLAIN_LINES`` lines per run) and at the last step, e.g.
    ``train: 30/300 steps (10%) | 12.3s elapsed, ~1.8m left | reward=0.41 eval_acc=0.5 loss=-0.01``.

    ``update(step, metrics)`` moves to ``step`` (absolute, so resuming mid-run just works) and shows reward,
    accuracy, loss, grad norm, staleness and masked fraction when present (see :data:`DEFAULT_PROGRESS_KEYS`); each
    shown value stays until a newer one arrives. ``interactive`` overrides the detection. With ``enabled=False`` it
    does nothing; use :func:`format_summary` for log lines.
    """

    PLAIN_LINES = 10

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        *,
        initial: int = 0,
        desc: str | None = "train",
        keys: Mapping[str, Sequence[str]] | None = None,
        file: IO[str] | None = None,
        interactive: bool | None = None,
    ) -> None:
        self.total = int(total)
        self.keys = dict(DEFAULT_PROGRESS_KEYS if keys is None else keys)
        self._bar: Any = None
        self._shown: dict[str, str] = {}
        self._file = file if file is not None else sys.stderr
        self._desc = desc or "progress"
        self._plain = False
        self.interactive = False
        if not enabled:
            return
        self.interactive = is_interactive(self._file) if interactive is None else bool(interactive)
        if self.interactive:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                logger.debug("tqdm not installed; plain progress lines instead of a bar")
            else:
                self._bar = tqdm(total=self.total, initial=int(initial), desc=desc, unit="step", dynamic_ncols=True,
                                 file=self._file)
                return
        self._plain = True
        self._start_step = self._step = int(initial)
        self._start_time = time.monotonic()
        self._every = max(1, math.ceil(self.total / self.PLAIN_LINES))
        self._next_line = (self._step // self._every + 1) * self._every  # the next multiple of ~10% after `initial`

    @property
    def enabled(self) -> bool:
        return self._bar is not None or self._plain

    def postfix(self, metrics: Mapping[str, Any]) -> dict[str, str]:
        """The label -> formatted value pairs shown for ``metrics``."""
        out = {}
        for label, candidates in self.keys.items():
            text = _fmt(lookup_metric(metrics, candidates))
            if text is not None:
                out[label] = text
        return out

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        if self._bar is None and not self._plain:
            return
        if metrics:
            # Sticky: a line holding only eval metrics must not blank out the training numbers shown so far.
            self._shown.update(self.postfix(metrics))
        if self._plain:
            self._step = int(step)
            if self._step >= self._next_line or self._step >= self.total:
                self._file.write(self.plain_line() + "\n")
                self._file.flush()
                self._next_line = (self._step // self._every + 1) * self._every
            return
        if metrics:
            self._bar.set_postfix(self._shown, refresh=False)
        delta = int(step) - self._bar.n
        if delta:
            self._bar.update(delta)
        else:
            self._bar.refresh()

    def plain_line(self) -> str:
        """The plain progress line for the current step (non-interactive output)."""
        pct = 100 * self._step / self.total if self.total else 100.0
        elapsed = time.monotonic() - self._start_time
        done = self._step - self._start_step
        timing = f"{_duration(elapsed)} elapsed"
        if 0 < done and self._step < self.total:
            timing += f", ~{_duration(elapsed / done * (self.total - self._step))} left"
        parts = [f"{self._desc}: {self._step}/{self.total} steps ({pct:.0f}%)", timing]
        if self._shown:
            parts.append(" ".join(f"{k}={v}" for k, v in self._shown.items()))
        return " | ".join(parts)

    def close(self) -> None:
        """Stop output (idempotent); the bar, if any, is closed."""
        bar, self._bar, self._plain = self._bar, None, False
        if bar is not None:
            bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
