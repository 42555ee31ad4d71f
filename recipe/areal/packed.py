"""The registry's losses on AReaL's packed micro-batches, and the whole-mini-batch selection. Pure torch + ``recipe``.

AReaL's engines hand the loss one micro-batch of *packed* 1-D tokens: every sequence of the micro-batch laid end to
end, ``cu_seqlens`` (``[0, l_0, l_0 + l_1, ...]``) marking where each starts. Per-token inputs (``logprobs`` of the
behaviour policy, ``advantages``, ``loss_mask``, the current ``logprobs`` from the forward) are aligned to the
next-token labels already, so the loss only needs them as rows. :func:`packed_rows` lays the packed tokens out as
``(num_sequences, longest)`` rows padded on the right, the shape every registered loss takes; FIPO needs rows (its
Future-KL runs along each sequence), the token-wise losses do not care.

Normalisation. AReaL scales each micro-batch's loss by ``local_weight / total_weight * dp_size`` with
``local_weight = loss_mask.count_nonzero()`` of the micro-batch and ``total_weight`` the same count over the whole
mini-batch and all data-parallel ranks (then FSDP averages gradients over ranks). A loss that returns *sum over its
valid tokens / its own valid-token count* therefore contributes exactly *sum / all valid tokens of the mini-batch*:
the registry's ``token-mean`` over the whole mini-batch. :func:`packed_policy_loss` returns that (``global_batch_info``
set to the micro-batch's own count), so AReaL's weighting and the registry's denominator agree by construction.
A loss whose step needs one decision before its micro-batches (its declaration's ``step``: M2PO's selection over the
whole mini-batch, FIPO's sequence drop) is planned once per mini-batch by ``recipe.optimizer_batch``
(:func:`select_mini_batch`): the plan's per-token tensors (M2PO's ``keep_mask``, FIPO's ``row_keep_mask``) ride
along in the mini-batch dict under :func:`extra_key`, so AReaL's micro-batching slices and packs them like the
log-probs, and each micro-batch's loss gets its share. When the plan counts fewer tokens than the valid ones (FIPO: a
dropped row leaves the step's denominator too), every micro-batch loss is multiplied by valid / planned tokens, which
turns AReaL's valid-token weighting into *sum / the plan's tokens of the mini-batch*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from recipe.optimizer_batch import MicroBatch, OptimizerBatchPlan, plan_optimizer_batch, with_global_batch_info
from recipe.registry import get_policy_loss_spec

#: Prefix of the keys under which a step plan's per-token tensors travel through AReaL's micro-batching (tensors of
#: the padded mini-batch, so AReaL splits and packs them with everything else).
EXTRA_PREFIX = "stalerl_"


def extra_key(name: str) -> str:
    """The mini-batch key of the plan's loss keyword ``name`` (``keep_mask`` -> ``stalerl_keep_mask``)."""
    return EXTRA_PREFIX + name


#: M2PO's whole-mini-batch selection (the plan's ``keep_mask``).
KEEP_MASK_KEY = extra_key("keep_mask")


