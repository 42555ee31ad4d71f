"""FIPO (Future-KL Influenced Policy Optimization; Ma et al., arXiv 2603.19835) as a policy loss. Pure torch.

Per token t of a response, with d_t = clamp(log pi_theta - log pi_old, -20, 20) and r_t = exp(d_t):

1. Participation: P_t = [d_t <= ln c] (tokens whose ratio is already above the dual-clip constant c are left out).
2. Discounted Future-KL, forward in time and including t:
   ``F_t = sum_{k >= t} gamma^(k-t) M_k P_k d_k`` with gamma = 2^(-1/decay_rate); the distance counts positions
   (masked positions add nothing but still stretch the distance). Computed in fp32 without gradient by an O(B*T)
   reverse scan (:func:`discounted_future_sum`), never by the closed form ``gamma^-t * revcumsum(gamma^k x_k)``,
   whose gamma^-t overflows for long responses.
3. Influence weight w = exp(F) clipped: high-only ``[1, 1+eps_f]`` (default), symmetric ``[1-eps_f, 1+eps_f]``, or
   eps_f == 0: ``(0, 10]``. Safety reset: where A < 0 and r > safety_threshold, ``w = clamp(w, 0.8, 1.0)``. The
   weight is detached: no gradient flows through F.
4. Dual-clip PPO surrogate on Â = A w: ``Lc = max(-Â r, -Â clip(r, 1-eps_low, 1+eps_high))``, and for Â < 0
   ``min(Lc, -Â c)``. The gradient of an unclipped token is ``-A w r``.
5. Sequence drop: a row with more than one valid A < 0 token with r > c is removed from the loss mask (one is
   tolerated: its gradient is already zero).
6. Aggregation: :func:`recipe.common.agg_loss` over the post-drop loss mask, like every loss here.

Thresholds are compared on the log scale, in fp32: "r > c" means ``d > fp32(ln c)``, so a token at exactly
d == ln c participates in the Future-KL and is neither dropped nor counted as a low-clip token; the safety test
is ``d > fp32(ln safety_threshold)``.

Normalisation: one definition of the step's objective. A dropped row leaves the numerator *and* the denominator of
the whole optimizer step: ``token-mean`` is the sum over the kept rows' valid tokens divided by the number of those
tokens over the whole step (all micro-batches, all ranks). That is the reference's objective when the step is one
call (the authors' verl code and the TRL port divide by the tokens kept after the drop), and it is what every path
that splits a step computes:

- one call, no ``global_batch_info``: the call's kept tokens (the reference, literally);
- a split step planned by :func:`recipe.optimizer_batch.plan_optimizer_batch`: the plan runs
  :func:`fipo_row_selector` on every micro-batch (rows never span micro-batches; packed 1-D micro-batches carry
  ``cu_seqlens``), passes each call its ``row_keep_mask`` (the tokens of its kept rows) and sets
  ``batch_num_tokens`` to the kept tokens of the whole step, all-reduced over the group. The loss honours that
  mask: the drop is the plan's, as M2PO's selection is. Summing the micro-batch losses is then exactly the
  one-call loss, whatever the split.
- a caller that sets the count itself (``batch_num_tokens``; ``global_batch_size`` for the seq-mean modes) without
  the plan's ``row_keep_mask`` (verl's ``ppo_loss``) counted every valid token (row) before the loss, dropped rows
  included. The loss is exact there or refuses (:func:`_exact_counts`): when no row of the call drops, the count is
  exact as given; when ``dp_size`` is 1 and the count is this call's own (the step is this call) the dropped rows'
  tokens (rows) leave it, exactly the one call above; any other count with a dropped row is refused with one line
  (the dropped rows' tokens would stay in a denominator that only the plan can count).

Clip metrics: ``fipo/clip_fraction`` (the PPO clip decided the token) and ``fipo/dual_clip_fraction`` (the dual
clip -A c decided it), as shares of the tokens that enter the loss (the kept rows' valid tokens).

Config keys (stalerl ``actor.*``; verl ``actor_rollout_ref.actor.policy_loss.*``; TRL GRPOConfig names):
``fipo_decay_rate`` (32), ``fipo_clip_ratio_c`` (10, must exceed 1 + eps_high), ``fipo_influence_clip_ratio``
(0.2), ``fipo_influence_clip_high_only`` (true), ``fipo_safety_threshold`` (10; a value >= e^20 ~ 4.9e8 never fires,
because d is clamped to 20). PPO clip: ``clip_ratio_low`` / ``clip_ratio`` / ``eps_clip`` (0.2) and
``clip_ratio_high`` / ``eps_clip_higher`` (default: the low value). TRL's ``fipo_chunk_size`` has no equivalent:
the scan needs no chunking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from recipe.fipo.declaration import DECLARATION
from recipe.registry import register_policy_loss
from recipe.common import (
    LOG_RATIO_CLAMP,
    agg_loss,
    check_inputs,
    global_batch_info,
    masked_log_ratio,
    ppo_clip_surrogate,
    clamp_log_ratio,
)

# What the loss reports on every call, in its declaration's order (declared once, recipe/fipo/declaration.py): the
# fractions and the count of tokens that enter the loss (the weight of its clip fractions when calls are pooled).
METRIC_KEYS = tuple(DECLARATION.metrics)
FRACTION_KEYS = tuple(k for k in METRIC_KEYS if k != "fipo/num_kept_tokens")

_DEFAULTS = DECLARATION.defaults()
DEFAULT_DECAY_RATE = _DEFAULTS["fipo_decay_rate"]
DEFAULT_CLIP_RATIO_C = _DEFAULTS["fipo_clip_ratio_c"]
DEFAULT_INFLUENCE_CLIP_RATIO = _DEFAULTS["fipo_influence_clip_ratio"]
DEFAULT_SAFETY_THRESHOLD = _DEFAULTS["fipo_safety_threshold"]
#: eps_f == 0 mode: the weight is only capped from above, at this value.
UNCLIPPED_WEIGHT_MAX = 10.0
#: Safety reset range for A < 0 tokens whose ratio exceeds the safety threshold.
SAFETY_RESET_RANGE = (0.8, 1.0)
#: F is clamped to this before exp() *for the raw-mean metric only*, so the metric stays finite (the reference's can
#: read inf); the weights use the unclamped exp, whose inf the clip absorbs.
RAW_METRIC_LOG_CLAMP = 20.0
#: Block length of the blocked reverse scan; any value gives the same result (up to fp32 rounding).
SCAN_BLOCK = 64


@dataclass(frozen=True)
class FIPOParams:
    decay_rate: float = DEFAULT_DECAY_RATE
    clip_ratio_c: float = DEFAULT_CLIP_RATIO_C
    influence_clip_ratio: float = DEFAULT_INFLUENCE_CLIP_RATIO
    influence_clip_high_only: bool = _DEFAULTS["fipo_influence_clip_high_only"]
    safety_threshold: float = DEFAULT_SAFETY_THRESHOLD
    eps_low: float = 0.2
    eps_high: float = 0.2

    @property
    def gamma(self) -> float:
        return 2.0 ** (-1.0 / self.decay_rate)

    def weight_bounds(self) -> tuple[Optional[float], float]:
        """(lower, upper) clip bounds of the influence weight; lower is None in the eps_f == 0 mode."""
        eps = self.influence_clip_ratio
        if eps == 0.0:
            return None, UNCLIPPED_WEIGHT_MAX
        return (1.0 if self.influence_clip_high_only else 1.0 - eps), 1.0 + eps

    def validate(self, where: str = "") -> "FIPOParams":
        """The declaration's cross-key rules; ``where`` prefixes the key names in messages (e.g. ``actor.``)."""
        DECLARATION.raise_problems(self.declared_values(), (self.eps_low, self.eps_high), where=where)
        return self

    def declared_values(self) -> dict[str, Any]:
        """The five declared keys by their config names."""
        return {"fipo_decay_rate": self.decay_rate, "fipo_clip_ratio_c": self.clip_ratio_c,
                "fipo_influence_clip_ratio": self.influence_clip_ratio,
                "fipo_influence_clip_high_only": self.influence_clip_high_only,
                "fipo_safety_threshold": self.safety_threshold}


