"""Exact losses across a framework's micro-batches: one selection and one token count per optimizer step.

Frameworks (TRL, ms-swift, AReaL, ...) call their loss once per micro-batch and sum the gradients. A loss that
averages over tokens, or that decides over a whole batch (M2PO's Algorithm 1 selection), is exact at the optimizer
step only if every micro-batch call sees

- the same **selection**, computed once over all micro-batches of the step (and all data-parallel ranks), and
- the same **denominator**, the valid-token count of the whole step (all ranks).

:func:`plan_optimizer_batch` computes both from the step's micro-batches (tensors of any, possibly different,
shapes: padded ``(B_i, T_i)`` rows or packed 1-D tokens) and returns, per micro-batch, the extra keyword tensors
that the registered loss takes (M2PO: ``keep_mask``, the selection; FIPO: ``row_keep_mask``, the tokens of the
rows its sequence drop keeps) plus a config that carries the global token count (``global_batch_info``, verl's
convention, read by ``recipe.common.agg_loss``). For FIPO that count leaves out the dropped rows: a dropped row
leaves the numerator and the denominator of the whole step, as in one call. Summing the micro-batch losses then
gives exactly the loss of the whole step computed in one call, whatever the split.

A loss with a per-row decision (FIPO) needs each micro-batch's rows: padded ``(B, T)`` rows, or packed 1-D tokens
with ``MicroBatch.cu_seqlens`` (``[0, l_0, l_0 + l_1, ...]``); a row never spans micro-batches.

Pure torch; ``group`` is an optional ``torch.distributed`` process group (every rank must call with the same number
of micro-batches' worth of collectives: one selection and one all-reduce). Before planning a split step, a caller
needs every micro-batch's current log-probs only if ``recipe.registry.needs_step_log_probs(loss_name)``; otherwise
only the masks count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from recipe.registry import get_batch_selector, get_row_selector


@dataclass
class MicroBatch:
    """One micro-batch's tensors, all of one shape: behaviour and current log-probs, advantages, valid mask.

    ``cu_seqlens`` (optional): for packed tokens (shape ``(N,)`` or ``(1, N)``), where each sequence starts,
    ``[0, l_0, l_0 + l_1, ...]``; a loss that decides per row (FIPO) needs it there.
    """

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape) for t in (self.old_log_prob, self.log_prob, self.advantages, self.response_mask)}
        if len(shapes) != 1:
            raise ValueError("MicroBatch: old_log_prob, log_prob, advantages and response_mask must share one shape, "
                             f"got {sorted(shapes)}; broadcast per-sequence advantages to the token shape first")
        if self.cu_seqlens is not None:
            dims = self.response_mask.dim()
            packed = dims == 1 or (dims == 2 and self.response_mask.shape[0] == 1)
            if not packed:
                raise ValueError(f"MicroBatch: cu_seqlens marks sequences in packed tokens of shape (N,) or (1, N), "
                                 f"got tensors of shape {tuple(self.response_mask.shape)}; padded (B, T) rows need "
                                 "no cu_seqlens")


@dataclass
class OptimizerBatchPlan:
    """What each micro-batch's loss call needs so that the step's loss is exact."""

    num_tokens: int  # valid tokens of the whole step, all ranks
    dp_size: int
    extras: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per micro-batch: loss keyword tensors
    selection: Any = None  # the batch selector's diagnostics (M2PO: recipe.m2po.M2POSelection), if any
    row_drops: Optional["RowDrops"] = None  # a row selector's step-wide counts (FIPO's sequence drop), if any
    # rows of the step with a counted token (after a row selector's drop), all ranks: the seq-mean modes' count
    num_rows: Optional[int] = None

    def config_for(self, config: Any) -> dict[str, Any]:
        """``config`` (dict, dataclass, DictConfig or None) as a dict with the step's ``global_batch_info``."""
        return with_global_batch_info(config, num_tokens=self.num_tokens, dp_size=self.dp_size)


@dataclass(frozen=True)
class RowDrops:
    """The step-wide counts of a row selector (FIPO's sequence drop): all micro-batches, all ranks of the group."""

    loss_name: str
    num_rows: int
    num_dropped_rows: int
    num_valid_tokens: int  # before the drop
    num_kept_tokens: int  # the step's denominator

    def metrics(self) -> dict[str, float]:
        """``<loss>/sequence_drop_ratio`` (dropped rows / rows) and the counts, once per optimizer step."""
        p = self.loss_name
        return {f"{p}/sequence_drop_ratio": self.num_dropped_rows / max(self.num_rows, 1),
                f"{p}/num_dropped_rows": float(self.num_dropped_rows),
                f"{p}/num_valid_tokens": float(self.num_valid_tokens),
                f"{p}/num_kept_tokens": float(self.num_kept_tokens)}


