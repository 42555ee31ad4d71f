"""A diverged asynchronous run ends ``status: diverged`` like a synchronous one, when the divergence is found by a
train rank in a worker process: the loss's ``NonFiniteLogProbError`` reaches the controller as the worker's failure
(its exception type kept), first seen by rank 0 as a collective error, and the trainer classifies it by that type
(``stalerl.training.trainer.divergence_reason``), never by the words of its message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import CPU_CONFIG, REPO, small_overrides

pytestmark = pytest.mark.slow

SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
MODULE = "nan_on_rank_one_pkg"
LOSS = "nan_on_rank_one"

# Rank 1 (a train worker process) refuses its third loss call as the losses refuse non-finite log-probs; every
# other call is no_trust_region's. The message avoids the words "non-finite" on purpose: the type decides.
SOURCE = textwrap.dedent(f'''
    import torch.distributed as dist

    from recipe.common import NonFiniteLogProbError
    from recipe.declaration import LossDeclaration
    from recipe.registry import get_policy_loss_fn, register_policy_loss

    DECLARATION = LossDeclaration(name={LOSS!r}, summary="no_trust_region; rank 1 diverges", split_probe=False)
    CALLS = [0]


    @register_policy_loss(DECLARATION)
    def compute(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        if dist.is_available() and dist.is_initialized() and dist.get_rank() == 1:
            CALLS[0] += 1
            if CALLS[0] >= 3:
                raise NonFiniteLogProbError("{LOSS}: NaN log_prob on a valid token (test)")
        loss, _ = get_policy_loss_fn("no_trust_region")(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
            loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
        return loss, {{}}
''')


def test_a_train_worker_that_diverges_ends_the_async_run_as_diverged(tmp_path):
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / f"{MODULE}.py").write_text(SOURCE)
    info = plugin / f"{MODULE}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[recipe.losses]\n{LOSS} = {MODULE}\n")
    over = small_overrides(tmp_path, **{"rollout.fixed_staleness": 0, "trial_name": "asyncdiv",
                                        "rollout.max_head_offpolicyness": 1, "actor.backend": "torch:d2",
                                        "actor.loss": LOSS, "total_train_steps": 8})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(plugin), str(REPO))))
    res = subprocess.run([sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *over], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=420)
    out = res.stdout + res.stderr
    summary = json.loads((tmp_path / "runs" / "gsm8k-m2po-cpu" / "asyncdiv" / "summary.json").read_text())
    assert summary["status"] == "diverged", (summary.get("status"), out[-3000:])
    assert "training diverged at step" in summary["error"] and "train/1" in summary["error"], summary["error"]
    assert "NaN log_prob on a valid token (test)" in summary["error"]
    assert 1 <= summary["steps_done"] < 8