def fipo_params_from_config(config: Any) -> FIPOParams:
    """The FIPO keys (``policy_loss.<key>`` first, then ``<key>``; recipe/fipo/declaration.py) and the PPO clip,
    checked, with the declaration's cross-key rules."""
    low, high, _ = DECLARATION.read_clip(config)  # the shared PPO-clip group (FIPO reads no dual clip of verl's)
    p = DECLARATION.read(config, clip=(low, high))
    return FIPOParams(decay_rate=p.fipo_decay_rate, clip_ratio_c=p.fipo_clip_ratio_c,
                      influence_clip_ratio=p.fipo_influence_clip_ratio,
                      influence_clip_high_only=p.fipo_influence_clip_high_only,
                      safety_threshold=p.fipo_safety_threshold, eps_low=low, eps_high=high)


# ------------------------------------------------------------------------------------------------ Future-KL


def _scan_small(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """F_t = x_t + gamma F_{t+1} along the last dim, one column at a time (short sequences)."""
    out = torch.empty_like(x)
    if x.shape[-1] == 0:
        return out
    acc = torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        acc = x[..., t] + gamma * acc
        out[..., t] = acc
    return out


@torch.no_grad()
def discounted_future_sum(x: torch.Tensor, gamma: float, block: int = SCAN_BLOCK) -> torch.Tensor:
    """``F_t = sum_{k >= t} gamma^(k-t) x_k`` along the last dim, in fp32, no grad, O(numel) work.

    A blocked reverse scan: the recurrence F_t = x_t + gamma F_{t+1} runs inside blocks of ``block`` positions (all
    blocks at once), the blocks' carries are the same scan one level up (factor gamma^block), recursively, so the
    Python loop has about ``block * log_block(T)`` steps. Only powers gamma^1 .. gamma^block <= 1 appear: nothing can
    overflow, unlike the closed form.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if block < 2:
        raise ValueError(f"block must be >= 2, got {block}")
    x = x.detach().float()
    t = x.shape[-1]
    if t <= block:
        return _scan_small(x, gamma)
    n_blocks = -(-t // block)
    pad = n_blocks * block - t
    xb = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], n_blocks, block)
    local = _scan_small(xb, gamma)  # the sum restricted to each block
    # carry[n] = F at the first position of block n+1 (0 after the last block): a scan over the blocks' heads
    heads = local[..., 0]
    suffix = discounted_future_sum(heads, gamma ** block, block)
    carry = torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1)
    # F at offset i of block n = local + gamma^(block - i) * carry[n]
    decay = gamma ** torch.arange(block, 0, -1, dtype=torch.float64, device=x.device)
    out = local + carry.unsqueeze(-1) * decay.to(torch.float32)
    return out.reshape(*x.shape[:-1], n_blocks * block)[..., :t]


@dataclass
class FIPOWeights:
    """No-grad per-token quantities of one FIPO call (all (B, T))."""

    future_kl: torch.Tensor
    weights: torch.Tensor
    loss_mask: torch.Tensor
    dropped_rows: torch.Tensor  # (B,) bool
    metrics: dict[str, float]


def _log_threshold(value: float, device: torch.device) -> torch.Tensor:
    """ln(value) in fp32: thresholds are compared on the log scale, in fp32 (see the module docstring)."""
    return torch.tensor(math.log(value), dtype=torch.float32, device=device)


def _clamped_inputs(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    d = torch.where(valid, log_ratio.detach().float(), torch.zeros((), device=valid.device))
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
    return d, adv


def _low_clip_tokens(d: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, params: FIPOParams) -> torch.Tensor:
    """Per token: a valid A < 0 token whose ratio exceeds c (two of them in a row drop the row)."""
    return valid & (d > _log_threshold(params.clip_ratio_c, d.device)) & (adv < 0)


@torch.no_grad()
def _fipo_weight_tensors(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
                         params: FIPOParams, row_keep_mask: Optional[torch.Tensor] = None):
    """The weights and the post-drop mask, and the metric numerators as tensors (no host sync)."""
    d, adv = _clamped_inputs(log_ratio, advantages, valid)
    above_c = valid & (d > _log_threshold(params.clip_ratio_c, d.device))
    contrib = torch.where(valid & ~above_c, d, torch.zeros_like(d))
    future_kl = discounted_future_sum(contrib, params.gamma)

    w_raw = torch.exp(future_kl)
    lower, upper = params.weight_bounds()
    w = w_raw.clamp(min=lower, max=upper)
    reset = (adv < 0) & (d > _log_threshold(params.safety_threshold, d.device))
    w = torch.where(reset, w.clamp(*SAFETY_RESET_RANGE), w)
    w = torch.where(valid, w, torch.ones_like(w))

    if row_keep_mask is None:
        dropped = (above_c & (adv < 0)).sum(dim=-1) > 1
        loss_mask = valid & ~dropped.unsqueeze(-1)
        partial_rows = torch.zeros((), device=d.device)
    else:  # the step's plan decided the drop (recipe.optimizer_batch): whole rows, honoured as given
        loss_mask = valid & row_keep_mask.bool()
        kept_per_row = loss_mask.sum(dim=-1)
        dropped = valid.any(dim=-1) & (kept_per_row == 0)
        partial_rows = ((kept_per_row > 0) & (kept_per_row < valid.sum(dim=-1))).sum()

    n_valid = valid.sum().clamp(min=1).float()
    raw_mean = torch.where(valid, torch.exp(future_kl.clamp(max=RAW_METRIC_LOG_CLAMP)), torch.zeros_like(w)).sum()
    at_upper = (valid & (w >= upper)).sum().float()
    at_lower = (valid & (w <= lower)).sum().float() if lower is not None else torch.zeros((), device=d.device)
    drop_ratio = dropped.float().sum() / max(1, dropped.numel())
    stats = [raw_mean / n_valid, at_upper / n_valid, at_lower / n_valid, drop_ratio]
    return future_kl, w, loss_mask, dropped, stats, partial_rows


@torch.no_grad()
def fipo_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
                 params: FIPOParams) -> FIPOWeights:
    """Future-KL, clipped and safety-reset influence weights, the post-drop loss mask and the metrics."""
    future_kl, w, loss_mask, dropped, stats, _ = _fipo_weight_tensors(log_ratio, advantages, valid, params)
    values = torch.stack(stats).tolist()
    return FIPOWeights(future_kl=future_kl, weights=w, loss_mask=loss_mask, dropped_rows=dropped,
                       metrics=dict(zip(METRIC_KEYS, values)))


def fipo_per_token_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                        params: FIPOParams) -> torch.Tensor:
    """The dual-clip PPO surrogate on the reweighted advantage A * w (w detached), per token, with grad."""
    return _surrogate(log_ratio, advantages, weights, params)[0]


def _surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, params: FIPOParams):
    ratio = torch.exp(clamp_log_ratio(log_ratio))
    adv_hat = advantages.detach().float() * weights.detach()
    return ppo_clip_surrogate(ratio, adv_hat, params.eps_low, params.eps_high, params.clip_ratio_c)


# ----------------------------------------------------------------------------- the step-wide sequence drop


def _packed_segments(cu_seqlens: Any, length: int, device: torch.device) -> torch.Tensor:
    """Sequence index of every packed position (-1 past the last boundary); checks ``cu_seqlens``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"fipo: cu_seqlens must be a 1-D integer tensor [0, l_0, l_0 + l_1, ...], got "
                         f"{cu_seqlens!r}")
    bounds = cu_seqlens.tolist()
    if not bounds or bounds[0] != 0 or any(b > c for b, c in zip(bounds, bounds[1:])) or bounds[-1] > length:
        raise ValueError(f"fipo: cu_seqlens must rise from 0 to at most {length} (the packed length), got {bounds}")
    positions = torch.arange(length, device=device)
    segment = torch.bucketize(positions, cu_seqlens.to(device)[1:], right=True)
    return torch.where(positions < bounds[-1], segment, torch.full_like(segment, -1))