def packed_rows(values: torch.Tensor, cu_seqlens: torch.Tensor, *, fill: float = 0.0) -> torch.Tensor:
    """``(total_tokens,)`` packed values as ``(num_sequences, longest)`` rows, right-padded with ``fill``."""
    if values.dim() != 1:
        raise ValueError(f"packed tokens must be 1-D, got shape {tuple(values.shape)}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if not bounds or bounds[0] != 0 or any(b > c for b, c in zip(bounds, bounds[1:])) or bounds[-1] > values.numel():
        raise ValueError(f"cu_seqlens must rise from 0 to at most {values.numel()} (the packed length), got {bounds}")
    lengths = [c - b for b, c in zip(bounds, bounds[1:])]
    width = max(lengths, default=0)
    rows = values.new_full((len(lengths), width), fill)
    for i, (start, length) in enumerate(zip(bounds, lengths)):
        rows[i, :length] = values[start:start + length]
    return rows


def packed_policy_loss(loss_name: str, logprobs: torch.Tensor, input_data: dict[str, Any], config: Any, *,
                       step_scale: float = 1.0) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The registered loss ``loss_name`` on one packed AReaL micro-batch, as AReaL's engine must receive it.

    ``logprobs``: the current policy's per-token log-probs from the training forward (with grad). ``input_data``:
    the micro-batch (``logprobs`` = behaviour log-probs, ``advantages``, ``loss_mask``, ``cu_seqlens`` and the step
    plan's tensors under :func:`extra_key`). ``step_scale``: the factor :func:`select_mini_batch` returned (valid /
    planned tokens of the mini-batch). Returns ``(loss, metrics, kept)``: the loss divided by this micro-batch's
    valid tokens (see the module note) times ``step_scale``, the loss's metrics, and the packed mask of the tokens
    that entered the objective (valid and kept by the plan's masks), for AReaL's statistics.
    """
    spec = get_policy_loss_spec(loss_name)
    mask = input_data["loss_mask"].bool()
    cu_seqlens = input_data["cu_seqlens"]
    rows = lambda t, fill=0.0: packed_rows(t, cu_seqlens, fill=fill)  # noqa: E731 - one layout for every tensor
    extras: dict[str, torch.Tensor] = {}
    kept = mask
    for key, value in input_data.items():
        if isinstance(key, str) and key.startswith(EXTRA_PREFIX) and isinstance(value, torch.Tensor):
            if value.dtype == torch.bool or key.endswith("mask"):
                value = value.bool() & mask
                kept = kept & value
            extras[key[len(EXTRA_PREFIX):]] = rows(value, fill=False if value.dtype == torch.bool else 0.0)
    if not extras and spec.declaration.step != "nothing":
        raise ValueError(f"{loss_name} on an AReaL micro-batch needs the mini-batch selection (its step plan, "
                         f"{extra_key('*')!r}); run it through recipe.areal.ExactLossPPOActor, which selects over the "
                         "whole mini-batch")
    local_config = with_global_batch_info(config, num_tokens=int(mask.count_nonzero()), dp_size=1)
    loss, metrics = spec.fn(
        old_log_prob=rows(input_data["logprobs"].detach()), log_prob=rows(logprobs),
        advantages=rows(input_data["advantages"].detach()), response_mask=rows(mask, fill=False),
        loss_agg_mode="token-mean", config=local_config, **extras)
    if step_scale != 1.0:
        loss = loss * step_scale
    return loss, metrics, kept


@dataclass
class MiniBatchPlan:
    """What :func:`select_mini_batch` decided for one AReaL mini-batch (one optimizer step)."""

    #: the registry's plan (M2PO: the selection, ``plan.selection``; FIPO: ``plan.row_drops``)
    plan: Optional[OptimizerBatchPlan]
    #: multiplies every micro-batch loss (valid / planned tokens of the mini-batch, all ranks; FIPO's drop: > 1)
    step_scale: float = 1.0
    #: the mini-batch's valid tokens and the tokens the plan counts (FIPO: after the sequence drop), all ranks
    num_valid_tokens: int = 0
    num_kept_tokens: int = 0

    @property
    def selection(self) -> Any:
        return None if self.plan is None else self.plan.selection


def _current_step(mini_batch: dict[str, Any], current_logprobs: torch.Tensor, device: torch.device) -> MicroBatch:
    mask = mini_batch["loss_mask"].to(device).bool()
    if current_logprobs.shape != mask.shape:
        raise ValueError(f"current log-probs have shape {tuple(current_logprobs.shape)}, expected the mini-batch's "
                         f"{tuple(mask.shape)}")
    # Padded (B, T) rows, one sequence each: no cu_seqlens needed here.
    return MicroBatch(old_log_prob=mini_batch["logprobs"].detach().to(device).float(),
                      log_prob=current_logprobs.detach().to(device).float(),
                      advantages=mini_batch["advantages"].detach().to(device).float(), response_mask=mask)


def select_mini_batch(loss_name: str, mini_batch: dict[str, Any], current_logprobs: torch.Tensor, config: Any, *,
                      group: Optional[Any] = None, device: Optional[torch.device] = None) -> MiniBatchPlan:
    """One decision over a whole padded AReaL mini-batch (and all ranks of ``group``), before its micro-batches:
    ``recipe.optimizer_batch.plan_optimizer_batch``, the one exact-step planner.

    ``mini_batch`` is what AReaL's ``PPOActor`` passes to ``engine.train_batch``: per-token ``(B, T)`` tensors
    ``logprobs`` (behaviour), ``advantages``, ``loss_mask``; ``current_logprobs`` the current policy's log-probs of
    the same tokens, same shape. The plan's per-token tensors (M2PO's selection, FIPO's kept rows) are stored in
    ``mini_batch`` under :func:`extra_key`; AReaL's micro-batching then slices and packs them with the other
    tensors. ``device``: where the decision runs (the engine's device: NCCL groups take only accelerator tensors);
    default the mini-batch's.
    """
    home = mini_batch["loss_mask"].device
    device = device if device is not None else home
    step = _current_step(mini_batch, current_logprobs, device)
    plan = plan_optimizer_batch(loss_name, [step], config, group=group)
    for name, value in plan.extras[0].items():
        mini_batch[extra_key(name)] = value.to(home)
    valid = plan.row_drops.num_valid_tokens if plan.row_drops is not None else plan.num_tokens
    scale = valid / plan.num_tokens if plan.num_tokens > 0 and valid != plan.num_tokens else 1.0
    return MiniBatchPlan(plan=plan, step_scale=scale, num_valid_tokens=valid, num_kept_tokens=plan.num_tokens)
