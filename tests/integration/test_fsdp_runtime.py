"""actor.backend=fsdp:d2 through the real runtime (controller = rank 0 + one train worker process, gloo on CPU):
the same training as torch:d1, and a SIGKILLed run resumed from its (full-state) checkpoint continues exactly like an
uninterrupted one."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from conftest import CPU_CONFIG, REPO, small_overrides
from stalerl.training.checkpoint import load_latest_checkpoint
from stalerl.results.metrics_log import read_metrics

SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
pytestmark = pytest.mark.slow
KEYS = ("reward", "actor/loss", "actor/grad_norm", "actor/m2po/masked_fraction", "response_length")
# eta = 0 in the asynchronous runtime is deterministic. AdamW eps 1e-3: float noise in near-zero gradients (FSDP sums
# in another order) is not blown up into lr-sized steps, so weights can be compared tightly.
# A 10-step warm start never answers correctly, so GRPO advantages would all be 0 and nothing would train: raw
# rewards shifted by -0.5 as advantages give every token a gradient.
COMMON = {"rollout.mode": "async", "rollout.fixed_staleness": 0, "rollout.max_head_offpolicyness": 0,
          "actor.optimizer.eps": 1e-3, "actor.ppo_n_minibatches": 2, "actor.adv_norm": "null",
          "actor.reward_bias": -0.5}


def _cmd(tmp_path, trial, **extra):
    over = small_overrides(tmp_path, **{**COMMON, "trial_name": trial, **extra})
    return [sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *over]


def _run(cmd):
    import os

    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _dir(tmp_path, trial):
    return tmp_path / "runs" / "gsm8k-m2po-cpu" / trial


def _final_weights(tmp_path, trial) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(_dir(tmp_path, trial) / "final_model" / "model.safetensors"))


def _assert_same_rows(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a[1:], b[1:]):
        for k in KEYS:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (ra["step"], k)


def _assert_same_weights(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-6, rtol=1e-4), k


def test_fsdp_d2_trains_like_torch_d1(tmp_path):
    _run(_cmd(tmp_path, "d1", total_train_steps=3))
    _run(_cmd(tmp_path, "fsdp2", total_train_steps=3, **{"actor.backend": "fsdp:d2"}))
    _assert_same_rows(read_metrics(_dir(tmp_path, "d1")), read_metrics(_dir(tmp_path, "fsdp2")))
    _assert_same_weights(_final_weights(tmp_path, "d1"), _final_weights(tmp_path, "fsdp2"))
    assert all(r["actor/grad_norm"] > 0 for r in read_metrics(_dir(tmp_path, "d1"))[1:])  # real updates


def test_fsdp_d2_resumes_after_sigkill_like_an_uninterrupted_run(tmp_path, sigkill_after_checkpoint):
    extra = {"actor.backend": "fsdp:d2", "total_train_steps": 4, "recover.mode": "auto", "recover.freq_steps": 2,
             "evaluator.freq_steps": 2}
    _run(_cmd(tmp_path, "straight", **extra))
    cmd = _cmd(tmp_path, "killed", **extra)
    assert sigkill_after_checkpoint(cmd, _dir(tmp_path, "killed"), 2) == -signal.SIGKILL
    step, state = load_latest_checkpoint(_dir(tmp_path, "killed"))
    assert step == 2 and state["actor"]["format"] == "full-fqn"  # the full weights and optimizer, gathered
    assert state["actor"]["optimizer"]["state"]  # AdamW moments saved (keyed by parameter name)
    res = _run(cmd)
    assert "resumed from checkpoint at step 2" in res.stdout + res.stderr
    straight, resumed = read_metrics(_dir(tmp_path, "straight")), read_metrics(_dir(tmp_path, "killed"))
    _assert_same_rows(straight, resumed)
    assert [r.get("eval/accuracy") for r in straight] == [r.get("eval/accuracy") for r in resumed]
    _assert_same_weights(_final_weights(tmp_path, "straight"), _final_weights(tmp_path, "killed"))
