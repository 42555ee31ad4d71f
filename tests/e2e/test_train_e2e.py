"""End-to-end: the main script trains, logs, evaluates, checkpoints, and resumes after SIGKILL exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CPU_CONFIG, REPO, small_overrides
from stalerl.config import load_config
from stalerl.results.metrics_log import read_metrics

SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
TIMING_PREFIXES = ("timing/", "throughput/", "memory/")  # machine-dependent figures


def _run_script(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, **kwargs)


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES) and not k.startswith("warm_start/sec")}
            for r in rows]


@pytest.mark.slow
def test_short_run_logs_every_step_with_staleness_ramp(tmp_path):
    from stalerl.training.trainer import Trainer

    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, **{"rollout.fixed_staleness": 2})])
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.train()
    run = Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name
    rows = read_metrics(run)
    steps = [r["step"] for r in rows]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    train_rows = rows[1:]
    # Stale-2 FIFO: the first batches all come from the starting weights, then every batch is exactly 2 versions old.
    assert [r["staleness/max"] for r in train_rows] == [0, 1, 2, 2, 2, 2]
    assert [r["staleness/min"] for r in train_rows] == [0, 1, 2, 2, 2, 2]
    for r in train_rows:
        for key in ("reward", "accuracy", "actor/loss", "actor/grad_norm", "actor/m2po/m2_before",
                    "actor/m2po/masked_fraction", "actor/m2po/trust_region_fraction", "timing/gen_s",
                    "timing/train_s", "throughput/gen_tokens_per_s", "staleness/hist"):
            assert key in r, key
        assert 0.0 <= r["reward"] <= 1.0
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[3] and "eval/accuracy" in rows[6]
    saved = load_config(["--config", str(run / "config.yaml")])
    assert saved.rollout.fixed_staleness == 2 and saved.actor.loss == "m2po"
    assert (run / "final_model" / "config.json").exists()
    # the saved final model reloads through the real loader
    from stalerl.core.model import load_policy

    model, tok = load_policy(str(run / "final_model"), device="cpu")
    assert tok.decode(tok("12+7=?")["input_ids"]) == "12+7=?"


@pytest.mark.slow
def test_sigkill_and_resume_logs_the_same_metrics(tmp_path, sigkill_after_checkpoint):
    common = small_overrides(tmp_path, **{
        "total_train_steps": 8, "recover.mode": "auto", "recover.freq_steps": 2, "rollout.fixed_staleness": 1,
        "evaluator.freq_steps": 4})
    reference = _run_script([*common, "trial_name=uninterrupted"])
    assert reference.returncode == 0, reference.stderr[-3000:]

    args = [sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *common, "trial_name=killed"]
    run = tmp_path / "runs" / "gsm8k-m2po-cpu" / "killed"
    assert sigkill_after_checkpoint(args, run, 4) == -signal.SIGKILL
    resumed = _run_script([*common, "trial_name=killed"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step" in resumed.stdout + resumed.stderr

    ref_rows = _comparable(read_metrics(tmp_path / "runs" / "gsm8k-m2po-cpu" / "uninterrupted"))
    got_rows = _comparable(read_metrics(run))
    assert [r["step"] for r in got_rows] == list(range(0, 9))
    assert got_rows == ref_rows


@pytest.mark.parametrize("override, needle", [
    ("train_dataset.path=/nonexistent/gsm8k.jsonl", "/nonexistent/gsm8k.jsonl"),
    ("actor.path=/nonexistent/model", "actor.path"),
    ("actor.device=cuda", "actor.device"),
    ("actor.loss=m3po", "m3po"),
    ("rollout.max_head_ofpolicyness=4", "max_head_offpolicyness"),
])
def test_bad_inputs_fail_before_training(tmp_path, override, needle):
    if override == "actor.device=cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    res = _run_script([*small_overrides(tmp_path), override])
    assert res.returncode != 0
    assert needle in res.stderr
    assert "warm start" not in res.stdout  # failed before any work
    assert not list((tmp_path / "runs").rglob("metrics.jsonl"))


@pytest.mark.slow
def test_local_sweep_2x2_runs_every_point_and_writes_a_summary(tmp_path):
    res = _run_script([*small_overrides(tmp_path, **{"total_train_steps": 2}), "trial_name=sw",
                       "actor.loss=m2po,vanilla", "rollout.fixed_staleness=0,1"])
    assert res.returncode == 0, res.stderr[-3000:]
    root = tmp_path / "runs" / "gsm8k-m2po-cpu"
    trials = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert trials == ["sw-loss=m2po-fixed_staleness=0", "sw-loss=m2po-fixed_staleness=1",
                      "sw-loss=vanilla-fixed_staleness=0", "sw-loss=vanilla-fixed_staleness=1"]
    for t in trials:
        cfg = load_config(["--config", str(root / t / "config.yaml")])
        assert cfg.trial_name == t
        assert cfg.actor.loss == t.split("loss=")[1].split("-")[0]
    summary = (root / "sweep_summary.md").read_text()
    assert summary.count("| ok |") == 4
    rows = json.loads((root / "sweep_summary.json").read_text())
    assert {r["trial"] for r in rows} == set(trials)
    assert all(r["steps"] == 2 for r in rows)
    m2po = [r for r in rows if "m2po" in r["trial"]]
    assert all(r["masked_fraction"] is not None and r["clip_fraction"] is None for r in m2po)
    assert all(r["final_reward_generated"] is not None and r["final_reward_consumed"] is not None for r in rows)
    for t in trials:  # every run of the sweep (its own process) wrote its summary.json
        s = json.loads((root / t / "summary.json").read_text())
        assert (s["status"], s["run"], s["steps_done"]) == ("finished", t, 2)
        assert s["setting"] == f"fixed_staleness {t[-1]}"


def test_sweep_validates_every_point_before_running(tmp_path):
    res = _run_script([*small_overrides(tmp_path), "actor.m2_threshold=0.04,-1"])
    assert res.returncode != 0
    assert "m2_threshold" in res.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("metrics.jsonl"))


@pytest.mark.slow
def test_fipo_at_fixed_staleness_4_trains_with_active_influence_weights(tmp_path):
    """actor.loss=fipo, Stale-4 FIFO: the FIPO metrics are logged every step, the influence weights sit at 1 while
    the batch is on-policy (staleness 0: the ratio is 1 up to engine noise) and move off 1 once it is stale. A longer
    warm start than the other runs, so that some groups get rewards and the loss has something to train on."""
    from stalerl.training.trainer import Trainer

    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, **{
        "rollout.fixed_staleness": 4, "actor.loss": "fipo", "total_train_steps": 8, "evaluator.freq_steps": 8,
        "warm_start.steps": 150})])
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.train()
    rows = read_metrics(Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name)[1:]
    assert [r["staleness/max"] for r in rows] == [0, 1, 2, 3, 4, 4, 4, 4]
    keys = ("influence_weights_mean_raw", "influence_weight_clip_ratio_upper", "influence_weight_clip_ratio_lower",
            "sequence_drop_ratio")
    for r in rows:
        for k in keys:
            assert f"actor/fipo/{k}" in r, k
    assert sum(r["actor/grad_norm"] > 0 for r in rows) >= 2  # the loss trained (nonzero advantages, gradients)
    fresh, stale = rows[0], rows[1:]
    assert abs(fresh["actor/fipo/influence_weights_mean_raw"] - 1.0) < 1e-3
    assert fresh["actor/fipo/influence_weight_clip_ratio_upper"] == 0.0
    for r in stale:
        assert r["actor/fipo/influence_weight_clip_ratio_upper"] > 0.0, r  # some weights at 1 + eps_f
    assert max(abs(r["actor/fipo/influence_weights_mean_raw"] - 1.0) for r in stale) > 5e-3


def test_actor_dtype_auto_runs_the_resolved_dtype_and_records_it(tmp_path):
    """actor.dtype=auto: one start line names the choice; config.yaml and summary.json record the resolved dtype,
    never 'auto' (issue 43 item 4)."""
    import yaml

    from stalerl.core.hardware import auto_compute_dtype

    expected = auto_compute_dtype("cpu")[0]
    overrides = small_overrides(tmp_path, **{"total_train_steps": 2, "evaluator.freq_steps": 2})
    res = _run_script([*overrides, "actor.dtype=auto", "actor.device=cpu", "trial_name=auto-dtype"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"actor.dtype=auto -> {expected}: " in res.stdout + res.stderr
    run = tmp_path / "runs" / "gsm8k-m2po-cpu" / "auto-dtype"
    assert yaml.safe_load((run / "config.yaml").read_text())["actor"]["dtype"] == expected
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished"
