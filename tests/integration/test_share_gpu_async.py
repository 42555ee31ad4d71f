"""cluster.share_gpu in CPU dry mode: the GPU check's one-GPU async command (examples/math/one_gpu_async.yaml, d1+d1)
with actor.device=cpu and the tiny model runs the same plan, fit check and weight-sync choice as on a GPU, with real
worker processes, and the refusals come before any worker starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalerl.results.metrics_log import read_metrics

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
YAML = REPO / "examples" / "math" / "one_gpu_async.yaml"
pytestmark = pytest.mark.slow


def _gpu_check_command(tmp_path: Path, *extra: str) -> list[str]:
    """What scripts/gpu_check.sh runs for its one-GPU async part, plus the CPU dry mode's keys."""
    return [sys.executable, str(SCRIPT), "--config", str(YAML), "trial_name=one-gpu-async", "actor.path=tiny:qwen2",
            f"cluster.fileroot={tmp_path / 'runs'}", "total_train_steps=4", "recover.mode=disabled",
            "saver.save_final=false", "stats_logger.tensorboard=false", "stats_logger.progress_bar=false",
            "actor.device=cpu", "actor.dtype=float32", "torch_threads=1", *extra]


def _run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_one_gpu_async_runs_in_cpu_dry_mode(tmp_path):
    res = _run(_gpu_check_command(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout + res.stderr
    # the plan, the fit check against the stated host figure, and the sync path, each said once at start
    assert "share_gpu: 1 rollout + 1 train processes on CPU dry mode" in out
    assert "cannot fit" not in out
    assert "share_gpu weight sync: host_shared_memory (CPU dry mode" in out
    run = tmp_path / "runs" / "one-gpu-async" / "one-gpu-async"
    assert "share_gpu: memory fraction" in (run / "logs" / "rollout-0.log").read_text()
    rows = read_metrics(run)
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(0 <= r["staleness/max"] <= 2 for r in steps)  # rollout.max_head_offpolicyness=2
    # Step s trains version s-1 on samples staleness versions older: the rollout worker's newest version used
    # must move past 0 (the trainer's weights reached it), and never ahead of the trainer.
    used = [int(r["version"]) - 1 - int(r["staleness/min"]) for r in steps]
    assert all(0 <= v <= r["step"] - 1 for v, r in zip(used, steps)), used
    assert max(used) >= 1, used
    assert any("mismatch/abs_mean" in r for r in steps)  # stats_logger.mismatch_freq_steps=1
    assert all(r.get("mismatch/abs_mean", 0.0) < 1e-3 for r in steps)  # float32 on one CPU: the same numerics


@pytest.mark.parametrize("extra, words", [
    (("rollout.mode=sync", "rollout.max_head_offpolicyness=0"), "cluster.share_gpu: got true but this run is "
                                                                "synchronous"),
    (("cluster.share_gpu_train_fraction=0.0000001",), "cluster.share_gpu=true: the memory split cannot fit on this "
                                                       "host (CPU dry mode"),
])
def test_refused_in_one_line_before_any_worker_starts(tmp_path, extra, words):
    res = _run(_gpu_check_command(tmp_path, *extra), timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("stalerl: error:") and words in lines[0], res.stderr
    assert "Fix:" in lines[0]
    # nothing started, not even the trial directory (stalerl.config.rules and stalerl.launch.preflight refuse)
    assert not (tmp_path / "runs" / "one-gpu-async" / "one-gpu-async").exists()
