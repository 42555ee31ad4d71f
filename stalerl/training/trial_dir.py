"""What a run may do with the trial directory it is about to use (torch-free; checked before any worker starts).

With ``recover.mode=auto`` or ``resume`` a run continues the trial's latest checkpoint, so its config must agree with
the one that wrote it in every key that changes what is trained (staleness, loss, backends, data, model, ...).
Keys that only change how the run is hosted, logged, evaluated or saved may differ (:data:`HARMLESS`).

A trial that reached its last step leaves ``finished.json``. Running it again says so and exits with code 2, unless
the run *extends* it: a larger ``total_train_steps`` (or more ``total_train_epochs``) than the step it finished at
resumes from its final checkpoint and trains the extra steps. ``recover.mode=disabled`` starts the trial over: the
old checkpoints and marker are set aside (renamed with a time stamp), never deleted.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from stalerl.core.errors import UserError

FINISHED_FILE = "finished.json"
CHECKPOINT_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step_(\d+)$")

# Dotted keys (or prefixes ending in ".") that may change between a checkpoint and the run resuming it. Total steps
# and epochs are handled separately (a larger total extends the trial; a smaller one than the checkpoint is refused).
HARMLESS = (
    "experiment_name", "trial_name", "total_train_steps", "total_train_epochs", "torch_threads",
    "cluster.", "scheduler.", "stats_logger.", "evaluator.", "saver.", "recover.", "eval_gconfig.", "valid_dataset.",
    "actor.device", "actor.mb_spec.", "actor.gradient_checkpointing", "rollout.weight_sync",
)


def config_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain nested dicts (what checkpoints record in their meta.json)."""
    from omegaconf import OmegaConf

    from stalerl.config import config_to_yaml

    return OmegaConf.to_container(OmegaConf.create(config_to_yaml(cfg)), resolve=True)


