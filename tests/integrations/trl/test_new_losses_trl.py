"""CISPO and DPPO through TRL's real ``GRPOTrainer`` (recipe.trl), TRL 1.16's lane.

- ``loss_type="stalerl_cispo"`` (TRL owns ``cispo``) trains to the weights of TRL's own ``cispo`` when the two clips
  mean the same: TRL caps the ratio at ``epsilon_high`` itself and has no lower bound; ours clips to
  ``[1 - epsilon, 1 + epsilon_high]``, so ``epsilon=1`` (lower bound 0 < r) and ``epsilon_high = E - 1``.
- ``loss_type="dppo_tv"`` / ``"dppo_kl"`` (TRL ships no DPPO) with their generated ``GRPOConfig`` field: each optimizer
  step's micro-batch losses sum to the registry loss of the whole step, tokens are dropped on the reuse pass, the
  metrics reach TRL's log once per step, and a bad delta is refused at construction in one line naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trl_cases import base_args, capturing_trainer, require_trl, tiny_model_and_tokenizer, train, weights  # noqa: F401

pytestmark = pytest.mark.trl

E = 1.2  # TRL's cispo cap on the ratio; the reuse pass at this learning rate moves ratios past it


_train = train
_capturing = capturing_trainer


def test_stalerl_cispo_trains_to_trls_own_cispo(tmp_path: Path) -> None:
    require_trl()
    import trl

    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4, epsilon=1.0)
    ours = _train(tmp_path / "ours", loss_type="stalerl_cispo", epsilon_high=E - 1.0, **common)
    theirs = _train(tmp_path / "theirs", trl.GRPOTrainer, trl.GRPOConfig, loss_type="cispo", epsilon_high=E,
                    **common)
    a, b, start = weights(ours.model), weights(theirs.model), weights(tiny_model_and_tokenizer()[0])
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"stalerl_cispo vs trl cispo: max |w_ours - w_trl| = {worst:.2e}, weights moved by up to {moved:.2e}")
    assert moved > 1e-2 and worst <= 1e-6  # measured: 0 (bit for bit) on CPU, torch 2.13, trl 1.16
    # the clip was active: TRL's own count and ours agree that some ratios passed E
    assert any(row.get("cispo/clip_fraction_high", 0) > 0 for row in ours.state.log_history)
    assert any(row.get("cispo_clip_ratio", 0) > 0 for row in theirs.state.log_history)


def test_cispo_keeps_trls_name_for_trls_own_loss() -> None:
    require_trl()
    from recipe.trl import STALERL_LOSS_TYPES, TRL_LOSS_TYPES

    assert "stalerl_cispo" in STALERL_LOSS_TYPES and "cispo" not in STALERL_LOSS_TYPES and "cispo" in TRL_LOSS_TYPES
    assert {"dppo_tv", "dppo_kl"} <= set(STALERL_LOSS_TYPES)


@pytest.mark.parametrize("name,delta", [("dppo_tv", 0.05), ("dppo_kl", 0.01)])
def test_dppo_step_is_the_registry_loss_of_the_whole_step(tmp_path: Path, name: str, delta: float) -> None:
    from recipe.registry import get_policy_loss_fn
    from recipe.trl.losses import loss_config

    trainer = _train(tmp_path, _capturing(), loss_type=name, **{f"{name}_delta": delta},
                     per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4)
    steps: dict[int, list[dict[str, Any]]] = {}
    for call in trainer.calls:
        steps.setdefault(call["window"], []).append(call)
    assert len(steps) == 4 and all(len(s) == 2 for s in steps.values())
    fn, dropped = get_policy_loss_fn(name), 0.0
    for step in steps.values():
        old, new, adv, mask = (torch.cat([c[k] for c in step]) for k in
                               ("old_log_prob", "log_prob", "advantages", "response_mask"))
        whole, metrics = fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                            loss_agg_mode="token-mean", config=loss_config(trainer.args))
        torch.testing.assert_close(sum(c["loss"] for c in step), whole, rtol=1e-5, atol=1e-7)
        assert sum(c["metrics"][f"{name}/num_masked_tokens"] for c in step) == metrics[f"{name}/num_masked_tokens"]
        dropped += metrics[f"{name}/num_masked_tokens"]
    assert dropped > 0, "the reuse pass must move some token out of the trust region"
    rows = [row for row in trainer.state.log_history if f"{name}/num_masked_tokens" in row]
    assert len(rows) == len(steps)  # one value per optimizer step (its declared SUM over the step)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_bad_delta_is_refused_at_construction_in_one_line(tmp_path: Path, name: str) -> None:
    require_trl()
    from recipe.trl import GRPOConfig

    with pytest.raises(ValueError, match=rf"GRPOConfig\.{name}_delta must be > 0") as err:
        GRPOConfig(**base_args(tmp_path, loss_type=name, **{f"{name}_delta": 0.0}))
    assert "\n" not in str(err.value)