@torch.no_grad()
def fipo_row_selector(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, *, config: Any = None,
                      cu_seqlens: Optional[torch.Tensor] = None) -> dict[str, Any]:
    """FIPO's sequence drop for one micro-batch of a planned step (``recipe.optimizer_batch``).

    Rows are ``(B, T)`` padded rows, or, with ``cu_seqlens``, the sequences of packed tokens (``(N,)`` or ``(1, N)``).
    Returns ``row_keep_mask`` (the input's shape: True on the valid tokens of the rows that stay), ``num_rows`` and
    ``num_dropped_rows``; the plan sums the kept tokens over micro-batches and ranks into the step's denominator
    and passes ``row_keep_mask`` back to :func:`compute_policy_loss_fipo`. The rule is the loss's own (module
    docstring, 5).
    """
    params = fipo_params_from_config(config)
    shape = response_mask.shape
    if cu_seqlens is None:
        if response_mask.dim() != 2:
            raise ValueError(f"fipo: a micro-batch of shape {tuple(shape)} is not (rows, tokens); FIPO drops whole "
                             "sequences, so packed 1-D tokens need their boundaries: set MicroBatch.cu_seqlens")
        valid = check_inputs("fipo", old_log_prob, log_prob, advantages, response_mask)
        d, adv = _clamped_inputs(masked_log_ratio(old_log_prob, log_prob, valid), advantages, valid)
        dropped = _low_clip_tokens(d, adv, valid, params).sum(dim=-1) > 1
        keep = valid & ~dropped.unsqueeze(-1)
        return {"row_keep_mask": keep, "num_rows": int(shape[0]), "num_dropped_rows": int(dropped.sum())}
    if response_mask.dim() not in (1, 2) or (response_mask.dim() == 2 and shape[0] != 1):
        raise ValueError(f"fipo: cu_seqlens marks sequences in packed tokens of shape (N,) or (1, N), got "
                         f"{tuple(shape)}")
    flat = [t.reshape(1, -1) for t in (old_log_prob, log_prob, advantages, response_mask)]
    valid = check_inputs("fipo", *flat)
    segment = _packed_segments(cu_seqlens, valid.shape[1], valid.device)[None, :]
    if (valid & (segment < 0)).any():
        raise ValueError("fipo: valid tokens lie past the last cu_seqlens boundary; every valid packed token must "
                         "belong to a sequence")
    d, adv = _clamped_inputs(masked_log_ratio(flat[0], flat[1], valid), flat[2], valid)
    num_rows = int(cu_seqlens.numel()) - 1
    low = _low_clip_tokens(d, adv, valid, params)
    counts = torch.zeros(num_rows + 1, dtype=torch.int64, device=valid.device)
    counts.index_add_(0, (segment + 1).reshape(-1), low.reshape(-1).long())  # slot 0: past the end (never low)
    dropped = counts[1:] > 1
    keep = valid & ~torch.cat([torch.zeros(1, dtype=torch.bool, device=valid.device), dropped])[segment + 1]
    return {"row_keep_mask": keep.reshape(shape), "num_rows": num_rows, "num_dropped_rows": int(dropped.sum())}


