"""CISPO (Clipped IS-weight Policy Optimization; MiniMax-M1, arXiv 2506.13585) as a policy loss. Pure torch.

Per valid token, with d = clamp(log pi_theta - log pi_behaviour, -20, 20) and r = exp(d):

    loss_t = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A_t * log pi_theta(t)

aggregated by :func:`recipe.common.agg_loss` (``token-mean`` over the step's valid tokens: the caller's
``global_batch_info`` count, so a step split over micro-batches and ranks sums to the one-call loss). The clipped
ratio is a detached weight: unlike PPO's clip, no token loses its gradient, ``-w A grad log pi``. The value is verl's
``compute_policy_loss_cispo`` term for term (same products in the same order), so verl's ``ppo_loss`` gives the same
loss and gradient with either function.

The clip is the framework's PPO clip: ``clip_ratio_low`` / ``clip_ratio`` / ``eps_clip`` (default 0.2) and
``clip_ratio_high`` / ``eps_clip_higher`` (default: the low value), read by the shared PPO-clip group
(``recipe.declaration.PPO_CLIP``) and checked by ``Param.check``. The paper keeps
no lower bound: set the low side to 1 (``actor.eps_clip=1``), so 1 - eps_low = 0 < r always.

Padding: the log-ratio, the advantage and the log-prob are zeroed on padding *before* the products, so garbage there
(NaN, inf) reaches neither the loss nor the gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.cispo.declaration import DECLARATION
from recipe.common import agg_loss, check_inputs, clamp_log_ratio, global_batch_info, masked_log_ratio
from recipe.registry import register_policy_loss

METRIC_KEYS = tuple(DECLARATION.metrics)


def clip_range(config: Any) -> tuple[float, float]:
    """(eps_low, eps_high) from ``config``: the shared PPO-clip group's reader (``recipe.declaration.PPO_CLIP``: verl's
    ``clip_ratio_low`` / ``clip_ratio`` first, then the runtime's ``eps_clip``; the high side defaults to the low);
    a bad value raises ValueError naming the key read (``Param.check``)."""
    clip = DECLARATION.read_clip(config)
    return clip.low, clip.high


@register_policy_loss(DECLARATION)
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO with verl's signature (module docstring)."""
    eps_low, eps_high = clip_range(config)
    valid = check_inputs("cispo", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    d = masked_log_ratio(old_log_prob, log_prob, valid)
    ratio = torch.exp(clamp_log_ratio(d)).detach()
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    zero = torch.zeros((), device=valid.device)
    adv = torch.where(valid, advantages.detach().float(), zero)
    logp = torch.where(valid, log_prob.float(), zero)
    per_token = -weight * adv * logp
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(ratio))
    loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        stats = torch.stack([
            (valid & (ratio < 1.0 - eps_low)).sum() / n,
            (valid & (ratio > 1.0 + eps_high)).sum() / n,
            torch.where(valid, -d, zero).sum() / n,
        ]).tolist()
    return loss, dict(zip(METRIC_KEYS, stats))
