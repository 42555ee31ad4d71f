"""The vLLM lane's touch-list test (issue 37 item 3): a throwaway loss from a temporary package (tests/
throwaway_loss.py, found through the ``recipe.losses`` entry point) trains on vLLM's rollouts in the asynchronous
runtime, with its own ``actor.<param>`` key and its metrics reduced by its declared rules; nothing of the repository
is edited."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import throwaway_loss
from conftest import CPU_CONFIG, REPO, small_overrides
from stalerl.results.metrics_log import read_metrics

pytestmark = pytest.mark.vllm
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"


def test_async_vllm_run_trains_with_a_loss_from_another_package(tmp_path):
    pytest.importorskip("vllm")
    site = throwaway_loss.install(tmp_path / "site")
    over = small_overrides(tmp_path, **{"trial_name": "plugin", "rollout.backend": "vllm:d1", "rollout.mode": "async",
                                        "rollout.max_head_offpolicyness": 1, "rollout.fixed_staleness": 0,
                                        "total_train_steps": 3,
                                        "actor.loss": "throwaway", "actor.tl_scale": 0.5,
                                        "actor.mb_spec.max_tokens_per_mb": 64})
    env = throwaway_loss.env_with(site, dict(os.environ, VLLM_LOGGING_LEVEL="WARNING",
                                             PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])))
    res = subprocess.run([sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *over], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "runs" / "gsm8k-m2po-cpu" / "plugin") if "actor/throwaway/ratio_mean" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["actor/num_micro_batches"] > 1  # split: the count below is a sum over micro-batches (SUM rule)
        assert r["actor/throwaway/num_tokens"] > 64
        assert r["actor/throwaway/ratio_mean"] > 0
