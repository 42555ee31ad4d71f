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
decrease, and a prefix ending at a value <= tau has mean <= tau. So the low tokens enter as one sum and one count,
and only the "high" tokens (d^2 > tau; a few per cent of a realistic stale batch) take part in the decision. One
elementwise pass (in cache-sized slices on CPU, over the whole tensor on accelerators) finds T, the low sum and the
high tokens; then a radix select over the high tokens' float32 bit patterns (recipe/m2po/radix_select.py: three
histogram passes and a fixed search over the tied tokens, no sort, no host sync inside) finds where Algorithm 1
stops, with its tie rule. Its decision is the sort's bit for bit; where it cannot prove that (an exact tie of a mean
with tau, pathological magnitudes) it says so and the high tokens are sorted instead (``_sort_decision``). The d^2 >
tau test is exact: tau is replaced by the largest float32 <= tau, so a float32 d^2 just above tau can never hide
among the low tokens.

Across data-parallel ranks (``group``), each rank contributes its low sum/count and its histograms (all_reduce of
fixed-size tensors) and its count of tokens tied at the boundary, and every rank takes the identical decision; a
rank with no tokens still joins the collectives.

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

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from recipe.m2po.declaration import DECLARATION, QUADRANTS
from recipe.m2po.radix_select import find_boundary, float32_floor
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

# The metric keys are the declaration's (recipe/m2po/declaration.py), in its order: the selection's own, then the
# quadrant diagnostics (named as in the authors' metrics, kl_pos_r_gt_1 / kl_neg_r_lt_1) and the clip comparison.
METRIC_KEYS = tuple(DECLARATION.metrics)
WOULD_CLIP_KEY = "m2po/would_clip_fraction"
QUADRANT_METRIC_KEYS = tuple(k for k in METRIC_KEYS if k.endswith(QUADRANTS) or k == WOULD_CLIP_KEY)
SELECTION_METRIC_KEYS = tuple(k for k in METRIC_KEYS if k not in QUADRANT_METRIC_KEYS)
# The paper's comparison on the same tokens: the share of valid tokens that PPO's clip at its default epsilon would
# have zeroed (A > 0 and r > 1 + eps, or A < 0 and r < 1 - eps), beside the share M2PO masked. Diagnostic only.
WOULD_CLIP_EPS = 0.2


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
    device = trust_region.device
    n = trust_region.numel()
    t_all = trust_region.detach().reshape(-1).bool()
    gone_all = removed.detach().reshape(-1).bool()
    a_all = advantages.detach().reshape(-1)
    r_all = ratio.detach().reshape(-1) if ratio is not None else None
    d_all = log_ratio.detach().reshape(-1)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    f64 = torch.float64
    # In cache-sized slices on CPU, as the selection's pass (a dozen full-size temporaries cost more in page faults
    # than the arithmetic); one slice on accelerators.
    chunk = _CPU_CHUNK if device.type == "cpu" else max(n, 1)
    parts = []
    for start in range(0, n, chunk):
        part = slice(start, min(n, start + chunk))
        t = t_all[part]
        a = a_all[part].float()
        if r_all is None:
            r = torch.exp(clamp_log_ratio(torch.where(t, d_all[part].float(), zero)))
        else:
            r = r_all[part].float()
        # |A r| on T, 0 elsewhere (padding may hold NaN, and T is False there)
        w = (a * r).abs_().masked_fill_(~t, 0.0)
        gone = t & gone_all[part]
        a_pos = a > 0
        pos = gone & a_pos
        neg = gone & ~a_pos  # inside T, A != 0: the other quadrant
        would_clip = t & ((a_pos & (r > 1.0 + WOULD_CLIP_EPS)) | ((a < 0) & (r < 1.0 - WOULD_CLIP_EPS)))
        parts.append(torch.stack([
            w.sum(dtype=f64), torch.where(pos, w, zero).sum(dtype=f64), torch.where(neg, w, zero).sum(dtype=f64),
            torch.count_nonzero(pos).to(f64), torch.count_nonzero(neg).to(f64),
            torch.count_nonzero(would_clip).to(f64),
        ]))
    stats = torch.stack(parts).sum(0) if parts else torch.zeros(6, dtype=f64, device=device)
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
        if self.quadrants is None:
            return {key: out[key] for key in SELECTION_METRIC_KEYS}
        out.update(self.quadrants.metrics())
        out[WOULD_CLIP_KEY] = self.quadrants.num_would_clip / valid
        return {key: out[key] for key in METRIC_KEYS}  # the declaration's keys, in its order


