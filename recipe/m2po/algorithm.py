"""M2PO: Second-Moment Trust Policy Optimization (Zheng, Zhao, Chen, ICLR 2026, arXiv 2510.01161), Algorithm 1.

Pure torch. With d = log(pi_theta / pi_behaviour) per token and A the advantage:

1. Trust-region set T: valid tokens with (A > 0 and d > 0) or (A < 0 and d < 0). Strict, per token, so A == 0 or
   r == 1 is never in T. (d > 0 is r > 1 without the rounding of exp.)
2. Selection: while T is non-empty and mean_{T} d^2 > tau, mask the token of T with the largest d^2 and drop it
   from T. Only tokens of T are ever masked. Among equal d^2 the later token (row-major over the batch, ranks in
   order) is masked first, so the result is deterministic.
3. Objective: loss = -sum_valid(keep * A * r) / (number of ALL valid tokens); no epsilon-clip. The mask is a
   constant (no gradient). d is clamped to +-20 before exp() as in verl, gradient included: a kept token with
   |d| > 20 contributes zero gradient (it is far outside any trust region, and a straight-through gradient would
   weigh it by |A| e^20). The selection uses the unclamped d.

Fast selection. A token with d^2 <= tau can never be masked: the prefix means of the ascending d^2 of T never
decrease, and a prefix ending at a value <= tau has mean <= tau. So only the "high" tokens (d^2 > tau) are sorted,
and the low ones enter as one sum and one count. Under a realistic stale distribution the high set is a few per cent
of the tokens, so the cost is one elementwise pass plus a small sort. The pass runs in cache-sized slices on CPU and
over the whole tensor on accelerators (a constant number of host syncs there). The d^2 > tau test is exact: tau is
replaced by the largest float32 <= tau, so a float32 d^2 just above tau can never hide among the low tokens.

Across data-parallel ranks (``group``), each rank contributes its low sum/count (all_reduce) and its high values
(all_gather of variable-length lists), and every rank takes the identical decision; a rank with no tokens still
joins the collectives.

Diagnostics by quadrant (not part of the selection, never read by the loss). The gradient weight of a token is
|A r| (the loss is -A r per token, so d loss / d log pi = -A r). For each trust-region quadrant, ``pos_r_gt_1``
(A > 0, r > 1) and ``neg_r_lt_1`` (A < 0, r < 1), the loss and the batch selector report how many tokens were
masked there and their share of the trust region's gradient weight, sum_{masked, quadrant} |A r| / sum_T |A r|, with
r the loss's own exp(clamp(d, +-20)). They come from one no-grad pass over tensors the caller already has (the
loss reuses its ratio); ``select_m2po`` alone does not pay for it (its result reports the selection's keys only).
The same pass counts the tokens PPO's clip at eps 0.2 would have zeroed (``m2po/would_clip_fraction``, over the
valid tokens, as ``m2po/masked_fraction``): the paper's masked-vs-clipped comparison on identical tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from recipe.m2po.declaration import DECLARATION
from recipe.registry import register_policy_loss
from recipe.common import (
    agg_loss,
    check_inputs,
    global_batch_info,
    masked_log_ratio,
    clamp_log_ratio,
)

DEFAULT_M2_THRESHOLD = DECLARATION.param("m2_threshold").default
from recipe.m2po.declaration import SCOPES  # noqa: E402,F401 - re-exported (the declaration owns it)

SELECTION_METRIC_KEYS = (
    "m2po/m2_before",
    "m2po/m2_after",
    "m2po/masked_fraction",
    "m2po/trust_region_fraction",
    "m2po/num_valid_tokens",
    "m2po/num_trust_region_tokens",
    "m2po/num_masked_tokens",
    "m2po/threshold",
)
# The trust region's two quadrants, named as in the authors' metrics (kl_pos_r_gt_1 / kl_neg_r_lt_1).
QUADRANTS = ("pos_r_gt_1", "neg_r_lt_1")
QUADRANT_METRIC_KEYS = (
    *(f"m2po/num_masked_{q}" for q in QUADRANTS),
    *(f"m2po/masked_weight_share_{q}" for q in QUADRANTS),
    "m2po/would_clip_fraction",
)
# The paper's comparison on the same tokens: the share of valid tokens that PPO's clip at its default epsilon would
# have zeroed (A > 0 and r > 1 + eps, or A < 0 and r < 1 - eps), beside the share M2PO masked. Diagnostic only.
WOULD_CLIP_EPS = 0.2
# What the loss (and the batch selector's selection) reports on every call.
METRIC_KEYS = (*SELECTION_METRIC_KEYS, *QUADRANT_METRIC_KEYS)


@dataclass(frozen=True)
class QuadrantWeights:
    """Masked tokens of T by quadrant and their gradient weight |A r| (sums over the scope, all ranks of a group)."""

    num_masked: tuple[int, int]  # (pos_r_gt_1, neg_r_lt_1)
    masked_weight: tuple[float, float]  # sum |A r| of the masked tokens of each quadrant
    trust_region_weight: float  # sum |A r| over all of T (masked or kept)
    # tokens of T that PPO's clip at WOULD_CLIP_EPS would zero (A > 0, r > 1 + eps; A < 0, r < 1 - eps), summed
    num_would_clip: int = 0

    def metrics(self, prefix: str = "m2po", noun: str = "masked") -> dict[str, float]:
        total = self.trust_region_weight
        out = {f"{prefix}/num_{noun}_{q}": float(n) for q, n in zip(QUADRANTS, self.num_masked)}
        out.update({f"{prefix}/{noun}_weight_share_{q}": (w / total if total > 0 else 0.0)
                    for q, w in zip(QUADRANTS, self.masked_weight)})
        return out


@torch.no_grad()
def quadrant_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, trust_region: torch.Tensor,
                     removed: torch.Tensor, *, ratio: Optional[torch.Tensor] = None,
                     group: Optional[Any] = None) -> QuadrantWeights:
    """Removed tokens of the trust region ``T`` per quadrant and their share of T's gradient weight |A r|.

    ``removed``: the tokens whose gradient the loss drops (M2PO: masked; clip: clipped); only those inside T count.
    ``ratio``: the loss's exp(clamp(d)) if the caller has it (no second exp); else computed from ``log_ratio``.
    One elementwise pass and one host sync (plus one all_reduce of 5 numbers with ``group``).
    """
    t = trust_region.bool()
    if ratio is None:
        ratio = torch.exp(clamp_log_ratio(torch.where(t, log_ratio.detach().float(), torch.zeros((),
                                                                                    device=t.device))))
    zero = torch.zeros((), dtype=torch.float32, device=t.device)
    # |A r| on T, 0 elsewhere (torch.where: padding may hold NaN, and T is False there)
    w = torch.where(t, advantages.detach().float().abs() * ratio.detach().float(), zero)
    gone = t & removed.bool()
    pos = gone & (advantages.detach() > 0)
    neg = gone & ~pos  # inside T, A != 0: the other quadrant
    r = ratio.detach().float()
    a = advantages.detach()
    would_clip = t & (((a > 0) & (r > 1.0 + WOULD_CLIP_EPS)) | ((a < 0) & (r < 1.0 - WOULD_CLIP_EPS)))
    f64 = torch.float64
    stats = torch.stack([
        w.sum(dtype=f64), torch.where(pos, w, zero).sum(dtype=f64), torch.where(neg, w, zero).sum(dtype=f64),
        torch.count_nonzero(pos).to(f64), torch.count_nonzero(neg).to(f64), torch.count_nonzero(would_clip).to(f64),
    ])
    if group is not None:
        torch.distributed.all_reduce(stats, group=group)
    total, w_pos, w_neg, n_pos, n_neg, n_clip = stats.tolist()
    return QuadrantWeights(num_masked=(int(n_pos), int(n_neg)), masked_weight=(w_pos, w_neg),
                           trust_region_weight=total, num_would_clip=int(n_clip))


@dataclass
class M2POSelection:
    """Result of Algorithm 1. Counts and means are over the whole selection scope (all ranks of ``group``)."""

    keep_mask: torch.Tensor  # bool, same shape as the inputs; False exactly on masked tokens and on padding
    trust_region: torch.Tensor  # bool, the local trust-region set T
    num_valid: int
    num_trust_region: int
    num_masked: int
    m2_before: float  # mean d^2 over T before masking (0 when T is empty)
    m2_after: float  # mean d^2 over the kept tokens of T (0 when none is kept)
    threshold: float
    # Per-quadrant diagnostics (see quadrant_weights): attached by the loss and the batch selector, None from
    # select_m2po alone, whose metrics() then has only the selection's keys.
    quadrants: Optional[QuadrantWeights] = None

    def metrics(self) -> dict[str, float]:
        valid = max(self.num_valid, 1)
        out = {
            "m2po/m2_before": float(self.m2_before),
            "m2po/m2_after": float(self.m2_after),
            "m2po/masked_fraction": self.num_masked / valid,
            "m2po/trust_region_fraction": self.num_trust_region / valid,
            "m2po/num_valid_tokens": float(self.num_valid),
            "m2po/num_trust_region_tokens": float(self.num_trust_region),
            "m2po/num_masked_tokens": float(self.num_masked),
            "m2po/threshold": float(self.threshold),
        }
        if self.quadrants is not None:
            out.update(self.quadrants.metrics())
            out["m2po/would_clip_fraction"] = self.quadrants.num_would_clip / valid
        return out


def m2_threshold_from_config(config: Any) -> float:
    """tau from ``config.policy_loss.m2_threshold``, else ``config.m2_threshold``, else 0.04 (the declaration's)."""
    return DECLARATION.read(config).m2_threshold


def m2_scope_from_config(config: Any) -> str:
    """The in-call selection scope; unset, ``local`` (a loss call cannot know the data-parallel group; the step
    planner's default is the declaration's ``dp_group``)."""
    return DECLARATION.read(config, framework="loss_call").m2_scope


def trust_region_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """T: valid tokens in the PPO trust-region quadrants (A>0, r>1) or (A<0, r<1), strict."""
    d = log_ratio.detach()
    a = advantages.detach()
    return valid.bool() & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))


