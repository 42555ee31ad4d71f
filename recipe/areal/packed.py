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
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.optimizer_batch import MicroBatch, OptimizerBatchPlan, plan_optimizer_batch, with_global_batch_info
from recipe.registry import get_policy_loss_fn

#: The key under which the whole-mini-batch M2PO selection travels through AReaL's micro-batching (a per-token tensor
#: of the padded mini-batch, so AReaL splits and packs it with everything else).
KEEP_MASK_KEY = "stalerl_keep_mask"


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


def packed_policy_loss(loss_name: str, logprobs: torch.Tensor, input_data: dict[str, Any], config: Any
                       ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The registered loss ``loss_name`` on one packed AReaL micro-batch, as AReaL's engine must receive it.

    ``logprobs``: the current policy's per-token log-probs from the training forward (with grad). ``input_data``:
    the micro-batch (``logprobs`` = behaviour log-probs, ``advantages``, ``loss_mask``, ``cu_seqlens`` and, for
    M2PO, :data:`KEEP_MASK_KEY`). Returns ``(loss, metrics, kept)``: the loss divided by this micro-batch's valid
    tokens (see the module note), the loss's metrics, and the packed mask of the tokens that entered the objective
    (M2PO: the selection; the others: the valid tokens), for AReaL's statistics.
    """
    mask = input_data["loss_mask"].bool()
    cu_seqlens = input_data["cu_seqlens"]
    rows = lambda t, fill=0.0: packed_rows(t, cu_seqlens, fill=fill)  # noqa: E731 - one layout for every tensor
    extras: dict[str, torch.Tensor] = {}
    keep = input_data.get(KEEP_MASK_KEY)
    if keep is not None:
        keep = keep.bool() & mask
        extras["keep_mask"] = rows(keep, fill=False)
    elif loss_name == "m2po":
        raise ValueError(f"m2po on an AReaL micro-batch needs the mini-batch selection ({KEEP_MASK_KEY!r}); "
                         "run it through recipe.areal.ExactLossPPOActor, which selects over the whole mini-batch")
    local_config = with_global_batch_info(config, num_tokens=int(mask.count_nonzero()), dp_size=1)
    loss, metrics = get_policy_loss_fn(loss_name)(
        old_log_prob=rows(input_data["logprobs"].detach()), log_prob=rows(logprobs),
        advantages=rows(input_data["advantages"].detach()), response_mask=rows(mask, fill=False),
        loss_agg_mode="token-mean", config=local_config, **extras)
    return loss, metrics, (keep if keep is not None else mask)


def select_mini_batch(loss_name: str, mini_batch: dict[str, Any], current_logprobs: torch.Tensor, config: Any, *,
                      group: Optional[Any] = None, device: Optional[torch.device] = None) -> OptimizerBatchPlan:
    """One selection over a whole padded AReaL mini-batch (and all ranks of ``group``), before its micro-batches.

    ``mini_batch`` is what AReaL's ``PPOActor`` passes to ``engine.train_batch``: per-token ``(B, T)`` tensors
    ``logprobs`` (behaviour), ``advantages``, ``loss_mask``; ``current_logprobs`` the current policy's log-probs of
    the same tokens, same shape. For a loss with a batch selector (M2PO) the selection is stored in ``mini_batch``
    under :data:`KEEP_MASK_KEY`; AReaL's micro-batching then slices and packs it with the other tensors.
    ``device``: where the selection runs (the engine's device: NCCL groups take only accelerator tensors); default
    the mini-batch's.
    """
    home = mini_batch["loss_mask"].device
    device = device if device is not None else home
    mask = mini_batch["loss_mask"].to(device).bool()
    if current_logprobs.shape != mask.shape:
        raise ValueError(f"current log-probs have shape {tuple(current_logprobs.shape)}, expected the mini-batch's "
                         f"{tuple(mask.shape)}")
    step = MicroBatch(old_log_prob=mini_batch["logprobs"].detach().to(device).float(),
                      log_prob=current_logprobs.detach().to(device).float(),
                      advantages=mini_batch["advantages"].detach().to(device).float(), response_mask=mask)
    plan = plan_optimizer_batch(loss_name, [step], config, group=group)
    keep = plan.extras[0].get("keep_mask")
    if keep is not None:
        mini_batch[KEEP_MASK_KEY] = keep.bool().to(home)
    return plan
