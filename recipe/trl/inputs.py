"""Reading a TRL GRPO batch: the behaviour log-probs and the loss mask. Pure torch (no TRL import)."""

from __future__ import annotations

from typing import Any, Optional

import torch


def behaviour_log_probs(inputs: dict[str, Any], current: Optional[torch.Tensor], *,
                        corrected: bool = False) -> Optional[torch.Tensor]:
    """The behaviour policy's per-token log-probs of a TRL batch, or None when the batch is on-policy.

    The sampler's (``sampling_per_token_logps``: vLLM) when present, else TRL's ``old_per_token_logps`` (a reused
    batch). Tokens the sampler could not score (NaN) fall back to ``old_per_token_logps``, else to ``current``
    (log-ratio 0), as TRL treats them (no correction). With TRL's vLLM importance-sampling correction on
    (``corrected``), the trainer's ``old_per_token_logps`` (the sampler's gap is then the correction's weight).
    """
    sampled = inputs.get("sampling_per_token_logps")
    old = inputs.get("old_per_token_logps")
    if corrected:
        if old is None:
            raise ValueError("TRL's vLLM importance-sampling correction is on but the batch has no "
                             "old_per_token_logps; the framework's batching changed")
        return old
    if sampled is None:
        return old
    missing = torch.isnan(sampled)
    if not bool(missing.any()):
        return sampled
    fallback = old if old is not None else current
    if fallback is None:
        raise ValueError("sampling_per_token_logps has NaN entries and there are no other log-probs to fill them")
    return torch.where(missing, fallback.detach().to(sampled.dtype), sampled)


def loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """TRL's loss mask: completion tokens, without tool-output tokens."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def correction_weights_of(inputs: dict[str, Any], mask: torch.Tensor, correction: dict[str, Any]) -> torch.Tensor:
    """TRL's vLLM importance-sampling weights of a batch, by ``recipe.rollout_correction`` (``correction``: the
    keywords :func:`recipe.trl.losses.vllm_correction` mapped from TRL's settings): rho = exp(old - sampling) per
    valid token, 1 where the sampler gave NaN (as TRL); the loss mask is left as it is (TRL keeps a zero-weight token
    in the denominator)."""
    from recipe.rollout_correction import correction_weights

    old, sampled = inputs["old_per_token_logps"], inputs["sampling_per_token_logps"]
    engine = torch.where(torch.isnan(sampled), old.to(sampled.dtype), sampled)
    weights, _ = correction_weights(old, engine, mask, **correction)
    return weights
