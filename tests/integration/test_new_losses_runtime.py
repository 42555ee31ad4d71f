"""CISPO and DPPO train in the runtime (issue 44 item 8): ``actor.loss=cispo`` / ``dppo_tv`` / ``dppo_kl`` on the
tiny CPU model, four versions stale, each step split into micro-batches; their keys are ``actor.<name>`` (a delta of
DPPO, the PPO clip for CISPO), their metrics are logged as ``actor/<loss>/<key>`` reduced by their declared rules,
and a bad value is refused in one line before any work."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import small_overrides

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
CONFIG = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"

# A warm start long enough that some samples are right (tests/integration/test_minimal_example.py: ~10%), so groups
# have non-zero advantages and the loss has a gradient; step 2 trains on a batch of the starting weights.
LEARNING = {"total_train_steps": 3, "warm_start.steps": 100, "warm_start.batch_size": 32,
            "rollout.fixed_staleness": 1, "train_dataset.batch_size": 4, "gconfig.max_new_tokens": 10,
            "gconfig.temperature": 0.8, "train_dataset.synthetic.max_operand": 12,
            "train_dataset.synthetic.train_size": 2000, "train_dataset.synthetic.test_size": 16,
            "valid_dataset.synthetic.max_operand": 12, "valid_dataset.synthetic.test_size": 16,
            "evaluator.freq_steps": 100}
# loss -> (its own settings, a SUM metric whose value is a count over the whole step)
RUNS = {
    "cispo": (["actor.eps_clip=1.0", "actor.eps_clip_higher=2.0"], None),  # the paper's regime: no lower bound
    "dppo_tv": (["actor.dppo_tv_delta=0.1"], "dppo_tv/num_masked_tokens"),
    "dppo_kl": (["actor.dppo_kl_delta=0.02"], "dppo_kl/num_masked_tokens"),
}


@pytest.mark.parametrize("loss", sorted(RUNS))
def test_trains_in_the_runtime_split_into_micro_batches(loss, tmp_path):
    settings, count_key = RUNS[loss]
    args = [sys.executable, str(SCRIPT), "--config", str(CONFIG), *small_overrides(tmp_path, **LEARNING),
            f"actor.loss={loss}", *settings, "actor.mb_spec.max_tokens_per_mb=64",
            "experiment_name=new_loss", "trial_name=t0"]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "new_loss" / "t0" / "metrics.jsonl").read_text()
            .splitlines()]
    train = [r for r in rows if "actor/loss" in r]
    assert len(train) == 3, rows[:2]
    assert any(r["actor/grad_norm"] > 0 for r in train), "no step had a learning signal: the run proves nothing"
    for r in train:
        assert r["actor/num_micro_batches"] > 1
        assert math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"])
        keys = {k for k in r if k.startswith(f"actor/{loss}/")}
        assert keys, f"no actor/{loss}/* metric logged: {sorted(r)}"
        assert all(math.isfinite(r[k]) for k in keys)
        if count_key is not None:  # a count is summed over the micro-batches (SUM), so it can exceed one's tokens
            assert 0 <= r[f"actor/{count_key}"] == int(r[f"actor/{count_key}"])
            assert 0.0 <= r[f"actor/{loss}/masked_fraction"] <= 1.0


@pytest.mark.parametrize("loss,bad,key", [
    ("dppo_tv", "actor.dppo_tv_delta=0", "actor.dppo_tv_delta"),
    ("dppo_kl", "actor.dppo_kl_delta=-0.1", "actor.dppo_kl_delta"),
    ("cispo", "actor.eps_clip=-1", "actor.eps_clip"),
])
def test_bad_value_is_one_line_before_work(loss, bad, key, tmp_path):
    args = [sys.executable, str(SCRIPT), "--config", str(CONFIG), *small_overrides(tmp_path), f"actor.loss={loss}",
            bad]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert key in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not list(tmp_path.rglob("metrics.jsonl"))
