"""``stats_logger.wandb``: the run's metrics, config and summary as a Weights & Biases run.

``offline`` writes ``<dir>/wandb/offline-run-<time>-<id>/`` per session (a resume is a new session of the same run
id); ``wandb sync <dir>/wandb/offline-run-*-<id>`` uploads them in order as one run. ``wandb`` is imported here only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from stalerl.results.trackers.base import Row, Tracker, scalar_metrics, summary_items

# wandb prints its own banner and run links unless silenced; stalerl prints one line at start and end instead.
_SETTINGS = {"console": "off", "silent": True}


def run_name(cfg: Any) -> str:
    return cfg.stats_logger.wandb.name or f"{cfg.experiment_name}/{cfg.trial_name}"


def run_group(cfg: Any) -> str:
    return cfg.stats_logger.wandb.group or cfg.experiment_name


def wandb_dir(cfg: Any, run_dir: Path) -> Path:
    """The folder W&B writes its ``wandb/`` directory into."""
    return Path(cfg.stats_logger.wandb.dir).expanduser() if cfg.stats_logger.wandb.dir else Path(run_dir)


def offline_sessions(root: Path, run_id: str) -> List[Path]:
    """The offline session directories of run ``run_id`` under ``root`` (the ``wandb/`` folder), oldest first."""
    return sorted(p for p in root.glob(f"offline-run-*-{run_id}") if p.is_dir())


def history_steps(session: Path) -> List[int]:
    """The history steps one session's ``.wandb`` transaction log holds, read with wandb's own reader
    (``wandb leet inspect --json``); a log cut short by a kill yields the records written before it."""
    files = sorted(session.glob("run-*.wandb"))
    if not files:
        return []
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(files[0])],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"wandb leet inspect {files[0]}: {(out.stderr or out.stdout).strip()[:300]}")
    steps = []
    for line in out.stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("type") == "history":
            steps.append(int(rec["history"].get("step", {}).get("num", 0)))
    return steps


class WandbTracker(Tracker):
    name = "W&B"
    key = "wandb"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.mode = cfg.stats_logger.wandb.mode
        self.run: Any = None
        self.run_id = ""
        self.root = Path()
        self._resumed = False

    def start(self, run_dir: Any, state: Optional[Mapping[str, Any]], log) -> Dict[str, Any]:
        import wandb

        from stalerl.results.run_summary import _config_dict as config_dict

        c = self.cfg.stats_logger.wandb
        base = wandb_dir(self.cfg, Path(run_dir))
        base.mkdir(parents=True, exist_ok=True)
        self._resumed = bool(state and state.get("id"))
        # W&B run ids: lowercase letters and digits; our own, so no wandb helper that moves between versions is needed
        self.run_id = str(state["id"]) if self._resumed else uuid.uuid4().hex[:12]
        self.root = base / "wandb"
        self._earlier = offline_sessions(self.root, self.run_id) if self._resumed else []
        self.run = wandb.init(mode=self.mode, project=c.project, entity=c.entity, name=run_name(self.cfg),
                              group=run_group(self.cfg), tags=list(c.tags) or None, dir=str(base), id=self.run_id,
                              resume="allow", config=config_dict(self.cfg), settings=wandb.Settings(**_SETTINGS))
        if self._resumed:  # a resumed trial may have changed harmless keys (total_train_steps to extend it)
            self.run.config.update(config_dict(self.cfg), allow_val_change=True)
        verb = "continues" if self._resumed else "started"
        if self.mode == "offline":
            log(f"stalerl: W&B offline run {self.run_id} {verb} in {self.root} (project {c.project}, group "
                f"{run_group(self.cfg)}); upload it later with: {self.sync_command()}")
        else:
            log(f"stalerl: W&B run {verb}: {self.run.url or self.run_id}")
        return {"id": self.run_id, "mode": self.mode, "dir": str(base), "project": c.project}

    def sync_command(self) -> str:
        return f"wandb sync {self.root}/offline-run-*-{self.run_id}"

    def last_step(self) -> Optional[int]:
        if not self._resumed:
            return None
        if self.mode == "online":
            first = int(getattr(self.run, "starting_step", 0) or 0)  # the server's next step for a resumed run
            return first - 1 if first > 0 else None
        steps = [s for session in self._earlier for s in history_steps(session)]
        return max(steps) if steps else None

    def log_rows(self, rows: Sequence[Row]) -> None:
        for step, values in rows:
            # commit=True: the step's row is written now, not when a later step arrives (a kill would lose it)
            self.run.log(scalar_metrics(values), step=int(step), commit=True)

    def finish(self, status: str, summary: Optional[Mapping[str, Any]], files: Sequence[Any]) -> None:
        if summary:
            numbers_, texts = summary_items(summary)
            self.run.summary.update({**numbers_, **texts})
        self.run.finish(exit_code=0 if status == "finished" else 1)
        self.run = None

    def end_lines(self) -> List[str]:
        if self.mode == "offline":
            return [f"stalerl: W&B offline run {self.run_id} is in {self.root}; upload it with: "
                    f"{self.sync_command()}"]
        return []