def m2_threshold_from_config(config: Any) -> float:
    """tau from ``config.policy_loss.m2_threshold``, else ``config.m2_threshold``, else 0.04 (the declaration's)."""
    return DECLARATION.read(config).m2_threshold


def m2_scope_from_config(config: Any) -> str:
    """The in-call selection scope; unset, ``local`` (a loss call cannot know the data-parallel group; the step
    planner's default is the declaration's ``dp_group``)."""
    return DECLARATION.read(config, planned=False).m2_scope


def trust_region_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """T: valid tokens in the PPO trust-region quadrants (A>0, r>1) or (A<0, r<1), strict."""
    d = log_ratio.detach()
    a = advantages.detach()
    return valid.bool() & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))


# Elements per slice of the CPU pass: small enough that the temporaries stay in cache and come from the heap (a fresh
# multi-MB buffer per elementwise op costs more in page faults than the op itself), large enough to amortise the
# per-op overhead. On accelerators the pass runs over the whole tensor at once.
_CPU_CHUNK = 1 << 18
# The pass gathers the high tokens into a short list (``nonzero``: one host sync on an accelerator, before the fixed
# passes, none in them), so the radix passes read ~2-5% of the tokens. On a device named here the passes read a
# full-size key tensor instead and nothing waits for the host until the result is read; off by default, because the
# histograms' atomic adds then pile onto the slot of the tokens that are not high (most of them).
_FULL_SIZE_DEVICES: tuple[str, ...] = ()


