"""Baseline policy losses for stale-rollout comparisons. Pure torch.

- ``vanilla``: PPO's clipped surrogate, max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), with optional dual clip
  (for A < 0 the loss is capped at -A c), as verl's ``vanilla`` and the paper's GRPO baseline; the log-ratio is
  clamped to +-20 before exp() as in verl (zero gradient beyond the bound, see ``recipe.common.LOG_RATIO_CLAMP``).
- ``no_trust_region``: the same unclipped importance-weighted objective as M2PO, -A r averaged over all valid tokens,
  with nothing masked (the paper's "GRPO no TR").

Clip's diagnostics by quadrant: how many tokens the clip zeroed in each trust-region quadrant, ``pos_r_gt_1``
(A > 0, r > 1 + eps_high) and ``neg_r_lt_1`` (A < 0, r < 1 - eps_low), and their share of the gradient weight |A r|
of the trust region T (valid tokens with A > 0, r > 1 or A < 0, r < 1), as M2PO reports its masked tokens
(``recipe.m2po.quadrant_weights``). A share is over the tokens of one call; the ``*_weight_per_token`` keys (sums /
valid tokens) combine exactly over micro-batches when weighted by their valid tokens, as the runtime does, so
``clipped_weight_per_token_Q / trust_region_weight_per_token`` is the share of a whole split step.

Config keys (verl names first, then the runtime's AReaL-style names): ``clip_ratio_low`` / ``clip_ratio`` /
``eps_clip`` (default 0.2), ``clip_ratio_high`` / ``eps_clip_higher`` (default: the low value), ``clip_ratio_c`` /
``c_clip`` (default: off).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.baselines.declaration import NO_TRUST_REGION, QUADRANTS, VANILLA
from recipe.registry import register_policy_loss
from recipe.common import (
    agg_loss,
    check_inputs,
    global_batch_info,
    masked_log_ratio,
    ppo_clip_surrogate,
    clamp_log_ratio,
)

# Metric keys in the order the loss reports them: its declaration's (declared once, recipe/baselines/declaration.py).
VANILLA_METRIC_KEYS = tuple(VANILLA.metrics)
VANILLA_QUADRANT_METRIC_KEYS = VANILLA_METRIC_KEYS[3:]  # after clip_fraction, dual_clip_fraction, ppo_kl
NO_TR_METRIC_KEYS = tuple(NO_TRUST_REGION.metrics)


def _clip_params(config: Any) -> tuple[float, float, Optional[float]]:
    """(eps_low, eps_high, dual clip or None): the shared PPO-clip group, read and checked by its one reader."""
    return tuple(VANILLA.read_clip(config))  # type: ignore[return-value]


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    values = torch.where(valid, values, torch.zeros_like(values))
    return values.sum() / valid.sum().clamp(min=1)


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip (optionally dual clip) with verl's signature."""
    low, high, dual = _clip_params(config)
    valid = check_inputs("vanilla", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    d = masked_log_ratio(old_log_prob, log_prob, valid)
    adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
    ratio = torch.exp(clamp_log_ratio(d))
    per_token, clipped, dual_clipped = ppo_clip_surrogate(ratio, adv, low, high, dual)
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(ratio))
    loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
    with torch.no_grad():
        stats = torch.stack([
            _masked_mean(clipped.float(), valid), _masked_mean(dual_clipped.float(), valid),
            _masked_mean(-d.detach(), valid),
        ]).tolist()
    metrics = dict(zip(VANILLA_METRIC_KEYS, stats))
    metrics.update(_clip_quadrants(d, adv, ratio, valid, clipped))
    return loss, metrics


def _clip_quadrants(d: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor, valid: torch.Tensor,
                    clipped: torch.Tensor) -> dict[str, float]:
    """The clipped tokens of each trust-region quadrant and their share of T's gradient weight (diagnostics only:
    no_grad, from the detached ratio the loss already computed)."""
    from recipe.m2po.algorithm import quadrant_weights, trust_region_mask

    t = trust_region_mask(d, adv, valid)
    q = quadrant_weights(d, adv, t, clipped & valid, ratio=ratio)
    n_valid = max(int(valid.sum()), 1)
    out = q.metrics(prefix="vanilla", noun="clipped")
    out["vanilla/trust_region_weight_per_token"] = q.trust_region_weight / n_valid
    for name, w in zip(QUADRANTS, q.masked_weight):
        out[f"vanilla/clipped_weight_per_token_{name}"] = w / n_valid
    return {k: out[k] for k in VANILLA_QUADRANT_METRIC_KEYS}


def compute_policy_loss_no_trust_region(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-A * r over all valid tokens, no clip and no mask (M2PO with tau = infinity)."""
    valid = check_inputs("no_trust_region", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    d = masked_log_ratio(old_log_prob, log_prob, valid)
    adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
    ratio = torch.exp(clamp_log_ratio(d))
    per_token = -adv * ratio
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(ratio))
    loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
    with torch.no_grad():
        r = ratio.detach()
        stats = torch.stack([
            _masked_mean(r, valid),
            torch.where(valid, r, torch.zeros_like(r)).max() if r.numel() else torch.zeros((), device=r.device),
            _masked_mean(-d.detach(), valid),
        ]).tolist()
    return loss, dict(zip(NO_TR_METRIC_KEYS, stats))


# Registration: the loss under its declaration (recipe/baselines/declaration.py), with what its step needs.
register_policy_loss(VANILLA)(compute_policy_loss_vanilla)
register_policy_loss(NO_TRUST_REGION)(compute_policy_loss_no_trust_region)
