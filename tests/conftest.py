"""Shared fixtures: a tiny policy and small configs, so runtime tests take seconds on 2 cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"

# One thread per test process keeps timings stable and avoids oversubscribing the 2 CI cores.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def small_overrides(tmp_path: Path, **extra) -> list[str]:
    """Overrides that shrink the embedded default to a few seconds of work."""
    base = {
        "cluster.fileroot": str(tmp_path / "runs"),
        "total_train_steps": 6,
        "torch_threads": 1,
        "warm_start.steps": 10,
        "warm_start.batch_size": 16,
        "warm_start.target_accuracy": 0,  # fixed 10 steps: the adaptive warm start has its own tests
        "train_dataset.batch_size": 8,
        "train_dataset.synthetic.train_size": 400,
        "gconfig.n_samples": 4,
        "evaluator.freq_steps": 3,
        "evaluator.n_prompts": 16,
        "valid_dataset.batch_size": 16,
        "stats_logger.progress_bar": False,
        "stats_logger.tensorboard": False,
        "stats_logger.log_every": 1000,
        "recover.mode": "disabled",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _sigkill_after_checkpoint(cmd: list[str], run_dir: Path, step: int, timeout: float = 300.0) -> int:
    """Start ``cmd``, SIGKILL it as soon as the checkpoint of ``step`` exists under ``run_dir``; returns its code."""
    import signal
    import subprocess
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout
    while not (run_dir / "checkpoints" / f"step_{step}").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, f"no checkpoint of step {step} after {timeout:.0f}s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


@pytest.fixture
def sigkill_after_checkpoint():
    """``sigkill_after_checkpoint(cmd, run_dir, step, timeout=300.0) -> returncode`` (see the function above)."""
    return _sigkill_after_checkpoint


@pytest.fixture
def tiny_policy():
    from stalerl.core.model import load_policy

    torch.manual_seed(0)
    model, tok = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    return model, tok


def pytest_collection_modifyitems(config, items):
    """vllm-marked tests need vLLM (its own virtual environment): skipped with the reason where it is missing, and
    a failure instead when STALERL_REQUIRE_VLLM=1 (CI's vLLM step must really run them)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    required = os.environ.get("STALERL_REQUIRE_VLLM") == "1"
    reason = ("vllm is not importable in this environment; the vLLM tests run in the vLLM virtual environment "
              "(bash scripts/setup_vllm.sh, then run pytest -m vllm there)")
    if required and any("vllm" in item.keywords for item in items):
        raise pytest.UsageError("STALERL_REQUIRE_VLLM=1 but " + reason)
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
