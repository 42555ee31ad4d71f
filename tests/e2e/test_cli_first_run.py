"""The product's own command as a new user runs it (subprocesses): config lookup, fast --help/--dry-run, one-line
user errors with exit code 2, the trial-directory rules, and the end-of-run summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, small_overrides
from stalerl.results.metrics_log import read_metrics

SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"


def run_cli(args: list[str], cwd: Path = REPO, importtime: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    pre = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *pre, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def imported(stderr: str) -> set[str]:
    return {ln.rsplit("|", 1)[1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")}


def error_lines(res: subprocess.CompletedProcess) -> list[str]:
    """stderr without -X importtime lines and the config-lookup note."""
    return [ln for ln in res.stderr.splitlines()
            if ln.strip() and not ln.startswith(("import time:", "stalerl: config "))]


def test_usage_line_dry_run_works_from_the_repo_root_without_heavy_imports():
    res = run_cli(["--config", "gsm8k_m2po.yaml", "scheduler.type=ray", "--dry-run"], importtime=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "experiment_name: gsm8k-m2po" in res.stdout and "type: ray" in res.stdout
    assert "examples/math/gsm8k_m2po.yaml" in res.stderr  # the resolved path is printed
    assert not imported(res.stderr) & {"torch", "transformers", "ray"}


def test_dry_run_from_inside_the_examples_directory():
    res = run_cli(["--config", "examples/math/gsm8k_m2po_cpu.yaml", "--dry-run"], cwd=REPO / "examples" / "math")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "experiment_name: gsm8k-m2po-cpu" in res.stdout


def test_help_is_fast_and_mentions_debug():
    res = run_cli(["--help"], importtime=True)
    assert res.returncode == 0
    assert "--debug" in res.stdout and "rollout.fixed_staleness" in res.stdout
    assert not imported(res.stderr) & {"torch", "transformers", "ray"}


@pytest.mark.parametrize("args, needle", [
    (["--config", "nope.yaml"], "config file not found: 'nope.yaml'"),
    (["--config", "gsm8k_m2po_cpu.yaml", "rollout.fixed_stalenes=4"], "fixed_staleness"),
    (["--config", "gsm8k_m2po_cpu.yaml", "actor.m2_threshold=-1"], "actor.m2_threshold"),
    (["--config", "gsm8k_m2po_cpu.yaml", "seed=abc"], "seed"),
    (["--config", "gsm8k_m2po_cpu.yaml", "actor.m2_threshold=-1", "total_train_steps=0"], "2 problems"),
    (["--config", "gsm8k_m2po_cpu.yaml", "--dryrun"], "--dry-run"),
    (["--config", "gsm8k_m2po_cpu.yaml", "train_dataset.path=/nonexistent/gsm8k"], "train_dataset.path="),
    (["--config", "gsm8k_m2po_cpu.yaml", "actor.path=/nonexistent/model"], "actor.path="),
    (["--config", "gsm8k_m2po_cpu.yaml", "actor.loss=m2po,vanila"], "vanila"),
    (["--config", "gsm8k_m2po_cpu.yaml", "scheduler.type=local,ray"], "scheduler.type cannot be swept"),
    (["--config", "gsm8k_m2po_cpu.yaml", "rollout.backend=vllm:d1", "warm_start.steps=1"], "rollout.backend"),
    (["--config", "gsm8k_m2po_cpu.yaml", "train_dataset.path=synthetic,/nonexistent/g.jsonl"], "/nonexistent/g.jsonl"),
])
def test_user_errors_are_one_line_with_exit_code_2(tmp_path, args, needle):
    res = run_cli([*args, f"cluster.fileroot={tmp_path}"])
    lines = error_lines(res)
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("stalerl: error: "), lines
    assert needle in lines[0]
    assert "Traceback" not in res.stderr and not list(tmp_path.rglob("metrics.jsonl"))


@pytest.mark.parametrize("path, needles", [
    ("README.md", ["actor.path='README.md' is a file, not a model directory"]),
    ("/nonexistent", ["actor.path='/nonexistent' does not exist", "stalerl-model list", "stalerl-model fetch <name>",
                      "smollm2-135m-instruct", "tiny:qwen2"]),
])
def test_a_model_path_that_is_a_file_or_missing_is_one_line_before_the_trial_directory_exists(tmp_path, path,
                                                                                               needles):
    """In a new trial, from the repository root (README.md is a file there): one line naming the key and the choices
    (the known names, the stalerl-model commands), exit 2, and no trial directory at all (issue 45)."""
    assert (REPO / "README.md").is_file()
    res = run_cli(["--config", "gsm8k_m2po_cpu.yaml", f"actor.path={path}", f"cluster.fileroot={tmp_path / 'runs'}",
                   "trial_name=new"])
    lines = error_lines(res)
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("stalerl: error: "), res.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in res.stderr and not (tmp_path / "runs").exists()


def test_gpu_config_on_a_cpu_machine_fails_at_once_on_every_scheduler(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for kind in ("local", "ray"):
        res = run_cli(["--config", "gsm8k_m2po.yaml", f"scheduler.type={kind}", f"cluster.fileroot={tmp_path}"],
                      importtime=True)
        lines = error_lines(res)
        assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
        assert "actor.device='cuda'" in lines[0] and "gsm8k_m2po_cpu.yaml" in lines[0]
        assert "ray" not in imported(res.stderr)  # refused before any Ray cluster starts


def test_debug_shows_the_traceback(tmp_path):
    res = run_cli(["--config", "nope.yaml", "--debug"])
    assert res.returncode != 0 and "Traceback" in res.stderr and "UserError" in res.stderr


@pytest.mark.slow
def test_trial_directory_reruns_are_refused_extended_or_started_over(tmp_path):
    base = ["--config", "gsm8k_m2po_cpu.yaml",
            *small_overrides(tmp_path, **{"total_train_steps": 2, "recover.mode": "auto", "recover.freq_steps": 50,
                                          "evaluator.freq_steps": 2}), "trial_name=t"]
    run = tmp_path / "runs" / "gsm8k-m2po-cpu" / "t"
    first = run_cli(base)
    assert first.returncode == 0, first.stderr[-3000:]
    # the summary block with the outputs and the plot command
    assert "== run finished" in first.stdout and "steps 2" in first.stdout
    assert str(run / "metrics.jsonl") in first.stdout and "stalerl-plot" in first.stdout
    assert (run / "checkpoints" / "step_2").is_dir()  # the last step is checkpointed even off the frequency
    assert f"checkpoints  {run / 'checkpoints'}" in first.stdout  # the summary block lists them (issue 28)
    first_summary = json.loads((run / "summary.json").read_text())
    assert first_summary["wall_s"] > 0
    assert first_summary["wall_s_total"] == pytest.approx(first_summary["wall_s"], rel=1e-3)

    again = run_cli(base)
    assert again.returncode == 2 and "is finished (step 2 of 2)" in again.stderr

    other = run_cli([*base, "rollout.fixed_staleness=0", "rollout.max_head_offpolicyness=2"])
    assert other.returncode == 2
    msg = error_lines(other)[0]
    assert "rollout.fixed_staleness (checkpoint 4, this run 0)" in msg and "recover.mode=disabled" in msg
    assert not (run / "logs").exists()  # refused before any worker started

    longer = run_cli([*base, "total_train_steps=3"])
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "extending finished trial" in longer.stdout and "resumed from checkpoint at step 2" in longer.stdout
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    # summary.json after the extension: wall_s is the extension's session, wall_s_total both sessions (issue 28);
    # the refused reruns in between trained nothing and wrote no summary
    extended = json.loads((run / "summary.json").read_text())
    assert extended["wall_s_total"] == pytest.approx(first_summary["wall_s_total"] + extended["wall_s"], rel=1e-3)

    over = run_cli([*base, "recover.mode=disabled", "rollout.fixed_staleness=1"])
    assert over.returncode == 0, over.stderr[-3000:]
    assert list(run.glob("checkpoints.*")) and "previous checkpoints moved" in over.stdout
    restarted = json.loads((run / "summary.json").read_text())
    assert restarted["wall_s_total"] == pytest.approx(restarted["wall_s"], rel=1e-3)  # started over: this session


@pytest.mark.slow
def test_a_run_logged_to_a_file_reads_line_by_line(tmp_path):
    """stdout and stderr to one file, as `... > run.log 2>&1` or CI: no carriage-return frames of a progress bar,
    plain progress lines, and the step lines in order with them (stdout is line-buffered, not block-buffered)."""
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "CI")}
    env["PYTHONPATH"] = str(REPO)
    args = ["--config", "gsm8k_m2po_cpu.yaml", *small_overrides(tmp_path, **{
        "total_train_steps": 4, "stats_logger.progress_bar": True, "stats_logger.log_every": 2})]
    with open(log, "w") as fh:
        res = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, stdout=fh,
                             stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert res.returncode == 0, text[-3000:]
    assert "\r" not in text
    lines = text.splitlines()
    expected = ["train: 1/4 steps", "train: 2/4 steps", "step 2 |", "train: 3/4 steps", "train: 4/4 steps",
                "step 4 |", "== run finished"]
    where = {key: next((i for i, ln in enumerate(lines) if ln.startswith(key)), None) for key in expected}
    assert None not in where.values(), (where, text[-3000:])
    assert sorted(expected, key=where.get) == expected, text[-3000:]
    assert lines[where["train: 2/4 steps"]].startswith("train: 2/4 steps (50%) | ")


def test_slurm_without_sbatch_is_one_line_exit_2(tmp_path):
    import shutil

    path = f"{Path(sys.executable).parent}:/nonexistent-bin"
    if shutil.which("sbatch", path=path):
        pytest.skip("sbatch is on this PATH")
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=path)
    res = subprocess.run([sys.executable, str(SCRIPT), "--config", "gsm8k_m2po_cpu.yaml", "scheduler.type=slurm",
                          f"cluster.fileroot={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    lines = error_lines(res)
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "sbatch not found on PATH" in lines[0]
