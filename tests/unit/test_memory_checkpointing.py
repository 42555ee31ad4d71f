"""actor.gradient_checkpointing: the memory lever of the real-model run (bench/real_model_memory.py) must not change
the update. Recomputing a decoder layer's forward in the backward pass runs the same kernels on the same inputs, so
on a CPU the log-probs, the gradients and the weights after the optimizer steps are bit-identical to the plain run."""

import copy

import pytest
import torch

from stalerl.config import NormConfig, load_config
from stalerl.core.model import PromptFormatter, load_policy, load_policy_from_config
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.engine import HFRolloutEngine
from stalerl.training.actor import Actor
from stalerl.training.advantage import grpo_advantages

QUESTIONS = ["12+7=?", "3+45=?", "99+1=?", "8+8=?"]
ANSWERS = ["19", "48", "100", "16"]


def _batch(model, tok):
    torch.manual_seed(3)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(0.05 * torch.randn_like(p))  # ratios far from 1, so the losses' clipping and masking act
    engine = HFRolloutEngine(behaviour, tok, PromptFormatter(tok).format, gsm8k_reward)
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8)
    batch.rewards = (torch.rand(batch.num_rows) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())
    return batch, adv


def _train(model, batch, adv, checkpointing: bool, loss: str):
    cfg = load_config([f"actor.loss={loss}", f"actor.gradient_checkpointing={str(checkpointing).lower()}"])
    m = copy.deepcopy(model)
    if checkpointing:
        m.gradient_checkpointing_enable()  # what load_policy_from_config does for the flag
    assert m.is_gradient_checkpointing == checkpointing
    actor = Actor(m, cfg.actor, temperature=0.7, total_updates=2)
    # The first layer's MLP starts once per grad forward, and again in each backward when recomputed (a pre-hook:
    # the recomputation stops once it has what the backward needs, before a forward hook would run).
    calls = []
    hook = m.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    metrics = [actor.update(batch, adv) for _ in range(2)]
    hook.remove()
    return [p.detach().clone() for p in m.parameters()], metrics, actor.compute_logp(batch), len(calls)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("loss", ["m2po", "vanilla"])
def test_gradient_checkpointing_gives_the_same_weights_bit_for_bit(arch, loss):
    torch.set_num_threads(1)
    model, tok = load_policy(f"tiny:{arch}", dtype="float32", device="cpu", seed=0)
    batch, adv = _batch(model, tok)
    plain, plain_metrics, plain_logp, plain_calls = _train(model, batch, adv, False, loss)
    ckpt, ckpt_metrics, ckpt_logp, ckpt_calls = _train(model, batch, adv, True, loss)
    assert ckpt_calls == 2 * plain_calls > 0, "the layers were not recomputed: checkpointing did not run"
    moved = max(float((a - b).abs().max()) for a, b in zip(plain, [p.detach() for p in model.parameters()]))
    assert moved > 0, "the update did not move the weights: the comparison would be vacuous"
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)
    assert torch.equal(plain_logp, ckpt_logp)
    for a, b in zip(plain_metrics, ckpt_metrics):
        assert a["actor/loss"] == b["actor/loss"] and a["actor/grad_norm"] == b["actor/grad_norm"]


def test_the_config_flag_turns_checkpointing_on():
    cfg = load_config(["actor.gradient_checkpointing=true"])
    model, _ = load_policy_from_config(cfg)
    assert model.is_gradient_checkpointing
    cfg = load_config([])
    model, _ = load_policy_from_config(cfg)
    assert not model.is_gradient_checkpointing