def flatten(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _harmless(key: str) -> bool:
    return any(key == h or (h.endswith(".") and key.startswith(h)) for h in HARMLESS)


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key that matters and differs; keys only one side has (a newer
    schema) are ignored."""
    a, b = dict(flatten(saved)), dict(flatten(current))
    return [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k] and not _harmless(k)]


def checkpoint_meta(run_dir: Path) -> Optional[dict[str, Any]]:
    """meta.json of the checkpoint a resume would start from (the ``latest`` pointer, else the newest step), or None."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    names = []
    try:
        names.append((root / "latest").read_text().strip())
    except OSError:
        pass
    names += [p.name for p in sorted(root.iterdir(), key=lambda p: -int(_STEP_RE.match(p.name).group(1))
                                     if _STEP_RE.match(p.name) else 0) if _STEP_RE.match(p.name)]
    for name in names:
        try:
            return json.loads((root / name / "meta.json").read_text())
        except (OSError, ValueError):
            continue
    return None


def read_finished(run_dir: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((Path(run_dir) / FINISHED_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_finished(run_dir: Path, *, step: int, total_steps: int, steps_per_epoch: int) -> Path:
    from stalerl.core.io import atomic_write_text

    info = {"step": int(step), "total_steps": int(total_steps), "steps_per_epoch": int(steps_per_epoch),
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return atomic_write_text(Path(run_dir) / FINISHED_FILE, json.dumps(info, indent=2) + "\n")


def clear_finished(run_dir: Path) -> None:
    (Path(run_dir) / FINISHED_FILE).unlink(missing_ok=True)


def planned_total(cfg: Any, steps_per_epoch: Optional[int]) -> Optional[int]:
    """This run's last step as the trainer will compute it (see stalerl.training.trainer.total_steps), when it is known."""
    if steps_per_epoch is not None and steps_per_epoch > 0:
        steps = steps_per_epoch * cfg.total_train_epochs
        return min(steps, cfg.total_train_steps) if cfg.total_train_steps is not None else steps
    return cfg.total_train_steps


def _ways_out(cfg: Any) -> str:
    return (f"use a new trial_name (e.g. trial_name={cfg.trial_name}-2) for this run, or recover.mode=disabled to "
            "start this trial over (its checkpoints are set aside, not deleted)")


def check_trial_dir(cfg: Any, run_dir: Path, log=print) -> None:
    """Refuse (``UserError``) a run that cannot continue the trial in ``run_dir``; set old state aside for a fresh
    start. Called before any worker, task or job starts."""
    run_dir = Path(run_dir)
    meta = checkpoint_meta(run_dir)
    finished = read_finished(run_dir)
    if cfg.recover.mode == "disabled":
        _set_aside(run_dir, meta is not None, finished is not None, log)
        return
    if meta is None and cfg.recover.mode == "resume":
        raise UserError(f"recover.mode=resume but trial {run_dir} has no checkpoint; use recover.mode=auto to start "
                        "fresh when none exists, or check experiment_name / trial_name / cluster.fileroot")
    if meta is None and finished is None:
        return  # nothing to continue: a fresh start
    if meta is None:  # finished without a checkpoint (it ran with recover.mode=disabled): nothing to extend from
        raise UserError(f"trial {run_dir} is finished (step {finished['step']}) and has no checkpoint to extend; "
                        + _ways_out(cfg))
    step = int(meta.get("step", 0))
    saved_cfg = meta.get("config")
    if saved_cfg is None:  # a checkpoint from before configs were recorded: the run's config.yaml is the best record
        try:
            from omegaconf import OmegaConf

            saved_cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
        except Exception:  # noqa: BLE001 - no record at all: nothing to compare
            saved_cfg = None
    if saved_cfg is not None:
        current = config_dict(cfg)
        if isinstance(current.get("rollout"), dict) and "backend" in current["rollout"]:
            # rollout.backend=auto:dX compares as the engine this machine would run (the run resolves it at start)
            from stalerl.config.rules import resolved_rollout_backend

            current["rollout"]["backend"] = resolved_rollout_backend(current["rollout"]["backend"])[0]
        diff = differing_keys(saved_cfg, current)
        if diff:
            shown = ", ".join(f"{k} (checkpoint {_v(a)}, this run {_v(b)})" for k, a, b in diff[:8])
            more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
            raise UserError(f"trial {run_dir} has a checkpoint at step {step} written with a different config: "
                            f"{shown}{more}; {_ways_out(cfg)}")
    per_epoch = (finished or {}).get("steps_per_epoch", meta.get("steps_per_epoch"))
    total = planned_total(cfg, per_epoch)
    if finished is not None and total is not None and total <= int(finished["step"]):
        raise UserError(f"trial {run_dir} is finished (step {finished['step']} of {finished['total_steps']}); to "
                        f"train it further set total_train_steps above {finished['step']} (it resumes from its final "
                        f"checkpoint), or {_ways_out(cfg)}")
    if total is not None and total < step:
        raise UserError(f"trial {run_dir} has a checkpoint at step {step}, past this run's last step {total} "
                        f"(total_train_steps={cfg.total_train_steps}); raise total_train_steps, or {_ways_out(cfg)}")
    if finished is not None:
        log(f"extending finished trial {run_dir} from step {finished['step']} to {total if total else 'the end'}")
        clear_finished(run_dir)


def _v(value: Any) -> str:
    return "null" if value is None else str(value)


def _set_aside(run_dir: Path, has_checkpoints: bool, finished: bool, log) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if has_checkpoints:
        aside = run_dir / f"{CHECKPOINT_DIR}.{stamp}"
        (run_dir / CHECKPOINT_DIR).rename(aside)
        log(f"recover.mode=disabled: starting {run_dir} over; its previous checkpoints moved to {aside}")
    if finished:
        (run_dir / FINISHED_FILE).rename(run_dir / f"finished.{stamp}.json")


# ----------------------------------------------------------------------------------------------------- the lock
LOCK_FILE = ".lock"


class TrialLock:
    """An exclusive OS lock (``fcntl.flock``) on ``<run_dir>/.lock``, held by the run for its whole life.

    The kernel drops the lock when the holder's file descriptor closes, also when the process is SIGKILLed, so a
    lock left by a dead run is stale by construction and the next run simply takes it. The file's text (pid, host,
    start time, command) only names the holder in the refusal; it is never trusted for the decision. Descriptors are
    not inherited by the run's worker processes (Python opens them close-on-exec), so only the controller holds it.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self, ways_out: str) -> "TrialLock":
        import fcntl
        import os
        import socket
        import sys

        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd)
            os.close(fd)
            raise UserError(f"trial {self.run_dir} is in use by another run ({holder}); wait for it to end or stop "
                            f"it (its lock is released when it exits, also if killed), or {ways_out}") from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        import os

        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the flock; the file stays (deleting it would race with a new holder)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "TrialLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_text(fd: int) -> str:
    import os

    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "holder unknown"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"


def lock_trial(cfg: Any, run_dir: Path) -> TrialLock:
    """Take the trial's lock or refuse (``UserError``) naming the holder and the ways out."""
    return TrialLock(run_dir).acquire(f"use a new trial_name (e.g. trial_name={cfg.trial_name}-2)")
