"""Rollout correction inside the runtime (issue 37 item 4): the actor applies recipe.rollout_correction once per
mini-batch before the loss, passing the weights as rollout_is_weights and the kept tokens as the loss mask. Checked
against the registered loss called by hand on the same tensors, for split invariance, and for the batch keeping the
engine's log-probs beside the trainer's recompute."""

from __future__ import annotations

import copy

import pytest
import torch

from recipe.registry import get_policy_loss_fn
from recipe.rollout_correction import METRIC_KEYS, CorrectionParams, correction_weights


@pytest.fixture
def recomputed_batch(tiny_policy):
    from stalerl.config import NormConfig, load_config
    from stalerl.core.model import PromptFormatter
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.training.actor import Actor
    from stalerl.training.advantage import grpo_advantages

    model, tok = tiny_policy
    torch.manual_seed(3)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward)
    batch = engine.generate(["12+7=?", "3+45=?", "99+1=?", "8+8=?"], ["19", "48", "100", "16"], n_samples=4,
                            max_new_tokens=8)
    cfg = load_config(["actor.behavior_logp=recompute"])
    batch.set_trainer_logp(Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=1).compute_logp(batch))
    assert batch.engine_logp is not None  # the engine's log-probs are kept beside the recompute
    # An engine far from the trainer, so correction has something to do (real engines: bf16 kernels, vLLM)
    g = torch.Generator().manual_seed(0)
    batch.engine_logp = batch.engine_logp + 0.3 * torch.randn(batch.engine_logp.shape, generator=g)
    batch.rewards = (torch.rand(batch.num_rows, generator=g) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())
    return model, batch, adv


def _update(model, batch, adv, mode: str, loss: str = "vanilla", max_tokens: int = 100000, **params):
    from stalerl.config import load_config
    from stalerl.training.actor import Actor

    cfg = load_config([f"actor.loss={loss}", "actor.behavior_logp=recompute",
                       f"actor.mb_spec.max_tokens_per_mb={max_tokens}"])
    actor = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=1,
                  correction=CorrectionParams(mode, **params))
    metrics = actor.update(batch, adv)
    return actor, metrics


@pytest.mark.parametrize("mode", ["tis_token", "rs_token", "tis_seq", "icepop"])
def test_the_actor_loss_is_the_registered_loss_with_the_corrections_weights_and_mask(recomputed_batch, mode):
    model, batch, adv = recomputed_batch
    params = {"low": 0.8, "high": 1.25, "threshold": 1.1}
    _, metrics = _update(model, batch, adv, mode, **params)
    weights, keep = correction_weights(batch.behavior_logp, batch.engine_logp, batch.response_mask, mode, **params)
    # at the same weights the trainer's current log-probs are the recompute (fp32: the same forward)
    ref, _ = get_policy_loss_fn("vanilla")(old_log_prob=batch.behavior_logp, log_prob=batch.behavior_logp.clone(),
                                           advantages=adv, response_mask=keep & batch.response_mask,
                                           loss_agg_mode="token-mean", config={}, rollout_is_weights=weights)
    assert metrics["actor/loss"] == pytest.approx(float(ref), rel=1e-4, abs=1e-7)
    assert all(k in metrics for k in METRIC_KEYS)
    rejected = 1 - float((keep & batch.response_mask).sum()) / float(batch.response_mask.sum())
    assert metrics["rollout_correction/rejected_fraction"] == pytest.approx(rejected)
    if mode in ("rs_token", "icepop"):
        assert 0 < rejected < 1  # the perturbed engine exercises rejection


@pytest.mark.parametrize("loss", ["vanilla", "m2po"])
def test_splitting_the_mini_batch_changes_nothing(recomputed_batch, loss):
    model, batch, adv = recomputed_batch
    _, mw = _update(model, batch, adv, "rs_token", loss=loss, low=0.8, high=1.25)
    _, ms = _update(model, batch, adv, "rs_token", loss=loss, max_tokens=40, low=0.8, high=1.25)
    assert ms["actor/num_micro_batches"] > 2 and mw["actor/num_micro_batches"] == 1
    assert ms["actor/loss"] == pytest.approx(mw["actor/loss"], rel=1e-5, abs=1e-8)
    # the gradient (its norm before clipping; Adam's first step would turn float noise in ~0 gradients into +-lr)
    assert ms["actor/grad_norm"] == pytest.approx(mw["actor/grad_norm"], rel=1e-5)
    for key in METRIC_KEYS:
        assert ms[key] == pytest.approx(mw[key], rel=1e-9)


def test_mode_none_adds_nothing_and_trains_as_before(recomputed_batch):
    model, batch, adv = recomputed_batch
    plain_actor, plain = _update(model, batch, adv, "none")
    assert not any(k.startswith("rollout_correction/") for k in plain)
    from stalerl.config import load_config
    from stalerl.training.actor import Actor

    cfg = load_config(["actor.loss=vanilla", "actor.behavior_logp=recompute"])
    before = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=1)  # no correction argument
    assert before.update(batch, adv)["actor/loss"] == plain["actor/loss"]
    for a, b in zip(before.model.parameters(), plain_actor.model.parameters()):
        assert torch.equal(a, b)


def test_a_batch_without_engine_logprobs_is_refused_with_the_fix(recomputed_batch):
    model, batch, adv = recomputed_batch
    batch.engine_logp = None
    with pytest.raises(ValueError, match="actor.behavior_logp=recompute"):
        _update(model, batch, adv, "tis_token")


def test_the_batch_keeps_engine_logprobs_through_select_concat_and_the_wire(recomputed_batch):
    from stalerl.rollout.batch import concat_batches
    from stalerl.training.workers.rollout_worker import from_wire, to_wire

    _, batch, _ = recomputed_batch
    part = batch.select([0, 1, 2])
    assert torch.equal(part.engine_logp, batch.engine_logp[:3, :part.response_ids.shape[1]])
    both = concat_batches([batch.select([0, 1]), batch.select([2, 3])], pad_id=0)
    width = both.response_ids.shape[1]
    assert torch.equal(both.engine_logp[both.response_mask], batch.engine_logp[:4, :width][both.response_mask])
    back = from_wire(to_wire(part.state()))
    assert torch.equal(back.engine_logp, part.engine_logp)
    plain = copy.copy(part)
    plain.engine_logp = None
    assert concat_batches([part, plain], pad_id=0).engine_logp is None  # a mix cannot be corrected as one
