"""The trackers' feeding rule (stalerl.results.tracking), without wandb or mlflow: a tracker that keeps its run in a
JSON file (as a real tracker keeps it on its server) receives only durable rows, continues across a resume, ends
with exactly the rows of metrics.jsonl, and a failing tracker is one line while metrics.jsonl goes on. The real
packages: tests/integrations/trackers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import CPU_CONFIG, REPO
from stalerl.results.metrics_log import read_metrics
from stalerl.results.trackers.base import Tracker, merge_rows, summary_items
from stalerl.results.tracking import STATE_FILE, TrackedMetricsLogger, finish_trackers


class FileTracker(Tracker):
    """A tracker whose run is a JSON file of rows: what it holds survives a "kill" of the logger, as a server's does.
    ``fail_at``: raise OSError (a full disk) when asked to log that step."""

    name = "FileTracker"
    key = "file"

    def __init__(self, store: Path, fail_at: int | None = None):
        self.store, self.fail_at = store, fail_at
        self.run_id = ""

    def _runs(self) -> dict[str, Any]:
        return json.loads(self.store.read_text()) if self.store.is_file() else {}

    def _save(self, runs: dict[str, Any]) -> None:
        self.store.write_text(json.dumps(runs))

    def start(self, run_dir, state, log):
        runs = self._runs()
        self.run_id = state["id"] if state else f"run{len(runs)}"
        runs.setdefault(self.run_id, {"rows": [], "status": "running", "summary": None})
        self._save(runs)
        return {"id": self.run_id}

    def last_step(self):
        rows = self._runs()[self.run_id]["rows"]
        return rows[-1][0] if rows else None

    def log_rows(self, rows):
        if self.fail_at is not None and any(step >= self.fail_at for step, _ in rows):
            raise OSError(28, "No space left on device")
        runs = self._runs()
        runs[self.run_id]["rows"] += [[step, values] for step, values in rows]
        self._save(runs)

    def finish(self, status, summary, files):
        runs = self._runs()
        runs[self.run_id].update(status=status, summary=summary, files=[Path(f).name for f in files])
        self._save(runs)


def _cfg(recover: str = "auto") -> Any:
    return SimpleNamespace(stats_logger=SimpleNamespace(tensorboard=False), recover=SimpleNamespace(mode=recover))


def _checkpoint(run_dir: Path, step: int) -> None:
    (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)


def _row(step: int) -> dict[str, Any]:
    return {"loss": 1.0 / (step + 1), "reward": step % 3 / 2, "flag": step % 2 == 0, "hist": [step, 1], "name": "x"}


def _expected(run_dir: Path) -> list:
    """metrics.jsonl as a tracker should hold it: one row per step, scalars and the rest as written."""
    return [[s, v] for s, v in merge_rows(read_metrics(run_dir))]


def test_only_durable_rows_reach_the_tracker_and_a_kill_then_resume_ends_with_exactly_the_file(tmp_path):
    run, store = tmp_path / "run", tmp_path / "tracker.json"
    lines: list[str] = []
    logger = TrackedMetricsLogger(run, _cfg(), [FileTracker(store)], resume_step=None, resume_rows=None,
                                  log=lines.append)
    for step in range(0, 6):
        logger.log(step, _row(step))
        if step in (2, 4):
            _checkpoint(run, step)
    # rows 0..4 are durable once checkpoint 4 exists (sent at the next log); row 5 is not: a resume would drop it
    held = json.loads(store.read_text())["run0"]["rows"]
    assert [r[0] for r in held] == [0, 1, 2, 3, 4]
    # "kill": the logger is dropped without close. The resume from checkpoint 2 (say 4 was damaged and set aside)
    # truncates metrics.jsonl to steps <= 2; the tracker holds 0..4 and cannot rewind: it keeps those, one line
    (run / "checkpoints" / "step_4").rename(run / "checkpoints" / "step_4.bad")
    lines.clear()
    logger2 = TrackedMetricsLogger(run, _cfg(), [FileTracker(store)], resume_step=2, resume_rows=None,
                                   log=lines.append)
    assert any("cannot rewind" in ln and "steps 3..4" in ln for ln in lines), lines
    assert json.loads((run / STATE_FILE).read_text()) == {"file": {"id": "run0"}}  # the same tracker run
    for step in range(3, 8):
        logger2.log(step, {**_row(step), "loss": -1.0})
    logger2.close()
    (run / "finished.json").write_text("{}")
    (run / "summary.json").write_text(json.dumps({"status": "finished", "eval": {"final": 0.5}}))
    finish_trackers(run, "finished", run / "summary.json")
    held = json.loads(store.read_text())["run0"]
    assert [r[0] for r in held["rows"]] == list(range(8))  # each step once
    assert held["rows"][5:] == _expected(run)[5:]  # after the kept steps: exactly the file's rows
    assert held["status"] == "finished" and held["summary"]["eval"]["final"] == 0.5
    assert held["files"] == ["summary.json"]


def test_a_kill_before_the_rows_reach_the_tracker_is_caught_up_on_resume(tmp_path):
    """Checkpoint 4 is written, then the process dies before its next log: rows 3..4 are durable but unsent. The
    resume from checkpoint 4 sends them from metrics.jsonl, so the tracker ends with the file's rows exactly."""
    run, store = tmp_path / "run", tmp_path / "tracker.json"
    logger = TrackedMetricsLogger(run, _cfg(), [FileTracker(store)], resume_step=None, resume_rows=None,
                                  log=print)
    for step in range(0, 5):
        logger.log(step, _row(step))
        if step == 2:
            _checkpoint(run, 2)
    _checkpoint(run, 4)
    assert [r[0] for r in json.loads(store.read_text())["run0"]["rows"]] == [0, 1, 2]
    logger2 = TrackedMetricsLogger(run, _cfg(), [FileTracker(store)], resume_step=4, resume_rows=None, log=print)
    for step in range(5, 7):
        logger2.log(step, _row(step))
    logger2.close()
    (run / "finished.json").write_text("{}")
    finish_trackers(run, "finished")
    assert json.loads(store.read_text())["run0"]["rows"] == _expected(run)


