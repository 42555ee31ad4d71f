"""Shared pieces of the tracker tests: the skip rule, the cheapest real training run through the real command, a
signal once a checkpoint exists, and metrics.jsonl as a tracker should hold it."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
CPU_CONFIG = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"
EXP = "gsm8k-m2po-cpu"
REQUIRE_ENV = "STALERL_REQUIRE_TRACKERS"
STEPS = 8


def require(module: str) -> None:
    """Skip with one line when ``module`` is missing, unless STALERL_REQUIRE_TRACKERS=1 (scripts/ci_trackers.sh):
    then fail."""
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {module} is not importable: run scripts/ci_trackers.sh (or pip install "
                    f"'stalerl[{module}]')")
    pytest.skip(f"{module} is not installed (its lane: scripts/ci_trackers.sh); set {REQUIRE_ENV}=1 to make this fail")


def overrides(root: Path, trial: str, **extra: Any) -> list[str]:
    """A few seconds of real training: no warm start, tiny batches, a checkpoint every 2 steps."""
    base = {"cluster.fileroot": str(root), "trial_name": trial, "total_train_steps": STEPS, "torch_threads": 1,
            "warm_start.steps": 0, "train_dataset.batch_size": 4, "train_dataset.synthetic.train_size": 100,
            "gconfig.n_samples": 2, "evaluator.freq_steps": 3, "evaluator.n_prompts": 8,
            "valid_dataset.batch_size": 8, "stats_logger.progress_bar": False, "stats_logger.tensorboard": False,
            "stats_logger.log_every": 1000, "recover.mode": "auto", "recover.freq_steps": 2}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), STALERL_STOP_GRACE_S="60", OMP_NUM_THREADS="1")


def cmd(args: list[str]) -> list[str]:
    return [sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *args]


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd(args), cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def latest_checkpoint(run_dir: Path) -> Optional[int]:
    from stalerl.results.tracking import latest_checkpoint_step

    return latest_checkpoint_step(run_dir)


def signal_after_checkpoint(args: list[str], run_dir: Path, after: int, sig: int,
                            timeout: float = 400) -> subprocess.CompletedProcess:
    """Run the command; send ``sig`` as soon as a checkpoint of a step above ``after`` exists."""
    proc = subprocess.Popen(cmd(args), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + timeout
        while (latest_checkpoint(run_dir) or -1) <= after:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, f"no checkpoint after step {after} in {timeout:.0f}s"
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def killed_sigtermed_resumed(root: Path, trial: str, **extra: Any) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """The trial SIGKILLed after its first checkpoint, resumed and SIGTERMed after a later one, resumed to its end."""
    args = overrides(root, trial, **extra)
    run_dir = root / EXP / trial
    first = signal_after_checkpoint(args, run_dir, 0, signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    k = latest_checkpoint(run_dir)
    second = signal_after_checkpoint(args, run_dir, k, signal.SIGTERM)
    assert second.returncode == 143, (second.returncode, second.stderr[-3000:])
    assert "resumed from checkpoint" in second.stdout + second.stderr
    third = run(args)
    assert third.returncode == 0, third.stderr[-3000:]
    return run_dir, [first, second, third]


def expected_rows(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """metrics.jsonl as a tracker holds it: one row per step, its scalar values."""
    from stalerl.results.metrics_log import read_metrics
    from stalerl.results.trackers.base import merge_rows, scalar_metrics

    return [(step, scalar_metrics(values)) for step, values in merge_rows(read_metrics(run_dir))]


def read_offline_session(session: Path) -> list[dict]:
    """Every record of one W&B offline session's transaction log, as wandb's own reader prints them."""
    import json

    log = next(session.glob("run-*.wandb"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_offline_run(run_dir: Path) -> dict[str, Any]:
    """The trial's W&B run read back from all its offline sessions, oldest first: ``id``, ``sessions``, ``runs``
    (the run records), ``history`` [(step, values without W&B's own _keys)], ``summary`` (merged) and ``exits``."""
    import json

    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    sessions = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    out: dict[str, Any] = {"id": run_id, "sessions": sessions, "runs": [], "history": [], "summary": {},
                           "exits": []}
    for session in sessions:
        for rec in read_offline_session(session):
            if rec["type"] == "run":
                out["runs"].append(rec["run"])
            elif rec["type"] == "history":
                item = {k: v for k, v in rec["history"]["item"].items() if not k.startswith("_")}
                out["history"].append((int(rec["history"]["step"].get("num", 0)), item))
            elif rec["type"] == "summary":
                out["summary"].update(rec["summary"].get("update", {}))
            elif rec["type"] == "exit":
                out["exits"].append(rec["exit"].get("exit_code", 0))
    return out


def stalerl_lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]
