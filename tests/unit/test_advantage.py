import pytest
import torch

from stalerl.training.advantage import grpo_advantages, shaped_rewards
from stalerl.config import NormConfig


def test_group_normalised_advantage_matches_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 3, dtype=torch.bool)
    mask[2, 1:] = False
    adv = grpo_advantages(rewards, groups, mask, adv_norm=NormConfig(mean_level="group", std_level="group", eps=1e-4))
    for g in (0, 1):
        r = rewards[groups == g]
        expected = (r - r.mean()) / (r.std() + 1e-4)
        assert torch.allclose(adv[groups == g][:, 0], expected, atol=1e-6)
    assert adv[2, 1:].abs().sum() == 0  # padding carries no advantage
    assert torch.all(adv[0, :] == adv[0, 0])  # broadcast over the sequence


def test_equal_rewards_give_zero_advantage():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, torch.zeros(4, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool),
                          adv_norm=NormConfig())
    assert torch.count_nonzero(adv) == 0


def test_batch_level_and_no_norm():
    rewards = torch.tensor([2.0, 0.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 1, dtype=torch.bool)
    raw = grpo_advantages(rewards, groups, mask, adv_norm=None)
    assert torch.equal(raw[:, 0], rewards)
    batch = grpo_advantages(rewards, groups, mask, adv_norm=NormConfig(mean_level="batch", std_level=None))
    assert torch.allclose(batch[:, 0], rewards - rewards.mean())


def test_reward_shaping_bias_then_scale():
    rewards = torch.tensor([0.0, 1.0])
    out = shaped_rewards(rewards, torch.tensor([0, 0]), scaling=10.0, bias=-0.5)
    assert torch.allclose(out, torch.tensor([-5.0, 5.0]))