@dataclass
class _Pass:
    """One pass over the local tokens (see :func:`_local_pass`)."""

    in_t: torch.Tensor  # bool, shaped like the inputs: the trust region T
    keys: torch.Tensor  # int32 float32-bit patterns of d^2 for the high tokens (d^2 > tau) of T
    positions: Optional[torch.Tensor]  # int64 flat position of each key, ascending; None: keys is full-size
    zeros: torch.Tensor  # int64 0-dim: entries of ``keys`` that are not high tokens (0 when compacted)
    totals: torch.Tensor  # float64 [sum of the low d^2 of T, |T| - #high, #valid]

    def high(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, float32 d^2) of the high tokens, in token order."""
        if self.positions is not None:
            return self.positions, self.keys.view(torch.float32)
        positions = self.keys.nonzero().squeeze(1)
        return positions, self.keys[positions].view(torch.float32)


def _local_pass(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, tau_lo: float) -> _Pass:
    """One pass over the local tokens: T, the high tokens' d^2 (as float32 bit patterns) and the low tokens' sum.

    Per token, e = sign(A) * d is > 0 exactly on the trust-region quadrants (sign(A) is exact, so the product is
    exactly +-d or 0); fmax(e, 0) turns everything else, NaN included, into 0, so e^2 is d^2 on T and 0 elsewhere.
    The low sum is a float64 sum per slice of e with the high tokens zeroed, then the sum of the slices: the decision
    compares means built on it, so it is computed the same way whichever selection reads it.
    """
    device = valid.device
    n = valid.numel()
    lr = log_ratio.detach().reshape(-1)
    adv = advantages.detach().reshape(-1)
    ok = valid.reshape(-1)
    in_t = torch.empty(n, dtype=torch.bool, device=device)
    compact = device.type not in _FULL_SIZE_DEVICES
    chunk = _CPU_CHUNK if device.type == "cpu" else max(n, 1)
    keys_full = None if compact else torch.empty(n, dtype=torch.int32, device=device)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    idx_parts, key_parts, sum_parts, high_parts = [], [], [], []
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
        is_high = e > tau_lo
        if compact:
            idx = is_high.nonzero().squeeze(1)
            key_parts.append(e[idx].view(torch.int32))
            idx_parts.append(idx + start)
            e[idx] = 0.0
        else:
            keys_full[part] = torch.where(is_high, e.view(torch.int32), 0)
            high_parts.append(torch.count_nonzero(is_high))
            e.masked_fill_(is_high, 0.0)
        sum_parts.append(e.sum(dtype=torch.float64))
    low_sum = torch.stack(sum_parts).sum() if sum_parts else torch.zeros((), dtype=torch.float64, device=device)
    if compact:
        keys = torch.cat(key_parts) if key_parts else torch.zeros(0, dtype=torch.int32, device=device)
        positions = torch.cat(idx_parts) if idx_parts else torch.zeros(0, dtype=torch.int64, device=device)
        num_high = torch.tensor(keys.numel(), device=device)
        zeros = torch.zeros((), dtype=torch.int64, device=device)
    else:
        keys, positions = keys_full, None
        num_high = torch.stack(high_parts).sum() if high_parts else torch.zeros((), dtype=torch.int64, device=device)
        zeros = n - num_high
    totals = torch.stack([
        low_sum,
        (torch.count_nonzero(in_t) - num_high).to(torch.float64),
        torch.count_nonzero(ok).to(torch.float64),
    ])
    return _Pass(in_t=in_t.view(valid.shape), keys=keys, positions=positions, zeros=zeros, totals=totals)


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


@dataclass
class _Decision:
    """Which local high tokens are kept, and the sums the diagnostics need (0-dim float64, all ranks)."""

    keep_high: torch.Tensor  # bool per local high token (in ``_Pass.high()`` order), or per entry of a full-size pass
    kept: torch.Tensor  # high tokens kept
    kept_sum: torch.Tensor  # their sum of d^2
    high: torch.Tensor  # high tokens
    high_sum: torch.Tensor  # their sum of d^2


def _sort_decision(high_vals: torch.Tensor, low_sum: torch.Tensor, low_count: torch.Tensor, tau: float,
                   group: Optional[Any]) -> _Decision:
    """Algorithm 1 by sorting the high tokens (all ranks): the definition the radix select reproduces bit for bit
    (recipe/m2po/radix_select.py), used where it cannot prove it does."""
    f64 = torch.float64
    device = high_vals.device
    if group is not None:
        all_vals, offset = _gather_variable(high_vals, group)
    else:
        all_vals, offset = high_vals, 0
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
    return _Decision(keep_high=keep_all[offset:offset + high_vals.numel()], kept=n_keep_high.to(f64),
                     kept_sum=(sorted64 * keep_sorted).sum(), high=torch.tensor(float(sorted64.numel()),
                                                                                dtype=f64, device=device),
                     high_sum=sorted64.sum())


def _radix_decision(keys: torch.Tensor, zeros: torch.Tensor, totals: torch.Tensor, tau: float,
                    group: Optional[Any]) -> tuple[_Decision, torch.Tensor]:
    """Algorithm 1 without sorting (recipe/m2po/radix_select.py); also returns whether it is provably the sort's."""
    b = find_boundary(keys, zeros, totals[0], totals[1], totals[2], tau, group=group,
                      narrow=keys.device.type == "cpu")
    high = keys > 0  # a full-size pass holds 0 where a token is not high; a high token's d^2 is > tau >= 0
    tie = (keys == b.key) & high
    ties_before = torch.cumsum(tie, 0) - tie.to(torch.int64)  # earlier local tokens equal to v*
    keep_ties = b.keep_ties
    if group is not None:  # ranks in order: this rank's ties come after those of the ranks before it
        dist = torch.distributed
        per_rank = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=keys.device)
        per_rank[dist.get_rank(group)] = tie.sum()
        dist.all_reduce(per_rank, group=group)
        keep_ties = keep_ties - per_rank[:dist.get_rank(group)].sum()
    masked = (keys > b.key) | (tie & (ties_before >= keep_ties))
    return _Decision(keep_high=~masked, kept=b.kept, kept_sum=b.kept_sum, high=b.high, high_sum=b.high_sum), b.exact