def test_a_failing_tracker_is_one_line_and_metrics_jsonl_goes_on(tmp_path):
    run, store = tmp_path / "run", tmp_path / "tracker.json"
    lines: list[str] = []
    logger = TrackedMetricsLogger(run, _cfg("disabled"), [FileTracker(store, fail_at=3)], resume_step=None,
                                  resume_rows=None, log=lines.append)
    for step in range(6):
        logger.log(step, _row(step))
    logger.close()
    finish_trackers(run, "finished")
    assert [r["step"] for r in read_metrics(run)] == list(range(6))
    assert len(lines) == 1, lines
    assert "FileTracker tracking stopped, logging step 3" in lines[0] and "No space left" in lines[0]
    assert "holds the steps up to 2" in lines[0] and "metrics.jsonl and TensorBoard go on" in lines[0]
    held = json.loads(store.read_text())["run0"]
    assert [r[0] for r in held["rows"]] == [0, 1, 2] and held["status"] == "running"  # never finished after it


def test_recover_disabled_sends_every_row_at_once(tmp_path):
    run, store = tmp_path / "run", tmp_path / "tracker.json"
    logger = TrackedMetricsLogger(run, _cfg("disabled"), [FileTracker(store)], resume_step=None, resume_rows=None,
                                  log=print)
    for step in range(3):
        logger.log(step, _row(step))
        assert json.loads(store.read_text())["run0"]["rows"][-1][0] == step
    logger.close()
    finish_trackers(run, "interrupted")
    assert json.loads(store.read_text())["run0"]["status"] == "interrupted"


def test_summary_items_flatten_numbers_and_text_and_skip_curves():
    numbers, texts = summary_items({"eval": {"final": 0.5, "final_step": 10}, "status": "finished",
                                    "code": {"commit": "abc", "dirty": False, "dirty_digest": None},
                                    "curves": {"reward": [1, 2]}, "staleness": {"hist": [1, 2], "max": 3},
                                    "wall_s": float("nan")})
    assert numbers == {"summary/eval.final": 0.5, "summary/eval.final_step": 10.0, "summary/staleness.max": 3.0}
    assert texts == {"summary/status": "finished", "summary/code.commit": "abc", "summary/code.dirty": "False",
                     "summary/code.dirty_digest": "null"}


