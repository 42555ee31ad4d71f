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
FIPO's reference removes the rows it drops from the denominator as well: :func:`select_mini_batch` counts the
mini-batch's kept tokens (all ranks) and every micro-batch loss is multiplied by valid / kept, which turns that
weighting into *sum / kept tokens of the mini-batch* (the drop is per row, so each micro-batch drops the same rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from recipe.optimizer_batch import MicroBatch, OptimizerBatchPlan, plan_optimizer_batch, with_global_batch_info
from recipe.registry import get_batch_selector, get_policy_loss_fn

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


def packed_policy_loss(loss_name: str, logprobs: torch.Tensor, input_data: dict[str, Any], config: Any, *,
                       step_scale: float = 1.0) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The registered loss ``loss_name`` on one packed AReaL micro-batch, as AReaL's engine must receive it.

    ``logprobs``: the current policy's per-token log-probs from the training forward (with grad). ``input_data``:
    the micro-batch (``logprobs`` = behaviour log-probs, ``advantages``, ``loss_mask``, ``cu_seqlens`` and, for
    M2PO, :data:`KEEP_MASK_KEY`). ``step_scale``: the factor :func:`select_mini_batch` returned (FIPO: the mini-batch's
    valid / kept tokens, so that rows FIPO drops leave the step's denominator too). Returns ``(loss, metrics, kept)``:
    the loss divided by this micro-batch's valid tokens (see the module note) times ``step_scale``, the loss's
    metrics, and the packed mask of the tokens that entered the objective (M2PO: the selection; the others: the valid
    tokens), for AReaL's statistics.
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
    if step_scale != 1.0:
        loss = loss * step_scale
    return loss, metrics, (keep if keep is not None else mask)


@dataclass
class MiniBatchPlan:
    """What :func:`select_mini_batch` decided for one AReaL mini-batch (one optimizer step)."""

    #: the registry's plan (M2PO: the selection, ``plan.selection``); None for losses decided per row (FIPO)
    plan: Optional[OptimizerBatchPlan]
    #: multiplies every micro-batch loss (FIPO: valid / kept tokens of the mini-batch, all ranks; else 1)
    step_scale: float = 1.0
    #: FIPO: the mini-batch's valid and kept (after the sequence drop) tokens, all ranks
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
    # Padded (B, T) rows, one sequence each: no cu_seqlens needed here (once MicroBatch has that field, packed
    # inputs would pass it as cu_seqlens=...).
    return MicroBatch(old_log_prob=mini_batch["logprobs"].detach().to(device).float(),
                      log_prob=current_logprobs.detach().to(device).float(),
                      advantages=mini_batch["advantages"].detach().to(device).float(), response_mask=mask)


def _fipo_step(step: MicroBatch, config: Any, group: Optional[Any]) -> MiniBatchPlan:
    """FIPO's sequence drop over the whole mini-batch (the reference: a dropped row leaves the numerator and the
    denominator of the step). The drop is per row, so the micro-batch losses drop the same rows; only the
    denominator needs the mini-batch (all ranks): ``step_scale`` = valid / kept turns AReaL's valid-token weighting
    into a division by the kept tokens."""
    from recipe.common import masked_log_ratio
    from recipe.fipo.algorithm import fipo_params_from_config, fipo_weights

    valid = step.response_mask
    d = masked_log_ratio(step.old_log_prob, step.log_prob, valid)
    weights = fipo_weights(d, step.advantages, valid, fipo_params_from_config(config))
    counts = torch.tensor([int(valid.sum()), int(weights.loss_mask.sum())], dtype=torch.int64, device=valid.device)
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    n_valid, n_kept = (int(x) for x in counts.tolist())
    scale = n_valid / n_kept if n_kept > 0 else 1.0  # nothing kept: every micro-batch loss is 0 anyway
    return MiniBatchPlan(plan=None, step_scale=scale, num_valid_tokens=n_valid, num_kept_tokens=n_kept)


def needs_current_logprobs(loss_name: str) -> bool:
    """Whether :func:`select_mini_batch` needs the current policy's log-probs of the mini-batch for ``loss_name``."""
    return get_batch_selector(loss_name) is not None or loss_name == "fipo"


def select_mini_batch(loss_name: str, mini_batch: dict[str, Any], current_logprobs: torch.Tensor, config: Any, *,
                      group: Optional[Any] = None, device: Optional[torch.device] = None) -> MiniBatchPlan:
    """One decision over a whole padded AReaL mini-batch (and all ranks of ``group``), before its micro-batches.

    ``mini_batch`` is what AReaL's ``PPOActor`` passes to ``engine.train_batch``: per-token ``(B, T)`` tensors
    ``logprobs`` (behaviour), ``advantages``, ``loss_mask``; ``current_logprobs`` the current policy's log-probs of
    the same tokens, same shape. For a loss with a batch selector (M2PO) the selection is stored in ``mini_batch``
    under :data:`KEEP_MASK_KEY`; AReaL's micro-batching then slices and packs it with the other tensors. For FIPO the
    step's kept-token count gives ``step_scale``. ``device``: where the decision runs (the engine's device: NCCL
    groups take only accelerator tensors); default the mini-batch's.
    """
    home = mini_batch["loss_mask"].device
    device = device if device is not None else home
    step = _current_step(mini_batch, current_logprobs, device)
    if loss_name == "fipo":
        return _fipo_step(step, config, group)
    plan = plan_optimizer_batch(loss_name, [step], config, group=group)
    keep = plan.extras[0].get("keep_mask")
    if keep is not None:
        mini_batch[KEEP_MASK_KEY] = keep.bool().to(home)
    return MiniBatchPlan(plan=plan, num_valid_tokens=plan.num_tokens, num_kept_tokens=plan.num_tokens)