#: The ``global_batch_info`` count each aggregation divides by (``token-sum`` divides by none).
_COUNT_KEYS = {"token-mean": "batch_num_tokens", "seq-mean-token-sum": "global_batch_size",
               "seq-mean-token-sum-norm": "global_batch_size", "seq-mean-token-mean": "global_batch_size"}


def _exact_counts(info: dict[str, Any], loss_agg_mode: str, valid: torch.Tensor,
                  dropped: torch.Tensor) -> dict[str, Any]:
    """The counts that make this call exact when its caller counted the step without the plan (no
    ``row_keep_mask``): without a dropped row the count is exact as given; a count that is this call's own
    (``dp_size`` 1: the step is this call) loses the dropped rows' tokens (rows), which makes it the one-call
    reference's (a caller that already counted this call's kept tokens (rows) is exact as given); any other count is
    a ValueError (module docstring, Normalisation)."""
    key = _COUNT_KEYS.get(loss_agg_mode)
    given = info.get(key) if key is not None else None
    if given is None:  # no count (agg_loss counts this call's kept tokens or rows), or token-sum (no count)
        return info
    if isinstance(given, torch.Tensor):
        given = given.item()
    dp_size = int(info.get("dp_size") or 1)
    n_tokens, n_rows, n_dropped, n_dropped_tokens = torch.stack([
        valid.sum(), valid.any(dim=-1).sum(), dropped.sum(), (valid & dropped.unsqueeze(-1)).sum()]).tolist()
    if not n_dropped:
        return info
    tokens = key == "batch_num_tokens"
    own = (n_tokens,) if tokens else (n_rows, valid.shape[0])
    lost = n_dropped_tokens if tokens else n_dropped
    if dp_size == 1 and float(given) in own:  # the step is this call: its kept tokens (rows)
        return {**info, key: int(given) - lost}
    if dp_size == 1 and float(given) in tuple(n - lost for n in own):  # the step is this call, counted kept
        return info
    what = "valid tokens" if key == "batch_num_tokens" else "rows"
    raise ValueError(
        f"fipo: global_batch_info {key}={given} (dp_size={dp_size}) is not this call's own count ({int(own[0])} "
        f"{what}), and {int(n_dropped)} of its rows drop, so the loss cannot be exact with that count: a dropped "
        f"row must leave the step's denominator, and only the call that holds it knows it drops. Plan the step with "
        f"recipe.optimizer_batch.plan_optimizer_batch('fipo', micro_batches, config) and pass each call its "
        f"row_keep_mask (the plan counts the kept {what}), or make the step one call")


