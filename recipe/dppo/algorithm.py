"""DPPO (Divergence Proximal Policy Optimization; Qi et al., "Rethinking the Trust Region in LLM Reinforcement
Learning", arXiv 2602.04879) as two policy losses, ``dppo_tv`` and ``dppo_kl``. Pure torch.

Per valid token t, with mu = pi_behaviour(y_t) and pi = pi_theta(y_t) the probabilities of the sampled token,
d = clamp(log pi - log mu, -20, 20) and r = exp(d):

    loss_t = -M_t * r_t * A_t                      (the paper's L = E[sum_t M_t r_t A_t], minimised as its negative)

aggregated by :func:`recipe.common.agg_loss` (``token-mean``: a dropped token leaves the numerator, not the count; the
count is the caller's ``global_batch_info``, so a split step sums to the one-call loss). The gradient of a kept token
is ``-A r grad log pi``, PPO's unclipped one. ``M_t`` (detached) drops the tokens that left the trust region in the
direction their advantage pushes:

    M_t = 0  if  A_t > 0 and pi > mu and D_t > delta      (the update would raise pi further)
         or  A_t < 0 and pi < mu and D_t > delta      (the update would lower pi further)
    M_t = 1  otherwise (A_t = 0 included: its loss is 0 either way)

with the binary approximation D of the divergence between mu and pi (the sampled token against the rest of the
vocabulary, two Bernoulli distributions):

- ``dppo_tv``: D = |pi - mu| (binary total variation); tested as ``pi - mu > delta`` (A > 0) and
  ``pi - mu < -delta`` (A < 0), the same floats as the authors' and verl's code;
- ``dppo_kl``: D = mu log(mu / pi) + (1 - mu) log((1 - mu) / (1 - pi)) (binary KL(mu || pi)), computed from the
  log-probs (``log(1 - p) = log(-expm1(log p))``, no additive epsilon; ``0 log 0 = 0``; pi = 1 > mu gives D = inf).

Probabilities are exp of the fp32 log-probs. The mask is the behaviour policy's (the paper anchors the trust region to
the rollout policy: ``old_log_prob`` is pi_behaviour here, as for every loss of this registry).

Differences from verl 0.9.1's ``dppo_tv`` / ``dppo_kl`` (docs/algorithms/dppo.md): verl minimises
``-A sg(min(r, clip_ratio_c)) M log pi`` -- the same gradient where r <= clip_ratio_c, another value -- with
``clip_ratio_c`` its actor's dual-clip constant (3.0 by default; the authors' script sets 10000), reads delta from the
PPO clip keys (low and high), assigns an A = 0 token the A < 0 test, and adds 1e-8 inside the KL's second log.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.common import agg_loss, check_inputs, clamp_log_ratio, global_batch_info, masked_log_ratio
from recipe.declaration import LossDeclaration
from recipe.dppo.declaration import DPPO_KL, DPPO_TV
from recipe.registry import register_policy_loss

DIVERGENCES = ("tv", "kl")


def binary_divergence(kind: str, log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """The binary divergence D between mu = exp(old_log_prob) and pi = exp(log_prob), per token, no gradient."""
    with torch.no_grad():
        lp, lm = log_prob.detach().float(), old_log_prob.detach().float()
        p, m = torch.exp(lp), torch.exp(lm)
        if kind == "tv":
            return (p - m).abs()
        if kind != "kl":
            raise ValueError(f"binary_divergence: kind must be one of {', '.join(DIVERGENCES)}, got {kind!r}")
        rest_m = -torch.expm1(lm)  # 1 - mu, without the cancellation of 1 - exp(lm)
        rest_p = -torch.expm1(lp)
        rest_term = torch.where(rest_m > 0, rest_m * (torch.log(rest_m) - torch.log(rest_p)), torch.zeros_like(p))
        return m * (lm - lp) + rest_term


def trust_region_drop(kind: str, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      valid: torch.Tensor, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(drop, divergence): the valid tokens with M_t = 0 (module docstring) and D per token."""
    with torch.no_grad():
        lp = torch.where(valid, log_prob.detach().float(), torch.zeros((), device=valid.device))
        lm = torch.where(valid, old_log_prob.detach().float(), torch.zeros((), device=valid.device))
        adv = advantages.detach()
        p, m = torch.exp(lp), torch.exp(lm)
        div = binary_divergence(kind, lp, lm)
        if kind == "tv":
            up_out, down_out = (p - m) > delta, (p - m) < -delta
        else:
            outside = div > delta
            up_out, down_out = outside & (p > m), outside & (p < m)
        drop = valid & (((adv > 0) & up_out) | ((adv < 0) & down_out))
    return drop, div


def _dppo(kind: str, decl: LossDeclaration, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
          advantages: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, config: Any,
          rollout_is_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    name = decl.name
    delta = getattr(decl.read(config), f"{name}_delta")
    valid = check_inputs(name, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    d = masked_log_ratio(old_log_prob, log_prob, valid)
    ratio = torch.exp(clamp_log_ratio(d))
    zero = torch.zeros((), device=valid.device)
    adv = torch.where(valid, advantages.detach().float(), zero)
    drop, div = trust_region_drop(kind, log_prob, old_log_prob, adv, valid, delta)
    per_token = torch.where(drop, torch.zeros_like(ratio), -adv * ratio)
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(ratio))
    loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        div = torch.nan_to_num(torch.where(valid, div, zero), posinf=torch.finfo(torch.float32).max)
        stats = torch.stack([
            drop.sum() / n, drop.sum(), (drop & (adv > 0)).sum(), (drop & (adv < 0)).sum(),
            div.sum() / n, div.max() if div.numel() else zero, torch.where(valid, -d, zero).sum() / n,
        ]).tolist()
    return loss, dict(zip(decl.metrics, (float(s) for s in stats)))


@register_policy_loss(DPPO_TV)
def compute_policy_loss_dppo_tv(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV with verl's signature (module docstring); delta: ``dppo_tv_delta``."""
    return _dppo("tv", DPPO_TV, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights)


@register_policy_loss(DPPO_KL)
def compute_policy_loss_dppo_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL with verl's signature (module docstring); delta: ``dppo_kl_delta``."""
    return _dppo("kl", DPPO_KL, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights)
