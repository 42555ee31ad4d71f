"""The actor's update must not depend on how a mini-batch is split into micro-batches."""

import copy

import pytest
import torch

from stalerl.training.actor import Actor
from stalerl.training.advantage import grpo_advantages
from stalerl.config import NormConfig, load_config
from stalerl.core.model import PromptFormatter
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.engine import HFRolloutEngine

QUESTIONS = ["12+7=?", "3+45=?", "99+1=?", "8+8=?", "40+2=?", "5+5=?"]
ANSWERS = ["19", "48", "100", "16", "42", "10"]


def _stale_batch(model, tok):
    """A batch whose behaviour log-probs come from perturbed weights, so ratios are far from 1."""
    torch.manual_seed(5)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = HFRolloutEngine(behaviour, tok, PromptFormatter(tok).format, gsm8k_reward)
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8)
    # random rewards so every group has signal
    batch.rewards = (torch.rand(batch.num_rows) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())
    return batch, adv


def _updated_params(model, batch, adv, **overrides):
    cfg = load_config([f"actor.{k}={v}" for k, v in overrides.items()])
    m = copy.deepcopy(model)
    actor = Actor(m, cfg.actor, temperature=1.0, total_updates=1)
    metrics = actor.update(batch, adv)
    return [p.detach().clone() for p in m.parameters()], metrics


@pytest.mark.parametrize("loss", ["m2po", "vanilla", "no_trust_region", "fipo"])
def test_micro_batch_split_does_not_change_the_update(tiny_policy, loss):
    model, tok = tiny_policy
    batch, adv = _stale_batch(model, tok)
    # SGD makes the parameter change proportional to the gradient, so equal parameters mean equal gradients.
    common = {"loss": loss, "optimizer.type": "sgd", "optimizer.lr": 1.0, "optimizer.gradient_clipping": 1e9,
              "m2_threshold": 0.01}
    whole, m_whole = _updated_params(model, batch, adv, **common, **{"mb_spec.max_tokens_per_mb": 100000})
    split, m_split = _updated_params(model, batch, adv, **common, **{"mb_spec.max_tokens_per_mb": 40})
    assert m_whole["actor/num_micro_batches"] == 1 and m_split["actor/num_micro_batches"] > 3
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)
    assert m_whole["actor/loss"] == pytest.approx(m_split["actor/loss"], abs=1e-6)
    if loss == "m2po":
        # the mask was chosen once over the mini-batch: the same tokens are masked, however it is split
        assert m_whole["actor/m2po/num_masked_tokens"] == m_split["actor/m2po/num_masked_tokens"]
        assert m_whole["actor/m2po/num_masked_tokens"] > 0
    if loss == "fipo":
        # FIPO's Future-KL, weights and drop are per row: a row split keeps them, and they are active here
        assert m_whole["actor/fipo/influence_weight_clip_ratio_upper"] > 0
        assert m_whole["actor/fipo/influence_weight_clip_ratio_upper"] == pytest.approx(
            m_split["actor/fipo/influence_weight_clip_ratio_upper"], rel=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("tokens_per_mb", [100000, 40])
def test_fipo_update_with_dropped_rows_is_the_reference_on_the_mini_batch(tiny_policy, tokens_per_mb, agg):
    """FIPO drops whole rows and a dropped row leaves the step's numerator and denominator: the actor's update, in one
    loss call or split into micro-batches, is the gradient of the registry's FIPO called alone on the whole mini-batch
    (which counts its own kept tokens, or kept rows for the seq-mean modes). The all-valid counts would scale it by
    valid / kept."""
    from recipe.fipo.algorithm import compute_policy_loss_fipo
    from stalerl.training.actor import loss_config

    model, tok = tiny_policy
    batch, adv = _stale_batch(model, tok)
    overrides = {"loss": "fipo", "optimizer.type": "sgd", "optimizer.lr": 1.0, "optimizer.gradient_clipping": 1e9,
                 "fipo_clip_ratio_c": 1.5, "mb_spec.max_tokens_per_mb": tokens_per_mb, "loss_agg_mode": agg}
    after, metrics = _updated_params(model, batch, adv, **overrides)
    assert metrics["actor/fipo/sequence_drop_ratio"] > 0, "the batch must make FIPO drop a row"
    assert (metrics["actor/num_micro_batches"] > 3) == (tokens_per_mb == 40)

    cfg = load_config([f"actor.{k}={v}" for k, v in overrides.items()])
    reference = copy.deepcopy(model)
    actor = Actor(reference, cfg.actor, temperature=1.0, total_updates=1)
    lp = actor._forward_logp(batch)  # the actor's own training forward, with grad, the whole batch at once
    width = lp.shape[1]
    loss, ref_metrics = compute_policy_loss_fipo(
        old_log_prob=batch.behavior_logp[:, :width], log_prob=lp, advantages=adv[:, :width],
        response_mask=batch.response_mask[:, :width], loss_agg_mode=agg, config=loss_config(cfg.actor))
    loss.backward()
    expected = [p.detach() - p.grad for p in reference.parameters()]
    for a, b in zip(after, expected):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert metrics["actor/loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    assert metrics["actor/fipo/sequence_drop_ratio"] == pytest.approx(ref_metrics["fipo/sequence_drop_ratio"])


def test_ppo_minibatches_take_several_optimizer_steps(tiny_policy):
    model, tok = tiny_policy
    batch, adv = _stale_batch(model, tok)
    cfg = load_config(["actor.ppo_n_minibatches=2", "train_dataset.batch_size=6"])
    actor = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=2)
    actor.update(batch, adv)
    assert actor.optimizer.state_dict()["state"][0]["step"].item() == 2


def test_m2po_mask_reduces_m2_of_trust_region(tiny_policy):
    model, tok = tiny_policy
    batch, adv = _stale_batch(model, tok)
    _, metrics = _updated_params(model, batch, adv, loss="m2po", m2_threshold=0.01,
                                 **{"mb_spec.max_tokens_per_mb": 40})
    assert metrics["actor/m2po/m2_before"] > 0.01
    assert metrics["actor/m2po/m2_after"] <= 0.01 + 1e-9


def test_the_multi_tensor_adamw_gives_the_per_parameter_loops_update_bit_for_bit(tiny_policy):
    """build_optimizer's foreach=True must not change a single weight against torch's CPU default (the
    per-parameter loop): 3 updates with weight decay, 2 mini-batches each, compared exactly."""
    model, tok = tiny_policy
    batch, adv = _stale_batch(model, tok)
    cfg = load_config(["actor.ppo_n_minibatches=2", "train_dataset.batch_size=6",
                       "actor.optimizer.weight_decay=0.1", "actor.optimizer.lr=1e-3"])
    fast = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=6)
    loop = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=6)
    for group in loop.optimizer.param_groups:
        group["foreach"] = False
    assert all(g["foreach"] is True for g in fast.optimizer.param_groups)
    for _ in range(3):
        fast.update(batch, adv)
        loop.update(batch, adv)
    for a, b in zip(fast.model.parameters(), loop.model.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(fast.model.parameters(), model.parameters()))


def test_a_checkpoint_saved_without_foreach_resumes_on_the_multi_tensor_path(tiny_policy):
    model, _ = tiny_policy
    cfg = load_config([])
    actor = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=1)
    state = actor.state_dict()
    for group in state["optimizer"]["param_groups"]:
        group["foreach"] = None  # what checkpoints written before foreach=True hold
    actor.load_state_dict(state)
    assert all(g["foreach"] is True for g in actor.optimizer.param_groups)