def compute_policy_loss_fipo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    row_keep_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """FIPO with verl's policy-loss signature (see the module docstring).

    ``row_keep_mask`` (optional): the step plan's sequence drop for this micro-batch (:func:`fipo_row_selector`
    through ``recipe.optimizer_batch.plan_optimizer_batch``), whose ``batch_num_tokens`` then counts the step's
    kept tokens (used as given).
    Without it the drop is computed here, from this call's rows, and a count in ``global_batch_info`` is used only
    where it is exact (:func:`_exact_counts`): as given without a dropped row; this call's own count less the dropped
    rows' tokens (the step is this call); any other count is refused when a row of this call drops.
    """
    params = fipo_params_from_config(config)
    valid = check_inputs("fipo", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if row_keep_mask is not None and tuple(row_keep_mask.shape) != tuple(valid.shape):
        raise ValueError(f"fipo: row_keep_mask has shape {tuple(row_keep_mask.shape)}, expected "
                         f"{tuple(valid.shape)} (the shape of response_mask); pass the mask plan_optimizer_batch made "
                         "for this micro-batch")
    d = masked_log_ratio(old_log_prob, log_prob, valid)
    adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
    _, w, loss_mask, dropped, stats, partial_rows = _fipo_weight_tensors(d, adv, valid, params, row_keep_mask)
    per_token, clipped, dual_clipped = _surrogate(d, adv, w, params)
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(), torch.zeros_like(per_token))
    info = global_batch_info(config)
    if row_keep_mask is None:  # with the plan's mask the count is the plan's: the step's kept tokens (rows)
        info = _exact_counts(info, loss_agg_mode, valid, dropped)
    loss = agg_loss(per_token, loss_mask, loss_agg_mode, **info)
    with torch.no_grad():
        n_kept = loss_mask.sum().float()
        n_loss = n_kept.clamp(min=1)
        clip_stats = [(clipped & loss_mask).sum() / n_loss, (dual_clipped & loss_mask).sum() / n_loss]
        values = torch.stack([*stats, *clip_stats, n_kept, partial_rows.float()]).tolist()  # one host sync
    if values[-1]:
        raise ValueError(f"fipo: row_keep_mask keeps only part of {int(values[-1])} row(s); FIPO drops whole "
                         "rows, so it takes only the mask plan_optimizer_batch('fipo', ...) made for this "
                         "micro-batch (an M2PO token mask is not one)")
    return loss, dict(zip(METRIC_KEYS, values[:-1]))


__all__ = ["FRACTION_KEYS", "METRIC_KEYS", "FIPOParams", "FIPOWeights",
           "compute_policy_loss_fipo", "discounted_future_sum",
           "fipo_params_from_config", "fipo_per_token_loss", "fipo_row_selector", "fipo_weights"]


# Registration: the loss under its declaration (recipe/fipo/declaration.py), with what its step needs.
register_policy_loss(DECLARATION, row_selector=fipo_row_selector)(compute_policy_loss_fipo)
