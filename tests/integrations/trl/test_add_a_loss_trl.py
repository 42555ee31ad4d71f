"""Adding a loss touches one module (issue 37 item 3), TRL's lane: the throwaway loss of tests/throwaway_loss.py,
installed into a temporary directory and found through its ``recipe.losses`` entry point, runs through the real
TRL ``GRPOTrainer`` (recipe.trl: ``loss_type="throwaway"``) with ``tl_scale`` set through the generated
``GRPOConfig`` field; its loss is ``no_trust_region``'s at tl_scale=1 and scales with tl_scale, its metrics reach
TRL's log reduced by the declared rules, and ``tl_scale=0`` is refused with one line naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import throwaway_loss
from trl_cases import REPO, require_trl

pytestmark = pytest.mark.trl

SCRIPT = r'''
import json, sys, dataclasses
from pathlib import Path
import torch
from trl_cases import base_args, digit_reward, prompts_dataset, tiny_model_and_tokenizer
from recipe.trl import GRPOConfig, GRPOTrainer, STALERL_LOSS_TYPES
from recipe.registry import get_policy_loss_fn

from recipe.registry import refusals, registered_policy_losses

out = {"loss_types": list(STALERL_LOSS_TYPES), "refusals": refusals(), "registered": registered_policy_losses()}
field = {f.name: f for f in dataclasses.fields(GRPOConfig)}["tl_scale"]
out["field"] = [field.default, field.metadata["help"]]
try:
    GRPOConfig(**base_args(Path(sys.argv[1]) / "bad", loss_type="throwaway", tl_scale=0.0))
    out["refused"] = None
except ValueError as err:
    out["refused"] = str(err)


class Capturing(GRPOTrainer):
    calls = []

    def _policy_loss(self, **kw):
        loss, metrics = super()._policy_loss(**kw)
        if self.model.training:
            ref, _ = get_policy_loss_fn("no_trust_region")(
                old_log_prob=kw["old_log_prob"], log_prob=kw["log_prob"], advantages=kw["advantages"],
                response_mask=kw["response_mask"], loss_agg_mode="token-mean", config=kw["config"])
            self.calls.append({"window": self._stalerl_window_start, "loss": float(loss), "ref": float(ref),
                               "tokens": float(kw["response_mask"].sum()), "metrics": metrics})
        return loss, metrics


for scale in (1.0, 2.0):
    Capturing.calls = []
    torch.manual_seed(0)
    model, tok = tiny_model_and_tokenizer()
    args = GRPOConfig(**base_args(Path(sys.argv[1]) / str(scale), loss_type="throwaway", tl_scale=scale,
                                  per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  steps_per_generation=2))
    trainer = Capturing(model=model, reward_funcs=digit_reward, args=args, train_dataset=prompts_dataset(),
                        processing_class=tok)
    trainer.train()
    out[str(scale)] = {"calls": Capturing.calls,
                       "log": [row for row in trainer.state.log_history if "throwaway/num_tokens" in row]}
print("RESULT " + json.dumps(out))
'''


def test_throwaway_loss_runs_through_trls_grpo_trainer(tmp_path: Path) -> None:
    require_trl()
    site = throwaway_loss.install(tmp_path / "site")
    throwaway_loss.install_clashing(site, "vespo", "trl")  # TRL's own loss name, beside the good plugin (issue 44)
    throwaway_loss.install_broken(site)
    env = throwaway_loss.env_with(site)
    env["PYTHONPATH"] = str(Path(__file__).parent) + ":" + env["PYTHONPATH"]
    res = subprocess.run([sys.executable, "-W", "ignore::FutureWarning", "-c", SCRIPT, str(tmp_path / "out")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert "throwaway" in out["loss_types"]
    # the plugin named after TRL's vespo is refused in TRL alone (one line, the fix named); the bad plugins too;
    # every built-in keeps its loss_type
    assert "vespo" not in out["loss_types"] and "vespo" in out["registered"]
    assert "trl has its own loss 'vespo'" in out["refusals"]["trl:vespo"]
    assert {"broken_import", "name_thief", "clip_thief", "tau_thief"} <= set(out["refusals"])
    assert all("\n" not in line and "Fix:" in line for line in out["refusals"].values())
    from recipe.registry import BUILTIN_POLICY_LOSSES, get_declaration

    assert {get_declaration(n).name_in("trl") for n in BUILTIN_POLICY_LOSSES} <= set(out["loss_types"])
    assert out["field"][0] == 1.0 and "scale" in out["field"][1]
    # refused at construction, before any model or update, in one line naming the generated field
    assert out["refused"] is not None and "GRPOConfig.tl_scale" in out["refused"] and "\n" not in out["refused"]
    for scale in ("1.0", "2.0"):
        calls, log = out[scale]["calls"], out[scale]["log"]
        assert len(calls) == 4, "two optimizer steps of two micro-batches each"
        for call in calls:  # the framework really ran it: no_trust_region's loss times tl_scale, on the same inputs
            assert call["ref"] != 0.0
            assert abs(call["loss"] - float(scale) * call["ref"]) <= 1e-6 * max(1.0, abs(call["ref"]))
        # metrics: once per optimizer step, num_tokens summed over the step's micro-batches (SUM), ratio_mean the
        # valid-token-weighted mean (MEAN)
        assert len(log) == 2
        for row, start in zip(log, sorted({c["window"] for c in calls})):
            step = [c for c in calls if c["window"] == start]
            assert row["throwaway/num_tokens"] == sum(c["tokens"] for c in step)
            tokens = sum(c["tokens"] for c in step)
            mean = sum(c["tokens"] * c["metrics"]["throwaway/ratio_mean"] for c in step) / tokens
            assert abs(row["throwaway/ratio_mean"] - mean) <= 1e-6