def test_no_tracker_package_is_imported_unless_enabled(tmp_path):
    """Opening the metrics logger of a run with the trackers off (the default) imports neither wandb nor mlflow."""
    code = f"""
import sys
from stalerl.config import load_config
from stalerl.results.tracking import open_metrics_logger
cfg = load_config(["--config", {str(CPU_CONFIG)!r}])
lg = open_metrics_logger({str(tmp_path)!r}, cfg, resume_step=None, resume_rows=None, log=print)
lg.log(0, {{"x": 1.0}}); lg.close()
print(sorted(m for m in ("wandb", "mlflow") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("key,module,extra", [("stats_logger.mlflow.enabled=true", "mlflow", "mlflow"),
                                              ("stats_logger.wandb.mode=offline", "wandb", "wandb")])
def test_an_enabled_tracker_without_its_package_is_refused_before_any_work(tmp_path, key, module, extra):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here; the refusal is checked where it is not")
    out = subprocess.run([sys.executable, str(REPO / "examples" / "math" / "gsm8k_rl.py"), "--config",
                          str(CPU_CONFIG), f"cluster.fileroot={tmp_path}", key], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith("stalerl: config ")]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and f"pip install 'stalerl[{extra}]'" in lines[0] and key.split("=")[0] in lines[0], lines
    assert not (tmp_path / "gsm8k-m2po-cpu").exists()  # nothing started


def test_the_trial_files_the_rule_reads_are_the_ones_the_trainer_writes(tmp_path):
    """finished.json and committed checkpoint names, as stalerl.training writes them (results may not import it)."""
    import torch

    from stalerl.results import tracking
    from stalerl.training import trial_dir
    from stalerl.training.checkpoint import save_checkpoint

    assert tracking.FINISHED_FILE == trial_dir.FINISHED_FILE
    save_checkpoint(tmp_path, 3, {"x": torch.zeros(1)}, keep_last=5)
    save_checkpoint(tmp_path, 7, {"x": torch.zeros(1)}, keep_last=5)
    assert tracking.latest_checkpoint_step(tmp_path) == 7
    assert tracking.durable_step(tmp_path, _cfg()) == 7
    trial_dir.write_finished(tmp_path, step=7, total_steps=7, steps_per_epoch=1)
    assert tracking.durable_step(tmp_path, _cfg()) == float("inf")


def _study_spec(tmp_path: Path, *overrides: str) -> dict:
    from stalerl_study import cli as study

    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps({
        "name": "tracked", "config": str(CPU_CONFIG), "losses": ["m2po", "vanilla"], "seeds": [1],
        "settings": {"fixed_staleness 2": ["rollout.fixed_staleness=2"]}, "warm_start_cache": False,
        "overrides": [f"cluster.fileroot={tmp_path}", *overrides], "results": str(tmp_path / "results"),
        "doc": str(tmp_path / "m2po.md")}))
    return study.load_spec(spec_file)


def test_the_study_name_is_the_group_and_experiment_of_its_trackers_only_when_they_are_on(tmp_path):
    from stalerl.config import load_config
    from stalerl_study import cli as study

    off = study.expand(_study_spec(tmp_path))
    assert not any("stats_logger." in o for r in off for o in r["overrides"])  # digests of untracked studies kept
    on = study.expand(_study_spec(tmp_path, "stats_logger.mlflow.tracking_uri=/tmp/x",
                                  "stats_logger.wandb.group=mine", "stats_logger.wandb.project=p"))
    assert not any("stats_logger.mlflow.experiment" in o for r in on for o in r["overrides"])  # mlflow is off
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed: a config enabling it is refused")
    on = study.expand(_study_spec(tmp_path, "stats_logger.wandb.mode=offline"))
    cfgs = [load_config(["--config", str(CPU_CONFIG), *r["overrides"]]) for r in on]
    assert {c.stats_logger.wandb.group for c in cfgs} == {"tracked"} and len(cfgs) == 2
    mine = study.expand(_study_spec(tmp_path, "stats_logger.wandb.mode=offline", "stats_logger.wandb.group=mine"))
    assert {load_config(["--config", str(CPU_CONFIG), *r["overrides"]]).stats_logger.wandb.group
            for r in mine} == {"mine"}  # a group the study sets itself is kept