@torch.no_grad()
def select_m2po(log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, tau: float,
                *, group: Optional[Any] = None) -> M2POSelection:
    """Algorithm 1 over all valid tokens of the given tensors (and of every rank of ``group``, if given).

    ``log_ratio`` is log(pi_theta/pi_behaviour); any float dtype (squared in fp32). Returns the keep mask and the
    diagnostics. With ``group``, every rank of the group must call this the same number of times.
    """
    tau = DECLARATION.param("m2_threshold").check(tau)
    valid = response_mask.bool()
    # low (d^2 <= tau) tokens of T are never masked, so they enter only as a sum and a count:
    # totals = [low sum, low count, valid count].
    local = _local_pass(log_ratio, advantages, valid, float32_floor(tau))
    totals = local.totals
    if group is not None:
        torch.distributed.all_reduce(totals, group=group)
    low_sum, low_count, num_valid = totals[0], totals[1], totals[2]

    decision, exact = _radix_decision(local.keys, local.zeros, totals, tau, group)
    stats = _selection_stats(decision, low_sum, low_count, num_valid, exact).tolist()  # the one host sync
    positions = local.positions
    if not stats[-1]:  # rare (recipe/m2po/radix_select.py): take the sort's decision, which the radix one reproduces
        positions, high_vals = local.high()
        decision = _sort_decision(high_vals, low_sum, low_count, tau, group)
        stats = _selection_stats(decision, low_sum, low_count, num_valid, exact).tolist()
    keep_flat = valid.flatten().clone()
    if positions is not None:
        keep_flat[positions] = decision.keep_high
    else:  # a full-size decision: True wherever a token is not high
        keep_flat &= decision.keep_high
    return M2POSelection(
        keep_mask=keep_flat.view_as(valid), trust_region=local.in_t, num_valid=int(stats[0]),
        num_trust_region=int(stats[1]), num_masked=int(stats[2]), m2_before=stats[3], m2_after=stats[4],
        threshold=tau,
    )


def _selection_stats(d: _Decision, low_sum: torch.Tensor, low_count: torch.Tensor, num_valid: torch.Tensor,
                     exact: torch.Tensor) -> torch.Tensor:
    """[#valid, |T|, #masked, M2 of T, M2 of the kept tokens of T, exact] as one float64 tensor (one sync)."""
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=low_sum.device)
    kept_sum, kept_cnt = low_sum + d.kept_sum, low_count + d.kept
    all_sum, all_cnt = low_sum + d.high_sum, low_count + d.high
    return torch.stack([
        num_valid, all_cnt, d.high - d.kept,
        torch.where(all_cnt > 0, all_sum / all_cnt.clamp(min=1), zero),
        torch.where(kept_cnt > 0, kept_sum / kept_cnt.clamp(min=1), zero),
        exact.to(f64),
    ])


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
    keep = selection.keep_mask  # False on padding (select_m2po and selection_from_mask both make it so)
    # -A on the kept tokens, 0 elsewhere (padding's garbage included): a constant, so the graph holds one product.
    # The same numbers as where(keep, -A * r, 0), since r = exp(clamp(d)) is finite and positive.
    coef = torch.where(keep, advantages.detach().float().neg(), torch.zeros((), device=valid.device))
    ratio = torch.exp(clamp_log_ratio(d))
    per_token = coef * ratio
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(ratio))
    loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
    # Diagnostics only (no_grad, from the detached ratio): the loss above is computed exactly as without them.
    selection = replace(selection, quadrants=quadrant_weights(d, advantages, selection.trust_region, ~keep,
                                                              ratio=ratio, group=group))
    return loss, selection.metrics()


# Registration: the loss under its declaration (recipe/m2po/declaration.py), with what its step needs.
register_policy_loss(DECLARATION, batch_selector=m2po_batch_selector)(compute_policy_loss_m2po)
