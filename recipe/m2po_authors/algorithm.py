"""The M2PO authors' released variant (Infini-AI-Lab/M2PO @ af54a3e, ``compute_m2po_policy_loss``), opt-in.

This is NOT the paper's Algorithm 1 (that is ``recipe.m2po``, the default). The released code turns the M2 budget
tau into one adaptive PPO clip bound (described in shared/reference/m2po-algorithm.md, section 2.3):

1. Trust-region tokens T: valid, and (A > 1e-12 and r > 1 + 1e-12) or (A < -1e-12 and r < 1 - 1e-12), r = exp(d),
   d = log pi_theta - log pi_behaviour (the comparisons in float32, as their tensors are).
2. v = d^2 over the n tokens of T, M2 = mean(v). If n = 0 or M2 <= tau + 1e-12: "no clipping", ratio bounds
   [0, 1e5] (their constants: a token with A > 0 and r > 1e5 is still clipped).
3. Otherwise sort v ascending and take the first k with sum_{i<=k} v_i + (n-k-1) v_k >= tau n, i.e.
   sum_i min(v_i, v_k) >= tau n: water-filling with the denominator fixed at n. The bound is
   tau_c = sqrt(v_{k-1} - 1e-12) (0 when k = 0): the largest breakpoint whose capped second moment stays below tau.
4. Ratio bounds [exp(-tau_c), exp(tau_c)], and PPO's clipped surrogate max(-A r, -A clamp(r, low, high)) with no dual
   clip, averaged over ALL valid tokens (token-mean; clipped tokens stay in the denominator). Only T's quadrants can
   bite, so every trust-region token with |d| > tau_c loses its gradient (kept as a constant in the loss value).

Capping counts a removed token as tau_c^2 instead of dropping it from the mean, so the variant is never less strict
than Algorithm 1 and often stricter (v = {0.001, 0.001, 0.1, 0.1}: Algorithm 1 masks one 0.1, this clips both).

What differs from the released code, on purpose (docs/algorithms/m2po.md lists it too):

- tau <= 1e-12 works (their solver returns a bare float there and the caller's tuple unpack crashes): tau = 0 gives
  tau_c = 0, every token of T with r != 1 clipped, like Algorithm 1 masking all of T.
- No per-token host syncs: the solver is one sort, one cumsum and one comparison (theirs loops in Python with one
  ``.item()`` per trust-region token).
- sqrt of a negative number cannot happen (v_{k-1} < 1e-12 gives tau_c = 0; theirs would give NaN bounds).
- The sign of A is each token's own (theirs: the first response token's, which equals it under GRPO's constant
  per-sequence advantages and is wrong for per-token advantages).
- The bound is chosen once per optimizer mini-batch, over all its micro-batches and (``m2_scope: dp_group``) all
  data-parallel ranks, through the registered batch selector, like ``m2po``: the update does not depend on the split.
  Theirs recomputes it per GPU micro-batch; with a single micro-batch the loss selects in-call, as theirs does.
- The log-ratio is clamped to +-20 before exp() as every loss here (verl does the same); the solver uses the
  unclamped d. Non-finite inputs on valid tokens are an error (theirs does not check).
- The optional ``miniclip`` floor on the epsilons is not implemented (off in every released script).

Pure torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from recipe.m2po_authors.declaration import DECLARATION
from recipe.registry import register_policy_loss
from recipe.common import agg_loss, check_inputs, global_batch_info, masked_log_ratio, clamp_log_ratio
from recipe.m2po.algorithm import (
    _gather_variable,
    _scope_group,
    m2_scope_from_config,
    m2_threshold_from_config,
    quadrant_weights,
)

# The released code's constants.
EPS = 1e-12  # sign, ratio and budget tolerances, and the breakpoint offset
NO_CLIP_HIGH = 1e5  # the upper ratio bound when the budget is not exceeded (the lower one is 0)

# Metric keys in the order the loss reports them: its declaration's (declared once, recipe/m2po_authors/declaration.py).
METRIC_KEYS = tuple(DECLARATION.metrics)
# The bound tensors the batch selector hands to every micro-batch's loss call (same shape as the tokens).
BOUND_KEYS = ("ratio_low", "ratio_high")


def authors_trust_region(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """T as the released code defines it: ratio-based with their 1e-12 tolerances, per token's own advantage."""
    r = torch.exp(clamp_log_ratio(log_ratio.detach().float()))
    a = advantages.detach()
    return valid.bool() & (((a > EPS) & (r > 1.0 + EPS)) | ((a < -EPS) & (r < 1.0 - EPS)))