def _validate_threshold(tau: float) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(float(tau)) or tau < 0:
        raise ValueError(f"m2_threshold must be a finite number >= 0, got {tau!r}")
    return float(tau)


# Elements per slice of the CPU pass: small enough that the temporaries stay in cache and come from the heap (a fresh
# multi-MB buffer per elementwise op costs more in page faults than the op itself), large enough to amortise the
# per-op overhead. On accelerators the pass runs over the whole tensor at once (one host sync).
_CPU_CHUNK = 1 << 18


def _float32_floor(tau: float) -> float:
    """The largest float32 value <= tau. For a float32 x, ``x > tau`` (exact) iff ``x > _float32_floor(tau)``, and the
    right-hand comparison is exact in float32 (comparing a float32 tensor with ``tau`` itself rounds tau first)."""
    t32 = torch.tensor(tau, dtype=torch.float32)
    if float(t32) > tau:
        t32 = torch.nextafter(t32, torch.tensor(-math.inf, dtype=torch.float32))
    return float(t32)


def _local_pass(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, tau_lo: float,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass over the local tokens.

    Returns (T as a bool mask shaped like ``valid``; flat indices of the high tokens (d^2 > tau), in token order;
    their d^2 in float32; [sum of the low d^2 of T (float64), |T| - #high, #valid] as a float64 tensor).

    Per token, e = sign(A) * d is > 0 exactly on the trust-region quadrants (sign(A) is exact, so the product is
    exactly +-d or 0); fmax(e, 0) turns everything else, NaN included, into 0, so e^2 is d^2 on T and 0 elsewhere.
    """
    device = valid.device
    n = valid.numel()
    lr = log_ratio.detach().reshape(-1)
    adv = advantages.detach().reshape(-1)
    ok = valid.reshape(-1)
    in_t = torch.empty(n, dtype=torch.bool, device=device)
    chunk = _CPU_CHUNK if device.type == "cpu" else max(n, 1)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    idx_parts, val_parts, sum_parts = [], [], []
    for start in range(0, n, chunk):
        part = slice(start, min(n, start + chunk))
        e = torch.sign(adv[part])
        if e.dtype != torch.float32:
            e = e.float()
        e.masked_fill_(~ok[part], 0.0)  # before the product: padding may hold NaN/inf, and 0 * inf is NaN
        e.mul_(lr[part])  # computes in float32 at least, so a bf16 log-ratio is widened, never squared in bf16
        torch.fmax(e, zero, out=e)
        torch.gt(e, 0, out=in_t[part])
        e.mul_(e)  # d^2 in float32 on T, 0 elsewhere
        idx = (e > tau_lo).nonzero().squeeze(1)
        vals = e[idx]
        e[idx] = 0.0
        sum_parts.append(e.sum(dtype=torch.float64))
        idx_parts.append(idx + start)
        val_parts.append(vals)
    if idx_parts:
        high_idx = torch.cat(idx_parts)
        high_vals = torch.cat(val_parts)
        low_sum = torch.stack(sum_parts).sum()
    else:
        high_idx = torch.zeros(0, dtype=torch.int64, device=device)
        high_vals = torch.zeros(0, dtype=torch.float32, device=device)
        low_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_t = torch.count_nonzero(in_t)
    totals = torch.stack([
        low_sum,
        (n_t - high_idx.numel()).to(torch.float64),
        torch.count_nonzero(ok).to(torch.float64),
    ])
    return in_t.view(valid.shape), high_idx, high_vals, totals


def _sort_by_value_then_position(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(values, stable=True)`` for non-negative float32 values, as one sort of int64 keys.

    A non-negative float's bit pattern orders like the float, so (bits << 32) | position sorts by value, then by
    position: a stable sort without the stable sort's cost (on CPU an integer sort is several times faster).
    """
    n = values.numel()
    if n >= 1 << 31:
        return torch.sort(values, stable=True)
    positions = torch.arange(n, device=values.device, dtype=torch.int64)
    keys = (values.contiguous().view(torch.int32).to(torch.int64) << 32) | positions
    keys = torch.sort(keys).values
    order = keys & 0xFFFFFFFF
    sorted_vals = (keys >> 32).to(torch.int32).view(torch.float32)
    return sorted_vals, order


@torch.no_grad()
def select_m2po(log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, tau: float,
                *, group: Optional[Any] = None) -> M2POSelection:
    """Algorithm 1 over all valid tokens of the given tensors (and of every rank of ``group``, if given).

    ``log_ratio`` is log(pi_theta/pi_behaviour); any float dtype (squared in fp32). Returns the keep mask and the
    diagnostics. With ``group``, every rank of the group must call this the same number of times.
    """
    tau = _validate_threshold(tau)
    valid = response_mask.bool()
    f64 = torch.float64
    device = valid.device
    # low (d^2 <= tau) tokens of T are never masked, so they enter only as a sum and a count:
    # totals = [low sum, low count, valid count].
    in_t, flat_idx, high_vals, totals = _local_pass(log_ratio, advantages, valid, _float32_floor(tau))

    if group is not None:
        all_vals, offset = _gather_variable(high_vals, group)
        torch.distributed.all_reduce(totals, group=group)
    else:
        all_vals, offset = high_vals, 0

    low_sum, low_count, num_valid = totals[0], totals[1], totals[2]
    # Stable ascending sort: among ties the earlier token sorts first and is kept longer (later ones go first).
    sorted_vals, order = _sort_by_value_then_position(all_vals)
    sorted64 = sorted_vals.to(f64)
    prefix_sum = low_sum + torch.cumsum(sorted64, 0)
    prefix_cnt = low_count + torch.arange(1, sorted64.numel() + 1, device=device, dtype=f64)
    within = (prefix_sum / prefix_cnt) <= tau
    # Prefix means are non-decreasing; count the leading run anyway so rounding can never produce a hole.
    n_keep_high = within.to(torch.int64).cumprod(0).sum()
    keep_sorted = torch.arange(sorted64.numel(), device=device) < n_keep_high
    keep_all = torch.empty_like(keep_sorted)
    keep_all[order] = keep_sorted
    keep_high_local = keep_all[offset:offset + high_vals.numel()]

    keep_flat = valid.flatten().clone()
    keep_flat[flat_idx] = keep_high_local
    keep_mask = keep_flat.view_as(valid)

    kept_high_sum = (sorted64 * keep_sorted).sum()
    n_high = torch.tensor(float(sorted64.numel()), dtype=f64, device=device)
    n_keep_f = n_keep_high.to(f64)
    kept_sum = low_sum + kept_high_sum
    kept_cnt = low_count + n_keep_f
    all_sum = low_sum + sorted64.sum()
    all_cnt = low_count + n_high
    stats = torch.stack([
        num_valid, all_cnt, n_high - n_keep_f,
        torch.where(all_cnt > 0, all_sum / all_cnt.clamp(min=1), torch.zeros((), dtype=f64, device=device)),
        torch.where(kept_cnt > 0, kept_sum / kept_cnt.clamp(min=1), torch.zeros((), dtype=f64, device=device)),
    ]).tolist()
    return M2POSelection(
        keep_mask=keep_mask, trust_region=in_t, num_valid=int(stats[0]), num_trust_region=int(stats[1]),
        num_masked=int(stats[2]), m2_before=stats[3], m2_after=stats[4], threshold=tau,
    )


def _gather_variable(values: torch.Tensor, group: Any) -> tuple[torch.Tensor, int]:
    """all_gather 1-D tensors of different lengths; returns (concatenation in rank order, this rank's offset)."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    count = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = torch.cat(counts).tolist()
    width = max(max(sizes), 1)
    padded = torch.zeros(width, dtype=values.dtype, device=values.device)
    padded[:values.numel()] = values
    chunks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    gathered = torch.cat([chunk[:n] for chunk, n in zip(chunks, sizes)])
    return gathered, int(sum(sizes[:rank]))


def selection_from_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                        keep_mask: torch.Tensor, tau: float) -> M2POSelection:
    """Diagnostics of a precomputed keep mask, restricted to these tensors (e.g. one micro-batch)."""
    with torch.no_grad():
        valid = response_mask.bool()
        device = valid.device
        d = torch.where(valid, log_ratio.detach().float(), torch.zeros((), device=device))
        sq = d * d
        in_t = trust_region_mask(d, advantages, valid)
        keep = keep_mask.bool() & valid
        kept_t = in_t & keep
        f64 = torch.float64
        zero = torch.zeros((), dtype=torch.float32, device=device)
        t_sum = torch.where(in_t, sq, zero).sum(dtype=f64)
        k_sum = torch.where(kept_t, sq, zero).sum(dtype=f64)
        n_t = in_t.sum().to(f64)
        n_k = kept_t.sum().to(f64)
        stats = torch.stack([
            valid.sum().to(f64), n_t, (valid & ~keep).sum().to(f64),
            torch.where(n_t > 0, t_sum / n_t.clamp(min=1), torch.zeros((), dtype=f64, device=device)),
            torch.where(n_k > 0, k_sum / n_k.clamp(min=1), torch.zeros((), dtype=f64, device=device)),
        ]).tolist()
    return M2POSelection(keep_mask=keep, trust_region=in_t, num_valid=int(stats[0]), num_trust_region=int(stats[1]),
                         num_masked=int(stats[2]), m2_before=stats[3], m2_after=stats[4], threshold=float(tau))


def _scope_group(scope: str) -> Optional[Any]:
    if scope == "local":
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("m2_scope='dp_group' needs an initialised torch.distributed default process group; "
                         "use m2_scope='local' in a single process")
    return dist.group.WORLD


def m2po_batch_selector(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, *, config: Any = None, group: Optional[Any] = None,
                        ) -> dict[str, Any]:
    """Select once over a whole optimizer mini-batch (all its micro-batches; all ranks of ``group``).

    Returns ``{"keep_mask": ..., "selection": M2POSelection}``; the runtime passes ``keep_mask`` (sliced per
    micro-batch) back to :func:`compute_policy_loss_m2po`, so splitting the mini-batch cannot change the update.
    """
    tau = m2_threshold_from_config(config)
    valid = check_inputs("m2po", old_log_prob, log_prob, advantages, response_mask)
    d = masked_log_ratio(old_log_prob, log_prob.detach(), valid)
    selection = select_m2po(d, advantages, valid, tau, group=group)
    selection = replace(selection, quadrants=quadrant_weights(d, advantages, selection.trust_region,
                                                              ~selection.keep_mask, group=group))
    return {"keep_mask": selection.keep_mask, "selection": selection}


def compute_policy_loss_m2po(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    keep_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The M2PO policy loss with verl's signature.

    ``keep_mask`` (optional): a mask selected beforehand over the whole mini-batch (see
    :func:`m2po_batch_selector`). Without it the selection runs over this call's tensors, or across the default
    process group when ``m2_scope: dp_group``.
    """
    tau = m2_threshold_from_config(config)
    valid = check_inputs("m2po", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    d = masked_log_ratio(old_log_prob, log_prob, valid)
    group = None
    if keep_mask is None:
        group = _scope_group(m2_scope_from_config(config))
        selection = select_m2po(d, advantages, valid, tau, group=group)
    else:
        if keep_mask.shape != valid.shape:
            raise ValueError(f"m2po: keep_mask has shape {tuple(keep_mask.shape)}, expected {tuple(valid.shape)}")
        selection = selection_from_mask(d, advantages, valid, keep_mask, tau)
    keep = selection.keep_mask & valid
    adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
    ratio = torch.exp(clamp_log_ratio(d))
    per_token = torch.where(keep, -adv * ratio, torch.zeros_like(ratio))
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(ratio))
    loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
    # Diagnostics only (no_grad, from the detached ratio): the loss above is computed exactly as without them.
    selection = replace(selection, quadrants=quadrant_weights(d, advantages, selection.trust_region, ~keep,
                                                              ratio=ratio, group=group))
    return loss, selection.metrics()


# Registration: the loss under its declaration (recipe/m2po/declaration.py), with what its step needs.
register_policy_loss(DECLARATION, batch_selector=m2po_batch_selector)(compute_policy_loss_m2po)