def with_global_batch_info(config: Any, *, num_tokens: int, dp_size: int = 1) -> dict[str, Any]:
    """A dict view of ``config`` whose ``global_batch_info`` makes ``token-mean`` divide by ``num_tokens``."""
    if config is None:
        out: dict[str, Any] = {}
    elif isinstance(config, dict):
        out = dict(config)
    elif hasattr(config, "items"):  # OmegaConf DictConfig and other mappings
        out = {k: v for k, v in config.items()}
    elif hasattr(config, "__dict__"):
        out = dict(vars(config))
    else:
        raise TypeError(f"config must be a mapping, an object with attributes, or None; got {type(config).__name__}")
    info = dict(out.get("global_batch_info") or {})
    info.update({"batch_num_tokens": int(num_tokens), "dp_size": int(dp_size)})
    out["global_batch_info"] = info
    return out


def _rows_with_tokens(mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    """Rows (sequences, for packed tokens) with at least one counted token."""
    if cu_seqlens is None:
        return int(mask.reshape(mask.shape[0], -1).any(dim=-1).sum()) if mask.dim() > 1 else int(mask.any())
    flat = mask.reshape(-1).long()
    bounds = cu_seqlens.to(flat.device).long()
    sums = torch.cat([flat.new_zeros(1), flat.cumsum(0)])[bounds.clamp(max=flat.numel())]
    return int(((sums[1:] - sums[:-1]) > 0).sum())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1)


def plan_optimizer_batch(loss_name: str, micro_batches: Sequence[MicroBatch], config: Any = None, *,
                         group: Optional[Any] = None) -> OptimizerBatchPlan:
    """Select once over all ``micro_batches`` of an optimizer step (and all ranks of ``group``); count its tokens.

    The selection sees the tokens in micro-batch order, row-major inside each, which is the order a single call on
    the concatenated batch would see; ties therefore break the same way whatever the split. A row selector (FIPO)
    runs on each micro-batch's rows; ``num_tokens`` is then the step's tokens of the rows it keeps.
    """
    if not micro_batches:
        raise ValueError("plan_optimizer_batch needs at least one micro-batch")
    device = micro_batches[0].response_mask.device
    row_selector = get_row_selector(loss_name)
    rows_selected = None
    if row_selector is None:
        local = [sum(int(mb.response_mask.bool().sum()) for mb in micro_batches),
                 sum(_rows_with_tokens(mb.response_mask.bool(), mb.cu_seqlens) for mb in micro_batches)]
    else:  # per micro-batch, from its own rows; then one all-reduce of the counts with the token count
        rows_selected = [row_selector(mb.old_log_prob.detach(), mb.log_prob.detach(), mb.advantages.detach(),
                                      mb.response_mask, config=config, cu_seqlens=mb.cu_seqlens)
                         for mb in micro_batches]
        kept = [sel["row_keep_mask"].bool() & mb.response_mask.bool()
                for sel, mb in zip(rows_selected, micro_batches)]
        local = [sum(int(k.sum()) for k in kept),
                 sum(_rows_with_tokens(k, mb.cu_seqlens) for k, mb in zip(kept, micro_batches)),
                 sum(int(mb.response_mask.bool().sum()) for mb in micro_batches),
                 sum(int(sel["num_rows"]) for sel in rows_selected),
                 sum(int(sel["num_dropped_rows"]) for sel in rows_selected)]
    dp_size = 1
    if group is not None:
        dist = torch.distributed
        dp_size = dist.get_world_size(group)
        count = torch.tensor(local, dtype=torch.int64, device=device)
        dist.all_reduce(count, group=group)
        local = [int(v) for v in count.tolist()]
    plan = OptimizerBatchPlan(num_tokens=local[0], dp_size=dp_size, extras=[{} for _ in micro_batches],
                              num_rows=local[1])
    if rows_selected is not None:
        for extras, k in zip(plan.extras, kept):
            extras["row_keep_mask"] = k
        plan.row_drops = RowDrops(loss_name=loss_name, num_rows=local[3], num_dropped_rows=local[4],
                                  num_valid_tokens=local[2], num_kept_tokens=local[0])
        return plan

    selector = get_batch_selector(loss_name)
    if selector is None:
        return plan
    cat = [torch.cat([_flat(getattr(mb, name).detach()) for mb in micro_batches], dim=1)
           for name in ("old_log_prob", "log_prob", "advantages", "response_mask")]
    selected = selector(*cat, config=config, group=group)
    sizes = [mb.response_mask.numel() for mb in micro_batches]
    for key, value in selected.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(cat[3].shape):
            for extras, part, mb in zip(plan.extras, value.reshape(-1).split(sizes), micro_batches):
                extras[key] = part.reshape(mb.response_mask.shape)
        elif key == "selection":
            plan.selection = value
    return plan