@dataclass(frozen=True)
class AuthorsBound:
    """The adaptive bound of one scope (the whole optimizer mini-batch, all ranks of a group)."""

    low: float  # ratio bounds: clamp(r, low, high)
    high: float
    tau_c: Optional[float]  # the log-ratio bound; None when the budget is not exceeded (no clipping)
    m2_before: float  # mean d^2 over T
    m2_capped: float  # mean over T of min(d^2, tau_c^2): the water-filled second moment (= m2_before if no clip)
    num_valid: int
    num_trust_region: int
    threshold: float


@torch.no_grad()
def solve_bound(log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, tau: float, *,
                group: Optional[Any] = None) -> AuthorsBound:
    """The released code's budget -> clip bound, vectorised (one sort, one cumsum; a constant number of syncs)."""
    tau = DECLARATION.param("m2_threshold").check(tau)  # the one validation (Param.check)
    valid = response_mask.bool()
    device = valid.device
    t = authors_trust_region(log_ratio, advantages, valid)
    d = log_ratio.detach().float()
    v = (d * d)[t]  # float32 d^2 of T, in token order
    counts = torch.stack([valid.sum(), t.sum()]).to(torch.float64)
    if group is not None:
        v, _ = _gather_variable(v, group)
        torch.distributed.all_reduce(counts, group=group)
    num_valid, n = (int(x) for x in counts.tolist())
    v64 = torch.sort(v.to(torch.float64)).values
    prefix = torch.cumsum(v64, 0)
    if n == 0:
        return AuthorsBound(0.0, NO_CLIP_HIGH, None, 0.0, 0.0, num_valid, 0, tau)
    # one host sync for everything the decision needs
    idx = torch.arange(n, device=device, dtype=torch.float64)
    capped = prefix + (n - idx - 1.0) * v64  # sum_i min(v_i, v_k) at every breakpoint k
    reached = capped >= tau * n
    first = torch.where(reached.any(), reached.to(torch.int64).argmax(), torch.tensor(n, device=device))
    prev = v64[(first - 1).clamp(min=0)]
    total, first_k, prev_v = torch.stack([prefix[-1], first.to(torch.float64), prev]).tolist()
    m2 = total / n
    if m2 <= tau + EPS:
        return AuthorsBound(0.0, NO_CLIP_HIGH, None, m2, m2, num_valid, n, tau)
    k = int(first_k)  # exists: at k = n - 1 the capped sum is n * m2 > tau * n
    tau_c = math.sqrt(max(prev_v - EPS, 0.0)) if k > 0 else 0.0
    m2_capped = float(torch.minimum(v64, torch.tensor(tau_c * tau_c, dtype=torch.float64, device=device)).sum()) / n
    return AuthorsBound(math.exp(-tau_c), math.exp(tau_c), tau_c, m2, m2_capped, num_valid, n, tau)


def _bound_tensors(bound: AuthorsBound, like: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"ratio_low": torch.full(like.shape, bound.low, dtype=torch.float64, device=like.device),
            "ratio_high": torch.full(like.shape, bound.high, dtype=torch.float64, device=like.device)}


@dataclass(frozen=True)
class AuthorsSelection:
    """What the batch selector decided, for the step's metrics (the runtime logs ``metrics()`` once per step)."""

    bound: AuthorsBound
    num_clipped: int
    quadrants: Any  # recipe.m2po.QuadrantWeights of the clipped tokens

    def metrics(self) -> dict[str, float]:
        return _metrics(self.bound, self.num_clipped, self.quadrants)


def _metrics(bound: AuthorsBound, num_clipped: int, quadrants: Any) -> dict[str, float]:
    valid = max(bound.num_valid, 1)
    out = {
        "m2po_authors/m2_before": float(bound.m2_before),
        "m2po_authors/m2_capped": float(bound.m2_capped),
        "m2po_authors/clip_fraction": num_clipped / valid,
        "m2po_authors/trust_region_fraction": bound.num_trust_region / valid,
        # no clipping: the bound of the upper ratio limit, log(1e5)
        "m2po_authors/log_ratio_bound": float(bound.tau_c) if bound.tau_c is not None else math.log(NO_CLIP_HIGH),
        "m2po_authors/num_valid_tokens": float(bound.num_valid),
        "m2po_authors/num_trust_region_tokens": float(bound.num_trust_region),
        "m2po_authors/num_clipped_tokens": float(num_clipped),
        "m2po_authors/threshold": float(bound.threshold),
    }
    out.update(quadrants.metrics(prefix="m2po_authors", noun="clipped"))
    return {k: out[k] for k in METRIC_KEYS}


def _clipped_mask(ratio: torch.Tensor, adv: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                  valid: torch.Tensor) -> torch.Tensor:
    """Where PPO's clipped branch strictly wins, so the token's gradient is zero (A > 0 and r > high, or A < 0 and
    r < low, decided on the loss values themselves as verl's pg_clipfrac is, so float ties count as kept)."""
    r = ratio.detach()
    return valid & (-adv * torch.clamp(r, min=low, max=high) > -adv * r)


