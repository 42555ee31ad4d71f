"""GRPO advantages: shaped rewards, normalised within each prompt group (or the batch), broadcast over tokens."""

from __future__ import annotations

from typing import Any, Optional

import torch


def _norm(values: torch.Tensor, group_ids: torch.Tensor, mean_level: Optional[str], std_level: Optional[str],
          eps: float) -> torch.Tensor:
    out = values.clone()
    if mean_level == "batch":
        out = out - values.mean()
    elif mean_level == "group":
        out = out - _group_stat(values, group_ids, "mean")
    if std_level == "batch":
        out = out / (values.std() + eps) if values.numel() > 1 else out
    elif std_level == "group":
        out = out / (_group_stat(values, group_ids, "std") + eps)
    return out


def _group_stat(values: torch.Tensor, group_ids: torch.Tensor, stat: str) -> torch.Tensor:
    """Per-row mean or (unbiased) std of the row's group."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inv, torch.ones_like(values))
    total = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inv, values)
    mean = total / count
    if stat == "mean":
        return mean[inv]
    sq = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inv, (values - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return std[inv]


def shaped_rewards(rewards: torch.Tensor, group_ids: torch.Tensor, *, scaling: float = 1.0, bias: float = 0.0,
                   norm: Any = None) -> torch.Tensor:
    """(reward + bias) * scaling, then optional normalisation (AReaL's reward_bias/reward_scaling/reward_norm)."""
    shaped = (rewards.float() + bias) * scaling
    if norm is not None:
        shaped = _norm(shaped, group_ids, norm.mean_level, norm.std_level, norm.eps)
    return shaped


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor, *,
                    adv_norm: Any = None) -> torch.Tensor:
    """Sequence advantage (reward, normalised by ``adv_norm``) broadcast over each row's response tokens.

    With ``adv_norm`` = group/group this is GRPO's (r - mean_g) / (std_g + eps); a group whose rewards are all equal
    gets advantage 0 on every token (no signal, and never in M2PO's trust region).
    """
    adv = rewards.float()
    if adv_norm is not None:
        adv = _norm(adv, group_ids, adv_norm.mean_level, adv_norm.std_level, adv_norm.eps)
    return torch.where(response_mask, adv.unsqueeze(1).expand_as(response_mask.float()),
                       torch.zeros(response_mask.shape, dtype=torch.float32))


def zero_advantage_rows(advantages: torch.Tensor, response_mask: torch.Tensor,
                        group_ids: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows of prompt groups whose advantage is exactly 0 on every valid token of every row (every sample
    of the prompt got the same reward). Such a group adds nothing to any registered loss's gradient (A = 0 puts a
    token in neither of the trust region's quadrants, and r * A = 0), only tokens to its denominator
    (actor.skip_zero_advantage_groups)."""
    row_zero = torch.where(response_mask.bool(), advantages == 0, torch.ones_like(response_mask.bool())).all(dim=1)
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    has_signal = torch.zeros(n_groups, dtype=torch.bool).index_put_((inv,), ~row_zero, accumulate=True)
    return ~has_signal[inv]