def m2po_authors_batch_selector(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, *, config: Any = None, group: Optional[Any] = None,
                                ) -> dict[str, Any]:
    """The bound, once over a whole optimizer mini-batch (all micro-batches; all ranks of ``group``), as per-token
    ``ratio_low`` / ``ratio_high`` tensors the runtime slices per micro-batch, plus the step's diagnostics."""
    tau = m2_threshold_from_config(config)
    valid = check_inputs("m2po_authors", old_log_prob, log_prob, advantages, response_mask)
    d = masked_log_ratio(old_log_prob, log_prob.detach(), valid)
    bound = solve_bound(d, advantages, valid, tau, group=group)
    bounds = _bound_tensors(bound, valid)
    with torch.no_grad():
        ratio = torch.exp(clamp_log_ratio(d))
        adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
        low, high = (bounds[k].to(ratio.dtype) for k in BOUND_KEYS)
        clipped = _clipped_mask(ratio, adv, low, high, valid)
        n_clipped = clipped.sum().to(torch.float64)
        if group is not None:
            torch.distributed.all_reduce(n_clipped, group=group)
        t = authors_trust_region(d, advantages, valid)
        quadrants = quadrant_weights(d, advantages, t, clipped, ratio=ratio, group=group)
    return {**bounds, "selection": AuthorsSelection(bound, int(n_clipped), quadrants)}


def compute_policy_loss_m2po_authors(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    ratio_low: Optional[torch.Tensor] = None,
    ratio_high: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The authors' adaptive-clip M2PO with verl's signature.

    ``ratio_low`` / ``ratio_high`` (optional, together): the bound chosen beforehand over the whole mini-batch (see
    :func:`m2po_authors_batch_selector`). Without them the bound is solved over this call's tensors, or across the
    default process group when ``m2_scope: dp_group``.
    """
    tau = m2_threshold_from_config(config)
    valid = check_inputs("m2po_authors", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    d = masked_log_ratio(old_log_prob, log_prob, valid)
    group = None
    if (ratio_low is None) != (ratio_high is None):
        raise ValueError("m2po_authors: pass both ratio_low and ratio_high (from m2po_authors_batch_selector) or "
                         "neither")
    if ratio_low is None:
        group = _scope_group(m2_scope_from_config(config))
        bound = solve_bound(d, advantages, valid, tau, group=group)
        bounds = _bound_tensors(bound, valid)
        ratio_low, ratio_high = bounds["ratio_low"], bounds["ratio_high"]
    else:
        for name, b in (("ratio_low", ratio_low), ("ratio_high", ratio_high)):
            if b.shape != valid.shape:
                raise ValueError(f"m2po_authors: {name} has shape {tuple(b.shape)}, expected {tuple(valid.shape)}")
        bound = _local_bound_stats(d, advantages, valid, ratio_low, ratio_high, tau)
    adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
    ratio = torch.exp(clamp_log_ratio(d))
    low = ratio_low.detach().to(ratio.dtype)
    high = ratio_high.detach().to(ratio.dtype)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, min=low, max=high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(ratio))
    loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
    with torch.no_grad():
        clipped = _clipped_mask(ratio, adv, low, high, valid)
        n_clipped = clipped.sum().to(torch.float64)
        if group is not None:
            torch.distributed.all_reduce(n_clipped, group=group)
        t = authors_trust_region(d, advantages, valid)
        quadrants = quadrant_weights(d, advantages, t, clipped, ratio=ratio, group=group)
    return loss, _metrics(bound, int(n_clipped), quadrants)


def _local_bound_stats(d: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, ratio_low: torch.Tensor,
                       ratio_high: torch.Tensor, tau: float) -> AuthorsBound:
    """This call's own counts and second moments under a bound chosen elsewhere (one micro-batch's diagnostics)."""
    with torch.no_grad():
        t = authors_trust_region(d, advantages, valid)
        v = (d.detach().float() ** 2)[t].to(torch.float64)
        high = ratio_high[valid]
        h = float(high.max()) if high.numel() else NO_CLIP_HIGH
        tau_c = None if h >= NO_CLIP_HIGH else math.log(h)
        n = int(t.sum())
        m2 = float(v.sum()) / n if n else 0.0
        m2_capped = m2 if tau_c is None else (float(torch.clamp(v, max=tau_c * tau_c).sum()) / n if n else 0.0)
    return AuthorsBound(float(ratio_low[valid].min()) if high.numel() else 0.0, h, tau_c, m2, m2_capped,
                        int(valid.sum()), n, tau)


# Registration: the loss under its declaration (recipe/m2po_authors/declaration.py), with what its step needs.
register_policy_loss(DECLARATION, batch_selector=m2po_authors_batch_selector)(compute_policy_loss_m2po_authors)
